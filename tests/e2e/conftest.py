"""Fixtures for end-to-end tests: real data and a reference run, made once per test session.

Under ``pytest -n N`` (pytest-xdist, as ``make test`` runs) a session is N worker
processes; :func:`made_once` lets them share one copy of each fixture's directory (the
first worker to ask makes it while the others wait on a file lock) instead of making it
N times.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
from filelock import FileLock


def made_once(
    tmp_path_factory: pytest.TempPathFactory, name: str, make: Callable[[Path], None]
) -> Path:
    """The directory ``name``, filled by ``make`` once per test session, whichever worker
    asks first (a failed ``make`` leaves nothing behind, so the next one retries)."""
    root = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        root = root.parent  # the workers' base directories share this parent
    out = root / name
    with FileLock(str(root / f"{name}.lock")):
        if not (out / ".done").is_file():
            shutil.rmtree(out, ignore_errors=True)
            out.mkdir(parents=True)
            try:
                make(out)
            except BaseException:
                shutil.rmtree(out, ignore_errors=True)
                raise
            (out / ".done").touch()
    return out


@pytest.fixture(scope="session")
def shakespeare_gpt2(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Shakespeare tokenized with GPT-2 BPE, prepared once per test session."""
    from plugintrain.data import prepare_shakespeare

    return made_once(
        tmp_path_factory, "shakespeare_gpt2", lambda out: prepare_shakespeare(out, "gpt2")
    )


@pytest.fixture(scope="session")
def shakespeare_llama3(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Shakespeare tokenized with the Llama 3 tokenizer, prepared once per test session."""
    from plugintrain.data import prepare_shakespeare

    return made_once(
        tmp_path_factory, "shakespeare_llama3", lambda out: prepare_shakespeare(out, "llama3")
    )


@pytest.fixture(scope="session")
def mnist_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The 5,000 real MNIST digits as IDX files, prepared once per test session."""
    from plugintrain.data import prepare_mnist

    return made_once(tmp_path_factory, "mnist", prepare_mnist)


@pytest.fixture(scope="session")
def uninterrupted_llama3_run(
    shakespeare_llama3: Path, tmp_path_factory: pytest.TempPathFactory
) -> tuple[dict[int, float], Path]:
    """One uninterrupted single-process run of the Llama debug recipe (8 steps at batch 4,
    seq_len 32, a checkpoint every 2 steps, all kept): step -> loss, and its checkpoint
    directory (``epoch=0-step=<n>.ckpt`` files), shared by every test that needs it:
    ``kill_during_save.fit_args``' single-process run, forked from the fork server."""
    from kill_during_save import NAME, STEPS, fit_args

    from _cli import logged_losses, run_cli

    def run(work: Path) -> None:
        out = work / "single_reference"
        args = fit_args(shakespeare_llama3, out, "single", "--checkpoint.save_top_k=-1")
        run_cli(*args, cwd=work, fresh_interpreter=False)
        (version,) = (out / NAME).glob("version_*")
        losses = logged_losses(version)
        assert sorted(losses) == list(range(STEPS))
        (work / "losses.json").write_text(json.dumps(losses))

    work = made_once(tmp_path_factory, "uninterrupted", run)
    losses = {
        int(step): loss for step, loss in json.loads((work / "losses.json").read_text()).items()
    }
    return losses, work / "single_reference" / NAME / "checkpoints"


@pytest.fixture(scope="session")
def uninterrupted_llama3(
    uninterrupted_llama3_run: tuple[dict[int, float], Path],
) -> dict[int, float]:
    """Step -> loss of the uninterrupted single-process run: what every resumed layout
    must reproduce."""
    return uninterrupted_llama3_run[0]
