"""``plugintrain prepare preference``: preference pairs (a prompt, a chosen and a rejected
answer) as token ids, with the mask of the answers' tokens, for DPO and its family.

The output folder (what ``PreferenceDataModule`` reads):

- ``meta.json``: ``kind`` ``"preference"``, ``version`` 1, the tokenizer, template, row
  format, ``settings``, ``eos_id``/``pad_id``/``stop_ids``, ``vocab_size``, each split's
  counts and ``reference`` (None, or the weights the reference log-probs came from).
- per split ``S`` of ``train`` and ``val``: ``S.ids.npy`` (uint32, every sequence back to
  back), ``S.mask.npy`` (uint8, 1 on the answer's tokens) and ``S.offsets.npy`` (int64,
  the ``2n + 1`` sequence starts): sequence ``2i`` is pair ``i``'s prompt + chosen answer,
  ``2i + 1`` its prompt + rejected answer; with ``--reference``, ``S.ref_logps.npy``
  (float64, ``2n``): each sequence's summed log-prob of its answer tokens under the
  reference model.
- ``val.pairs.jsonl``: each val pair's ``{"prompt": [messages], "chosen", "rejected"}``.

**Rendering.** Each answer is rendered after the prompt through the chat template, as
``prepare chat --train_on completion`` renders a conversation: the mask covers the final
assistant answer through its stop token. The two sequences of a pair must start with the
same prompt tokens (those before the first masked one).

**Truncation.** A pair whose prompt and longer answer hold more than ``seq_len`` tokens:
``right``: the prompt is first cut from the left to its last ``max_prompt`` tokens (if it
is longer), then each answer is cut from the right to the ``seq_len`` left; a pair whose
prompt leaves no token of answer is dropped. ``drop``: the pair is dropped. ``error``:
the input is refused. ``meta.json`` counts per split the pairs whose prompt was cut
(``prompts_truncated``), the answers cut (``answers_truncated``, up to two a pair) and the
pairs dropped by reason.

**Held-out split**: as ``prepare chat``'s, a seeded hash of the pair's prompt, so every
pair of a prompt lands in one split.

**Shards, resumption, tasks** (:mod:`~plugintrain.data.prepare.preference_shards`): the
rows are encoded and scored in shards of ``shard_pairs``, kept in ``DIR.progress`` as they
finish; a rerun of the same settings resumes, ``num_tasks`` tasks share the shards, and the
run that holds them all assembles ``DIR`` (the split decided then), the same bytes
however the work was cut. **All or nothing**: ``DIR`` is written as ``DIR.partial`` and
renamed into place once every shard is encoded, checked and scored; bad input found in a
fresh run removes ``DIR.progress`` too.
"""

from __future__ import annotations

import itertools
import multiprocessing
import sys
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

import numpy as np

from plugintrain.core.atomic_files import remove
from plugintrain.data.prepare import preference_shards as shards
from plugintrain.data.prepare.chat_formats import ChatDataError, read_chat_rows
from plugintrain.data.prepare.chat_prepare import (  # a chat folder's checks, split, writers
    SPLITS,
    TRUNCATE,
    check_options,
    check_out,
    held_out_key,
    held_out_mask,
    show_legend,
    show_sequence,
    write_folder,
)
from plugintrain.data.prepare.preference_formats import FORMATS, Pair, detect_layout, to_pair
from plugintrain.data.prepare.text_sources import ReadOptions, expand_inputs
from plugintrain.data.tokenizers.chat_templates import (
    ChatEncoder,
    ChatTemplateError,
    load_chat_template,
)
from plugintrain.data.tokenizers.registry import get_tokenizer, tokenizer_spec

KIND = "preference"
"""``meta.json``'s ``kind`` in a folder of ``prepare preference``."""
VERSION = 1
ARRAYS = ("ids", "mask", "offsets", "ref_logps")
FILES = frozenset(
    {"meta.json", "val.pairs.jsonl", "reference_cache"}
    | {f"{s}.{a}.npy" for s in SPLITS for a in ARRAYS}
)
"""Every file a preference folder may hold (``reference_cache``: a training run's first
pass, which a rebuilt folder drops)."""
_CHUNK = 64  # rows a worker encodes per task

Sequences = list[tuple[np.ndarray, np.ndarray]]
"""``(ids, mask)`` of each sequence, as the reference scores them."""


