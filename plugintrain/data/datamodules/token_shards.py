"""Prepared token folders as a datamodule reads them: shards memory-mapped, never joined.

A folder is either ``plugintrain prepare text``'s (``meta.json`` lists each split's shards
with their sha256) or a plain pair of llm.c files (``train.bin``/``val.bin``, as ``prepare
shakespeare`` and llm.c write them). `ShardedTokens` reads a split as one sequence of
tokens across its shards and `TokenWindows` cuts it into training windows;
`verify_shards` checks every shard against ``meta.json`` once per file version (the result
is cached by path, size and modification time).
"""

from __future__ import annotations

import fcntl
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset

from plugintrain.core.atomic_files import atomic_open
from plugintrain.data.assets import sha256_file
from plugintrain.data.token_bin import read_token_bin

TEXT_SHARDS_FORMAT = "plugintrain.text-shards/1"


class ShardedTokens:
    """The tokens of several llm.c files as one sequence; shards opened on first access.

    Args:
        paths: The shard files, in order.
    """

    def __init__(self, paths: list[Path]) -> None:
        self.paths = list(paths)
        self._maps: list[np.memmap] | None = None
        counts = [len(read_token_bin(p)) for p in self.paths]
        self.starts = np.concatenate([[0], np.cumsum(counts, dtype=np.int64)])

    def _shards(self) -> list[np.memmap]:
        if self._maps is None:
            self._maps = [read_token_bin(p) for p in self.paths]
        return self._maps

    def __len__(self) -> int:
        return int(self.starts[-1])

    def read(self, start: int, stop: int) -> np.ndarray:
        """Tokens ``[start, stop)`` as int64, across shard boundaries."""
        shards, pieces = self._shards(), []
        index = int(np.searchsorted(self.starts, start, side="right")) - 1
        while start < stop and index < len(shards):
            offset = start - int(self.starts[index])
            take = min(stop - start, len(shards[index]) - offset)
            pieces.append(np.asarray(shards[index][offset : offset + take], dtype=np.int64))
            start += take
            index += 1
        return np.concatenate(pieces) if pieces else np.zeros(0, np.int64)

    def chunks(self, size: int = 1 << 24) -> Iterator[tuple[int, np.ndarray]]:
        """``(position, tokens)`` in chunks of at most ``size``, shard by shard."""
        for start, shard in zip(self.starts, self._shards(), strict=False):
            for i in range(0, len(shard), size):
                yield int(start) + i, shard[i : i + size]

    def __getstate__(self) -> dict[str, Any]:
        # DataLoader workers re-open the memmaps rather than receive pickled copies.
        return {**self.__dict__, "_maps": None}


class TokenWindows(Dataset):
    """Windows of a token file or of a split's shards: item ``i`` is ``(x, y)``, int64 of
    shape (T,), with ``y`` the next tokens of ``x``.

    Without ``starts`` the windows tile the tokens: window ``i`` starts at ``i*T`` (and may
    cross a document or shard boundary). With ``starts`` window ``i`` starts there.

    Args:
        path: llm.c token file, or the list of a split's shards (memory-mapped on first
            access, also in each worker; never joined).
        seq_len: Window length T.
        starts: Where each window starts, if not tiled.
    """

    def __init__(
        self, path: str | Path | list[Path], seq_len: int, starts: np.ndarray | None = None
    ) -> None:
        paths = [Path(p) for p in path] if isinstance(path, list) else [Path(path)]
        self.path = paths[0]
        self.seq_len = seq_len
        self.tokens = ShardedTokens(paths)
        self.num_tokens = len(self.tokens)
        self.starts = starts

    def __len__(self) -> int:
        if self.starts is not None:
            return len(self.starts)
        # The last window needs one extra token for its final target.
        return max(self.num_tokens - 1, 0) // self.seq_len

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        start = int(self.starts[i]) if self.starts is not None else i * self.seq_len
        chunk = torch.from_numpy(self.tokens.read(start, start + self.seq_len + 1))
        return chunk[:-1], chunk[1:]


