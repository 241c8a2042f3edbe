"""QLoRA through the command line under every layout that holds whole weights (or
shards them flat), against one process.

One recipe: a small random Hugging Face Llama as the base, LoRA r 4 on every attention
and MLP projection with the base held in NF4 (``quantize: nf4``, quantized as the base is
read), fp32, a fixed seed and fixed random tokens. It runs in one process (the reference)
and on 2 gloo ranks under ``ddp_bucketed``, ``zero1``, ``zero2``, ``hybrid`` with
``zero_stage: 3`` (torch FSDP2: each rank holds a part of every packed NF4 parameter and
all-gathers it per block), the same with ``activation_checkpointing: full`` (the
recomputed forward reads the packed weights the backward's all-gather put back), and
``pipeline`` (2 stages, each building on the meta device, then loading and quantizing its
own layers). Every layout's loss of the global batch must be the one process's at every
step within 1e-5 relative. For scale: the same run with the base unquantized is 7e-5 to
2.5e-4 off the reference, one whose adapters never move (lr 0) 8e-4 to 2e-3 off from
step 1 on. ``hybrid`` with ``tensor_parallel: 2`` is refused in one line before any
process is spawned.

Each command runs forked from the fork server (``_cli.run_cli``), the 2-rank fits as
torchrun starts its ranks. The data-parallel ranks' losses come from files a small
callback of this module writes (TensorBoard holds rank 0's half of the batch only), and
so do the packed parameters each rank holds; the pipeline's and the one process's losses
are read from TensorBoard as well.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import numpy as np
import pytest
import yaml
from lightning.pytorch.callbacks import Callback
from torch.distributed.tensor import DTensor

from plugintrain.data.token_bin import write_token_bin

from _cli import REPO, logged_losses, run_cli
from _hf_models import random_hf_llama

VOCAB = 256
STEPS = 4
GLOBAL_BATCH = 4
NAME = "qlora"
TARGETS = ["*.attention.w?", "*.feed_forward.w?"]
HYBRID = "plugintrain.strategies.HybridParallelStrategy"

# name -> (strategy, data-parallel degree over the 2 ranks)
LAYOUTS: dict[str, tuple[Any, int]] = {
    "ddp_bucketed": ("ddp_bucketed", 2),
    "zero1": ("zero1", 2),
    "zero2": ("zero2", 2),
    "fsdp2": ({"class_path": HYBRID, "init_args": {"zero_stage": 3}}, 2),
    "fsdp2_recompute": (
        {"class_path": HYBRID, "init_args": {"zero_stage": 3, "activation_checkpointing": "full"}},
        2,
    ),
    "pipeline": ("pipeline", 1),
}


class LayoutProbe(Callback):
    """Writes ``<dirpath>/rank_<rank>.json``: this rank's loss at each step, and the local
    and whole element counts of every packed quantized parameter at train start (after the
    strategy has sharded the model).

    Args:
        dirpath: Where the files go.
    """

    def __init__(self, dirpath: str) -> None:
        self.dirpath = dirpath
        self.losses: dict[int, float] = {}
        self.packed: dict[str, list[int]] = {}

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        for name, param in pl_module.named_parameters():
            if name.endswith(".packed"):
                local = param.to_local() if isinstance(param, DTensor) else param
                self.packed[name] = [local.numel(), param.numel()]

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, *args: Any
    ) -> None:
        self.losses[trainer.global_step - 1] = float(outputs["loss"])

    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        path = Path(self.dirpath, f"rank_{trainer.global_rank}.json")
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps({"losses": self.losses, "packed": self.packed}))


def _recipe(base: Path, data: Path) -> dict[str, Any]:
    lora = {"r": 4, "alpha": 8, "quantize": "nf4", "target_modules": TARGETS}
    return {
        "seed_everything": 7,
        "trainer": {
            "accelerator": "cpu", "devices": 1, "precision": "32-true", "max_steps": STEPS,
            "limit_val_batches": 0, "log_every_n_steps": 1, "enable_progress_bar": False,
            "callbacks": [{"class_path": "plugintrain.callbacks.LoRA", "init_args": lora}],
            "logger": {
                "class_path": "lightning.pytorch.loggers.TensorBoardLogger",
                "init_args": {"save_dir": "runs", "name": NAME},
            },
        },
        "model": {
            "class_path": "plugintrain.model_zoo.CausalLM",
            "init_args": {
                "weights": str(base), "warmup_steps": 0, "min_lr_ratio": 1.0, "weight_decay": 0.0,
                "optimizer": {"class_path": "torch.optim.AdamW", "init_args": {"lr": 0.01}},
            },
        },
        "data": {
            "class_path": "plugintrain.data.TokenDataModule",
            "init_args": {"data_dir": str(data), "seq_len": 16, "batch_size": GLOBAL_BATCH},
        },
        "checkpoint": {"every_n_train_steps": STEPS},
    }  # fmt: skip


@pytest.fixture(scope="module")
def recipe(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("qlora_layouts")
    base = random_hf_llama(root / "base", VOCAB, seed=0)
    tokens = np.random.default_rng(0).integers(0, VOCAB, 4096)
    for name in ("train.bin", "val.bin"):
        write_token_bin(root / "data" / name, tokens)
    path = root / "qlora.yaml"
    path.write_text(yaml.safe_dump(_recipe(base, root / "data")))
    return path


def _fit(recipe: Path, out: Path, *extra: str, ranks: int = 1) -> dict[str, Any]:
    """Fit the recipe (forked, ``ranks`` ranks); every rank's probe record, and rank 0's
    TensorBoard losses."""
    probe = {"class_path": f"{__name__}.LayoutProbe", "init_args": {"dirpath": str(out / "probe")}}
    run_cli(
        "fit", "--config", str(recipe), f"--trainer.logger.init_args.save_dir={out}",
        f"--trainer.default_root_dir={out}", f"--trainer.callbacks+={json.dumps(probe)}",
        *extra, cwd=REPO, fresh_interpreter=False, ranks=ranks,
    )  # fmt: skip
    records = [json.loads((out / "probe" / f"rank_{r}.json").read_text()) for r in range(ranks)]
    return {"ranks": records, "logged": logged_losses(out / NAME / "version_0")}


@pytest.fixture(scope="module")
def reference(recipe: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    return _fit(recipe, tmp_path_factory.mktemp("qlora_single"))


@pytest.fixture(scope="module", params=LAYOUTS)
def layout_run(
    request: pytest.FixtureRequest, recipe: Path, tmp_path_factory: pytest.TempPathFactory
) -> dict[str, Any]:
    """The recipe fitted on 2 ranks under one layout (per-rank batch: the global one over
    the data-parallel degree)."""
    strategy, dp = LAYOUTS[request.param]
    strategy = strategy if isinstance(strategy, str) else json.dumps(strategy)
    out = tmp_path_factory.mktemp(f"qlora_{request.param}")
    run = _fit(
        recipe, out, f"--trainer.strategy={strategy}", "--trainer.devices=2",
        f"--data.init_args.batch_size={GLOBAL_BATCH // dp}", ranks=2,
    )  # fmt: skip
    return {**run, "layout": request.param, "dp": dp}


def _steps(record: dict[str, Any]) -> dict[int, float]:
    return {int(step): loss for step, loss in record["losses"].items()}


def test_reference_holds_its_base_in_nf4(reference: dict[str, Any]) -> None:
    """The one process: every projection of both layers packed, at NF4's 4.127 bits a
    weight (bitsandbytes' layout), and losses logged at every step."""
    (record,) = reference["ranks"]
    packed = record["packed"]
    assert len(packed) == 2 * 7  # wq wk wv wo w1 w2 w3 of 2 layers
    wq = packed["model.layers.0.attention.wq.weight.packed"]
    assert wq == [64 * 64 // 2 + 64 + 4 + 4] * 2  # codes, block codes, group scale, offset
    assert sorted(reference["logged"]) == list(range(STEPS))
    assert _steps(record) == reference["logged"]


def test_layout_gives_the_one_process_losses(
    reference: dict[str, Any], layout_run: dict[str, Any]
) -> None:
    """The global batch's loss at each step against the one process's (rel 1e-5): the
    mean of the data-parallel ranks' halves; under the pipeline every rank's (the last
    stage's, broadcast), and rank 0's logged one."""
    expected = reference["logged"]
    per_rank = [_steps(record) for record in layout_run["ranks"]]
    assert all(sorted(losses) == sorted(expected) for losses in per_rank)
    for step, loss in expected.items():
        mean = sum(losses[step] for losses in per_rank) / len(per_rank)
        assert mean == pytest.approx(loss, rel=1e-5), step
    if layout_run["dp"] == 1:
        assert layout_run["logged"] == pytest.approx(expected, rel=1e-5)
        assert all(losses == pytest.approx(expected, rel=1e-5) for losses in per_rank)


def test_each_rank_holds_packed_weights_as_its_layout_says(
    reference: dict[str, Any], layout_run: dict[str, Any]
) -> None:
    """Against the one process's packed parameters: whole on every rank under the
    gradient engines, each stage its own layers' whole under the pipeline, and under
    FSDP2 a part on each rank, the two parts making the whole."""
    whole = {name: counts[1] for name, counts in reference["ranks"][0]["packed"].items()}
    held = [record["packed"] for record in layout_run["ranks"]]
    for packed in held:
        assert all(counts[1] == whole[name] for name, counts in packed.items())
    if layout_run["layout"] == "pipeline":
        assert set(held[0]) | set(held[1]) == set(whole) and not set(held[0]) & set(held[1])
        assert all(local == total for packed in held for local, total in packed.values())
    elif layout_run["layout"].startswith("fsdp2"):
        assert all(set(packed) == set(whole) for packed in held)
        for name, total in whole.items():
            assert all(packed[name][0] < total for packed in held), name
            assert sum(packed[name][0] for packed in held) == total, name
    else:
        assert held == [reference["ranks"][0]["packed"]] * 2


def test_tensor_parallel_is_refused_before_launch(recipe: Path, tmp_path: Path) -> None:
    """``hybrid`` with ``tensor_parallel: 2`` on 2 devices: exit 2 with one line naming
    the layout and the strategies that hold a quantized base, from the launching process
    before Lightning starts the second rank (no run directory is written)."""
    strategy = {"class_path": HYBRID, "init_args": {"tensor_parallel": 2}}
    proc = run_cli(
        "fit", "--config", str(recipe), f"--trainer.logger.init_args.save_dir={tmp_path / 'runs'}",
        f"--trainer.default_root_dir={tmp_path / 'runs'}", "--trainer.devices=2",
        f"--trainer.strategy={json.dumps(strategy)}",
        cwd=REPO, fresh_interpreter=False, exit_code=2, timeout=120,
    )  # fmt: skip
    assert "Traceback" not in proc.stderr and "usage:" not in proc.stderr, proc.stderr
    (message,) = [line for line in proc.stderr.splitlines() if "LoRA quantize" in line]
    assert proc.stderr.strip().splitlines()[-1] == message
    assert "nf4 cannot run under HybridParallelStrategy(tensor_parallel=2)" in message
    assert "use one process, ddp_bucketed, zero1, zero2, hybrid or pipeline" in message
    assert not (tmp_path / "runs").exists()