@dataclass(frozen=True)
class PreferencePrepareOptions:
    """Everything that decides what ``prepare preference`` writes.

    Attributes:
        tokenizer: A `get_tokenizer` spec.
        template: None: the tokenizer's own chat template; ``"plain"``; or a Jinja file.
        format: ``"auto"`` (told by the first row) or one of `preference_formats.FORMATS`.
        seq_len: Most tokens of one sequence (prompt and answer).
        max_prompt: Most prompt tokens kept when a pair is cut (None: ``seq_len // 2``).
        truncate: A pair over ``seq_len``: ``right``, ``drop`` or ``error`` (module
            docstring).
        val_fraction: Share of pairs held out, by hash.
        val_examples: Exactly this many pairs held out instead (the smallest hashes).
        seed: Seed of the held-out split's hash.
        workers: Processes encoding rows (1: this one); the output is the same.
        shard_pairs: Rows a shard holds: the unit of resumption and of tasks (the output
            is the same whatever it is).
        read: The split and configuration of ``hf:NAME`` inputs.
    """

    tokenizer: str
    template: str | None = None
    format: str = "auto"
    seq_len: int = 1024
    max_prompt: int | None = None
    truncate: str = "right"
    val_fraction: float = 0.01
    val_examples: int | None = None
    seed: int = 0
    workers: int = 1
    shard_pairs: int = 4096
    read: ReadOptions = field(default_factory=ReadOptions)

    @property
    def prompt_limit(self) -> int:
        """``max_prompt``, its default filled in."""
        return self.seq_len // 2 if self.max_prompt is None else self.max_prompt


@dataclass(frozen=True)
class Reference:
    """The reference model that scores the sequences before they are written.

    Attributes:
        weights: What ``meta.json`` records (the ``--reference`` spec).
        logps: ``(ids, mask)`` of each sequence -> its float64 summed log-probs of the
            masked tokens.
    """

    weights: str
    logps: Callable[[Sequences], np.ndarray]


@dataclass
class EncodedPair:
    """One pair, encoded: the shared prompt ids, then each answer's ids and mask."""

    where: str
    pair: Pair
    prompt: np.ndarray  # (P,) int64
    answers: list[tuple[np.ndarray, np.ndarray]]  # chosen, rejected: (A,) int64, (A,) bool
    key: float  # its held-out hash in [0, 1)
    prompt_truncated: bool = False
    answers_truncated: int = 0
    dropped: str | None = None  # why, if it was

    def sequences(self) -> Sequences:
        """``(ids, mask)`` of prompt + chosen, then prompt + rejected."""
        none = np.zeros(len(self.prompt), dtype=bool)
        return [
            (np.concatenate([self.prompt, ids]), np.concatenate([none, mask]))
            for ids, mask in self.answers
        ]


def prepare_preference(
    inputs: list[str],
    out: str | Path,
    options: PreferencePrepareOptions,
    overwrite: bool = False,
    show: int = 0,
    reference: Reference | None = None,
    num_tasks: int = 1,
    task_index: int = 0,
) -> dict[str, Any]:
    """Encode the preference pairs of ``inputs`` into a preference folder ``out``, shard by
    shard, resuming a run of the same settings (`preference_shards`).

    Args:
        inputs: What `chat_formats.read_chat_rows` reads.
        out: The folder to write.
        options: How to encode, fit and split.
        overwrite: Replace a preference folder already at ``out`` (and a progress folder of
            other settings).
        show: Print this many encoded pairs, answers marked, to stdout.
        reference: Score every kept sequence with it and write ``S.ref_logps.npy``.
        num_tasks: Share the shards among this many tasks (runs of the same command).
        task_index: This task's: the shards ``k`` with ``k % num_tasks == task_index``.

    Returns:
        What ``meta.json`` records; with ``num_tasks > 1``, what this task did (``task``,
        ``shards``, ``encoded``: those it encoded now), ``out`` left to a run without.

    Raises:
        ChatDataError, ChatTemplateError, CorpusError: For bad input or settings, before
            ``out`` is touched (a fresh run leaves no progress folder either).
        FileExistsError: If ``out`` holds anything but a preference folder, or one without
            ``overwrite``; or its progress folder is of other settings.
    """
    _check_options(options, num_tasks, task_index)
    out = Path(out)
    check_out(out, overwrite, KIND, "preference pairs", FILES)
    tokenizer = get_tokenizer(options.tokenizer)
    encoder = ChatEncoder(tokenizer, load_chat_template(options.tokenizer, options.template))
    sources = expand_inputs(inputs, exclude=out)
    settings = _settings(options, encoder, sources, reference)
    folder, fresh = shards.open_progress(out, settings, overwrite)
    run = _Run(folder, shards.settings_digest(settings), (num_tasks, task_index))
    try:
        fmt, count, encoded = _encode_shards(inputs, out, encoder, options, reference, run)
        if num_tasks > 1:
            return {"task": [task_index, num_tasks], "shards": count, "encoded": encoded}
        meta = _assemble(out, run, count, options, encoder, fmt, inputs, reference, show)
    except (ChatDataError, ChatTemplateError, ValueError):
        if fresh and num_tasks == 1:  # bad input: nothing of this run is left (tasks share it)
            remove(folder)
        raise
    remove(folder)
    return meta


