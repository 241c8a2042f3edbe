"""``plugintrain prepare text``: the user's documents as sharded llm.c token files.

The pipeline streams: sources are read a document at a time, batches of documents go to a
pool of tokenizer processes (at most two batches per process in flight, results taken in
order), and tokens go straight into the open shard. Memory is bounded by the batches in
flight and the largest document, never by the corpus.

**Groups make the output independent of how it was made.** The sorted sources are cut into
groups of consecutive files of about ``4 * shard_tokens`` bytes (a file larger than that is
a group of its own); a shard never spans two groups. So one process, ``--num_proc N`` and
``--num_tasks N`` (each task takes a contiguous run of groups, balanced by bytes) all write
the same shards, byte for byte, and a finished group is the unit of resumption: its record
``progress/group_<g>.json`` (shards and their sha256) is written after its shards, and a
rerun skips every group whose shards still match it.

**Boundaries.** Each document is ``[BOS] + tokens + [EOS]``: BOS where the tokenizer adds
one itself (Llama 3; not GPT-2 or SmolLM2), EOS always, so EOS separates documents (and,
never being produced from text, marks every boundary). ``meta.json`` records both.

**Held-out split.** A document is held out by a hash of ``(seed, its source's label, its
ordinal)``: with ``val_fraction``, when the hash falls below it; with ``val_docs``, when it
is among the ``val_docs`` smallest over every document with text in the whole input (every
task ranks the same keys, reading the input once before tokenizing).
"""

from __future__ import annotations

import hashlib
import heapq
import json
import multiprocessing
import os
import shlex
import shutil
import sys
import time
from collections import deque
from collections.abc import Iterator
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from plugintrain.core.atomic_files import PARTIAL_SUFFIX, atomic_open
from plugintrain.data.assets import sha256_file
from plugintrain.data.prepare.text_sources import (
    CorpusError,
    ReadOptions,
    Source,
    document_ordinals,
    expand_inputs,
)
from plugintrain.data.token_bin import HEADER_BYTES, HEADER_DTYPE, HEADER_INTS, MAGIC
from plugintrain.data.tokenizers.token_bytes import write_token_bytes
from plugintrain.data.tokenizers.registry import get_tokenizer, tokenizer_spec

FORMAT = "plugintrain.text-shards/1"
SPLITS = ("train", "val")
_BATCH_CHARS = 1 << 20  # characters of text per batch sent to a tokenizer process
_BYTES_PER_TOKEN = 4  # how groups are sized from bytes on disk (compressed files: 4x more)


@dataclass(frozen=True)
class PrepareOptions:
    """Everything that decides the tokens ``prepare text`` writes (recorded in ``meta.json``).

    Attributes:
        tokenizer: A `get_tokenizer` spec.
        read: How documents are read from the sources.
        val_fraction: Share of documents held out (by hash).
        val_docs: Exactly this many documents held out instead (the smallest hashes).
        seed: Seed of the held-out split's hash.
        shard_tokens: A shard is closed once it holds this many tokens (or its group ends).
        eos: The token that ends each document; None: the tokenizer's EOS.
    """

    tokenizer: str
    read: ReadOptions = field(default_factory=ReadOptions)
    val_fraction: float = 0.01
    val_docs: int | None = None
    seed: int = 0
    shard_tokens: int = 100_000_000
    eos: str | None = None


@dataclass(frozen=True)
class Group:
    """Consecutive sources whose documents fill shards of their own."""

    index: int
    sources: tuple[Source, ...]

    @property
    def size(self) -> int:
        return sum(_weight(s) for s in self.sources)


def _weight(source: Source) -> int:
    compressed = source.path is not None and source.path.suffix.lower() in (".gz", ".zst")
    return source.size * (4 if compressed else 1)


