"""Shards of ``prepare preference``'s work: what makes it resumable and divisible into
tasks.

The input's rows are cut, in reading order, into shards of ``shard_pairs`` rows. Each shard
is encoded (and, with ``--reference``, scored) on its own and kept in the progress folder
``DIR.progress`` beside the output: ``shard_<k>.npz`` (its kept pairs' sequences, every
pair's held-out hash and what was cut or dropped, the reference log-probs) and
``shard_<k>.pairs.jsonl`` (every pair's rows and where it was read), then the record
``shard_<k>.json`` (their sha256), written last. A rerun of the same settings skips every
shard whose record still matches its files; ``--num_tasks N --task_index I`` encodes the
shards ``k`` with ``k % N == I`` only, so N machines (or GPUs scoring with the reference)
share the work through one folder. The run that finds every shard finished (a run without
``--num_tasks``) assembles the output: the held-out split is decided then, over every
pair's hash, so the folder is byte for byte the same however the work was shared, and
``--val_fraction``, ``--val_examples`` and ``--show`` may change between the runs. The
progress folder is removed once the output is in place.

Nothing here touches ``DIR`` itself, which appears whole (`chat_prepare.write_folder`)
or not at all. Every file of the progress folder is numpy (``allow_pickle=False``), JSON
or JSON lines.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import re
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from plugintrain.core.atomic_files import PARTIAL_SUFFIX, atomic_open, remove, sibling
from plugintrain.data.assets import sha256_file

PROGRESS_SUFFIX = ".progress"
"""The progress folder's suffix: ``DIR.progress`` beside the output ``DIR``."""
DROPPED = ("too_long", "prompt_fills_seq_len", "same_after_truncation")
"""Why a pair is dropped (``EncodedPair.dropped``), as a shard stores it: 1 + its index."""


def progress_folder(out: Path) -> Path:
    """The progress folder of the output ``out``."""
    return sibling(out, PROGRESS_SUFFIX)


def open_progress(out: Path, settings: dict[str, Any], overwrite: bool) -> tuple[Path, bool]:
    """The progress folder of a run of ``settings`` into ``out``, made ready, and whether
    it holds no finished shard (a fresh run). One of other settings is cleared where it
    holds no finished shard or ``overwrite`` is given, else refused. Tasks may open it at
    the same time: one of the same settings is never cleared, and nothing of another
    task's (its unfinished files) is touched.

    Raises:
        FileExistsError: For a progress folder of other settings with finished shards, or
            a path of that name that holds other files.
    """
    folder = progress_folder(out)
    recorded = _read_json(folder / "settings.json")
    finished = any(folder.glob("shard_*.json"))
    if recorded is None and folder.exists() and not _only_progress(folder):
        if not overwrite:
            raise FileExistsError(
                f"{folder}: holds files that are no progress of `plugintrain prepare"
                " preference`; move them away, or add --overwrite to replace the folder"
            )
        remove(folder)
        finished = False
    elif recorded is not None and recorded != settings:
        if finished and not overwrite:
            changed = sorted(k for k in settings if recorded.get(k) != settings[k])
            raise FileExistsError(
                f"{folder}: holds finished shards of a run with other settings"
                f" ({', '.join(changed)} differ); rerun with those settings to resume it, or"
                " add --overwrite to start over"
            )
        remove(folder)
        finished = False
    folder.mkdir(parents=True, exist_ok=True)
    if recorded != settings:
        with atomic_open(folder / "settings.json", shared=True) as stream:
            stream.write(json.dumps(settings, indent=2).encode())
    return folder, not finished


def settings_digest(settings: dict[str, Any]) -> str:
    """What a shard's record names its settings by (a shard of others is not finished)."""
    return hashlib.sha256(json.dumps(settings, sort_keys=True).encode()).hexdigest()


def _only_progress(folder: Path) -> bool:
    """Whether ``folder`` holds nothing but a progress folder's files."""
    names = (p.name for p in folder.iterdir())
    return all(_PROGRESS_FILE.fullmatch(name) for name in names)


_PROGRESS_FILE = re.compile(
    rf"(settings\.json|shard_\d{{6}}\.(npz|pairs\.jsonl|json))(\.[0-9a-f]{{12}})?({PARTIAL_SUFFIX})?"
)


def shards_of(rows: Iterator[Any], shard_pairs: int) -> Iterator[tuple[int, list[Any]]]:
    """``(k, rows)`` of each shard of ``rows``, in order."""
    index = 0
    while True:
        shard = [row for _, row in zip(range(shard_pairs), rows, strict=False)]
        if not shard:
            return
        yield index, shard
        index += 1


# -- one shard --------------------------------------------------------------------------


def _name(index: int) -> str:
    return f"shard_{index:06d}"


def is_finished(folder: Path, index: int, digest: str) -> bool:
    """Whether shard ``index``'s record is there, of the settings of ``digest``
    (`settings_digest`), and its files still match it."""
    record = _read_json(folder / f"{_name(index)}.json")
    return (
        record is not None
        and record.get("settings") == digest
        and all(
            (folder / name).is_file() and sha256_file(folder / name) == digest
            for name, digest in record["files"].items()
        )
    )


