"""SIGKILL inside a checkpoint save never costs the previous checkpoint, nor exactness.

The job is killed at the most delicate point of the save that replaces ``last.ckpt`` at
step 4: a single file just before it is renamed into place; a zero2 x 2 DCP directory
between the two renames that swap it with the previous one (which then exists only under
its ``.retired`` name). ``--ckpt_path last`` then resumes in one process (batch 4, the
same global batch, forked: its subject is what the kill left, not a launch) and must log
the uninterrupted single-process run's losses.
``tests/e2e/kill_during_save.py --attempts 20`` kills at random points instead.
"""

from __future__ import annotations

import pytest
from kill_during_save import attempt

from _cli import run_cli


@pytest.mark.parametrize(
    ("strategy", "event"),
    [("single", "replace:1"), ("zero2x2", "replace:4")],  # files: 1 rename; dirs: 4 (2 swap)
)
def test_a_kill_inside_save_resumes_exactly(
    shakespeare_llama3, uninterrupted_llama3, tmp_path, strategy, event
) -> None:
    where = (4, event, 0)  # save 4 replaces last.ckpt; rank 0 renames
    landed, failure = attempt(
        shakespeare_llama3, tmp_path, strategy, uninterrupted_llama3, where, resume_as="single",
        resume=lambda args, cwd: run_cli(*args, cwd=cwd, fresh_interpreter=False, exit_code=None),
    )  # fmt: skip
    assert landed, "the kill point was not reached: the save has fewer renames than assumed"
    assert failure is None, failure
