"""plugintrain's preference objectives equal TRL 1.16's, on SmolLM2-135M.

TRL (the reference most users know, driven by ``tests/reference/trl_preference.py``)
loads plugintrain's Hugging Face export of SmolLM2-135M-Instruct with ``transformers``;
plugintrain's :class:`~plugintrain.model_zoo.PreferenceLM` reads the same folder. Both
score the same id sequences (a prompt, a chosen and a rejected answer per pair; TRL adds
no BOS/EOS to given ids), fp32, dropout off.

- One batch, each objective TRL implements: DPO (``sigmoid``), conservative DPO (label
  smoothing), IPO, DPO with an SFT term, SimPO (TRL's CPO trainer) and ORPO: the loss,
  each pair's chosen/rejected rewards and log-probs, and the gradient of the trainable
  weights equal TRL's within 1e-4 relative (the gradient as one vector; each weight's own
  within 3e-4: TRL computes log-probs in fp32 with an online log-sum-exp over 32,768-column
  chunks of the vocabulary, ``trl/kernels/chunked_logprob.py``, and against the same
  model run in float64 its weights' gradients are off by up to 1.05e-4, plugintrain's by
  up to 1.1e-5; measured on the LoRA DPO batch here). The reference-based ones train LoRA adapters
  on every projection (``B != 0``, so the policy is not the reference) with the base,
  adapters off, as the reference on both sides; DPO also trains every weight with cached
  reference log-probs (TRL's ``precompute_ref_log_probs``).
- 20 LoRA steps of DPO with AdamW: the losses track TRL's DPOTrainer's within 1e-3.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from reference.trl_preference import trl_step, trl_train

from plugintrain.core.preference_batch import encode_targets, pack_batch
from plugintrain.model_zoo.llama3 import hf_names
from plugintrain.model_zoo.lora import LoRASpec, adapted_layers, inject
from plugintrain.model_zoo.preference import PreferenceLM

BETA = 0.1
RTOL = 1e-4
TEXTS = [  # prompt, chosen, rejected
    ("Write 5 March 2021 as an ISO 8601 date:", " 2021-03-05", " March 5, 2021"),
    ("The capital of France is", " Paris.", " a city in Europe, I think."),
    ("2 + 2 =", " 4", " 5, as everyone knows"),
    ("Name a primary colour.", " Red.", " Purple, obviously."),
]
# plugintrain's projection -> Hugging Face's (peft's adapter names follow the module path)
PROJECTIONS = {
    "attention.wq": "self_attn.q_proj",
    "attention.wk": "self_attn.k_proj",
    "attention.wv": "self_attn.v_proj",
    "attention.wo": "self_attn.o_proj",
    "feed_forward.w1": "mlp.gate_proj",
    "feed_forward.w3": "mlp.up_proj",
    "feed_forward.w2": "mlp.down_proj",
}
LORA = {"r": 4, "alpha": 8, "dropout": 0.0, "target_modules": sorted(PROJECTIONS.values())}


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from plugintrain.cli import main

    out = tmp_path_factory.mktemp("smollm2") / "hf"
    assert main(["convert", "smollm2-135m", str(out), "--format", "hf"]) == 0
    return out


@pytest.fixture(scope="module")
def pairs() -> list[dict[str, list[int]]]:
    from plugintrain.data import get_tokenizer

    tokenizer = get_tokenizer("smollm2-135m")
    return [
        {
            "prompt_ids": tokenizer.encode(prompt),
            "chosen_ids": tokenizer.encode(chosen),
            "rejected_ids": tokenizer.encode(rejected),
        }
        for prompt, chosen, rejected in TEXTS
    ]


def _batch(pairs: list[dict], reference: torch.Tensor | None = None) -> tuple[torch.Tensor, ...]:
    """plugintrain's batch of ``pairs`` (the layout of plugintrain.core.preference_batch)."""
    rows = []
    for pair in pairs:
        for answer in (pair["chosen_ids"], pair["rejected_ids"]):
            ids = pair["prompt_ids"] + answer
            rows.append((ids, [False] * len(pair["prompt_ids"]) + [True] * len(answer)))
    width = max(len(ids) for ids, _ in rows) - 1
    x = torch.zeros(len(rows), width, dtype=torch.int64)
    y = torch.full_like(x, -100)
    for r, (ids, answer) in enumerate(rows):
        x[r, : len(ids) - 1] = torch.tensor(ids[:-1])
        y[r, : len(ids) - 1] = torch.from_numpy(encode_targets(_np(ids), _np(answer)))
    if reference is None:
        reference = torch.full((len(rows),), float("nan"), dtype=torch.float64)
    # The batch is its step: its pairs, chosen answers' tokens and chosen rows' tokens but one.
    chosen = [(p["prompt_ids"], p["chosen_ids"]) for p in pairs]
    totals = [
        len(pairs),
        sum(len(a) for _, a in chosen),
        sum(len(p) + len(a) - 1 for p, a in chosen),
    ]
    return x, pack_batch(y, reference, torch.tensor(totals))