@dataclass(frozen=True)
class _Run:
    """Where a run keeps its shards, the digest of its settings, and its ``(num_tasks,
    task_index)``."""

    folder: Path
    digest: str
    task: tuple[int, int]


def _check_options(options: PreferencePrepareOptions, num_tasks: int, task_index: int) -> None:
    """The settings that are wrong whatever the input."""
    choices = {
        "--format": (options.format, ("auto", *FORMATS)),
        "--truncate": (options.truncate, TRUNCATE),
    }
    counts = {"--seq_len": options.seq_len, "--max_prompt": options.prompt_limit}
    counts |= {"--workers": options.workers, "--shard_pairs": options.shard_pairs}
    counts |= {"--num_tasks": num_tasks}
    check_options(choices, counts, options.val_fraction, options.val_examples)
    if not 0 <= task_index < num_tasks:
        raise ChatDataError(
            f"--task_index {task_index}: must be in [0, {num_tasks}) for --num_tasks {num_tasks}"
        )


def _settings(
    options: PreferencePrepareOptions,
    encoder: ChatEncoder,
    sources: list[Any],
    reference: Reference | None,
) -> dict[str, Any]:
    """What decides the shards' bytes (a resumed run or another task must match it): not
    the held-out split's settings, which only the assembly reads."""
    return {
        "tokenizer": tokenizer_spec(options.tokenizer),
        "template": encoder.template.sha256,
        "format": options.format,
        "seq_len": options.seq_len,
        "max_prompt": options.prompt_limit,
        "truncate": options.truncate,
        "seed": options.seed,
        "read": [options.read.split, options.read.hub_config, options.read.errors],
        "shard_pairs": options.shard_pairs,
        "sources": [_fingerprint(source) for source in sources],
        "reference": None if reference is None else reference.weights,
    }


def _fingerprint(source: Any) -> list[Any]:
    """A source as the settings name it: its label, size and (a file's) modification time
    (a hub dataset: its name alone; its revision is the hub's cache's)."""
    path = source.path
    changed = path.stat().st_mtime_ns if path is not None and path.exists() else None
    return [source.label, source.size, changed]


# -- encoding ---------------------------------------------------------------------------


def _encode_shards(
    inputs: list[str],
    out: Path,
    encoder: ChatEncoder,
    options: PreferencePrepareOptions,
    reference: Reference | None,
    run: _Run,
) -> tuple[str, int, int]:
    """Encode, score and write each shard of this task not finished yet (by
    ``options.workers`` processes); the row format, the input's shards and how many were
    encoded now.

    Raises:
        ChatDataError: For a row that is no pair of the format, or over ``seq_len`` with
            ``truncate="error"``.
        ChatTemplateError: For a pair the template refuses, named by its row.
    """
    rows = read_chat_rows(inputs, options.read, exclude=out)
    first = next(rows, None)
    if first is None:
        raise ChatDataError(f"{' '.join(inputs)}: holds no rows; give preference pairs")
    fmt = detect_layout(first[1], first[0]) if options.format == "auto" else options.format
    num_tasks, task_index = run.task
    count = encoded = 0
    with _Encoder(encoder, options, fmt) as encode:
        for index, part in shards.shards_of(itertools.chain([first], rows), options.shard_pairs):
            count = index + 1
            if index % num_tasks != task_index or shards.is_finished(run.folder, index, run.digest):
                continue
            pairs = encode(part)
            scores = _score(reference, _kept(pairs)) if reference is not None else None
            shards.write_shard(run.folder, index, pairs, scores, run.digest)
            encoded += 1
    return fmt, count, encoded


