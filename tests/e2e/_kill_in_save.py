"""Run ``plugintrain`` with a SIGKILL at a chosen point inside one of its checkpoint saves.

Usage: ``python tests/e2e/_kill_in_save.py SAVE EVENT RANK plugintrain-args...``

With a checkpoint every 2 steps and ``last.ckpt``, saves 1 and 2 write step 2's
``epoch=0-step=2.ckpt`` and ``last.ckpt``; save 3 writes step 4's new checkpoint (the
rotation deletes step 2's only after it), save 4 replaces ``last.ckpt``.

Every rank counts the file-system steps of a save (each ``os.fsync``: one per shard file,
metadata file and directory sync; each ``os.replace``: the renames that publish it).
During save ``SAVE``, rank ``RANK`` kills the whole job (its process group, as a lost
node would) just before its ``EVENT``-th step, or with ``EVENT`` = ``replace:N`` just
before its ``N``-th rename. A number larger than the save's step count lets the save
finish (every save prints each rank's count). Lightning's ``popen`` launcher reruns this same
command for the other ranks, so every rank is instrumented.
"""

from __future__ import annotations

import os
import signal
import sys

_saves = {"started": 0, "events": 0, "fsync": 0, "replace": 0}


def _instrument(save: int, event: str, rank: int) -> None:
    from lightning.pytorch import Trainer

    real_fsync, real_replace = os.fsync, os.replace
    real_save = Trainer.save_checkpoint

    kind, _, number = event.rpartition(":")

    def step(what: str) -> None:
        _saves["events"] += 1
        _saves[what] += 1
        count = _saves[kind] if kind else _saves["events"]
        here = int(os.environ.get("LOCAL_RANK", "0"))
        if _saves["started"] == save and count == int(number) and here == rank:
            print(f"KILLED at save event {event}", flush=True)
            os.killpg(os.getpgid(0), signal.SIGKILL)

    def fsync(fd: int) -> None:
        step("fsync")
        real_fsync(fd)

    def replace(src, dst) -> None:
        step("replace")
        real_replace(src, dst)

    def save_checkpoint(self, *args, **kwargs):
        _saves.update(started=_saves["started"] + 1, events=0, fsync=0, replace=0)
        result = real_save(self, *args, **kwargs)
        if _saves["started"] == save or save == 0:
            here, number = os.environ.get("LOCAL_RANK", "0"), _saves["started"]
            events, renames = _saves["events"], _saves["replace"]
            print(f"SAVE {number} EVENTS rank {here}: {events} ({renames} renames)")
        return result

    os.fsync, os.replace = fsync, replace
    Trainer.save_checkpoint = save_checkpoint


if __name__ == "__main__":
    _instrument(int(sys.argv[1]), sys.argv[2], int(sys.argv[3]))
    from plugintrain.cli import main

    sys.exit(main(sys.argv[4:]))