def read_meta(data_dir: Path) -> dict[str, Any]:
    """The ``meta.json`` in ``data_dir``, else ``{}``."""
    path = data_dir / "meta.json"
    return json.loads(path.read_text()) if path.is_file() else {}


def is_text_shards(meta: dict[str, Any]) -> bool:
    """Whether ``meta`` is ``plugintrain prepare text``'s (shards listed per split)."""
    return meta.get("format") == TEXT_SHARDS_FORMAT


def split_paths(data_dir: Path, meta: dict[str, Any], split: str, file: str) -> list[Path]:
    """The files of ``split``: the shards ``meta.json`` lists, else ``data_dir / file``."""
    if is_text_shards(meta):
        return [data_dir / s["file"] for s in meta["splits"][split]["shards"]]
    return [data_dir / file]


def _redo(meta: dict[str, Any]) -> str:
    """How to write the folder's shards again."""
    if meta.get("task_commands"):
        return "prepare the data again with the tasks' commands (task_commands in meta.json)"
    return f"prepare the data again with its command: {meta.get('command')}"


def verify_shards(data_dir: Path, meta: dict[str, Any], cache: Path | None) -> None:
    """Check every listed shard's size and sha256 against ``meta.json``.

    A shard already verified in this version (same path, size and mtime, recorded in
    ``cache``) is not read again, so only new or changed files cost a pass.

    Raises:
        ValueError: Naming the first shard that is missing or differs, and the fix.
    """
    if not is_text_shards(meta):
        return
    if cache is None:
        _verify(data_dir, meta, None)
        return
    try:
        cache.parent.mkdir(parents=True, exist_ok=True)
        lock = open(cache.with_name(cache.name + ".lock"), "a")  # noqa: SIM115
    except OSError:  # a read-only cache: every start verifies
        _verify(data_dir, meta, None)
        return
    with lock:  # one process hashes while the others (ranks started together) wait
        fcntl.flock(lock, fcntl.LOCK_EX)
        _verify(data_dir, meta, cache)


def _verify(data_dir: Path, meta: dict[str, Any], cache: Path | None) -> None:
    known = _read_cache(cache)
    fresh = {}
    for split in meta["splits"].values():
        for shard in split["shards"]:
            path = (data_dir / shard["file"]).resolve()
            if not path.is_file():
                raise ValueError(
                    f"{path}: listed in {data_dir / 'meta.json'} but missing; {_redo(meta)}"
                )
            stat = path.stat()
            stamp = f"{path}|{stat.st_size}|{stat.st_mtime_ns}"
            if known.get(stamp) == shard["sha256"]:
                continue
            digest = sha256_file(path)
            if digest != shard["sha256"]:
                raise ValueError(
                    f"{path}: sha256 {digest[:16]}... does not match {data_dir / 'meta.json'}"
                    f" ({shard['sha256'][:16]}...): the shard changed since it was prepared;"
                    f" {_redo(meta)}"
                )
            fresh[stamp] = digest
    if fresh and cache is not None:
        _write_cache(cache, {**known, **fresh})


def _read_cache(cache: Path | None) -> dict[str, str]:
    if cache is None or not cache.is_file():
        return {}
    try:
        data = json.loads(cache.read_text())
    except (OSError, json.JSONDecodeError):
        return {}
    return data if isinstance(data, dict) else {}


def _write_cache(cache: Path, data: dict[str, str]) -> None:
    try:
        with atomic_open(cache, shared=True) as f:
            f.write(json.dumps(data).encode())
    except OSError:
        pass  # a read-only cache only costs the next start another pass


def document_starts(tokens: ShardedTokens, eos_id: int) -> np.ndarray:
    """Where each document starts: position 0 and every position after an EOS."""
    ends = [start + np.flatnonzero(chunk == eos_id) + 1 for start, chunk in tokens.chunks()]
    starts = np.concatenate([[0], *ends]).astype(np.int64)
    return starts[starts < len(tokens)]