class _Encoder:
    """Rows -> ``EncodedPair``s, in order: here, or by a pool of ``options.workers``
    processes (started once, for every shard)."""

    def __init__(self, encoder: ChatEncoder, options: PreferencePrepareOptions, fmt: str) -> None:
        self.encoder, self.options, self.fmt = encoder, options, fmt
        self.pool: ProcessPoolExecutor | None = None

    def __enter__(self) -> _Encoder:
        if self.options.workers > 1:
            self.pool = ProcessPoolExecutor(
                self.options.workers,
                mp_context=multiprocessing.get_context("spawn"),  # never fork a threaded one
                initializer=_start_worker,
                initargs=(self.options,),
            )
        return self

    def __exit__(self, *exc: object) -> None:
        if self.pool is not None:
            self.pool.shutdown(cancel_futures=True)

    def __call__(self, rows: list[tuple[str, Any]]) -> list[EncodedPair]:
        if self.pool is None:
            return [
                encode_pair(w, to_pair(r, self.fmt, w), self.encoder, self.options) for w, r in rows
            ]
        chunks = [rows[start : start + _CHUNK] for start in range(0, len(rows), _CHUNK)]
        encoded = self.pool.map(_encode_chunk, chunks, itertools.repeat(self.fmt))
        return [pair for chunk in encoded for pair in chunk]


_worker: tuple[ChatEncoder, PreferencePrepareOptions] | None = None
"""A worker process's encoder and options (set by `_start_worker`)."""


def _start_worker(options: PreferencePrepareOptions) -> None:
    global _worker
    encoder = ChatEncoder(
        get_tokenizer(options.tokenizer), load_chat_template(options.tokenizer, options.template)
    )
    _worker = (encoder, options)


def _encode_chunk(rows: list[tuple[str, Any]], fmt: str) -> list[EncodedPair]:
    assert _worker is not None, "call _start_worker first"
    encoder, options = _worker
    return [encode_pair(where, to_pair(row, fmt, where), encoder, options) for where, row in rows]


def encode_pair(
    where: str, pair: Pair, encoder: ChatEncoder, options: PreferencePrepareOptions
) -> EncodedPair:
    """``pair`` rendered with each answer, checked to share its prompt tokens, and fitted
    to ``options.seq_len``.

    Raises:
        ChatDataError: If the two renderings start with different prompt tokens, or the
            pair is too long and ``truncate="error"``.
        ChatTemplateError: If the template refuses the pair.
    """
    encoded = []
    for answer in (pair.chosen, pair.rejected):
        try:
            ids, mask = encoder.encode(
                [*pair.prompt, {"role": "assistant", "content": answer}], "completion"
            )
        except ChatTemplateError as error:
            raise ChatTemplateError(f"{where}: {error}") from None
        encoded.append((ids, mask, int(np.argmax(mask))))
    (chosen, _, start), (rejected, _, other) = encoded
    if start != other or not np.array_equal(chosen[:start], rejected[:other]):
        raise ChatDataError(
            f"{where}: the chat template ({encoder.template.origin}) renders the prompt"
            " differently before the chosen and the rejected answer, so they share no prompt"
            " tokens; pass another --template"
        )
    answers = [(ids[start:], mask[start:]) for ids, mask, _ in encoded]
    key = held_out_key(pair.prompt, options.seed)  # a prompt's pairs stay in one split
    return _fit(EncodedPair(where, pair, chosen[:start], answers, key), options)


def _fit(pair: EncodedPair, options: PreferencePrepareOptions) -> EncodedPair:
    """``pair`` within ``seq_len`` tokens a sequence, as ``truncate`` says."""
    longer = max(len(ids) for ids, _ in pair.answers)
    length, limit = len(pair.prompt) + longer, options.seq_len
    if length <= limit:
        return pair
    if options.truncate == "error":
        raise ChatDataError(
            f"{pair.where}: {length} tokens (prompt {len(pair.prompt)} + longer answer"
            f" {longer}), over --seq_len {limit}; raise --seq_len, or pass --truncate right"
            " (cut the prompt's start, then the answers' ends) or --truncate drop"
        )
    if options.truncate == "drop":
        pair.dropped = "too_long"
        return pair
    if len(pair.prompt) > options.prompt_limit:
        pair.prompt = pair.prompt[len(pair.prompt) - options.prompt_limit :]
        pair.prompt_truncated = True
    room = limit - len(pair.prompt)
    if room < 1:
        pair.dropped = "prompt_fills_seq_len"
        return pair
    pair.answers_truncated = sum(len(ids) > room for ids, _ in pair.answers)
    pair.answers = [(ids[:room], mask[:room]) for ids, mask in pair.answers]
    (chosen, _), (rejected, _) = pair.answers
    if np.array_equal(chosen, rejected):  # the answers differed only past the cut
        pair.dropped = "same_after_truncation"
    return pair


def _kept(pairs: list[EncodedPair]) -> list[EncodedPair]:
    return [p for p in pairs if p.dropped is None]


