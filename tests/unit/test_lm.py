"""CausalLM: model building, optimizer groups, LR schedule, training, meta init."""

import math

import lightning as L
import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from plugintrain.data import TokenDataModule, get_tokenizer, write_token_bin, write_token_bytes
from plugintrain.model_zoo import CausalLM, Transformer, TransformerConfig
from plugintrain.model_zoo.metrics import BitsPerByte


def _config(preset: str = "gpt2-debug") -> TransformerConfig:
    return TransformerConfig.from_name(preset, vocab_size=64, block_size=32, n_layer=2)


def _batch(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    data = torch.randint(0, 64, (4, 17), generator=torch.Generator().manual_seed(seed))
    return data[:, :-1], data[:, 1:]


def test_properties_before_configure_model():
    lm = CausalLM("gpt2-debug")
    assert lm.model is None
    assert (lm.vocab_size, lm.max_seq_len) == (50257, 256)


def test_configure_model_is_idempotent():
    lm = CausalLM(_config())
    lm.configure_model()
    model = lm.model
    lm.configure_model()
    assert lm.model is model


def test_weight_decay_groups():
    lm = CausalLM(_config(), weight_decay=0.05, lr_decay_steps=10)
    lm.configure_model()
    optimizer = lm.configure_optimizers()["optimizer"]
    decay, no_decay = optimizer.param_groups
    assert decay["weight_decay"] == 0.05 and no_decay["weight_decay"] == 0.0
    assert all(p.dim() == 2 for p in decay["params"])
    assert all(p.dim() == 1 for p in no_decay["params"])  # biases and norm weights
    named = dict(lm.named_parameters())
    assert any(p is named["model.layers.0.attention.wq.bias"] for p in no_decay["params"])
    assert any(p is named["model.layers.0.ffn_norm.weight"] for p in no_decay["params"])
    assert sum(len(g["params"]) for g in optimizer.param_groups) == len(named)


def test_lr_schedule_warmup_peak_end():
    lm = CausalLM(_config(), warmup_steps=10, lr_decay_steps=110, min_lr_ratio=0.1)
    lm.configure_model()
    config = lm.configure_optimizers()
    optimizer, scheduler = config["optimizer"], config["lr_scheduler"]["scheduler"]
    assert config["lr_scheduler"]["interval"] == "step"
    peak = optimizer.defaults["lr"]
    lrs = []
    for _ in range(120):
        lrs.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        scheduler.step()
    assert lrs[0] == pytest.approx(peak / 11)  # (step + 1) / (warmup + 1)
    assert lrs[10] == pytest.approx(peak)
    assert lrs[60] == pytest.approx(peak * (0.1 + 0.9 * 0.5))  # cosine midpoint
    assert lrs[110] == pytest.approx(peak * 0.1)
    assert lrs[119] == pytest.approx(peak * 0.1)
    assert max(lrs) == pytest.approx(peak)


def test_optimizer_steps_reduce_loss():
    torch.manual_seed(0)
    lm = CausalLM(_config("llama3-debug"), warmup_steps=0, lr_decay_steps=100)
    lm.configure_model()
    optimizer = lm.configure_optimizers()["optimizer"]
    x, y = _batch()
    losses = []
    for _ in range(10):
        loss = lm.loss_fn(lm(x), y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    assert losses[0] == pytest.approx(math.log(64), abs=0.3)  # near-uniform at init
    assert losses[-1] < losses[0] - 0.5


def test_meta_build_then_materialize_keeps_ties():
    config = _config("llama3-debug")
    with torch.device("meta"):
        model = Transformer(config)
    assert model.output.weight.is_meta and model.rope_cos.is_meta
    model.to_empty(device="cpu")
    model.init_weights()
    assert model.output.weight is model.tok_embeddings.weight
    torch.manual_seed(0)
    reference = Transformer(config)
    torch.testing.assert_close(model.rope_cos, reference.rope_cos)
    torch.testing.assert_close(model.rope_sin, reference.rope_sin)
    assert model.layers["0"].attention_norm.weight.eq(1).all()
    std = model.layers["0"].attention.wq.weight.std().item()
    assert std == pytest.approx(config.init_std, rel=0.1)
    residual = model.layers["0"].attention.wo.weight.std().item()
    assert residual == pytest.approx(config.init_std / math.sqrt(2 * config.n_layer), rel=0.1)


def test_materializing_a_meta_built_model_keeps_its_metrics():
    # Shard-first strategies build the transformer on meta and allocate it in place; the
    # metrics were real all along and keep their states (once, every state was replaced
    # by uninitialized memory: val_ppl 1.0 under pipelines).
    from plugintrain.strategies.parallel_plan import materialize

    lm = CausalLM(_config("llama3-debug"))
    with torch.device("meta"):
        lm.configure_model()
    states = [lm.eval_metrics["val"].ppl.total, lm.eval_metrics["val"].bpb.total]
    materialize(lm, torch.device("cpu"))
    assert not any(t.is_meta for t in [*lm.parameters(), *lm.buffers()])
    assert lm.model.output.weight is lm.model.tok_embeddings.weight
    metrics = lm.eval_metrics["val"]
    now = [metrics.ppl.total, metrics.bpb.total]
    assert all(a is b for a, b in zip(states, now, strict=True))  # not replaced by garbage
    metrics.token_bytes = torch.ones(64, dtype=torch.int32)
    logged = metrics.update(torch.tensor(2.0), torch.zeros(4, 8, dtype=torch.long))
    assert logged["ppl"].compute().item() == pytest.approx(math.exp(2.0))
    assert logged["bpb"].compute().item() == pytest.approx(2.0 / math.log(2))


def test_seeded_construction_is_reproducible():
    torch.manual_seed(3)
    a = Transformer(_config())
    torch.manual_seed(3)
    b = Transformer(_config())
    for pa, pb in zip(a.parameters(), b.parameters(), strict=True):
        torch.testing.assert_close(pa, pb)
    assert "rope_cos" not in Transformer(_config("llama3-debug")).state_dict()


def test_pipeline_stage_without_embeddings_or_head():
    torch.manual_seed(0)
    model = Transformer(_config("llama3-debug")).eval()
    x, _ = _batch()
    with torch.no_grad():
        expected = model(x)
        hidden = model.tok_embeddings(x)
        model.tok_embeddings, norm, output = None, model.norm, model.output
        model.norm = model.output = None
        assert model(hidden).shape == hidden.shape
        torch.testing.assert_close(output(norm(model(hidden))), expected)


def test_fit_logs_losses_and_perplexity(tmp_path):
    torch.manual_seed(0)
    x, y = _batch()
    loader = DataLoader(TensorDataset(x, y), batch_size=2)
    lm = CausalLM(_config(), warmup_steps=1)
    trainer = L.Trainer(
        max_steps=3,
        limit_val_batches=2,
        accelerator="cpu",
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=tmp_path,
    )
    trainer.fit(lm, loader, loader)
    metrics = trainer.callback_metrics
    assert {"train_loss", "val_loss", "val_ppl"} <= set(metrics)
    assert "val_bpb" not in metrics  # plain loaders know no bytes per token
    assert lm.flops_per_batch == lm.config.flops_per_token(16) * 2 * 16
    assert metrics["val_ppl"].item() == pytest.approx(
        math.exp(metrics["val_loss"].item()), rel=1e-4
    )
    (result,) = trainer.test(lm, loader, verbose=False)
    assert result["test_ppl"] == pytest.approx(math.exp(result["test_loss"]), rel=1e-4)
    trainer.save_checkpoint(tmp_path / "lm.ckpt")
    loaded = CausalLM.load_from_checkpoint(tmp_path / "lm.ckpt")
    torch.testing.assert_close(loaded(x), lm(x))


# ---- bits per byte ---------------------------------------------------------------------

VERSE = (
    "Now is the winter of our discontent\nMade glorious summer by this sun of York;\n"
    "And all the clouds that lour'd upon our house\nIn the deep bosom of the ocean buried.\n"
    "Now are our brows bound with victorious wreaths;\nOur bruised arms hung up for"
    " monuments;\nOur stern alarums changed to merry meetings,\nOur dreadful marches to"
    " delightful measures.\nGrim-visaged war hath smooth'd his wrinkled front;\n"
)


def test_bits_per_byte_metric():
    bpb = BitsPerByte()
    token_bytes = torch.tensor([0, 1, 2, 3])
    bpb.update(torch.tensor(2.0), torch.tensor([[1, 2], [3, 0]]), token_bytes)  # NLL 8, 6 bytes
    bpb.update(torch.tensor(1.0), torch.tensor([3, 3]), token_bytes)  # NLL 2, 6 bytes
    assert bpb.compute().item() == pytest.approx(10 / (12 * math.log(2)))


class _EvalData(L.LightningDataModule):
    """Test batches and the bytes per token id (a TokenBytesSource)."""

    def __init__(self, x: torch.Tensor, y: torch.Tensor, token_bytes: torch.Tensor) -> None:
        super().__init__()
        self.batches, self.token_bytes = TensorDataset(x, y), token_bytes

    def test_dataloader(self) -> DataLoader:
        return DataLoader(self.batches, batch_size=2)


def test_validation_logs_bits_per_byte_of_the_text(tmp_path):
    gpt2 = get_tokenizer("gpt2")
    ids = np.array(gpt2.encode(VERSE))
    seq_len, windows = 16, 6
    write_token_bin(tmp_path / "train.bin", ids)
    write_token_bin(tmp_path / "val.bin", ids[: seq_len * windows + 1])
    write_token_bytes(tmp_path, gpt2.token_bytes())
    torch.manual_seed(0)
    config = TransformerConfig.from_name("gpt2-debug", block_size=seq_len, n_layer=1)
    lm = CausalLM(config)
    data = TokenDataModule(str(tmp_path), seq_len=seq_len, batch_size=2, shuffle=False)
    trainer = L.Trainer(
        accelerator="cpu", logger=False, enable_progress_bar=False, default_root_dir=tmp_path
    )
    (result,) = trainer.validate(lm, datamodule=data, verbose=False)

    # The same windows by hand: NLL from log-softmax, bytes from the decoded target text.
    tokens = torch.from_numpy(ids[: seq_len * windows + 1]).long()
    x, y = tokens[:-1].view(windows, seq_len), tokens[1:].view(windows, seq_len)
    with torch.no_grad():
        log_p = torch.log_softmax(lm(x).double(), dim=-1)
    nll = -log_p.gather(-1, y[..., None]).sum().item()
    text_bytes = sum(len(gpt2.decode(row.tolist()).encode()) for row in y)
    expected = nll / text_bytes / math.log(2)
    assert result["val_bpb"] == pytest.approx(expected, rel=1e-5)
    assert result["val_loss"] == pytest.approx(nll / y.numel(), rel=1e-5)

    (tested,) = trainer.test(
        lm, _EvalData(x, y, torch.from_numpy(gpt2.token_bytes())), verbose=False
    )
    assert tested["test_bpb"] == pytest.approx(expected, rel=1e-5)
