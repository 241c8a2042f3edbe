"""Files published atomically: a reader sees the old file or the whole new one, never a part.

- **Files** are written to a temporary sibling, flushed to disk, then ``os.replace``\\ d onto
  their name (atomic on POSIX): ``<name>.partial`` for checkpoints (one writer; a kill
  leaves it for :func:`plugintrain.checkpoints.files.recover` to clean up), or a temporary
  name of the writer's own for files several processes may write at once (prepared data).
- **Directories** are written as ``<name>.partial/``; :func:`publish` renames an existing
  ``<name>`` to ``<name>.retired``, the new one into place, and then deletes the retired
  one. A kill between the two renames leaves ``<name>.retired`` complete and no
  ``<name>``; ``recover`` renames it back.
"""

from __future__ import annotations

import os
import shutil
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import IO

PARTIAL_SUFFIX = ".partial"
RETIRED_SUFFIX = ".retired"


@contextmanager
def atomic_open(path: str | Path, *, shared: bool = False) -> Iterator[IO[bytes]]:
    """Open a temporary sibling of ``path`` for binary writing; once the block completes,
    flush it to disk and move it onto ``path`` (creating the directory if missing).

    Args:
        path: The file to publish.
        shared: Other processes may write ``path`` at the same time (prepared data): each
            writes a temporary file of its own, removed if the block raises, and the last
            complete one wins. Otherwise the temporary file is ``<path>.partial``, left
            behind by an error as by a kill (a checkpoint's ``recover`` reports it).
    """
    path = Path(path)
    suffix = f".{uuid.uuid4().hex[:12]}{PARTIAL_SUFFIX}" if shared else PARTIAL_SUFFIX
    partial = sibling(path, suffix)
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        with open(partial, "xb" if shared else "wb") as stream:
            yield stream
            stream.flush()
            os.fsync(stream.fileno())
    except BaseException:
        if shared:
            partial.unlink(missing_ok=True)
        raise
    publish(partial, path)


def write_file_atomically(path: Path, write: Callable[[IO[bytes]], None]) -> None:
    """Write ``path`` through ``write(stream)`` with :func:`atomic_open` (``<path>.partial``,
    fsynced, then moved onto ``path``)."""
    with atomic_open(path) as stream:
        write(stream)


def sibling(path: Path, suffix: str) -> Path:
    """``<path><suffix>`` in the same directory (``last.ckpt`` -> ``last.ckpt.partial``)."""
    return path.with_name(path.name + suffix)


def publish(partial: Path, path: Path) -> None:
    """Move the complete file or directory ``partial`` to ``path``, replacing what is there.

    One ``os.replace`` where it can (a file over a file); otherwise (a directory on either
    side) the old one is first renamed to ``<path>.retired`` and deleted afterwards.
    """
    if not path.is_dir() and not partial.is_dir():
        os.replace(partial, path)
    else:
        retired = sibling(path, RETIRED_SUFFIX)
        remove(retired)
        if path.exists():
            os.replace(path, retired)
        os.replace(partial, path)
        _fsync_directory(path.parent)
        remove(retired)
    _fsync_directory(path.parent)


def remove(path: Path) -> None:
    """Delete a checkpoint file or directory, if there."""
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    elif path.exists() or path.is_symlink():
        path.unlink()


def fsync_tree(path: Path) -> None:
    """Flush a file, or every file of a directory and the directory, to disk: what
    :func:`publish` needs of an output written without :func:`write_file_atomically`."""
    for file in sorted(path.rglob("*")) if path.is_dir() else [path]:
        if file.is_file():
            with open(file, "rb") as stream:
                os.fsync(stream.fileno())
    if path.is_dir():
        _fsync_directory(path)


def _fsync_directory(directory: Path) -> None:
    """Make a rename durable (POSIX); a no-op where directories cannot be opened."""
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