def write_shard(
    folder: Path, index: int, pairs: list[Any], scores: np.ndarray | None, digest: str
) -> None:
    """Shard ``index``: its ``EncodedPair``s and the reference log-probs of the kept ones'
    sequences (None without a reference); the record, naming the settings' ``digest``,
    last. Each file goes through a temporary file of its own, so two runs writing one
    shard (an assembly started while a task still runs) leave one whole copy."""
    kept = [p for p in pairs if p.dropped is None]
    sequences = [s for p in kept for s in p.sequences()]
    arrays = {
        "ids": _joined([ids for ids, _ in sequences], np.uint32),
        "mask": _joined([mask for _, mask in sequences], np.uint8),
        "offsets": np.cumsum([0] + [len(ids) for ids, _ in sequences], dtype=np.int64),
        "keys": np.array([p.key for p in pairs], dtype=np.float64),
        "dropped": np.array([_dropped_code(p.dropped) for p in pairs], dtype=np.int8),
        "prompt_truncated": np.array([p.prompt_truncated for p in pairs], dtype=bool),
        "answers_truncated": np.array([p.answers_truncated for p in pairs], dtype=np.int8),
        "prompt_tokens": np.array([len(p.prompt) for p in pairs], dtype=np.int64),
    }
    if scores is not None:
        arrays["ref_logps"] = np.asarray(scores, dtype=np.float64)
    name = _name(index)
    with atomic_open(folder / f"{name}.npz", shared=True) as stream:
        np.savez(stream, **arrays)
    lines = (json.dumps({"where": p.where, **record(p.pair)}, ensure_ascii=False) for p in pairs)
    with atomic_open(folder / f"{name}.pairs.jsonl", shared=True) as stream:
        stream.write("".join(f"{line}\n" for line in lines).encode())
    files = [f"{name}.npz", f"{name}.pairs.jsonl"]
    summary = {"shard": index, "pairs": len(pairs), "settings": digest}
    summary["files"] = {file: sha256_file(folder / file) for file in files}
    with atomic_open(folder / f"{name}.json", shared=True) as stream:
        stream.write(json.dumps(summary, indent=2).encode())


def _joined(parts: list[np.ndarray], dtype: type) -> np.ndarray:
    return np.concatenate([part.astype(dtype) for part in parts]) if parts else np.zeros(0, dtype)


def _dropped_code(reason: str | None) -> int:
    return 0 if reason is None else 1 + DROPPED.index(reason)


def record(pair: Any) -> dict[str, Any]:
    """A ``Pair`` as ``val.pairs.jsonl`` holds it."""
    return {"prompt": pair.prompt, "chosen": pair.chosen, "rejected": pair.rejected}


@dataclass
class Shard:
    """One finished shard: its arrays and pairs, read on demand."""

    folder: Path
    index: int

    def arrays(self) -> dict[str, np.ndarray]:
        """Its arrays (`write_shard`'s), read without unpickling."""
        with np.load(self.folder / f"{_name(self.index)}.npz", allow_pickle=False) as npz:
            return {name: npz[name] for name in npz.files}

    def pairs(self) -> Iterator[dict[str, Any]]:
        """Each pair's ``{"where", "prompt", "chosen", "rejected"}``, in order."""
        with (self.folder / f"{_name(self.index)}.pairs.jsonl").open(encoding="utf-8") as lines:
            for line in lines:
                yield json.loads(line)


# -- assembling the output --------------------------------------------------------------


