"""``plugintrain bench`` end to end on a tiny matrix: real runs, real files.

Five rows: the plain PyTorch loop (the baseline), ``plugintrain fit`` of the same recipe
(its batch as two accumulated micro-batches), a row that fails on purpose (recorded, never
dropped), ZeRO-2 on two ranks, and a two-stage pipeline that balances its stages itself
(``layers_per_stage: auto``). The figures are checked against
references outside the bench code: the model's analytic parameter count, AdamW's two
moments per weight, and the hand-written loop's loss at the same step.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import yaml

from plugintrain.cli import main
from plugintrain.data import write_token_bin
from plugintrain.model_zoo import Transformer, TransformerConfig

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def bench_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[int, Path, Path]:
    root = tmp_path_factory.mktemp("bench")
    tokens = root / "tokens"
    rng = np.random.default_rng(0)
    for name in ("train.bin", "val.bin"):
        write_token_bin(tokens / name, rng.integers(0, 50257, 20_000))
    (tokens / "meta.json").write_text(
        json.dumps({"dataset": "shakespeare", "tokenizer": "gpt2", "vocab_size": 50257})
    )
    pipeline = {
        "class_path": "plugintrain.strategies.PipelineStrategy",
        "init_args": {"pipeline_parallel": 2, "microbatches": 2, "layers_per_stage": "auto"},
    }
    matrix = {
        "defaults": {
            "recipe": str(REPO / "recipes" / "gpt2_debug_shakespeare_cpu.yaml"),
            "micro_batch": 2, "seq_len": 32, "steps": 2, "warmup": 1,
            "overrides": [f"--data.init_args.data_dir={tokens}"],
        },
        "runs": [
            {"name": "plain loop", "runner": "plain", "baseline": True},
            # Two micro-batches of one sequence per step: the same step as the loop's batch of
            # two, so the same weights and losses.
            {"name": "fit accumulate 2", "micro_batch": 1,
             "overrides": [f"--data.init_args.data_dir={tokens}",
                           "--trainer.accumulate_grad_batches=2"]},
            {"name": "broken", "strategy": "nonsense"},
            {"name": "zero2 x2", "strategy": "zero2", "devices": 2},
            {"name": "pp2 auto", "devices": 2, "micro_batch": 4, "strategy": pipeline},
        ],
    }  # fmt: skip
    path = root / "matrix.yaml"
    path.write_text(yaml.safe_dump(matrix))
    out = root / "out"
    code = main(["bench", "--matrix", str(path), "--out", str(out)])
    return code, out, tokens


def _records(out: Path) -> dict[str, dict]:
    document = json.loads((out / "results.json").read_text())
    return {r["name"]: r for r in document["records"]}


def test_every_row_is_recorded_and_the_failure_kept(bench_run: tuple[int, Path, Path]) -> None:
    code, out, _ = bench_run
    records = _records(out)
    assert code == 1  # one row failed
    assert list(records) == ["plain loop", "fit accumulate 2", "broken", "zero2 x2", "pp2 auto"]
    assert [r["status"] for r in records.values()] == ["ok", "ok", "failed", "ok", "ok"]
    assert records["broken"]["error"].startswith(
        "plugintrain fit: error: unknown strategy 'nonsense'"
    )
    assert records["fit accumulate 2"]["command"].startswith("plugintrain fit --config ")
    table = (out / "results.md").read_text()
    assert table.count("\n| ") == 6  # header + five rows
    assert "| broken | failed: plugintrain fit: error: unknown strategy" in table
    for chart in ("throughput.png", "memory.png"):
        assert (out / chart).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_state_bytes_match_the_model_and_adamw(bench_run: tuple[int, Path, Path]) -> None:
    records = _records(bench_run[1])
    config = TransformerConfig.from_name("gpt2-debug")
    weights = config.num_params() * 4  # fp32
    tensors = len(list(Transformer(config).parameters()))
    adamw = 2 * weights + 4 * tensors  # exp_avg, exp_avg_sq, and a float32 step each
    for name in ("plain loop", "fit accumulate 2"):
        record = records[name]
        assert record["param_bytes"] == [weights], name
        assert record["grad_bytes"] == [weights], name
        assert record["optimizer_bytes"] == [adamw], name
        assert record["peak_bytes"][0] > 3 * weights + 4 * tensors, name  # state + activations
    # ZeRO-2 on two ranks: whole weights, half the gradients and half of AdamW's state each
    # (the engine's shards, padded to the bucket: within 1%).
    zero2 = records["zero2 x2"]
    assert zero2["param_bytes"] == [weights, weights]
    for held in zero2["grad_bytes"]:
        assert held == pytest.approx(weights / 2, rel=0.01)
    for held in zero2["optimizer_bytes"]:
        assert held == pytest.approx(weights, rel=0.01)  # two moments of half the weights


def test_fit_trains_like_the_hand_written_loop(bench_run: tuple[int, Path, Path]) -> None:
    records = _records(bench_run[1])
    plain, fit = records["plain loop"], records["fit accumulate 2"]
    # The step's mean over its micro-batches, not the last one's share of it.
    assert fit["loss"] == pytest.approx(plain["loss"], abs=1e-4)
    assert plain["tokens_per_step"] == fit["tokens_per_step"] == 2 * 32
    assert records["pp2 auto"]["tokens_per_step"] == 4 * 32  # one replica, not two ranks
    assert plain["vs_baseline"] == 1.0 and fit["vs_baseline"] > 0
    assert plain["mfu"] is None  # no peak FLOP/s is known for a CPU


def test_the_pipeline_holds_the_split_it_chose(bench_run: tuple[int, Path, Path]) -> None:
    out = bench_run[1]
    log = next(out.glob("04-pp2-auto/output.log")).read_text()
    line = next(x for x in log.splitlines() if "layers_per_stage=auto: chose [" in x)
    split = [int(n) for n in line.split("chose [")[1].split("]")[0].split(",")]
    assert sum(split) == 4 and len(split) == 2
    # Each stage's weights, counted on the one-process model: embeddings and the first
    # blocks on rank 0; the other blocks, the final norm and the tied head on rank 1.
    model = Transformer(TransformerConfig.from_name("gpt2-debug"))
    expected = [0, model.output.weight.numel() * 4]  # the head's copy of the embedding
    for name, param in model.named_parameters():
        if name.startswith("layers."):
            stage = 0 if int(name.split(".")[1]) < split[0] else 1
        else:
            stage = 0 if "embeddings" in name else 1
        expected[stage] += param.numel() * 4
    held = _records(out)["pp2 auto"]["param_bytes"]
    assert held == [pytest.approx(e, rel=0.01) for e in expected]  # bucket padding aside
    assert _records(out)["pp2 auto"]["grad_bytes"] == held  # the engine's buckets
