"""The preference objectives' parts against plain PyTorch (TRL's own losses are compared in
test_preference_trl.py): answer log-probs and their gradient, conservative DPO's formula,
the reference packed into the targets, and the reference as the base with adapters off."""

import math
import re

import pytest
import torch
import torch.nn.functional as F

from plugintrain.core.preference_batch import pack_batch, unpack_reference
from plugintrain.model_zoo import preference
from plugintrain.model_zoo.cross_entropy import IGNORE_INDEX
from plugintrain.model_zoo.lora import LoRASpec, adapters_disabled, init_adapters, inject
from plugintrain.model_zoo.preference import PreferenceLM, PreferenceLoss, sequence_logps
from plugintrain.model_zoo.transformer import Transformer


def _targets(n: int, t: int, vocab: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    targets = torch.randint(0, vocab, (n, t), generator=g)
    targets[:, : t // 3] = IGNORE_INDEX  # the prompt
    targets[1::2, -2:] = IGNORE_INDEX  # padding after shorter answers
    return targets


def _torch_logps(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    picked = torch.log_softmax(logits.double(), -1).gather(-1, targets.clamp(min=0)[..., None])
    return (picked.squeeze(-1) * (targets != IGNORE_INDEX)).sum(-1)


@pytest.mark.parametrize("chunk_elements", [None, 3 * 40])  # one chunk; 3 tokens a chunk
def test_sequence_logps_equals_log_softmax(monkeypatch, chunk_elements):
    if chunk_elements is not None:
        monkeypatch.setattr(preference, "CHUNK_ELEMENTS", chunk_elements)
    torch.manual_seed(0)
    logits = torch.randn(6, 10, 40, requires_grad=True)
    targets = _targets(6, 10, 40)
    ours = sequence_logps(logits, targets)
    reference = _torch_logps(logits, targets)
    torch.testing.assert_close(ours.double(), reference, rtol=1e-6, atol=1e-5)
    upstream = torch.randn(6)
    (grad,) = torch.autograd.grad(ours, logits, upstream)
    (expected,) = torch.autograd.grad(reference, logits, upstream.double())
    torch.testing.assert_close(grad.double(), expected.double(), rtol=1e-5, atol=1e-7)
    assert grad[targets == IGNORE_INDEX].abs().max() == 0  # nothing flows to the prompt


def test_sequence_logps_bf16_gradient_in_logits_dtype():
    torch.manual_seed(0)
    logits = torch.randn(4, 8, 32, dtype=torch.bfloat16, requires_grad=True)
    targets = _targets(4, 8, 32)
    sequence_logps(logits, targets).sum().backward()
    assert logits.grad.dtype == torch.bfloat16
    expected = torch.autograd.functional.jacobian(
        lambda z: _torch_logps(z, targets).sum(), logits.detach().double()
    )
    torch.testing.assert_close(logits.grad.double(), expected, rtol=0, atol=1e-2)


def test_pack_batch_round_trips_every_float64():
    targets = _targets(4, 5, 9)
    reference = torch.tensor(
        [-12.5, float("nan"), -1e-300, -3.0000000000000004], dtype=torch.float64
    )
    packed = pack_batch(targets, reference)
    assert packed.dtype == torch.int64 and packed.shape == (4, 9)
    back_targets, back = unpack_reference(packed[2:])  # a pipeline micro-batch's slice
    assert torch.equal(back_targets, targets[2:])
    assert back[0].item() == -1e-300 and back[1].item() == -3.0000000000000004
    assert math.isnan(unpack_reference(packed)[1][1].item())


def test_conservative_dpo_is_the_label_smoothed_sigmoid():
    torch.manual_seed(0)
    logps, reference = torch.randn(8) * 5, torch.randn(8) * 5
    counts = torch.full((8,), 3)
    beta, e = 0.2, 0.1
    loss, stats = PreferenceLoss("sigmoid", beta, label_smoothing=e)(logps, counts, reference)
    h = beta * ((logps[0::2] - reference[0::2]) - (logps[1::2] - reference[1::2]))
    expected = (-(1 - e) * F.logsigmoid(h) - e * F.logsigmoid(-h)).mean()
    torch.testing.assert_close(loss, expected)
    torch.testing.assert_close(stats["reward_chosen"], beta * (logps[0::2] - reference[0::2]))


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ({"objective": "kto"}, "objective='kto': use one of sigmoid, ipo, simpo, orpo"),
        ({"beta": 0.0}, "beta=0.0: must be > 0"),
        ({"label_smoothing": 0.5}, "label_smoothing=0.5: must be in [0, 0.5)"),
        ({"objective": "ipo", "label_smoothing": 0.1}, "use it with objective: sigmoid"),
        ({"objective": "orpo", "sft_weight": 1.0}, "ORPO has its own NLL term"),
        ({"reference": "copy"}, "reference='copy': use one of auto, data, adapters_off"),
    ],
)
def test_bad_settings_are_one_line(settings, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        PreferenceLM(config="llama3-debug", **settings)


def test_adapters_off_is_the_base_model():
    """The reference of a LoRA run: the model with its adapters switched off gives the
    logits of the same model without adapters (an independent copy, never injected)."""
    torch.manual_seed(0)
    base = Transformer(preference_config())
    adapted = Transformer(preference_config())
    adapted.load_state_dict(base.state_dict())
    inject(adapted, LoRASpec(r=4, alpha=8, target_modules=("*.attention.*", "*.feed_forward.*")))
    init_adapters(adapted, seed=1)
    with torch.no_grad():
        for name, param in adapted.named_parameters():
            if "lora_B" in name:
                param.normal_()  # B != 0: the adapters change the output
    x = torch.randint(0, 64, (2, 7))
    with torch.no_grad():
        expected = base(x)
        assert not torch.allclose(adapted(x), expected)
        with adapters_disabled(adapted):
            off = adapted(x)
        after = adapted(x)
    torch.testing.assert_close(off, expected, rtol=0, atol=0)
    assert not torch.allclose(after, expected)  # switched back on


def preference_config():
    from plugintrain.model_zoo.config import TransformerConfig

    return TransformerConfig.from_name("llama3-debug", vocab_size=64, n_layer=2)


def test_adapters_off_under_qlora_is_the_quantized_base():
    """QLoRA's reference: the adapters switched off over an NF4 base compute what a plain
    model computes with each adapted weight quantized and dequantized (fake_quantize,
    bitsandbytes' bytes: tests/unit/test_quantization.py)."""
    from plugintrain.model_zoo.lora import quantize_frozen
    from plugintrain.model_zoo.quantization import fake_quantize

    torch.manual_seed(0)
    config = preference_config()
    base = Transformer(config)
    adapted = Transformer(config)
    adapted.load_state_dict(base.state_dict())
    spec = LoRASpec(r=4, alpha=8, target_modules=("*.attention.*", "*.feed_forward.*"))
    inject(adapted, spec)
    kept = quantize_frozen(adapted, "nf4")
    init_adapters(adapted, seed=1)
    with torch.no_grad():
        for name, module in base.named_modules():
            if isinstance(module, torch.nn.Linear) and name != "output" and name not in kept:
                module.weight.copy_(fake_quantize(module.weight, "nf4"))
        for name, param in adapted.named_parameters():
            if "lora_B" in name:
                param.normal_()
        x = torch.randint(0, 64, (2, 7))
        with adapters_disabled(adapted):
            off = adapted(x)
    torch.testing.assert_close(off, base(x), rtol=1e-5, atol=1e-5)


class _Data:
    """A datamodule's attributes the launch checks read."""

    def __init__(self, preference: bool = True, has_reference: bool = False) -> None:
        self.preference, self.has_reference, self.batch_size = preference, has_reference, 4


def _trainer(*callbacks: object) -> object:
    from types import SimpleNamespace

    return SimpleNamespace(callbacks=list(callbacks), strategy=object())


@pytest.mark.parametrize(
    ("options", "what"),
    [
        ({"trainable": ["*.norm"]}, "LoRA trainable: ['*.norm']"),
        ({"bias": "lora_only"}, "LoRA bias: lora_only"),
        ({"adapter": "runs/sft/checkpoints"}, "LoRA adapter: runs/sft/checkpoints"),
    ],
)
def test_adapters_off_is_refused_where_it_is_not_the_reference(options, what):
    """LoRA that trains more than its adapters, or starts from an adapter: switching the
    adapters off would not give the starting model. Refused before launch, naming the way
    out; with the reference in the data, accepted."""
    from plugintrain.callbacks import LoRA

    module = PreferenceLM(config="llama3-debug")
    callback = LoRA(r=4, target_modules=["*.attention.wq"], **options)
    with pytest.raises(ValueError, match=re.escape(what)) as error:
        module.check_launch(_trainer(callback), _Data())
    assert "--reference WEIGHTS" in str(error.value) and "reference: data" in str(error.value)
    module.check_launch(_trainer(callback), _Data(has_reference=True))  # the data's: fine
    PreferenceLM(config="llama3-debug", objective="simpo").check_launch(
        _trainer(callback), _Data()
    )  # reference-free: fine


def test_each_model_refuses_the_other_data_before_launch():
    from plugintrain.callbacks import LoRA
    from plugintrain.model_zoo import CausalLM

    lora = LoRA(r=4, target_modules=["*.attention.wq"])
    with pytest.raises(ValueError, match="holds preference pairs, which CausalLM does not"):
        CausalLM(config="llama3-debug").check_launch(_trainer(lora), _Data())
    with pytest.raises(ValueError, match="PreferenceLM trains on preference pairs, and"):
        PreferenceLM(config="llama3-debug").check_launch(_trainer(lora), _Data(False))
    for reference in ("data", "adapters_off"):  # neither in the data nor adapters
        with pytest.raises(ValueError, match="this objective needs reference log-probs"):
            PreferenceLM(config="llama3-debug", reference=reference).check_launch(
                _trainer(), _Data()
            )
    # auto: a first pass, which reads a PreferenceDataModule's pairs
    with pytest.raises(ValueError, match=r"first pass, which needs plugintrain\.data\.Preference"):
        PreferenceLM(config="llama3-debug").check_launch(_trainer(), _Data())


# -- token weighting over a step --------------------------------------------------------


class _Grads:
    """A callback keeping the weights at the start and the gradients the optimizer steps
    with (after accumulation and every rescale)."""

    def __new__(cls):
        from lightning.pytorch.callbacks import Callback

        class Grads(Callback):
            def on_fit_start(self, trainer, module):
                self.start = {n: p.clone() for n, p in module.model.state_dict().items()}

            def on_before_optimizer_step(self, trainer, module, optimizer):
                named = module.model.named_parameters()
                self.grads = {n: p.grad.detach().clone() for n, p in named if p.grad is not None}

        return Grads()


def _varied_folder(root, count: int, with_reference: bool = True):
    """``count`` pairs of vocab-64 ids whose prompts, chosen and rejected answers all differ
    in length (so a micro-batch's token mean is not the step's), with reference log-probs."""
    import numpy as np
    from test_preference_data import _folder

    rng = np.random.default_rng(4)
    sequences, refs = [], []
    for n in range(count):
        prompt = rng.integers(1, 64, 1 + n % 3).tolist()
        for answer in (rng.integers(1, 64, 1 + (3 * n) % 7), rng.integers(1, 64, 1 + n % 4)):
            sequences.append((prompt + answer.tolist(), [0] * len(prompt) + [1] * len(answer)))
            refs.append(-3.0 * len(answer) - 0.1 * n)
    pairs = list(zip(sequences[0::2], sequences[1::2], strict=True))
    _folder(root, pairs, refs if with_reference else None, pad_id=0)
    return sequences, refs


def _one_step(folder, batch: int, accumulate: int, **objective):
    import lightning.pytorch as pl

    from plugintrain.data import PreferenceDataModule

    pl.seed_everything(0)
    module = PreferenceLM(
        config=preference_config(), warmup_steps=0, min_lr_ratio=1.0, reference="data",
        optimizer=lambda params: torch.optim.SGD(params, lr=0.0), **objective,
    )  # fmt: skip
    grads = _Grads()
    trainer = pl.Trainer(
        accelerator="cpu", max_steps=1, accumulate_grad_batches=accumulate, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        limit_val_batches=0, callbacks=[grads],
    )  # fmt: skip
    data = PreferenceDataModule(str(folder), batch_size=batch, shuffle=False, pad_multiple=1)
    trainer.fit(module, datamodule=data)
    return grads


def test_the_sft_term_is_token_weighted_over_the_step(tmp_path):
    """DPO + SFT, 2 micro-batches of 2 pairs accumulated: the gradient the optimizer steps
    with is plain PyTorch's of the step's loss, the mean over its 4 pairs of DPO's term plus
    the chosen answers' summed NLL over all their tokens (not the mean of the micro-batches'
    token means), within 1e-5."""
    beta, weight = 0.1, 0.7
    sequences, refs = _varied_folder(tmp_path / "pref", 8)
    run = _one_step(tmp_path / "pref", 2, 2, beta=beta, sft_weight=weight)
    model = Transformer(preference_config())
    model.load_state_dict(run.start)
    logps = []
    for ids, mask in sequences[:8]:  # the first 4 pairs: the first step, unshuffled
        ids, mask = torch.tensor(ids), torch.tensor(mask, dtype=torch.bool)
        logits = model(ids[None, :-1])[0].double()
        picked = torch.log_softmax(logits, -1).gather(-1, ids[1:, None]).squeeze(-1)
        logps.append((picked * mask[1:]).sum())
    logps, refs = torch.stack(logps), torch.tensor(refs[:8], dtype=torch.float64)
    ratios = logps - refs
    dpo = -F.logsigmoid(beta * (ratios[0::2] - ratios[1::2])).mean()
    chosen_tokens = sum(sum(mask[1:]) for _, mask in sequences[0:8:2])
    loss = dpo - weight * logps[0::2].sum() / chosen_tokens
    loss.backward()
    for name, param in model.named_parameters():
        torch.testing.assert_close(run.grads[name], param.grad.float(), rtol=1e-5, atol=1e-7)


def test_orpo_accumulated_is_orpo_on_the_whole_step(tmp_path):
    """ORPO (its NLL over the chosen rows' every token): 2 micro-batches of 2 pairs
    accumulated step with the gradient of one batch of the same 4 pairs (TRL's loss on it:
    tests/e2e/test_preference_trl.py) within 1e-5; before the step totals they differed."""
    _varied_folder(tmp_path / "pref", 8)
    whole = _one_step(tmp_path / "pref", 4, 1, objective="orpo", beta=0.2)
    parts = _one_step(tmp_path / "pref", 2, 2, objective="orpo", beta=0.2)
    assert whole.start.keys() == parts.start.keys()
    assert all(torch.equal(parts.start[name], value) for name, value in whole.start.items())
    assert whole.grads.keys() == parts.grads.keys() and len(whole.grads) > 10
    for name, grad in whole.grads.items():
        torch.testing.assert_close(parts.grads[name], grad, rtol=1e-5, atol=1e-7)


# -- the reference from a first pass ----------------------------------------------------


def test_a_first_pass_scores_the_pairs_caches_them_and_resumes(tmp_path, monkeypatch):
    """Full fine-tuning with no reference in the data: ``fit`` scores every sequence
    before the first step, with the model as it starts (plain PyTorch's log-probs of the
    same weights, within 1e-5), so the first step's DPO loss is log 2; a pass stopped
    after two chunks resumes with the six it lacks, and a second run scores nothing."""
    import shutil

    import lightning.pytorch as pl
    import numpy as np

    from plugintrain.data import PreferenceDataModule
    from plugintrain.model_zoo import reference_pass

    sequences, _ = _varied_folder(tmp_path / "pref", 8, with_reference=False)
    monkeypatch.setattr(reference_pass, "CHUNK_PAIRS", 2)  # 4 chunks a split
    written = []
    real_open = reference_pass.atomic_open

    def counting_open(path, **kwargs):
        if len(written) == stop_after:
            raise RuntimeError("stopped")
        written.append(path.name)
        return real_open(path, **kwargs)

    monkeypatch.setattr(reference_pass, "atomic_open", counting_open)
    losses = []

    class FirstLoss(pl.Callback):
        def on_train_batch_end(self, trainer, module, outputs, *args):
            losses.append(float(outputs["loss"]))

    def fit(steps=1, ckpt_path=None):
        pl.seed_everything(0)
        module = PreferenceLM(config=preference_config(), warmup_steps=0, beta=0.1)
        trainer = pl.Trainer(
            accelerator="cpu", max_steps=steps, logger=False, enable_progress_bar=False,
            enable_model_summary=False, limit_val_batches=0, callbacks=[grads, FirstLoss()],
            default_root_dir=tmp_path / "run",
        )  # fmt: skip
        data = PreferenceDataModule(str(tmp_path / "pref"), batch_size=2, pad_multiple=1)
        trainer.fit(module, datamodule=data, ckpt_path=ckpt_path)
        return data

    grads, stop_after = _Grads(), 2
    with pytest.raises(RuntimeError, match="stopped"):
        fit()
    assert written == ["train.000000.npy", "train.000001.npy"] and not losses
    written.clear()
    stop_after = None
    data = fit()
    assert written == [f"train.00000{k}.npy" for k in (2, 3)] + [
        f"val.00000{k}.npy" for k in range(4)
    ]
    assert losses == [pytest.approx(math.log(2), rel=1e-6)]
    model = Transformer(preference_config())
    model.load_state_dict(grads.start)
    expected = []
    for ids, mask in sequences:
        ids, mask = torch.tensor(ids), torch.tensor(mask, dtype=torch.bool)
        with torch.no_grad():
            logits = model(ids[None, :-1])[0].double()
        picked = torch.log_softmax(logits, -1).gather(-1, ids[1:, None]).squeeze(-1)
        expected.append(float((picked * mask[1:]).sum()))
    (cache,) = data.reference_cache_root.iterdir()
    for split in ("train", "val"):
        got = np.concatenate([np.load(cache / f"{split}.00000{k}.npy") for k in range(4)])
        np.testing.assert_allclose(got, expected, rtol=1e-5)
    written.clear()
    fit()
    assert written == []  # a complete cache: nothing scored again
    # Resumed from a checkpoint (its model trained past the reference) with the cache gone:
    # refused in one line, nothing scored.
    checkpoint = sorted((tmp_path / "run").rglob("*.ckpt"))[-1]
    shutil.rmtree(cache)
    with pytest.raises(ValueError, match=r"lack 8 chunks, and this run resumes from .*\.ckpt"):
        fit(steps=2, ckpt_path=str(checkpoint))
    assert written == []


def test_a_pipeline_refuses_a_first_pass():
    """No pipeline stage holds the whole model for the pass: refused before launch, naming
    the stored reference."""
    from types import SimpleNamespace

    strategy = SimpleNamespace(
        pipeline_options=SimpleNamespace(microbatches=2),
        parallel_dims=SimpleNamespace(pipeline_parallel=2),
    )
    data = _Data()
    data.use_reference = lambda logps: None  # a PreferenceDataModule's
    problem = PreferenceLM(config="llama3-debug").launch_problem(strategy, data, lora=False)
    assert problem is not None and problem.startswith("under pipeline parallelism the")
    assert "--reference WEIGHTS" in problem


def test_context_parallelism_is_refused_before_launch():
    """An answer's log-prob is a sum over its whole row: a split row is refused in one
    line, and the hint (context_parallel: 1) is accepted."""
    from types import SimpleNamespace

    from plugintrain.strategies import ParallelDims

    model = PreferenceLM(config="llama3-debug", objective="orpo")  # no reference needed
    data = _Data()
    split = SimpleNamespace(parallel_dims=ParallelDims(world_size=2, context_parallel=2))
    problem = model.launch_problem(split, data, lora=False)
    assert problem is not None and "context_parallel=2 splits rows" in problem
    whole = SimpleNamespace(parallel_dims=ParallelDims(world_size=2))
    assert model.launch_problem(whole, data, lora=False) is None
