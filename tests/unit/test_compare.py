"""``plugintrain compare``: loss tables, tolerances per dtype, module divergence, exit codes."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from torch.utils.tensorboard import SummaryWriter

from plugintrain.callbacks.precision_check import step_file
from plugintrain.cli import main
from plugintrain.tools.compare import DEFAULT_RTOL, relative_diff, step_ranges


def _tensorboard_run(path: Path, losses: list[float], tag: str = "train_loss") -> Path:
    with SummaryWriter(str(path / "version_0")) as writer:
        for step, loss in enumerate(losses):
            writer.add_scalar(tag, loss, step)
    return path


def _record(name: str, mean: float, absmax: float = 1.0) -> dict:
    return {
        "name": name,
        "kind": "output",
        "dtype": "float32",
        "shape": [2],
        "mean": mean,
        "std": 0.5,
        "absmax": absmax,
        "nan": 0,
        "inf": 0,
        "hash": "0",
    }


def _check_run(path: Path, steps: dict[int, list[dict]], loss: float = 2.0) -> Path:
    for step, records in steps.items():
        file = step_file(path, step, 0)
        file.parent.mkdir(parents=True, exist_ok=True)
        file.write_text(json.dumps({"step": step, "rank": 0, "loss": loss, "records": records}))
    return path


def test_relative_diff() -> None:
    assert relative_diff(0.0, 0.0) == 0.0
    assert relative_diff(1.0, 1.01) == pytest.approx(0.01 / 1.01)
    assert relative_diff(1.0, float("nan")) == float("inf")


def test_losses_within_and_beyond_tolerance(tmp_path: Path, capsys) -> None:
    base = _tensorboard_run(tmp_path / "a", [3.0, 2.5, 2.0])
    close = _tensorboard_run(tmp_path / "b", [3.0, 2.51, 2.01])
    assert main(["compare", str(base), str(close), "--dtype", "bf16"]) == 0
    assert main(["compare", str(base), str(close)]) == 1  # fp32 default: 1e-5
    assert "first at step 1" in capsys.readouterr().out
    assert main(["compare", str(base), str(close), "--rtol", "0.005"]) == 0
    assert DEFAULT_RTOL == {"fp32": 1e-5, "bf16": 1e-2, "fp16": 1e-3}


def _last_error_line(capsys) -> str:
    return capsys.readouterr().err.strip().splitlines()[-1]


def test_bad_input_exits_2_with_one_line(tmp_path: Path, capsys) -> None:
    base = _tensorboard_run(tmp_path / "a", [3.0, 2.5])
    assert main(["compare", str(base), str(tmp_path / "missing")]) == 2
    assert _last_error_line(capsys).endswith("missing: no such directory.")
    other_tag = _tensorboard_run(tmp_path / "b", [3.0], tag="loss")
    assert main(["compare", str(base), str(other_tag)]) == 2
    assert _last_error_line(capsys).endswith("found ['loss'].")
    later = _tensorboard_run(tmp_path / "c", [])
    with SummaryWriter(str(later / "version_0")) as writer:
        writer.add_scalar("train_loss", 1.0, 10)
    assert main(["compare", str(base), str(later)]) == 2
    assert _last_error_line(capsys).endswith("have no common steps.")


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--rtol", "-1"], "--rtol must be a finite number >= 0, got -1.0"),
        (["--dtype", "bf17"], "--dtype bf17: choose from bf16, fp16, fp32"),
        (["--rt", "0.1"], "unknown option --rt; did you mean --rtol?"),  # never abbreviated
    ],
    ids=["negative-rtol", "dtype", "abbreviation"],
)
def test_bad_options_exit_2_with_one_line(tmp_path: Path, capsys, argv, message) -> None:
    run = _tensorboard_run(tmp_path / "a", [3.0])
    assert main(["compare", str(run), str(run), *argv]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith(f"plugintrain compare: error: {message}")


def test_a_run_missing_steps_fails_and_lists_them(tmp_path: Path, capsys) -> None:
    full = _tensorboard_run(tmp_path / "full", [3.0, 2.5, 2.0, 1.8, 1.7, 1.6])
    short = _tensorboard_run(tmp_path / "short", [3.0, 2.5])
    with SummaryWriter(str(short / "version_0")) as writer:
        writer.add_scalar("train_loss", 1.7, 4)  # steps 2, 3 and 5 are missing
    assert main(["compare", str(full), str(short)]) == 1
    out = capsys.readouterr().out.strip().splitlines()
    assert "losses over 3 common steps: all within" in out[-2]
    assert out[-1] == f"{short} lacks the losses of steps 2-3, 5 that {full} has"
    assert main(["compare", str(short), str(full)]) == 1  # either way round
    assert capsys.readouterr().out.strip().splitlines()[-1].startswith(f"{short} lacks")


def test_first_diverging_module_from_checker_files(tmp_path: Path, capsys) -> None:
    same = [_record("embed", 0.1), _record("block.0", 0.2), _record("head", 0.3)]
    drift = [_record("embed", 0.1), _record("block.0", 0.25), _record("head", 0.9)]
    run_a = _check_run(tmp_path / "a", {0: same, 1: same})
    run_b = _check_run(tmp_path / "b", {0: same, 1: drift})
    assert main(["compare", str(run_a), str(run_b), "--dtype", "bf16"]) == 1
    out = capsys.readouterr().out
    assert "losses over 2 common steps: all within" in out  # losses from the checker files
    assert "first diverging module at step 1: block.0 (output)" in out
    assert main(["compare", str(run_a), str(run_a)]) == 0


def test_missing_checker_steps_fail(tmp_path: Path, capsys) -> None:
    same = [_record("embed", 0.1)]
    run_a = _check_run(tmp_path / "a", {0: same, 1: same, 2: same})
    run_b = _check_run(tmp_path / "b", {0: same, 1: same})
    assert main(["compare", str(run_a), str(run_b)]) == 1
    out = capsys.readouterr().out
    assert f"{run_b} lacks the losses of step 2 that {run_a} has" in out
    assert f"{run_b} lacks the module statistics of step 2 that {run_a} has" in out


def test_step_ranges() -> None:
    assert step_ranges([9, 3, 4, 5, 7]) == "3-5, 7, 9"
    assert step_ranges([]) == ""