def _np(values: list) -> object:
    import numpy as np

    return np.asarray(values)


def _model(hf_dir: Path, lora_seed: int | None, **objective: object) -> PreferenceLM:
    """PreferenceLM on the exported weights; with ``lora_seed``, LoRA r 4 on every
    projection, ``A`` and ``B`` drawn from it (``B != 0``: the policy is not the base)."""
    module = PreferenceLM(weights=str(hf_dir), **objective)
    module.configure_model()
    module.init_weights()
    if lora_seed is not None:
        spec = LoRASpec(r=4, alpha=8, target_modules=tuple(f"*.{p}" for p in PROJECTIONS))
        inject(module.model, spec)
        generator = torch.Generator().manual_seed(lora_seed)
        for _, layer in adapted_layers(module.model):
            for param in (layer.lora_A, layer.lora_B):
                param.data = torch.randn(param.shape, generator=generator) * 0.05
    return module.train()


def _peft_names(module: PreferenceLM) -> dict[str, str]:
    """Our adapter parameter -> peft's state-dict name."""
    names = {}
    for path, _ in adapted_layers(module.model):
        layer, projection = path.split(".", 2)[1], path.split(".", 2)[2]
        theirs = f"base_model.model.model.layers.{layer}.{PROJECTIONS[projection]}"
        names[f"model.{path}.lora_A"] = f"{theirs}.lora_A.weight"
        names[f"model.{path}.lora_B"] = f"{theirs}.lora_B.weight"
    return names


def _step(module: PreferenceLM, batch: tuple[torch.Tensor, ...]) -> dict:
    """Our loss, per-pair statistics and gradients of one batch (the training step's path:
    the reference filled in, then the loss)."""
    x, y = module.with_reference(batch)
    loss = module.loss_fn(module(x), y)
    loss.backward()
    stats = {name: torch.cat(values) for name, values in module._stats.items() if name[:3] != "los"}
    return {"loss": loss.item(), **stats}


def _close(ours: torch.Tensor, theirs: torch.Tensor, what: str, rtol: float = RTOL) -> None:
    ours, theirs = ours.double(), theirs.double()
    error = (ours - theirs).norm() / theirs.norm().clamp(min=1e-30)
    assert error <= rtol, f"{what}: relative error {error:.2e}"


def _compare(ours: dict, theirs: dict, grads: dict[str, tuple[torch.Tensor, str]]) -> None:
    assert ours["loss"] == pytest.approx(theirs["loss"], rel=RTOL)
    for side in ("chosen", "rejected"):
        _close(ours[f"reward_{side}"], theirs[f"{side}_rewards"], f"{side} rewards")
        _close(ours[f"logp_{side}"], theirs[f"{side}_logps"], f"{side} log-probs")
    assert set(theirs["grads"]) == {name for _, name in grads.values()}
    pairs = [(grad, theirs["grads"][name]) for grad, name in grads.values()]
    whole = [torch.cat([grad.flatten() for grad in side]) for side in zip(*pairs, strict=True)]
    _close(*whole, "the gradient")
    for ours_name, (grad, theirs_name) in grads.items():
        _close(grad, theirs["grads"][theirs_name], ours_name, rtol=3 * RTOL)


