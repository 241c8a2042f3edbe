"""Shared by every test folder: pytest puts this folder on ``sys.path`` for it, so test
modules import the helpers beside it (``from _hf_models import random_hf_llama``).

Around every test the launch variables a Lightning run in this process leaves behind are
reset (:mod:`_launch_env`), so no later command inherits them.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from _launch_env import reset_launch_environment


@pytest.fixture(autouse=True)
def _fresh_launch_environment() -> Iterator[None]:
    reset_launch_environment()
    yield
    reset_launch_environment()
