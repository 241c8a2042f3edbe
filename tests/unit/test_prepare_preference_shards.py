"""``prepare preference`` in shards (issue 45): the same bytes however the work is cut,
shared among tasks or interrupted and resumed; a finished shard is never encoded or
scored twice; a rerun of other settings is refused while finished shards exist."""

import itertools
import json
from pathlib import Path

import numpy as np
import pytest
from test_preference_data import _FakeScorer, _pairs, _run, fake_reference  # noqa: F401
from test_prepare_chat import _last_error, _write

from plugintrain.data.prepare import preference_prepare, preference_shards

PAIRS = 60
WRITE_SHARD = preference_shards.write_shard


def _files(folder: Path) -> dict[str, bytes]:
    return {path.name: path.read_bytes() for path in sorted(folder.iterdir())}


@pytest.fixture
def rows(tmp_path: Path) -> Path:
    """60 pairs, two of them too long for --seq_len 24 (dropped), all in one file."""
    pairs = _pairs(PAIRS)
    for n in (7, 41):
        pairs[n]["chosen"] = " ".join(f"w{i}" for i in range(30))
    return _write(tmp_path / "in.jsonl", pairs)


OPTIONS = ["--seq_len", "24", "--truncate", "drop", "--val_examples", "9"]


@pytest.fixture
def whole(rows: Path, tmp_path: Path) -> dict[str, bytes]:
    """The folder one shard writes (the default --shard_pairs holds every row)."""
    assert _run([rows], tmp_path / "whole", *OPTIONS) == 0
    return _files(tmp_path / "whole")