@dataclass
class Assembly:
    """Every pair of every shard, as the output needs them, in input order: each pair's
    held-out hash, what was dropped or cut, and (0 for a dropped pair) the tokens and the
    targets of its two sequences."""

    shards: list[Shard]
    sizes: list[int]  # each shard's pairs
    keys: np.ndarray  # (n,) float64
    dropped: np.ndarray  # (n,) int8: 0 kept, else 1 + index in DROPPED
    prompt_truncated: np.ndarray  # (n,) bool
    answers_truncated: np.ndarray  # (n,) int8
    tokens: np.ndarray  # (n,) int64
    targets: np.ndarray  # (n,) int64

    @classmethod
    def read(cls, folder: Path, count: int) -> Assembly:
        """The ``count`` shards of ``folder`` (every one finished), one in memory at a time."""
        shards = [Shard(folder, index) for index in range(count)]
        names = ("keys", "dropped", "prompt_truncated", "answers_truncated", "tokens", "targets")
        parts: dict[str, list[np.ndarray]] = {name: [] for name in names}
        for shard in shards:
            arrays = shard.arrays()
            kept = arrays["dropped"] == 0
            per_pair = np.zeros((len(kept), 2), dtype=np.int64)
            per_pair[kept] = _per_sequence(arrays).reshape(-1, 2, 2).sum(axis=1)
            arrays["tokens"], arrays["targets"] = per_pair[:, 0], per_pair[:, 1]
            for name in names:
                parts[name].append(arrays[name])
        sizes = [len(keys) for keys in parts["keys"]]
        return cls(shards, sizes, **{name: np.concatenate(parts[name]) for name in names})

    def counts(self, held_out: np.ndarray) -> dict[str, dict[str, Any]]:
        """``meta.json``'s counts of each split, ``held_out`` saying which pairs are val."""
        out = {}
        for split, chosen in (("train", ~held_out), ("val", held_out)):
            kept = chosen & (self.dropped == 0)
            codes = self.dropped[chosen & (self.dropped > 0)].tolist()
            out[split] = {
                "pairs": int(kept.sum()),
                "tokens": int(self.tokens[kept].sum()),
                "targets": int(self.targets[kept].sum()),
                "prompts_truncated": int(self.prompt_truncated[kept].sum()),
                "answers_truncated": int(self.answers_truncated[kept].sum()),
                "dropped": dict(sorted(Counter(DROPPED[c - 1] for c in codes).items())),
            }
        return out

    def write(self, folder: Path, held_out: np.ndarray, scored: bool) -> None:
        """Each split's arrays (``S.ids/mask/offsets.npy``, with ``scored`` also
        ``S.ref_logps.npy``) and ``val.pairs.jsonl`` into ``folder``, streamed shard by
        shard into files of their final size."""
        for split, chosen in (("train", ~held_out), ("val", held_out)):
            kept = chosen & (self.dropped == 0)
            tokens = int(self.tokens[kept].sum())
            ids = np.lib.format.open_memmap(folder / f"{split}.ids.npy", "w+", np.uint32, (tokens,))
            mask = np.lib.format.open_memmap(
                folder / f"{split}.mask.npy", "w+", np.uint8, (tokens,)
            )
            offsets, scores, filled = [np.zeros(1, np.int64)], [], 0
            for shard, selected in zip(self.shards, self._by_shard(kept), strict=True):
                if not selected.any():
                    continue
                arrays = shard.arrays()
                rows = np.flatnonzero(np.repeat(selected[arrays["dropped"] == 0], 2))
                starts, ends = arrays["offsets"][rows], arrays["offsets"][rows + 1]
                for start, end in zip(starts.tolist(), ends.tolist(), strict=True):
                    ids[filled : filled + end - start] = arrays["ids"][start:end]
                    mask[filled : filled + end - start] = arrays["mask"][start:end]
                    filled += end - start
                offsets.append(offsets[-1][-1] + np.cumsum(ends - starts))
                if scored:
                    scores.append(arrays["ref_logps"][rows])
            ids.flush(), mask.flush()
            del ids, mask  # the memory maps closed before the folder is synced
            np.save(folder / f"{split}.offsets.npy", np.concatenate(offsets))
            if scored:
                np.save(folder / f"{split}.ref_logps.npy", _joined(scores, np.float64))
        self._write_val_pairs(folder / "val.pairs.jsonl", held_out & (self.dropped == 0))

    def first_kept(self, count: int) -> Iterator[tuple[int, str, int, list[Any]]]:
        """The first ``count`` kept pairs: each one's index among all pairs, where it was
        read, its prompt's tokens and its two sequences' ``(ids, mask)``."""
        first = 0
        for shard, size in zip(self.shards, self.sizes, strict=True):
            arrays, kept = shard.arrays(), 0
            offsets = arrays["offsets"].tolist()
            for index, pair in enumerate(shard.pairs()):
                if count <= 0:
                    return
                if arrays["dropped"][index]:
                    continue
                bounds = offsets[2 * kept : 2 * kept + 3]
                sequences = [
                    (arrays["ids"][a:b].astype(np.int64), arrays["mask"][a:b])
                    for a, b in itertools.pairwise(bounds)
                ]
                yield first + index, pair["where"], int(arrays["prompt_tokens"][index]), sequences
                kept, count = kept + 1, count - 1
            first += size

    def _by_shard(self, per_pair: np.ndarray) -> list[np.ndarray]:
        """``per_pair`` (n,) cut into each shard's part."""
        return np.split(per_pair, np.cumsum(self.sizes)[:-1])

    def _write_val_pairs(self, path: Path, val: np.ndarray) -> None:
        with path.open("w", encoding="utf-8") as out:
            for shard, selected in zip(self.shards, self._by_shard(val), strict=True):
                if not selected.any():
                    continue
                for pair, keep in zip(shard.pairs(), selected.tolist(), strict=True):
                    if keep:
                        del pair["where"]
                        out.write(json.dumps(pair, ensure_ascii=False) + "\n")


def _per_sequence(arrays: dict[str, np.ndarray]) -> np.ndarray:
    """``(2m, 2)``: each kept sequence's tokens and masked tokens."""
    offsets = arrays["offsets"]
    masked = np.concatenate([[0], np.cumsum(arrays["mask"], dtype=np.int64)])
    return np.stack((np.diff(offsets), masked[offsets[1:]] - masked[offsets[:-1]]), axis=1)


def _read_json(path: Path) -> dict[str, Any] | None:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None
