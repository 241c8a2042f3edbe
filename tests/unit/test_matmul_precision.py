"""``--matmul_precision`` reaches torch before the Trainer is built, and MFU's fp32 peak
follows it (the TF32 rate unless 'highest')."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch

from plugintrain.cli import PluginTrainCLI, main
from plugintrain.core.peak_flops import device_peak_flops
from plugintrain.data import write_token_bin

REPO = Path(__file__).resolve().parents[2]
GPT2_RECIPE = REPO / "recipes" / "gpt2_debug_shakespeare_cpu.yaml"


@pytest.fixture(autouse=True)
def _restore_matmul_precision() -> Iterator[None]:
    before = torch.get_float32_matmul_precision()
    yield
    torch.set_float32_matmul_precision(before)


@pytest.fixture
def gpt2_tokens(tmp_path: Path) -> Path:
    out = tmp_path / "shakespeare_gpt2"
    write_token_bin(out / "train.bin", np.arange(300) % 1000)
    write_token_bin(out / "val.bin", np.arange(300) % 1000)
    meta = {"dataset": "shakespeare", "tokenizer": "gpt2", "vocab_size": 50257}
    (out / "meta.json").write_text(json.dumps(meta))
    return out


def _cli(tmp_path: Path, data_dir: Path, *args: str) -> PluginTrainCLI:
    return PluginTrainCLI(
        args=[
            "--config", str(GPT2_RECIPE), f"--data.init_args.data_dir={data_dir}",
            f"--trainer.logger.init_args.save_dir={tmp_path / 'runs'}", *args,
        ],
        run=False,
    )  # fmt: skip


@pytest.mark.parametrize("precision", ["high", "medium", "highest"])
def test_the_option_reaches_torch(tmp_path: Path, gpt2_tokens: Path, precision: str) -> None:
    torch.set_float32_matmul_precision("highest" if precision != "highest" else "high")
    _cli(tmp_path, gpt2_tokens, f"--matmul_precision={precision}")
    assert torch.get_float32_matmul_precision() == precision


def test_unset_leaves_torch_s_default(tmp_path: Path, gpt2_tokens: Path) -> None:
    _cli(tmp_path, gpt2_tokens)
    assert torch.get_float32_matmul_precision() == "highest"


def test_a_bad_value_is_one_line(capfd, tmp_path: Path, gpt2_tokens: Path) -> None:
    args = ["fit", "--config", str(GPT2_RECIPE), f"--data.init_args.data_dir={gpt2_tokens}"]
    assert main([*args, "--matmul_precision=tf32"]) == 2
    line = capfd.readouterr().err.strip().splitlines()[-1]
    assert line.startswith("plugintrain fit: error:") and "tf32" in line


def test_mfu_fp32_peak_follows_it(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *_: "NVIDIA H100 80GB HBM3")
    device = torch.device("cuda", 0)
    torch.set_float32_matmul_precision("highest")
    assert device_peak_flops(device, torch.float32) == pytest.approx(66.9e12)
    torch.set_float32_matmul_precision("high")
    assert device_peak_flops(device, torch.float32) == pytest.approx(494.7e12)
    assert device_peak_flops(device, torch.bfloat16) == pytest.approx(989.4e12)  # unchanged
