"""Atomic file writes: readers see the old file or the complete new one, never a part."""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import BinaryIO


@contextmanager
def atomic_open(path: str | Path) -> Iterator[BinaryIO]:
    """Open a temporary file beside ``path`` for binary writing; rename it over ``path`` on success.

    The directory is created if missing. If the block raises, the temporary file is removed
    and ``path`` is left untouched.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    # A plain exclusive open (not mkstemp) so the file gets the usual umask permissions.
    tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex[:12]}.tmp")
    try:
        with open(tmp, "xb") as f:
            yield f
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