def make_groups(sources: list[Source], shard_tokens: int) -> list[Group]:
    """Cut the sources into groups of about ``4 * shard_tokens`` bytes, in order."""
    groups, current, size = [], [], 0
    for source in sources:
        current.append(source)
        size += _weight(source)
        if size >= shard_tokens * _BYTES_PER_TOKEN or source.kind == "hub":
            groups.append(Group(len(groups), tuple(current)))
            current, size = [], 0
    if current:
        groups.append(Group(len(groups), tuple(current)))
    return groups


def task_groups(groups: list[Group], num_tasks: int, task_index: int) -> list[Group]:
    """Task ``task_index``'s contiguous run of groups: the runs split the bytes evenly."""
    total = sum(g.size for g in groups) or 1
    done, runs = 0, [[] for _ in range(num_tasks)]
    for group in groups:
        middle = done + group.size / 2  # a group goes to the task its middle byte falls in
        runs[min(int(middle * num_tasks / total), num_tasks - 1)].append(group)
        done += group.size
    return runs[task_index]


class HeldOut:
    """Which documents are held out: a hash of ``(seed, label, ordinal)`` per document."""

    def __init__(self, options: PrepareOptions, sources: list[Source]) -> None:
        self.seed = options.seed
        self.fraction = options.val_fraction
        self.threshold: float | None = None
        if options.val_docs is not None:
            self.threshold = self._rank(options, sources)

    def key(self, label: str, ordinal: int) -> float:
        """The document's hash as a number in [0, 1)."""
        digest = hashlib.blake2b(f"{self.seed}\0{label}\0{ordinal}".encode(), digest_size=8)
        return int.from_bytes(digest.digest(), "big") / 2**64

    def __call__(self, label: str, ordinal: int) -> bool:
        key = self.key(label, ordinal)
        return key <= self.threshold if self.threshold is not None else key < self.fraction

    def _rank(self, options: PrepareOptions, sources: list[Source]) -> float:
        """The largest key among the ``val_docs`` smallest over every source's documents."""
        wanted = options.val_docs or 0
        smallest: list[float] = []  # a max-heap of negated keys
        total = 0
        for source in sources:
            for ordinal in document_ordinals(source, options.read):
                total += 1
                key = -self.key(source.label, ordinal)
                if len(smallest) < wanted:
                    heapq.heappush(smallest, key)
                elif key > smallest[0]:
                    heapq.heapreplace(smallest, key)
        if total <= wanted:
            raise CorpusError(
                f"--val_docs {wanted}: the input holds {total} documents with text; hold out"
                f" fewer (at most {max(total - 1, 0)}, so that one is left to train on)"
            )
        return -smallest[0] if smallest else -1.0


class _Boundaries:
    """Ids a document is framed with, as the tokenizer's own configuration says."""

    def __init__(self, options: PrepareOptions) -> None:
        tokenizer = get_tokenizer(options.tokenizer)
        self.vocab_size = tokenizer.vocab_size
        self.bos_id = tokenizer.bos_id
        self.add_bos = bool(getattr(tokenizer, "add_bos", False))
        self.eos_id = tokenizer.eos_id if options.eos is None else _token_id(tokenizer, options.eos)
        self.dtype = np.dtype("<u2") if self.vocab_size <= 1 << 16 else np.dtype("<u4")


def _token_id(tokenizer: Any, token: str) -> int:
    specials = tokenizer.special_tokens
    if token not in specials:
        raise CorpusError(
            f"--eos {token!r}: not a special token of {tokenizer.name}; choose one of"
            f" {sorted(specials)[:8]}{' ...' if len(specials) > 8 else ''}"
        )
    return specials[token]


# -- tokenizer processes --------------------------------------------------------------

_WORKER: dict[str, Any] = {}


def _init_worker(spec: str, bos: int | None, eos: int) -> None:
    os.environ.setdefault("RAYON_NUM_THREADS", "1")  # one core per process
    _WORKER.update(tokenizer=get_tokenizer(spec), bos=bos, eos=eos)


