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

**Held-out split**, **all or nothing**: as ``prepare chat`` (a seeded hash of the pair;
every row read, encoded, checked and scored before ``DIR.partial`` is written and renamed
into place).
"""

from __future__ import annotations

import itertools
import multiprocessing
import sys
from collections import Counter
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

import numpy as np

from plugintrain.data.prepare.chat_formats import ChatDataError, read_chat_rows
from plugintrain.data.prepare.chat_prepare import (  # a chat folder's checks, split, writers
    SPLITS,
    TRUNCATE,
    check_options,
    check_out,
    held_out_key,
    show_legend,
    show_sequence,
    split_held_out,
    write_folder,
    write_jsonl,
    write_sequences,
)
from plugintrain.data.prepare.preference_formats import FORMATS, Pair, detect_layout, to_pair
from plugintrain.data.prepare.text_sources import ReadOptions
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
    {"meta.json", "val.pairs.jsonl"} | {f"{s}.{a}.npy" for s in SPLITS for a in ARRAYS}
)
"""Every file a preference folder may hold."""
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
) -> dict[str, Any]:
    """Encode the preference pairs of ``inputs`` into a preference folder ``out``.

    Args:
        inputs: What `chat_formats.read_chat_rows` reads.
        out: The folder to write.
        options: How to encode, fit and split.
        overwrite: Replace a preference folder already at ``out``.
        show: Print this many encoded pairs, answers marked, to stdout.
        reference: Score every kept sequence with it and write ``S.ref_logps.npy``.

    Returns:
        What ``meta.json`` records.

    Raises:
        ChatDataError, ChatTemplateError, CorpusError: For bad input or settings, before
            anything is written.
        FileExistsError: If ``out`` holds anything but a preference folder, or one without
            ``overwrite``.
    """
    _check_options(options)
    out = Path(out)
    check_out(out, overwrite, KIND, "preference pairs", FILES)
    tokenizer = get_tokenizer(options.tokenizer)
    encoder = ChatEncoder(tokenizer, load_chat_template(options.tokenizer, options.template))
    fmt, pairs = encode_rows(inputs, encoder, options, exclude=out)
    splits, labels = split_held_out(pairs, options.val_fraction, options.val_examples)
    meta = _meta(inputs, options, encoder, fmt, splits, reference)
    if show:
        show_pairs(pairs, labels, tokenizer, show, sys.stdout)
    scores = {s: _score(reference, _kept(p)) for s, p in splits.items()} if reference else {}
    write_folder(out, lambda folder: _write_splits(folder, splits, scores), meta)
    return meta


def _check_options(options: PreferencePrepareOptions) -> None:
    """The settings that are wrong whatever the input."""
    choices = {
        "--format": (options.format, ("auto", *FORMATS)),
        "--truncate": (options.truncate, TRUNCATE),
    }
    counts = {"--seq_len": options.seq_len, "--max_prompt": options.prompt_limit}
    counts |= {"--workers": options.workers}
    check_options(choices, counts, options.val_fraction, options.val_examples)


# -- encoding ---------------------------------------------------------------------------


def encode_rows(
    inputs: list[str],
    encoder: ChatEncoder,
    options: PreferencePrepareOptions,
    exclude: Path | None = None,
) -> tuple[str, list[EncodedPair]]:
    """Every row of ``inputs`` (but those in the folder ``exclude``) encoded and fitted to
    ``seq_len``, in order (by ``options.workers`` processes), and the row format.

    Raises:
        ChatDataError: For a row that is no pair of the format, or over ``seq_len`` with
            ``truncate="error"``.
        ChatTemplateError: For a pair the template refuses, named by its row.
    """
    rows = read_chat_rows(inputs, options.read, exclude)
    first = next(rows, None)
    if first is None:
        raise ChatDataError(f"{' '.join(inputs)}: holds no rows; give preference pairs")
    fmt = detect_layout(first[1], first[0]) if options.format == "auto" else options.format
    rows = itertools.chain([first], rows)
    if options.workers == 1:
        return fmt, [encode_pair(w, to_pair(row, fmt, w), encoder, options) for w, row in rows]
    chunks = iter(lambda: list(itertools.islice(rows, _CHUNK)), [])
    with ProcessPoolExecutor(
        options.workers,
        mp_context=multiprocessing.get_context("spawn"),  # never fork a threaded one
        initializer=_start_worker,
        initargs=(options,),
    ) as pool:
        encoded = pool.map(_encode_chunk, chunks, itertools.repeat(fmt))
        return fmt, [p for chunk in encoded for p in chunk]


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


def _meta(
    inputs: list[str],
    options: PreferencePrepareOptions,
    encoder: ChatEncoder,
    fmt: str,
    splits: dict[str, list[EncodedPair]],
    reference: Reference | None,
) -> dict[str, Any]:
    counts = {split: _counts(pairs) for split, pairs in splits.items()}
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


def _counts(pairs: list[EncodedPair]) -> dict[str, Any]:
    kept = _kept(pairs)
    sequences = [s for p in kept for s in p.sequences()]
    return {
        "pairs": len(kept),
        "tokens": sum(len(ids) for ids, _ in sequences),
        "targets": sum(int(mask.sum()) for _, mask in sequences),
        "prompts_truncated": sum(p.prompt_truncated for p in kept),
        "answers_truncated": sum(p.answers_truncated for p in kept),
        "dropped": dict(sorted(Counter(p.dropped for p in pairs if p.dropped).items())),
    }


# -- output -----------------------------------------------------------------------------


def _write_splits(
    folder: Path, splits: dict[str, list[EncodedPair]], scores: dict[str, np.ndarray]
) -> None:
    """Each split's sequences of the pairs kept, their reference log-probs (if scored), and
    the val pairs."""
    for split, pairs in splits.items():
        kept = _kept(pairs)
        write_sequences(folder, split, [s for p in kept for s in p.sequences()])
        if split in scores:
            np.save(folder / f"{split}.ref_logps.npy", scores[split])
        if split == "val":
            write_jsonl(folder / "val.pairs.jsonl", (_record(p.pair) for p in kept))


def _record(pair: Pair) -> dict[str, Any]:
    """The pair as ``val.pairs.jsonl`` holds it."""
    return {"prompt": pair.prompt, "chosen": pair.chosen, "rejected": pair.rejected}


def show_pairs(
    pairs: list[EncodedPair], splits: list[str], tokenizer: Any, count: int, stream: IO[str]
) -> None:
    """Print the first ``count`` pairs kept: each sequence's decoded text with the trained
    answer marked (see `chat_prepare.marked_text`), then ``{"ids", "mask"}`` as one JSON
    line."""
    color = show_legend(stream)
    shown = [(p, s) for p, s in zip(pairs, splits, strict=True) if p.dropped is None][:count]
    for pair, split in shown:
        cuts = [("prompt truncated", pair.prompt_truncated)]
        cuts.append((f"{pair.answers_truncated} answers truncated", pair.answers_truncated))
        notes = "".join(f", {what}" for what, done in cuts if done)
        stream.write(f"--- {pair.where} ({split}): prompt {len(pair.prompt)} tokens{notes}\n")
        for side, (ids, mask) in zip(("chosen", "rejected"), pair.sequences(), strict=True):
            show_sequence(stream, tokenizer, ids, mask, color, f"{side} ({len(ids)} tokens): ")
