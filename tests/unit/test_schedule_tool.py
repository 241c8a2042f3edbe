"""``plugintrain schedule``: grid and summary text, JSON output, bad input, the entry point."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from plugintrain.cli import main as cli_main
from plugintrain.tools import COMMANDS


def main(argv: list[str]) -> int:
    return cli_main(["schedule", *argv])


REPO = Path(__file__).resolve().parents[2]


def _run(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_interleaved_grid_then_summary(capsys) -> None:
    code, out, err = _run(capsys, "--pp", "4", "--vpp", "2", "--microbatches", "8")
    assert (code, err) == (0, "")
    grid, summary = out.rstrip("\n").split("\n\n")
    lines = grid.splitlines()
    assert len(lines) == 4 + 1
    assert lines[0].split()[:2] == ["time", "|"]
    assert lines[1].split("|")[1].split()[:5] == ["F0", "F1", "F2", "F3", "F0.1"]
    assert lines[4].split("|")[1].split()[:4] == [".", ".", ".", "F0"]
    assert "B7" in lines[4]
    assert summary.startswith("schedule=interleaved pp=4 vpp=2 microbatches=8")  # the default
    assert "makespan 28.5, bubble 15.8%" in summary
    assert "p2p order matched: True" in summary
    assert "rank  0: idle  15.8%  peak in-flight 11 micro-batch chunks" in summary


def test_one_f_one_b_summary(capsys) -> None:
    code, out, _ = _run(capsys, "--pp", "4", "--microbatches", "8")
    assert code == 0
    assert "schedule=1f1b pp=4 vpp=1 microbatches=8" in out  # default for vpp 1
    assert "makespan 33, bubble 27.3%" in out
    assert "rank  3: idle  27.3%  peak in-flight 1 micro-batch chunks" in out


def test_times_and_schedule_choice(capsys) -> None:
    code, out, _ = _run(
        capsys, "--pp", "2", "--microbatches", "2", "--schedule", "gpipe",
        "--forward-time", "1", "--backward-time", "1",
    )  # fmt: skip
    assert code == 0
    assert "schedule=gpipe" in out
    assert "(forward 1, backward 1 per micro-batch and rank)" in out
    assert "makespan 6, bubble 33.3%" in out  # (p-1)/(m+p-1) = 1/3 of 3 * (1 + 1)


def test_json(capsys) -> None:
    code, out, _ = _run(
        capsys, "--pp", "2", "--vpp", "2", "--microbatches", "4", "--schedule", "interleaved",
        "--json",
    )  # fmt: skip
    assert code == 0
    payload = json.loads(out)
    assert [" ".join(actions) for actions in payload["actions"]] == [
        "F0 F1 F0.1 F1.1 F2 B0.1 F3 B1.1 F2.1 B0 F3.1 B1 B2.1 B3.1 B2 B3",
        "F0 F1 F0.1 B0.1 F1.1 B1.1 F2 B0 F3 B1 F2.1 B2.1 F3.1 B3.1 B2 B3",
    ]
    assert (payload["schedule"], payload["pp"], payload["vpp"]) == ("interleaved", 2, 2)
    assert payload["bubble_exact"] == "1/9"  # (p-1)/(v*m+p-1)
    assert payload["bubble"] == pytest.approx(1 / 9)
    assert payload["idle"] == [pytest.approx(1 / 9)] * 2
    assert payload["peak_in_flight"] == [5, 3]
    assert payload["makespan"] == 13.5
    assert payload["p2p_in_order"] is True
    assert (payload["forward_time"], payload["backward_time"]) == (1, 2)


def test_json_forward_only(capsys) -> None:
    code, out, _ = _run(capsys, "--pp", "3", "--microbatches", "2", "--forward-only", "--json")
    assert code == 0
    payload = json.loads(out)
    assert payload["forward_only"] is True
    assert payload["schedule"] == "1f1b"
    assert payload["actions"] == [["F0", "F1"]] * 3
    assert payload["makespan"] == 4  # m + p - 1 forwards of time 1


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--pp", "4", "--vpp", "2", "--microbatches", "6"], "got microbatches=6; use e.g. 8."),
        (
            ["--pp", "2", "--vpp", "2", "--microbatches", "4", "--schedule", "1f1b"],
            "virtual_pipeline_parallel=2; use schedule='interleaved'",
        ),
        (["--pp", "0", "--microbatches", "4"], "pipeline_parallel must be an integer >= 1, got 0"),
        (["--pp", "2", "--microbatches", "-3"], "microbatches must be an integer >= 1, got -3"),
    ],
    ids=["not_a_multiple", "vpp_without_interleaving", "zero_pp", "negative_microbatches"],
)
def test_bad_layout_exits_2(capsys, argv: list[str], message: str) -> None:
    code, out, err = _run(capsys, *argv)
    assert code == 2
    assert out == ""
    assert err.startswith("plugintrain schedule: error: ")
    assert message in err


@pytest.mark.parametrize("bad", ["0", "-1", "fast"])
def test_bad_time_is_an_argparse_error(capsys, bad: str) -> None:
    assert main(["--pp", "2", "--microbatches", "2", "--forward-time", bad]) == 2
    err = capsys.readouterr().err
    assert err.startswith("plugintrain schedule: error: --forward-time") and err.count("\n") == 1


def test_registered_with_the_cli(capsys) -> None:
    assert COMMANDS["schedule"].target == "plugintrain.tools.schedule:schedule"
    assert cli_main(["schedule", "--pp", "2", "--microbatches", "2"]) == 0
    assert "schedule=1f1b pp=2" in capsys.readouterr().out
    assert cli_main(["--help"]) == 0
    assert "plugintrain schedule --pp 4 --vpp 2 --microbatches 8" in capsys.readouterr().out


def test_python_dash_m_entry_point() -> None:
    assert (REPO / "plugintrain" / "__main__.py").is_file()
    done = subprocess.run(
        [sys.executable, "-m", "plugintrain", "schedule", "--pp", "2", "--microbatches", "4"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    assert "bubble 20.0%" in done.stdout
    assert done.stdout.startswith("   time | 0")