def _encode(texts: list[str]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Documents' ids with their boundaries, concatenated; each document's length in tokens
    and in UTF-8 bytes of its text."""
    tokenizer, bos, eos = _WORKER["tokenizer"], _WORKER["bos"], _WORKER["eos"]
    head = np.array([] if bos is None else [bos], dtype=np.uint32)
    tail = np.array([eos], dtype=np.uint32)
    pieces, lengths = [], np.zeros(len(texts), dtype=np.int64)
    for i, text in enumerate(texts):
        try:
            ids = tokenizer.encode_array(text)
        except (UnicodeEncodeError, TypeError):  # lone surrogates (JSON "\\ud800"): as
            # tiktoken's own encode, U+FFFD (`tokenizers` refuses them with a TypeError)
            text = texts[i] = text.encode("utf-16", "surrogatepass").decode("utf-16", "replace")
            ids = tokenizer.encode_array(text)
        pieces += [head, ids, tail]
        lengths[i] = len(head) + len(ids) + 1
    sizes = np.array([len(t.encode("utf-8", "surrogatepass")) for t in texts], dtype=np.int64)
    tokens = np.concatenate(pieces) if pieces else np.zeros(0, np.uint32)
    return tokens, lengths, sizes


class _Encoder:
    """Ordered encoding of batches: in this process, or in a pool with a bounded window.

    The pool is a ``ProcessPoolExecutor``: a tokenizer process that dies (killed, out of
    memory) fails the run at once (``BrokenProcessPool``) instead of leaving it waiting.
    """

    def __init__(self, options: PrepareOptions, bounds: _Boundaries, num_proc: int) -> None:
        args = (options.tokenizer, bounds.bos_id if bounds.add_bos else None, bounds.eos_id)
        self.pool: ProcessPoolExecutor | None = None
        if num_proc > 1:
            self.pool = ProcessPoolExecutor(
                num_proc,
                mp_context=multiprocessing.get_context("spawn"),  # never fork a threaded one
                initializer=_init_worker,
                initargs=args,
            )
        else:
            _init_worker(*args)
        self.window = 2 * max(num_proc, 1)

    def map(self, batches: Iterator[Any]) -> Iterator[tuple[Any, Any]]:
        """``(tag, encoded)`` for each ``(tag, texts)``, in order."""
        if self.pool is None:
            for tag, texts in batches:
                yield tag, _encode(texts)
            return
        pending: deque = deque()
        try:
            for tag, texts in batches:
                pending.append((tag, self.pool.submit(_encode, texts)))
                if len(pending) >= self.window:
                    tag0, result = pending.popleft()
                    yield tag0, result.result()
            while pending:
                tag0, result = pending.popleft()
                yield tag0, result.result()
        except BrokenProcessPool:
            raise RuntimeError(
                "a tokenizer process died (killed, or out of memory?); the finished groups are"
                " kept: rerun the same command to go on, with a smaller --num_proc if memory"
                " ran out"
            ) from None

    def close(self, abort: bool) -> None:
        """Stop the pool: at once when aborting (a batch in progress is not waited for)."""
        if self.pool is None:
            return
        processes = list((getattr(self.pool, "_processes", None) or {}).values())
        self.pool.shutdown(wait=not abort, cancel_futures=True)
        if abort:
            for process in processes:
                process.terminate()
                process.join(5)


# -- shards ---------------------------------------------------------------------------


class _ShardWriter:
    """One split's shards of one task: documents appended, cut every ``shard_tokens``."""

    def __init__(self, out: Path, split: str, first: int, dtype: np.dtype, limit: int) -> None:
        self.out, self.split, self.next_index, self.dtype, self.limit = (
            out,
            split,
            first,
            dtype,
            limit,
        )
        self.done: list[dict[str, Any]] = []
        self._context: Any = None
        self._stream: Any = None
        self._tokens = self._documents = self._bytes = 0

    def add(self, tokens: np.ndarray, text_bytes: int) -> None:
        if self._stream is None:
            name = f"{self.split}_{self.next_index:06d}.bin"
            self._context = atomic_open(self.out / name, shared=True)
            self._stream = self._context.__enter__()
            self._stream.write(bytes(HEADER_BYTES))
            self._name = name
        self._stream.write(memoryview(np.ascontiguousarray(tokens, dtype=self.dtype)))
        self._tokens += len(tokens)
        self._documents += 1
        self._bytes += text_bytes
        if self._tokens >= self.limit:
            self.close()

    def close(self) -> None:
        """Publish the open shard (its header written last) and record it."""
        if self._stream is None:
            return
        header = np.zeros(HEADER_INTS, dtype=HEADER_DTYPE)
        header[:3] = (MAGIC, 1 if self.dtype.itemsize == 2 else 2, self._tokens)
        self._stream.seek(0)
        self._stream.write(header.tobytes())
        self._context.__exit__(None, None, None)
        self.done.append(
            {
                "file": self._name,
                "tokens": self._tokens,
                "documents": self._documents,
                "text_bytes": self._bytes,
                "sha256": sha256_file(self.out / self._name),
            }
        )
        self.next_index += 1
        self._stream = self._context = None
        self._tokens = self._documents = self._bytes = 0

    def abort(self) -> None:
        if self._context is not None:
            self._context.__exit__(CorpusError, CorpusError("aborted"), None)
            self._stream = self._context = None


# -- the run --------------------------------------------------------------------------


def prepare_text(
    inputs: list[str],
    out: str | Path,
    options: PrepareOptions,
    num_proc: int | None = None,
    num_tasks: int = 1,
    task_index: int = 0,
    suffixes: tuple[str, ...] = (),
    overwrite: bool = False,
    command: list[str] | None = None,
    progress: bool = True,
) -> dict[str, Any]:
    """Tokenize ``inputs`` into shards under ``out``; returns what ``meta.json`` records.

    Raises:
        CorpusError: For unreadable input (before anything is written where it can be
            told up front; a problem found mid-run removes what this run wrote).
        FileExistsError: If ``out`` holds data prepared with other settings.
    """
    _check_numbers(options, num_tasks, task_index)
    out = Path(out)
    sources = expand_inputs(inputs, suffixes, exclude=out)
    bounds = _Boundaries(options)
    groups = task_groups(make_groups(sources, options.shard_tokens), num_tasks, task_index)
    settings = _settings(options, sources, num_tasks, task_index)
    held_out = HeldOut(options, sources)  # every up-front check before anything is touched
    fresh, existed = _check_out(out, settings, overwrite), out.exists()
    out.mkdir(parents=True, exist_ok=True)
    for stale in [*out.glob(f"*{PARTIAL_SUFFIX}"), *out.glob(f"progress/*{PARTIAL_SUFFIX}")]:
        stale.unlink()  # a killed run's unfinished files
    try:
        records = _run_groups(out, settings, groups, options, bounds, held_out, num_proc, progress)
        meta = _meta(options, bounds, settings, records, command)
        if num_tasks == 1 and meta["splits"]["train"]["tokens"] == 0:
            raise CorpusError(f"{' '.join(inputs)}: no document with text to train on")
    except Exception as error:
        _clean_up(out, fresh and isinstance(error, CorpusError), remove=not existed)
        raise
    write_token_bytes(out, get_tokenizer(options.tokenizer).token_bytes())
    _write_json(out / "meta.json", meta)
    if num_tasks == 1 and not meta["splits"]["val"]["documents"]:
        sys.stderr.write(
            f"prepare text: no document was held out, so {out} has no validation split;"
            " rerun with --val_docs N (and --overwrite) to hold some out\n"
        )
    return meta


def _check_numbers(options: PrepareOptions, num_tasks: int, task_index: int) -> None:
    """The options that are wrong whatever the input."""
    if not 0 <= task_index < num_tasks:
        raise CorpusError(
            f"--task_index {task_index}: must be in [0, {num_tasks}) for --num_tasks {num_tasks}"
        )
    if not 0 <= options.val_fraction < 1:
        raise CorpusError(f"--val_fraction {options.val_fraction}: must be in [0, 1)")
    # A shard closes after the document that fills it, and llm.c counts tokens in int32.
    largest = 2**31 - 1 - options.read.max_doc_bytes - 2
    if not 1 <= options.shard_tokens <= largest:
        raise CorpusError(
            f"--shard_tokens {options.shard_tokens}: must be in [1, {largest}] (a shard's"
            " token count is an int32, and its last document may run past --shard_tokens by"
            " up to --max_doc_bytes)"
        )


def _settings(
    options: PrepareOptions, sources: list[Source], num_tasks: int, task_index: int
) -> dict[str, Any]:
    read = asdict(options.read)
    return {
        "tokenizer": tokenizer_spec(options.tokenizer),
        "read": read,
        "val_fraction": options.val_fraction,
        "val_docs": options.val_docs,
        "seed": options.seed,
        "shard_tokens": options.shard_tokens,
        "eos": options.eos,
        "sources": [[s.label, s.size] for s in sources],
        "task": {"index": task_index, "of": num_tasks},
    }


def _check_out(out: Path, settings: dict[str, Any], overwrite: bool) -> bool:
    """Whether ``out`` holds nothing to keep (absent, empty, or a run with no finished
    group); refuse a folder of other settings unless ``overwrite`` (which clears it).

    Raises:
        FileExistsError: If ``out`` holds other files, or text prepared otherwise.
    """
    meta = _read_json(out / "meta.json")
    recorded = _read_json(out / "progress" / "settings.json") or (meta or {}).get("settings")
    if not out.is_dir() or not any(out.iterdir()):
        return True
    if recorded is None and not overwrite:
        raise FileExistsError(
            f"{out} is not empty and holds no prepared text; choose another --out or add"
            " --overwrite to write into it"
        )
    finished = meta is not None or any((out / "progress").glob("group_*.json"))
    if recorded is not None and recorded != settings and finished and not overwrite:
        changed = sorted(k for k in settings if recorded.get(k) != settings[k])
        raise FileExistsError(
            f"{out} holds text prepared with other settings ({', '.join(changed)} differ);"
            " add --overwrite to rebuild it, or choose another --out"
        )
    if recorded is not None and recorded != settings:  # the old shards go with their records
        _clear(out)
        return True
    return not finished


def _clear(out: Path) -> None:
    """Remove what ``prepare text`` writes in ``out`` (and nothing else)."""
    shutil.rmtree(out / "progress", ignore_errors=True)
    for name in ("meta.json", "token_bytes.npy"):
        (out / name).unlink(missing_ok=True)
    for split in SPLITS:
        for shard in out.glob(f"{split}_[0-9][0-9][0-9][0-9][0-9][0-9].bin"):
            shard.unlink()


def _run_groups(
    out: Path,
    settings: dict[str, Any],
    groups: list[Group],
    options: PrepareOptions,
    bounds: _Boundaries,
    held_out: HeldOut,
    num_proc: int | None,
    progress: bool,
) -> list[dict[str, Any]]:
    """Each group's record: skipped when its shards are there, else tokenized."""
    progress_dir = out / "progress"
    _write_json(progress_dir / "settings.json", settings)
    records, todo, first = [], [], {"train": 0, "val": 0}
    for group in groups:
        record = _read_json(progress_dir / f"group_{group.index:06d}.json")
        if not todo and record is not None and _shards_intact(out, record):
            records.append(record)
            for split in SPLITS:
                first[split] += len(record[split])
        else:
            todo.append(group)
    if not todo:
        return records
    encoder = _Encoder(options, bounds, num_proc or _cores())
    meter = _Meter(progress)
    try:
        records += _tokenize(out, todo, options, bounds, held_out, encoder, first, meter)
    except BaseException:
        encoder.close(abort=True)
        raise
    finally:
        meter.finish()
    encoder.close(abort=False)
    return records


def _tokenize(
    out: Path,
    groups: list[Group],
    options: PrepareOptions,
    bounds: _Boundaries,
    held_out: HeldOut,
    encoder: _Encoder,
    first: dict[str, int],
    meter: _Meter,
) -> list[dict[str, Any]]:
    writers = {
        s: _ShardWriter(out, s, first[s], bounds.dtype, options.shard_tokens) for s in SPLITS
    }
    records, current = [], groups[0].index
    try:
        for (group_index, flags), (tokens, lengths, sizes) in encoder.map(
            _batches(groups, options, held_out)
        ):
            if group_index != current:
                records.append(_finish_group(out, current, writers))
                current = group_index
            tokens = tokens.astype(bounds.dtype, copy=False)  # once per batch, not per document
            starts = np.concatenate([[0], np.cumsum(lengths)])
            for i, is_val in enumerate(flags):
                writers["val" if is_val else "train"].add(
                    tokens[starts[i] : starts[i + 1]], int(sizes[i])
                )
            meter.update(len(flags), len(tokens))
        records.append(_finish_group(out, current, writers))
    except BaseException:
        for writer in writers.values():
            writer.abort()
        raise
    return records


def _batches(
    groups: list[Group], options: PrepareOptions, held_out: HeldOut
) -> Iterator[tuple[tuple[int, list[bool]], list[str]]]:
    """``((group, held out?), texts)`` batches of about 1 MiB of text; a batch never spans
    groups (an empty group still yields one empty batch)."""
    for group in groups:
        flags, texts, size = [], [], 0
        for source in group.sources:
            for ordinal, text in source.documents(options.read):
                if not text:
                    continue
                flags.append(held_out(source.label, ordinal))
                texts.append(text)
                size += len(text)
                if size >= _BATCH_CHARS:
                    yield (group.index, flags), texts
                    flags, texts, size = [], [], 0
        yield (group.index, flags), texts


def _finish_group(out: Path, index: int, writers: dict[str, _ShardWriter]) -> dict[str, Any]:
    record: dict[str, Any] = {"group": index}
    for split, writer in writers.items():
        writer.close()
        record[split] = writer.done
        writer.done = []
    _write_json(out / "progress" / f"group_{index:06d}.json", record)
    return record


def _shards_intact(out: Path, record: dict[str, Any]) -> bool:
    return all(
        (out / shard["file"]).is_file() and sha256_file(out / shard["file"]) == shard["sha256"]
        for split in SPLITS
        for shard in record[split]
    )


def _clean_up(out: Path, bad_input_in_fresh: bool, remove: bool) -> None:
    """After an error: no unfinished file left; after bad input into a folder that held
    nothing to keep, nothing of this run either (the folder too if this run made it). An
    interrupted or crashed run keeps its finished groups, to resume."""
    for path in [*out.glob(f"*{PARTIAL_SUFFIX}"), *out.glob(f"progress/*{PARTIAL_SUFFIX}")]:
        path.unlink(missing_ok=True)
    if bad_input_in_fresh:
        _clear(out)
        if remove and not any(out.iterdir()):
            out.rmdir()


def _meta(
    options: PrepareOptions,
    bounds: _Boundaries,
    settings: dict[str, Any],
    records: list[dict[str, Any]],
    command: list[str] | None,
) -> dict[str, Any]:
    splits = {}
    for split in SPLITS:
        shards = [shard for record in records for shard in record[split]]
        splits[split] = {
            "shards": shards,
            "tokens": sum(s["tokens"] for s in shards),
            "documents": sum(s["documents"] for s in shards),
            "text_bytes": sum(s["text_bytes"] for s in shards),
        }
    return {
        "format": FORMAT,
        "tokenizer": settings["tokenizer"],
        "vocab_size": bounds.vocab_size,
        "bos_id": bounds.bos_id,
        "eos_id": bounds.eos_id,
        "add_bos": bounds.add_bos,
        "add_eos": True,
        "token_dtype": bounds.dtype.name,
        "groups": [r["group"] for r in records],
        "splits": splits,
        "settings": settings,
        "command": shlex.join(command) if command else None,
    }


def merge(task_dirs: list[str | Path], out: str | Path) -> dict[str, Any]:
    """Join the ``meta.json`` of every task of one ``--num_tasks`` run into ``out``.

    Shards stay where the tasks wrote them; the merged ``meta.json`` names them by paths
    relative to ``out``. Refused unless the tasks are one run's (same settings but the
    task index) and every task is there once.
    """
    out = Path(out)
    metas = []
    for directory in task_dirs:
        meta = _read_json(Path(directory) / "meta.json")
        if meta is None or meta.get("format") != FORMAT:
            raise CorpusError(
                f"{directory}: no meta.json of `plugintrain prepare text`; run the task there"
                " first (a task still running has none yet)"
            )
        metas.append((Path(directory), meta))
    metas.sort(key=lambda item: item[1]["settings"]["task"]["index"])
    _check_tasks(metas)
    for directory, _ in metas:
        if directory.resolve() == out.resolve():
            raise CorpusError(
                f"--out {out}: is one of the tasks' folders; merge into a folder of its own"
                " (e.g. their parent)"
            )
    merged = dict(metas[0][1])
    merged["settings"] = {**merged["settings"], "task": {"index": 0, "of": 1}}
    merged["groups"] = [g for _, meta in metas for g in meta["groups"]]
    splits = {}
    for split in SPLITS:
        shards = []
        for directory, meta in metas:
            for shard in meta["splits"][split]["shards"]:
                path = os.path.relpath(directory.resolve() / shard["file"], out.resolve())
                shards.append({**shard, "file": Path(path).as_posix()})
        splits[split] = {
            "shards": shards,
            **{
                k: sum(m["splits"][split][k] for _, m in metas)
                for k in ("tokens", "documents", "text_bytes")
            },
        }
    merged["splits"] = splits
    merged["merged_from"] = [str(d) for d, _ in metas]
    merged["command"] = None  # the shards come from the tasks' commands:
    merged["task_commands"] = [meta["command"] for _, meta in metas]
    out.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(metas[0][0] / "token_bytes.npy", out / "token_bytes.npy")
    _write_json(out / "meta.json", merged)
    return merged


def _check_tasks(metas: list[tuple[Path, dict[str, Any]]]) -> None:
    first = metas[0][1]["settings"]
    count = first["task"]["of"]
    indices = [m["settings"]["task"]["index"] for _, m in metas]
    if indices != list(range(count)):
        missing = sorted(set(range(count)) - set(indices))
        raise CorpusError(
            f"the tasks given are {indices} of --num_tasks {count}; give every task's folder"
            f" once (missing: {missing})"
        )
    for directory, meta in metas:
        other = {k: v for k, v in meta["settings"].items() if k != "task"}
        if other != {k: v for k, v in first.items() if k != "task"}:
            raise CorpusError(
                f"{directory}: prepared with other settings than {metas[0][0]}; merge the tasks"
                " of one run"
            )


class _Meter:
    """Documents, tokens and tokens/s on stderr, about once a second."""

    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled
        self.start = self.last = time.perf_counter()
        self.documents = self.tokens = 0

    def update(self, documents: int, tokens: int) -> None:
        self.documents += documents
        self.tokens += tokens
        now = time.perf_counter()
        if self.enabled and now - self.last >= 1.0:
            self.last = now
            self._print("\r" if sys.stderr.isatty() else "\n")

    def _print(self, end: str) -> None:
        rate = self.tokens / max(time.perf_counter() - self.start, 1e-9)
        sys.stderr.write(
            f"prepare text: {self.documents:,} documents, {self.tokens:,} tokens,"
            f" {rate:,.0f} tokens/s{end}"
        )
        sys.stderr.flush()

    def finish(self) -> None:
        if self.enabled:
            self._print("\n")


def _cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def _read_json(path: Path) -> dict[str, Any] | None:
    if not path.is_file():
        return None
    return json.loads(path.read_text())


def _write_json(path: Path, data: dict[str, Any]) -> None:
    with atomic_open(path, shared=True) as f:
        f.write((json.dumps(data, indent=2) + "\n").encode())