class _Spy:
    """Counts the shards encoded (and which), wrapping the real writer."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, stop_at: int | None = None) -> None:
        self.written: list[int] = []

        def write(folder, index, *rest):
            if index == stop_at:
                raise KeyboardInterrupt  # a Ctrl-C (or SIGTERM) while this shard is written
            self.written.append(index)
            WRITE_SHARD(folder, index, *rest)

        monkeypatch.setattr(preference_shards, "write_shard", write)


def test_shards_and_workers_write_the_same_bytes(rows, whole, tmp_path, monkeypatch):
    spy = _Spy(monkeypatch)
    out = tmp_path / "sharded"
    assert _run([rows], out, *OPTIONS, "--shard_pairs", "7", "--workers", "2") == 0
    assert spy.written == list(range(9))  # 60 rows in shards of 7
    assert _files(out) == whole
    assert json.loads(whole["meta.json"])["splits"]["train"]["dropped"] == {"too_long": 2}
    assert not preference_shards.progress_folder(out).exists()  # removed once out is written


def test_an_interrupted_run_resumes_from_its_finished_shards(
    rows, whole, tmp_path, monkeypatch, capsys
):
    out = tmp_path / "out"
    _Spy(monkeypatch, stop_at=3)
    assert _run([rows], out, *OPTIONS, "--shard_pairs", "7") == 130
    assert f"the finished shards are kept in {out}.progress: rerun the same" in _last_error(capsys)
    progress = preference_shards.progress_folder(out)
    assert not out.exists()
    assert sorted(p.name for p in progress.glob("shard_*.json")) == [
        f"shard_00000{k}.json" for k in range(3)
    ]
    # A finished shard whose files changed is encoded again.
    npz = progress / "shard_000001.npz"
    data = bytearray(npz.read_bytes())
    data[-1] ^= 0xFF
    npz.write_bytes(bytes(data))
    spy = _Spy(monkeypatch)
    # --val_examples only splits the assembled pairs: it may change on the way.
    assert _run([rows], out, *OPTIONS[:-1], "5", "--shard_pairs", "7") == 0
    assert spy.written == [1, 3, 4, 5, 6, 7, 8]
    assert _run([rows], tmp_path / "again", *OPTIONS[:-1], "5", "--shard_pairs", "7") == 0
    assert _files(out) == _files(tmp_path / "again")
    assert json.loads(_files(out)["meta.json"])["splits"]["val"]["pairs"] == 5
    assert not progress.exists()


@pytest.mark.usefixtures("fake_reference")
def test_tasks_share_the_shards_and_one_run_assembles_them(rows, tmp_path, monkeypatch, capsys):
    out = tmp_path / "out"
    shared = [*OPTIONS, "--shard_pairs", "7", "--reference", "fake-weights"]
    shared += ["--reference_batch_size", "3"]
    spy = _Spy(monkeypatch)
    for task in ("1", "0"):
        capsys.readouterr()
        assert _run([rows], out, *shared, "--num_tasks", "2", "--task_index", task) == 0
        report = json.loads(capsys.readouterr().out)
        assert report["task"] == [int(task), 2] and report["shards"] == 9
        assert not out.exists()
    assert spy.written == [1, 3, 5, 7, 0, 2, 4, 6, 8]
    assert _FakeScorer.loads == 2  # one model a task, whatever its shards
    assert _run([rows], out, *shared) == 0
    assert spy.written == [1, 3, 5, 7, 0, 2, 4, 6, 8]  # the assembly encoded nothing
    assert _FakeScorer.loads == 2  # nor scored
    written = _files(out)
    assert (
        _run(
            [rows],
            tmp_path / "alone",
            *OPTIONS,
            "--reference",
            "fake-weights",
            "--reference_batch_size",
            "3",
        )
        == 0
    )
    assert written == _files(tmp_path / "alone")
    for split in ("train", "val"):
        ids = np.load(out / f"{split}.ids.npy")
        offsets, mask = np.load(out / f"{split}.offsets.npy"), np.load(out / f"{split}.mask.npy")
        expected = [
            -(ids[a:b][mask[a:b] > 0].astype(np.int64).sum()) / 1000
            for a, b in itertools.pairwise(offsets)
        ]
        assert np.load(out / f"{split}.ref_logps.npy").tolist() == expected


def test_other_settings_are_refused_while_finished_shards_exist(
    rows, tmp_path, monkeypatch, capsys
):
    out = tmp_path / "out"
    _Spy(monkeypatch, stop_at=2)
    assert _run([rows], out, *OPTIONS, "--shard_pairs", "7") == 130
    capsys.readouterr()
    other = [*OPTIONS, "--shard_pairs", "7", "--seq_len", "32"]
    assert _run([rows], out, *other) == 2
    assert _last_error(capsys) == (
        f"plugintrain prepare preference: error: {out}.progress: holds finished shards of a"
        " run with other settings (max_prompt, seq_len differ); rerun with those settings to"
        " resume it, or add --overwrite to start over"
    )
    assert sorted(p.name for p in preference_shards.progress_folder(out).glob("*.json"))[:2] == [
        "settings.json",
        "shard_000000.json",
    ]
    spy = _Spy(monkeypatch)
    assert _run([rows], out, *other, "--overwrite") == 0  # the hint works: a fresh start
    assert spy.written == list(range(9))
    assert json.loads((out / "meta.json").read_text())["settings"]["seq_len"] == 32


def test_bad_input_in_a_later_shard_leaves_nothing_of_a_fresh_run(tmp_path, capsys):
    pairs = _pairs(20)
    pairs[15] = {"prompt": "p", "chosen": "same", "rejected": "same"}
    path = _write(tmp_path / "in.jsonl", pairs)
    out = tmp_path / "out"
    assert _run([path], out, "--shard_pairs", "4") == 2
    assert "in.jsonl:16: chosen equals rejected" in _last_error(capsys)
    assert not list(tmp_path.glob("out*"))


def test_shard_options_are_checked_first(rows, tmp_path, capsys):
    for options, message in [
        (["--shard_pairs", "0"], "--shard_pairs 0: must be >= 1"),
        (["--num_tasks", "2", "--task_index", "2"], "--task_index 2: must be in [0, 2)"),
    ]:
        assert _run([rows], tmp_path / "out", *options) == 2
        assert message in _last_error(capsys)
        assert not list(tmp_path.glob("out*"))
    assert preference_prepare.PreferencePrepareOptions("gpt2").shard_pairs == 4096


def test_a_task_leaves_the_other_tasks_files_alone(tmp_path, capsys):
    """Tasks share ``OUT.progress``: a task starting while another writes a shard keeps
    that one's unfinished file, and a task that meets bad input in its own shard removes
    nothing (the other tasks' finished shards stay)."""
    pairs = _pairs(20)
    pairs[2] = {"prompt": "p", "chosen": "same", "rejected": "same"}  # in shard 0 (task 0)
    path = _write(tmp_path / "in.jsonl", pairs)
    out, shared = tmp_path / "out", ["--shard_pairs", "4", "--num_tasks", "2"]
    assert _run([path], out, *shared, "--task_index", "1") == 0
    progress = preference_shards.progress_folder(out)
    writing = progress / "shard_000002.npz.0123456789ab.partial"  # task 0's, mid-write
    writing.write_bytes(b"half")
    finished = sorted(p.name for p in progress.glob("shard_*.json"))
    assert finished == ["shard_000001.json", "shard_000003.json"]
    assert _run([path], out, *shared, "--task_index", "0") == 2
    assert "in.jsonl:3: chosen equals rejected" in _last_error(capsys)
    assert writing.read_bytes() == b"half"
    assert sorted(p.name for p in progress.glob("shard_*.json")) == finished


SLOW_RUN = """
import sys, time
from plugintrain.cli import main
from plugintrain.data.prepare import preference_shards

write = preference_shards.write_shard

def slow(*args):
    write(*args)
    time.sleep(0.5)

if __name__ == "__main__":  # not in the spawned workers
    preference_shards.write_shard = slow
    sys.exit(main(["prepare", "preference", *sys.argv[1:]]))
"""


def test_sigterm_ends_every_process_and_keeps_the_finished_shards(rows, whole, tmp_path):
    """SIGTERM while shards are encoded by 2 worker processes: within seconds the run and
    its workers are gone, exit status 130 with a one-line note last, the finished shards
    kept and ``OUT`` untouched; the same command then writes the uncut run's bytes."""
    import os
    import signal
    import subprocess
    import sys
    import time

    out = tmp_path / "out"
    options = [*OPTIONS, "--shard_pairs", "7", "--workers", "2", "--template", "plain"]
    argv = [str(rows), "--tokenizer", "gpt2", "--out", str(out), *options]
    script = tmp_path / "slow.py"
    script.write_text(SLOW_RUN)
    proc = subprocess.Popen(
        [sys.executable, str(script), *argv], stderr=subprocess.PIPE, text=True,
        start_new_session=True,
    )  # fmt: skip
    progress = preference_shards.progress_folder(out)
    deadline = time.monotonic() + 60
    while not (progress / "shard_000001.json").exists():
        assert proc.poll() is None and time.monotonic() < deadline, proc.stderr.read()
        time.sleep(0.05)
    proc.send_signal(signal.SIGTERM)
    stopped = time.monotonic()
    _, stderr = proc.communicate(timeout=30)
    assert time.monotonic() - stopped < 10
    assert proc.returncode == 130
    assert stderr.strip().splitlines()[-1] == (
        f"plugintrain prepare preference: interrupted; the finished shards are kept in"
        f" {out}.progress: rerun the same command to go on"
    )
    with pytest.raises(ProcessLookupError):  # no worker outlived it
        for _ in range(100):
            os.killpg(proc.pid, 0)
            time.sleep(0.1)
    assert not out.exists() and len(list(progress.glob("shard_*.json"))) >= 2
    assert _run([rows], out, *OPTIONS, "--shard_pairs", "7") == 0
    assert _files(out) == whole
