"""``plugintrain bench``'s matrix files and records, without running a configuration."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from plugintrain.bench import BenchConfig, MatrixError, load_matrix
from plugintrain.bench.report import add_ratios, markdown, merge_ranks
from plugintrain.cli import main

REPO = Path(__file__).resolve().parents[2]
RECIPE = "recipes/gpt2_debug_shakespeare_cpu.yaml"


@pytest.fixture(autouse=True)
def _in_repo(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(REPO)  # recipe paths in matrices are relative to the repository


def _matrix(tmp_path: Path, document: dict) -> Path:
    path = tmp_path / "matrix.yaml"
    path.write_text(yaml.safe_dump(document))
    return path


def test_axes_cross_and_mappings_merge(tmp_path: Path) -> None:
    path = _matrix(tmp_path, {
        "defaults": {"recipe": RECIPE, "steps": 3},
        "matrix": [{
            "layout": [{"name": "single"}, {"name": "zero2 x2", "strategy": "zero2", "devices": 2}],
            "precision": ["32-true", "bf16-mixed"],
        }],
        "runs": [{"name": "plain", "runner": "plain", "baseline": True}],
    })  # fmt: skip
    configs = load_matrix(path)
    assert [c.name for c in configs] == [
        "single · 32-true", "single · bf16-mixed", "zero2 x2 · 32-true", "zero2 x2 · bf16-mixed",
        "plain",
    ]  # fmt: skip
    zero2 = configs[3]
    assert (zero2.strategy, zero2.devices, zero2.precision, zero2.steps) == (
        "zero2", 2, "bf16-mixed", 3
    )  # fmt: skip
    assert configs[0].devices == 1 and configs[-1].baseline


def test_the_command_is_plugintrain_fit_with_the_recorder(tmp_path: Path) -> None:
    config = BenchConfig(
        name="tp2", recipe=RECIPE, devices=2, micro_batch=2, seq_len=64, steps=3, warmup=1,
        strategy={"class_path": "plugintrain.strategies.HybridParallelStrategy",
                  "init_args": {"tensor_parallel": 2}},
    )  # fmt: skip
    command = config.command(tmp_path)
    assert command[1:4] == ["-m", "plugintrain", "fit"]
    assert "--trainer.max_steps=5" in command  # 1 warm-up + 3 timed + 1 measured for memory
    assert "--data.init_args.batch_size=2" in command and "--trainer.devices=2" in command
    strategy = next(a for a in command if a.startswith("--trainer.strategy="))
    assert json.loads(strategy.split("=", 1)[1])["init_args"] == {"tensor_parallel": 2}
    assert config.shell(tmp_path).startswith("plugintrain fit --config " + RECIPE)


@pytest.mark.parametrize(
    ("document", "message"),
    [
        ({"runs": [{"name": "a", "recipe": RECIPE, "devics": 2}]}, "unknown field 'devics' in 'a'"),
        ({"runs": [{"name": "a", "recipe": "recipes/nope.yaml"}]}, "recipe 'recipes/nope.yaml'"),
        ({"runs": [{"name": "a", "recipe": RECIPE, "runner": "deepspeed"}]},
         "runner='deepspeed' of 'a' is not one of ('fit', 'plain', 'torch_pipelining')"),
        ({"runs": [{"name": "a", "recipe": RECIPE}, {"name": "a", "recipe": RECIPE}]},
         "two configurations are named 'a'"),
        ({"runs": [{"name": "a", "recipe": RECIPE, "warmup": 0}]}, "all must be at least 1"),
        ({"run": []}, "top-level keys ['run'] are not 'defaults', 'matrix' and 'runs'"),
        ({"defaults": {"recipe": RECIPE}, "matrix": [{"precision": "bf16-mixed"}]},
         "matrix axis precision='bf16-mixed' must be a non-empty list"),
        ({"runs": [{"name": "a", "recipe": RECIPE, "steps": "6"}]},
         "steps='6' of 'a' is not an integer (YAML: write steps: 6)"),
        ({"runs": ["a"]}, "runs must be a list of mappings"),
        ({"runs": [{"name": "a", "recipe": RECIPE, "runner": "torch_pipelining", "devices": 2,
                    "strategy": {"class_path": "plugintrain.strategies.PipelineStrategy",
                                 "init_args": {"layers_per_stage": "auto"}}}]},
         "runs torch_pipelining over layers_per_stage auto; give it block counts"),
    ],
)  # fmt: skip
def test_bad_matrices_end_in_one_line_before_anything_runs(
    tmp_path: Path, capsys: pytest.CaptureFixture, document: dict, message: str
) -> None:
    path = _matrix(tmp_path, document)
    with pytest.raises(MatrixError, match=None) as error:
        load_matrix(path)
    assert message in str(error.value)
    out = tmp_path / "out"
    assert main(["bench", "--matrix", str(path), "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("plugintrain bench: error: ") and message in err[0]
    assert not out.exists()  # nothing written


def test_results_are_never_overwritten(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    path = _matrix(tmp_path, {"runs": [{"name": "a", "recipe": RECIPE}]})
    out = tmp_path / "out"
    out.mkdir()
    (out / "results.json").write_text("{}")
    assert main(["bench", "--matrix", str(path), "--out", str(out)]) == 2
    assert "is not empty; pass a new directory so earlier results are kept" in (
        capsys.readouterr().err
    )
    assert (out / "results.json").read_text() == "{}"


def test_list_prints_every_command(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    path = REPO / "benchmarks" / "cpu.yaml"
    assert main(["bench", "--matrix", str(path), "--list", "--out", str(tmp_path / "o")]) == 0
    out = capsys.readouterr().out
    names = [c.name for c in load_matrix(path)]
    assert all(name in out for name in names)
    assert "python -m plugintrain.bench.baselines plain --config" in out
    assert not (tmp_path / "o").exists()


def test_the_shipped_matrices_load() -> None:
    for name in ("cpu.yaml", "gpu.yaml", "gpu8.yaml"):
        configs = load_matrix(REPO / "benchmarks" / name)
        assert sum(c.baseline for c in configs) == 1, name


def _rank(rank: int, **fields: object) -> dict:
    record = {
        "rank": rank, "world_size": 4, "replicas": 2, "device": "cpu", "tokens_per_step": 512,
        "step_seconds": [1.0, 1.0, 1.0], "peak_bytes": 100, "peak_source": "LiveTensorMemory",
        "param_bytes": 10, "grad_bytes": 10, "optimizer_bytes": 20, "loss": None,
        "flops_per_token": 1000, "peak_flops": 1e6,
    }  # fmt: skip
    return {**record, **fields}


def test_merged_ranks_count_tokens_per_replica_and_wait_for_the_slowest(tmp_path: Path) -> None:
    # dp2 x tp2: four ranks, two replicas of 512 tokens each per step.
    ranks = [
        _rank(0, step_seconds=[1.0, 2.0, 1.0], loss=3.0),
        _rank(1, step_seconds=[1.5, 1.0, 1.0], loss=5.0),
        _rank(2, step_seconds=[1.0, 1.0, 4.0]),
        _rank(3),
    ]
    for record in ranks:
        (tmp_path / f"rank{record['rank']}.json").write_text(json.dumps(record))
    merged = merge_ranks(tmp_path)
    assert merged["step_s_median"] == 2.0  # per-step maxima 1.5, 2.0, 4.0
    assert (merged["step_s_min"], merged["step_s_max"]) == (1.5, 4.0)
    assert merged["tokens_per_s"] == 1024 / 2.0
    assert merged["tokens_per_s_per_device"] == 1024 / 2.0 / 4
    assert merged["mfu"] == pytest.approx(1000 * 512 / (1e6 * 4))
    assert merged["loss"] == 4.0


def test_a_missing_rank_is_a_failure(tmp_path: Path) -> None:
    (tmp_path / "rank0.json").write_text(json.dumps(_rank(0)))
    with pytest.raises(FileNotFoundError, match="1 of 4 ranks wrote measurements"):
        merge_ranks(tmp_path)


def test_ratios_and_the_table_keep_failed_rows() -> None:
    ok = {"status": "ok", "tokens_per_s": 100.0, "world_size": 1, "tokens_per_s_per_device": 100.0,
          "step_s_median": 0.5, "step_spread": 0.1, "peak_bytes": [2**20], "param_bytes": [0],
          "grad_bytes": [0], "optimizer_bytes": [0], "mfu": None, "loss": 1.0}  # fmt: skip
    records = [
        {**ok, "name": "slow", "tokens_per_s": 50.0},
        {**ok, "name": "base", "baseline": True},
        {"name": "bad", "status": "failed", "error": "plugintrain fit: error: x | y"},
    ]
    assert add_ratios(records) == "base"
    assert [r["vs_baseline"] for r in records] == [0.5, 1.0, None]
    table = markdown(records, "base", "a machine")
    assert "| slow | 1 | 50 | 100 | 0.50x |" in table
    assert "| bad | failed: plugintrain fit: error: x \\| y |" in table
    # A failed baseline leaves the other rows without a ratio, not the matrix without a table.
    records[1] = {"name": "base", "baseline": True, "status": "failed", "error": "killed"}
    assert add_ratios(records) is None
    assert "| slow | 1 | 50 | 100 | - |" in markdown(records, None, "a machine")