OBJECTIVES = {  # test id -> (ours, the harness's objective and options)
    "dpo": ({"objective": "sigmoid"}, ("sigmoid", {})),
    "cdpo": (
        {"objective": "sigmoid", "label_smoothing": 0.2}, ("sigmoid", {"label_smoothing": 0.2})
    ),
    "ipo": ({"objective": "ipo"}, ("ipo", {})),
    "dpo_sft": ({"objective": "sigmoid", "sft_weight": 0.5}, ("sigmoid_sft", {"sft_weight": 0.5})),
    "simpo": ({"objective": "simpo", "simpo_gamma": 0.5}, ("simpo", {"simpo_gamma": 0.5})),
    "orpo": ({"objective": "orpo"}, ("orpo", {})),
}  # fmt: skip


@pytest.mark.parametrize("name", OBJECTIVES)
def test_lora_objective_equals_trl(hf_dir: Path, pairs: list[dict], name: str) -> None:
    ours_options, (objective, options) = OBJECTIVES[name]
    module = _model(hf_dir, lora_seed=0, beta=BETA, **ours_options)
    peft = _peft_names(module)
    state = {peft[n]: p.detach().clone() for n, p in module.named_parameters() if n in peft}
    ours = _step(module, _batch(pairs))
    theirs = trl_step(str(hf_dir), pairs, objective, BETA, lora=LORA, lora_state=state, **options)
    grads = {n: (p.grad, peft[n]) for n, p in module.named_parameters() if p.requires_grad}
    assert len(grads) == 2 * 7 * module.config.n_layer
    _compare(ours, theirs, grads)


def test_full_dpo_with_cached_reference_equals_trl(hf_dir: Path, pairs: list[dict]) -> None:
    """Every weight trains; the reference log-probs come with the data (made up here, so
    the policy is not the reference), as TRL's precomputed ones."""
    generator = torch.Generator().manual_seed(1)
    reference = -10 - 5 * torch.rand(2 * len(pairs), generator=generator, dtype=torch.float64)
    module = _model(hf_dir, lora_seed=None, beta=BETA, objective="sigmoid", reference="data")
    ours = _step(module, _batch(pairs, reference))
    cached = (reference[0::2].tolist(), reference[1::2].tolist())
    theirs = trl_step(str(hf_dir), pairs, "sigmoid", BETA, ref_logps=cached)
    hf = hf_names(module.config)
    grads = {
        n: (p.grad, hf[n.removeprefix("model.")])
        for n, p in module.named_parameters()
        if p.requires_grad
    }
    _compare(ours, theirs, grads)


def test_twenty_lora_dpo_steps_track_trl(hf_dir: Path, pairs: list[dict]) -> None:
    """AdamW as TRL's trainer runs it (betas 0.9/0.999, eps 1e-8, no weight decay, constant
    learning rate, no clipping), 2 pairs a step in order, cycling."""
    steps, lr = 20, 1e-3
    module = _model(hf_dir, lora_seed=2, beta=BETA, objective="sigmoid")
    peft = _peft_names(module)
    state = {peft[n]: p.detach().clone() for n, p in module.named_parameters() if n in peft}
    trainable = [p for p in module.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trainable, lr=lr, betas=(0.9, 0.999), eps=1e-8, weight_decay=0)
    losses = []
    for step in range(steps):
        start = 2 * step % len(pairs)
        optimizer.zero_grad()
        losses.append(_step(module, _batch(pairs[start : start + 2]))["loss"])
        module._stats.clear()
        optimizer.step()
    theirs = trl_train(
        str(hf_dir), pairs, "sigmoid", BETA, steps, lr, lora=LORA, lora_state=state, batch_size=2
    )
    assert len(theirs) == steps
    assert losses[-1] < losses[0] - 0.05  # it learns: the comparison is not of flat curves
    assert losses == pytest.approx(theirs, rel=1e-3)