def _score(reference: Reference, pairs: list[EncodedPair]) -> np.ndarray:
    """The reference's log-prob of each sequence, ``(2n,)`` float64, checked."""
    sequences = [s for p in pairs for s in p.sequences()]
    scores = np.asarray(reference.logps(sequences) if sequences else [], dtype=np.float64)
    if scores.shape != (len(sequences),) or not np.isfinite(scores).all():
        raise ChatDataError(
            f"--reference {reference.weights}: scored {len(sequences)} sequences with"
            f" {scores.shape} values{'' if np.isfinite(scores).all() else ' (not all finite)'};"
            " check that the weights load and read this tokenizer's ids"
        )
    return scores


# -- output -----------------------------------------------------------------------------


def _assemble(
    out: Path,
    run: _Run,
    count: int,
    options: PreferencePrepareOptions,
    encoder: ChatEncoder,
    fmt: str,
    inputs: list[str],
    reference: Reference | None,
    show: int,
) -> dict[str, Any]:
    """The output folder from the ``count`` finished shards of ``run``: the held-out
    split over every pair, the splits' arrays, ``val.pairs.jsonl`` and ``meta.json``.

    Raises:
        ChatDataError: If the split leaves no pair to train on.
    """
    folder = run.folder
    unfinished = [k for k in range(count) if not shards.is_finished(folder, k, run.digest)]
    if unfinished:  # another task's, still running or stopped
        raise ChatDataError(
            f"{folder}: {len(unfinished)} of {count} shards are not encoded (first: shard"
            f" {unfinished[0]}); run the tasks that own them, or rerun without --num_tasks to"
            " encode them here"
        )
    assembly = shards.Assembly.read(folder, count)
    held_out = held_out_mask(
        assembly.keys, assembly.dropped > 0, options.val_fraction, options.val_examples
    )
    meta = _meta(inputs, options, encoder, fmt, assembly.counts(held_out), reference)
    if show:
        show_pairs(assembly, held_out, encoder.tokenizer, show, sys.stdout)
    write_folder(
        out, lambda staging: assembly.write(staging, held_out, reference is not None), meta
    )
    return meta


def _meta(
    inputs: list[str],
    options: PreferencePrepareOptions,
    encoder: ChatEncoder,
    fmt: str,
    counts: dict[str, dict[str, Any]],
    reference: Reference | None,
) -> dict[str, Any]:
    if not counts["train"]["pairs"]:
        raise ChatDataError(
            f"{' '.join(inputs)}: no pair is left to train on (dropped: over --seq_len, or"
            " held out); raise --seq_len, or hold out fewer"
        )
    tokenizer, template = encoder.tokenizer, encoder.template
    settings = {
        "seq_len": options.seq_len,
        "max_prompt": options.prompt_limit,
        "truncate": options.truncate,
        "val_fraction": options.val_fraction,
        "val_examples": options.val_examples,
        "seed": options.seed,
    }
    return {
        "kind": KIND,
        "version": VERSION,
        "tokenizer": tokenizer_spec(options.tokenizer),
        "vocab_size": tokenizer.vocab_size,
        "template": {"origin": template.origin, "sha256": template.sha256},
        "format": fmt,
        "settings": settings,
        "eos_id": tokenizer.eos_id,
        "pad_id": tokenizer.eos_id,
        "stop_ids": encoder.stop_ids,
        "inputs": list(inputs),
        "splits": counts,
        "reference": None if reference is None else {"weights": reference.weights},
    }


def show_pairs(
    assembly: shards.Assembly, held_out: np.ndarray, tokenizer: Any, count: int, stream: IO[str]
) -> None:
    """Print the first ``count`` pairs kept: each sequence's decoded text with the trained
    answer marked (see `chat_prepare.marked_text`), then ``{"ids", "mask"}`` as one JSON
    line."""
    color = show_legend(stream)
    for index, where, prompt, sequences in assembly.first_kept(count):
        split = "val" if held_out[index] else "train"
        cuts = [("prompt truncated", assembly.prompt_truncated[index])]
        answers = int(assembly.answers_truncated[index])
        cuts.append((f"{answers} answers truncated", answers))
        notes = "".join(f", {what}" for what, done in cuts if done)
        stream.write(f"--- {where} ({split}): prompt {prompt} tokens{notes}\n")
        for side, (ids, mask) in zip(("chosen", "rejected"), sequences, strict=True):
            show_sequence(
                stream, tokenizer, ids, mask.astype(bool), color, f"{side} ({len(ids)} tokens): "
            )
