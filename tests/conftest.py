"""Shared by every test folder: pytest puts this folder on ``sys.path`` for it, so test
modules import the helpers beside it (``from _hf_models import random_hf_llama``).

Around every test the launch variables a Lightning run in this process leaves behind are
reset (:mod:`_launch_env`), so no later command inherits them. Workers that fill the cores
run with one intra-op thread, and so does every command they start (``OMP_NUM_THREADS``).
"""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest
from _launch_env import reset_launch_environment


def pytest_configure(config: pytest.Config) -> None:
    # Workers that fill the cores between them get one intra-op thread each, as torchrun
    # gives each of several ranks on a node: two workers of two OpenMP threads each on two
    # cores would spin waiting for each other's threads. The commands and ranks the tests
    # start inherit it (``OMP_NUM_THREADS``). A serial run (`TEST_WORKERS=0`) keeps them all.
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "0"))
    if workers >= (os.cpu_count() or 1) and "OMP_NUM_THREADS" not in os.environ:
        import torch

        os.environ["OMP_NUM_THREADS"] = "1"
        torch.set_num_threads(1)
    # The fork server's imports, asked for before any child starts it (code under test
    # that starts processes from it, the dry run, adds its own to these).
    from _processes import context

    context()


@pytest.fixture(autouse=True)
def _fresh_launch_environment() -> Iterator[None]:
    reset_launch_environment()
    yield
    reset_launch_environment()


# The slowest files first, longest first (their test time in a `make test` run's junit
# XML, two workers on two cores): `make test` hands whole files to its workers in this
# order (`--dist loadfile --no-loadscope-reorder`; pytest-xdist would otherwise order files
# by their number of tests, and these long ones, with few tests each, would start last and
# run alone at the end). Each starts while the other worker still has work, and the many
# short unit files fill the end.
SLOWEST_FIRST = (
    "e2e/test_resume_anywhere.py", "e2e/test_preference_trl.py", "e2e/test_grpo_trl.py",
    "e2e/test_signals.py",
    "e2e/test_hybrid_launch.py", "e2e/test_preference_layouts.py",
    "e2e/test_cli.py", "e2e/test_qlora_layouts.py", "e2e/test_preemption.py",
    "e2e/test_pretrained.py", "distributed/test_pipeline.py", "e2e/test_bench.py",
    "e2e/test_kill_during_save.py", "distributed/test_zero.py", "e2e/test_pipeline_launch.py",
    "e2e/test_elastic.py", "distributed/test_hybrid.py", "e2e/test_wheel.py",
    "unit/test_gpu_check.py", "e2e/test_docs_site.py", "unit/test_startup.py",
    "distributed/test_estimate_distributed.py", "e2e/test_tracking_cli.py",
    "e2e/test_tracking_ui.py", "e2e/test_grpo_cli.py",
)  # fmt: skip


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    def rank(item: pytest.Item) -> int:
        path = item.path.as_posix()
        return next(
            (i for i, name in enumerate(SLOWEST_FIRST) if path.endswith(name)), len(SLOWEST_FIRST)
        )

    items.sort(key=rank)  # stable: the rest keep their order
