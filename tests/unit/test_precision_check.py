"""PrecisionCheck: what it records, where it writes, and how it treats fp16 loss scaling."""

from __future__ import annotations

import json
import math

import lightning as L
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from plugintrain.callbacks.precision_check import PrecisionCheck, step_file, tensor_stats
from plugintrain.precision_plugins import FP16MixedPrecision, FP32Precision


class _Net(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))

    def training_step(self, batch, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return nn.functional.mse_loss(self.net(x).float(), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def _fit(check: PrecisionCheck, plugin, steps: int = 3) -> None:
    generator = torch.Generator().manual_seed(0)
    data = TensorDataset(
        torch.randn(8, 4, generator=generator), torch.randn(8, 1, generator=generator)
    )
    trainer = L.Trainer(
        accelerator="cpu",
        plugins=[plugin],
        max_steps=steps,
        callbacks=[check],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(_Net(), DataLoader(data, batch_size=2))


def test_tensor_stats() -> None:
    stats = tensor_stats(torch.tensor([1.0, -3.0, math.inf, math.nan]))
    assert (stats["nan"], stats["inf"], stats["shape"], stats["dtype"]) == (1, 1, [4], "float32")
    finite = tensor_stats(torch.tensor([[1.0, -3.0]], dtype=torch.bfloat16))
    assert (finite["mean"], finite["std"], finite["absmax"]) == (-1.0, 2.0, 3.0)
    assert finite["dtype"] == "bfloat16"
    assert finite["hash"] == tensor_stats(torch.tensor([[1.0, -3.0]], dtype=torch.bfloat16))["hash"]
    assert finite["hash"] != tensor_stats(torch.tensor([[1.0, -3.0]]))["hash"]


def test_glob_selects_modules() -> None:
    net = _Net()
    assert list(PrecisionCheck(modules=["net.*"]).matched_modules(net)) == [
        "net.0",
        "net.1",
        "net.2",
    ]
    assert list(PrecisionCheck(modules=["*.2"]).matched_modules(net)) == ["net.2"]


def test_records_chosen_steps_one_file_per_rank_per_step(tmp_path) -> None:
    _fit(
        PrecisionCheck(modules=["net.0", "net.2"], steps=[0, 2], dirpath=str(tmp_path)),
        FP32Precision(),
    )
    assert sorted(p.parent.name for p in tmp_path.rglob("rank_*.json")) == [
        "step_000000",
        "step_000002",
    ]
    payload = json.loads(step_file(tmp_path, 2, 0).read_text())
    names = [(r["name"], r["kind"]) for r in payload["records"]]
    assert names == [
        ("net.0", "output"),
        ("net.2", "output"),
        ("net.2", "grad_output"),
        ("net.0", "grad_output"),
        ("net.0.weight", "grad"),
        ("net.0.bias", "grad"),
        ("net.2.weight", "grad"),
        ("net.2.bias", "grad"),
    ]
    assert payload["records"][0]["shape"] == [2, 8]
    assert payload["step"] == 2 and payload["loss"] > 0


def test_fp16_gradients_are_recorded_unscaled(tmp_path) -> None:
    _fit(
        PrecisionCheck(modules=["net.2"], steps=[0], dirpath=str(tmp_path / "fp32")),
        FP32Precision(),
        1,
    )
    plugin = FP16MixedPrecision(device="cpu", init_scale=2.0**12)
    _fit(PrecisionCheck(modules=["net.2"], steps=[0], dirpath=str(tmp_path / "fp16")), plugin, 1)
    runs = [json.loads(step_file(tmp_path / run, 0, 0).read_text()) for run in ("fp32", "fp16")]
    for fp32, fp16 in zip(runs[0]["records"], runs[1]["records"], strict=True):
        assert fp32["name"] == fp16["name"]
        # fp16 rounding moves them by ~1%; an undivided scale would be 4096x.
        assert math.isclose(fp32["absmax"], fp16["absmax"], rel_tol=5e-2), fp32["name"]


def test_statistics_are_exact_over_chunks(monkeypatch) -> None:
    from plugintrain.callbacks import precision_check

    values = torch.randn(1000, generator=torch.Generator().manual_seed(0)) * 3 + 50
    whole = tensor_stats(values)
    monkeypatch.setattr(precision_check, "_CHUNK", 64)  # 16 chunks, the last one ragged
    chunked = tensor_stats(values)
    reference = values.double()
    assert math.isclose(chunked["mean"], reference.mean().item(), rel_tol=1e-12)
    assert math.isclose(chunked["std"], reference.std(correction=0).item(), rel_tol=1e-12)
    assert chunked["absmax"] == reference.abs().max().item()
    assert chunked["hash"] == whole["hash"]  # the fingerprint does not depend on chunking


def test_no_whole_fp64_copy_exists(monkeypatch) -> None:
    from plugintrain.callbacks import precision_check
    from plugintrain.core.memory import LiveTensorMemory

    values = torch.randn(4096, dtype=torch.bfloat16)
    monkeypatch.setattr(precision_check, "_CHUNK", 64)
    with LiveTensorMemory() as memory:
        memory.track(values)
        tensor_stats(values)
    # The bf16 tensor plus a few chunk-sized temporaries: far below one fp64 copy (32 KiB).
    assert memory.peak_bytes - values.numel() * 2 < values.numel() * 8 / 4


def test_fingerprint_sees_every_byte_and_position() -> None:
    base = torch.arange(64, dtype=torch.float32)
    digest = tensor_stats(base)["hash"]
    assert len(digest) == 16 and digest == tensor_stats(base.clone())["hash"]
    changed = base.clone()
    changed[37] = torch.nextafter(changed[37], torch.tensor(100.0))  # the last bit of one value
    swapped = base.clone()
    swapped[[3, 4]] = swapped[[4, 3]]
    as_bf16 = base.to(torch.bfloat16)  # same values, other bytes
    others = {tensor_stats(t)["hash"] for t in (changed, swapped, as_bf16, base.flip(0))}
    assert digest not in others and len(others) == 4
