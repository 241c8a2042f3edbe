"""One test's launch environment kept out of the next.

Lightning's launcher writes ``MASTER_PORT``, ``LOCAL_RANK``, ``WORLD_SIZE``... into
``os.environ`` when a test trains in the pytest process, and a ``plugintrain fit
--trainer.devices 4`` started afterwards would inherit ``LOCAL_RANK``, take it for an
external launcher's (torchrun's), start no ranks of its own and wait for them forever.
Serially that depends on the order tests run in; under ``pytest -n 2`` each worker runs
its own mix. ``tests/conftest.py`` resets the variables around every test, and the e2e
runner again before each command (a fixture may have trained just before it).
"""

from __future__ import annotations

import os

LAUNCH_VARIABLES = (
    "RANK", "LOCAL_RANK", "GROUP_RANK", "NODE_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE",
    "MASTER_ADDR", "MASTER_PORT",
)  # fmt: skip
"""What a launcher sets for each rank (Lightning's, torchrun's)."""

_AT_START = {name: os.environ[name] for name in LAUNCH_VARIABLES if name in os.environ}


def reset_launch_environment() -> None:
    """The launch variables as they were when the session started (normally: none)."""
    for name in LAUNCH_VARIABLES:
        if name in _AT_START:
            os.environ[name] = _AT_START[name]
        else:
            os.environ.pop(name, None)
