"""``plugintrain prepare chat``: conversations as token ids, with the mask of the tokens
trained on, for supervised fine-tuning.

The output folder (what ``ChatDataModule`` and ``plugintrain evaluate`` read):

- ``meta.json``: ``kind`` ``"chat"``, ``version`` 1, the tokenizer, template, settings and
  ``eos_id``/``pad_id``/``stop_ids``, and each split's counts.
- per split ``S`` of ``train`` and ``val``: ``S.ids.npy`` (uint32, every example's ids
  back to back), ``S.mask.npy`` (uint8, 1 where the token is a training target) and
  ``S.offsets.npy`` (int64, the ``n + 1`` example starts);
- ``val.messages.jsonl``: each val example's messages, in the same order, so answers can
  be generated against the final assistant turn.

**Held-out split.** An example is held out by a hash of its seed and its messages, so the
split does not depend on the rows' order, the row format or the tokenizer, and copies of
one conversation land in the same split.

**All or nothing.** Every row is read and encoded in memory before anything is written,
so bad input is reported before ``--out`` is touched; the folder is written as
``DIR.partial`` and renamed into place.

``prepare preference`` writes the same arrays (two sequences a pair) and shares this
module's option and ``--out`` checks, held-out split, writers and ``--show`` printing.
"""

from __future__ import annotations

import hashlib
import json
import sys
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any, Protocol, TypeVar

import numpy as np

from plugintrain.core.atomic_files import PARTIAL_SUFFIX, fsync_tree, publish, remove, sibling
from plugintrain.data.prepare.chat_formats import (
    FORMATS,
    ChatDataError,
    detect_format,
    read_chat_rows,
    to_messages,
)
from plugintrain.data.prepare.corpus import FORMAT as TEXT_FORMAT
from plugintrain.data.prepare.text_sources import ReadOptions
from plugintrain.data.tokenizers.chat_templates import (
    TRAIN_ON,
    ChatEncoder,
    ChatTemplateError,
    load_chat_template,
)
from plugintrain.data.tokenizers.registry import get_tokenizer, tokenizer_spec

KIND = "chat"
"""``meta.json``'s ``kind`` in a folder of ``prepare chat``."""
VERSION = 1
SPLITS = ("train", "val")
TRUNCATE = ("right", "drop", "error")
FILES = frozenset(
    {"meta.json", "val.messages.jsonl"}
    | {f"{split}.{array}.npy" for split in SPLITS for array in ("ids", "mask", "offsets")}
)
"""Every file a chat folder holds."""
_OPEN, _CLOSE = "\u27e6", "\u27e7"  # ⟦ ⟧ around trained text where colour cannot show


@dataclass(frozen=True)
class ChatPrepareOptions:
    """Everything that decides what ``prepare chat`` writes.

    Attributes:
        tokenizer: A `get_tokenizer` spec.
        template: None: the tokenizer's own chat template; ``"plain"``; or a Jinja file.
        format: ``"auto"`` (told by the first row) or one of `chat_formats.FORMATS`.
        train_on: ``assistant``, ``completion`` or ``all`` (see `ChatEncoder.encode`).
        seq_len: Most tokens of one example.
        pack: Whether the data module packs several examples per row (recorded only).
        truncate: An example over ``seq_len``: ``right`` cuts its end (dropped if no
            target is left), ``drop`` drops it, ``error`` refuses the input.
        val_fraction: Share of examples held out, by hash.
        val_examples: Exactly this many held out instead (the smallest hashes).
        seed: Seed of the held-out split's hash.
        read: The split and configuration of ``hf:NAME`` inputs.
    """

    tokenizer: str
    template: str | None = None
    format: str = "auto"
    train_on: str = "assistant"
    seq_len: int = 2048
    pack: bool = True
    truncate: str = "right"
    val_fraction: float = 0.01
    val_examples: int | None = None
    seed: int = 0
    read: ReadOptions = field(default_factory=ReadOptions)


@dataclass
class ChatExample:
    """One conversation, encoded."""

    where: str
    messages: list[dict[str, str]]
    ids: np.ndarray  # (n,) int64
    mask: np.ndarray  # (n,) bool, True: a training target
    key: float  # its held-out hash in [0, 1)
    truncated: bool = False
    dropped: bool = False


def prepare_chat(
    inputs: list[str],
    out: str | Path,
    options: ChatPrepareOptions,
    overwrite: bool = False,
    show: int = 0,
) -> dict[str, Any]:
    """Encode the conversations of ``inputs`` into a chat folder ``out``.

    Args:
        inputs: What `chat_formats.read_chat_rows` reads.
        out: The folder to write.
        options: How to encode and split.
        overwrite: Replace a chat folder already at ``out``.
        show: Print this many encoded examples, trained text marked, to stdout.

    Returns:
        What ``meta.json`` records.

    Raises:
        ChatDataError, ChatTemplateError, CorpusError: For bad input or settings, before
            anything is written.
        FileExistsError: If ``out`` holds anything but a chat folder, or a chat folder
            without ``overwrite``.
    """
    _check_options(options)
    out = Path(out)
    _check_out(out, overwrite)
    tokenizer = get_tokenizer(options.tokenizer)
    encoder = ChatEncoder(tokenizer, load_chat_template(options.tokenizer, options.template))
    fmt, examples = encode_rows(inputs, encoder, options, exclude=out)
    splits, labels = split_held_out(examples, options.val_fraction, options.val_examples)
    meta = _meta(inputs, options, encoder, fmt, splits)
    if show:
        show_examples(examples, labels, tokenizer, show, sys.stdout)
    write_folder(out, lambda folder: _write_splits(folder, splits), meta)
    return meta


def _check_options(options: ChatPrepareOptions) -> None:
    """The settings that are wrong whatever the input."""
    choices = {
        "--format": (options.format, ("auto", *FORMATS)),
        "--train_on": (options.train_on, TRAIN_ON),
        "--truncate": (options.truncate, TRUNCATE),
    }
    counts = {"--seq_len": options.seq_len}
    check_options(choices, counts, options.val_fraction, options.val_examples)


def check_options(
    choices: dict[str, tuple[str, Sequence[str]]],
    counts: dict[str, int],
    val_fraction: float,
    val_examples: int | None,
) -> None:
    """The checks of settings that ``prepare chat`` and ``prepare preference`` share.

    Args:
        choices: Each flag's value and the values it may take.
        counts: Each flag's value, which must be at least 1.
        val_fraction: ``--val_fraction``, in [0, 1).
        val_examples: ``--val_examples``, None or at least 1.

    Raises:
        ChatDataError: Naming the first flag that is wrong, in that order.
    """
    for flag, (value, allowed) in choices.items():
        if value not in allowed:
            raise ChatDataError(f"{flag} {value}: choose one of {', '.join(allowed)}")
    for flag, count in counts.items():
        if count < 1:
            raise ChatDataError(f"{flag} {count}: must be >= 1")
    if not 0 <= val_fraction < 1:
        raise ChatDataError(f"--val_fraction {val_fraction}: must be in [0, 1)")
    if val_examples is not None and val_examples < 1:
        raise ChatDataError(f"--val_examples {val_examples}: must be >= 1")


def _check_out(out: Path, overwrite: bool) -> None:
    """Refuse an ``out`` of text shards, or one whose files this run would lose."""
    if _read_meta(out).get("format") == TEXT_FORMAT:
        raise FileExistsError(
            f"--out {out}: holds text prepared by `plugintrain prepare text`; write chat data"
            " to a folder of its own"
        )
    check_out(out, overwrite, KIND, "chat data", FILES)


def check_out(out: Path, overwrite: bool, kind: str, holds: str, files: frozenset[str]) -> None:
    """Refuse an ``out`` whose files a run of ``plugintrain prepare KIND`` would lose.

    Args:
        out: The folder to write.
        overwrite: Whether a folder of ``kind`` may be rebuilt.
        kind: The command, and ``meta.json``'s ``kind`` in the folders it writes.
        holds: What those folders hold, in words (``"chat data"``).
        files: Every file those folders may hold.

    Raises:
        FileExistsError: If ``out`` is a file, holds other data or other files, or holds a
            folder of ``kind`` and ``overwrite`` is not given.
    """
    if out.is_file():
        raise FileExistsError(f"--out {out}: is a file; choose a folder")
    entries = sorted(p.name for p in out.iterdir()) if out.is_dir() else []
    if not entries:
        return
    if _read_meta(out).get("kind") != kind:
        raise FileExistsError(
            f"--out {out}: is not empty and holds no {holds} of `plugintrain prepare {kind}`;"
            " choose a new or empty folder"
        )
    others = [name for name in entries if name not in files]
    if others:
        raise FileExistsError(
            f"--out {out}: holds {holds} and other files ({', '.join(others[:5])}), which"
            " rebuilding it would lose; move them out, or choose another --out"
        )
    if not overwrite:
        raise FileExistsError(
            f"--out {out}: holds {holds} already; add --overwrite to rebuild it, or choose"
            " another --out"
        )


def _read_meta(folder: Path) -> dict[str, Any]:
    try:
        meta = json.loads((folder / "meta.json").read_text())
    except (OSError, ValueError):  # absent, unreadable or not JSON: no folder of ours
        return {}
    return meta if isinstance(meta, dict) else {}


# -- encoding ---------------------------------------------------------------------------


def encode_rows(
    inputs: list[str],
    encoder: ChatEncoder,
    options: ChatPrepareOptions,
    exclude: Path | None = None,
) -> tuple[str, list[ChatExample]]:
    """Every row of ``inputs`` (but those in the folder ``exclude``) encoded and fitted to
    ``seq_len``, and the row format.

    Raises:
        ChatDataError: For a row that is no conversation of the format, or over
            ``seq_len`` with ``truncate="error"``.
        ChatTemplateError: For a conversation the template refuses, named by its row.
    """
    fmt, examples = options.format, []
    for where, row in read_chat_rows(inputs, options.read, exclude):
        if fmt == "auto":
            fmt = detect_format(row, where)
        messages = to_messages(row, fmt, where)
        try:
            ids, mask = encoder.encode(messages, options.train_on)
        except ChatTemplateError as error:
            raise ChatTemplateError(f"{where}: {error}") from None
        example = ChatExample(where, messages, ids, mask, held_out_key(messages, options.seed))
        examples.append(_fit(example, options))
    if not examples:
        raise ChatDataError(f"{' '.join(inputs)}: holds no rows; give conversations to train on")
    return fmt, examples


def held_out_key(record: Any, seed: int) -> float:
    """The held-out hash of ``record`` (a conversation's messages, a preference pair), in
    [0, 1)."""
    text = json.dumps(record, ensure_ascii=False, sort_keys=True)
    digest = hashlib.blake2b(f"{seed}\0{text}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") / 2**64


def _fit(example: ChatExample, options: ChatPrepareOptions) -> ChatExample:
    """``example`` within ``seq_len`` tokens, as ``truncate`` says."""
    length, limit = len(example.ids), options.seq_len
    if length <= limit:
        return example
    if options.truncate == "error":
        raise ChatDataError(
            f"{example.where}: {length} tokens, over --seq_len {limit}; raise --seq_len, or"
            " pass --truncate right (cut its end) or --truncate drop"
        )
    if options.truncate == "drop":
        example.dropped = True
        return example
    example.ids, example.mask = example.ids[:limit], example.mask[:limit]
    example.truncated = True
    example.dropped = not example.mask.any()  # cut before its first target
    return example


class Keyed(Protocol):
    """An encoded example (a conversation, a pair), as the held-out split reads it."""

    @property
    def key(self) -> float:
        """Its held-out hash (`held_out_key`), in [0, 1)."""

    @property
    def dropped(self) -> Any:
        """Truthy if it is not written (over ``seq_len``)."""


_Example = TypeVar("_Example", bound=Keyed)


def split_held_out(
    examples: list[_Example], val_fraction: float, val_examples: int | None
) -> tuple[dict[str, list[_Example]], list[str]]:
    """The examples of each split (`SPLITS`), and each example's split, held out by hash.

    Raises:
        ChatDataError: If ``val_examples`` leaves no example to train on.
    """
    held_out = _held_out(examples, val_fraction, val_examples)
    labels = ["val" if val else "train" for val in held_out]
    splits = {
        split: [e for e, label in zip(examples, labels, strict=True) if label == split]
        for split in SPLITS
    }
    return splits, labels


def _held_out(examples: list[Keyed], val_fraction: float, val_examples: int | None) -> list[bool]:
    """Whether each example is held out."""
    keys = np.array([e.key for e in examples], dtype=np.float64)
    dropped = np.array([bool(e.dropped) for e in examples], dtype=bool)
    return held_out_mask(keys, dropped, val_fraction, val_examples).tolist()


def held_out_mask(
    keys: np.ndarray, dropped: np.ndarray, val_fraction: float, val_examples: int | None
) -> np.ndarray:
    """Whether each example of held-out hashes ``keys`` (`held_out_key`) is held out:
    ``val_fraction``'s share by hash, or the ``val_examples`` smallest hashes of those not
    ``dropped`` (and every example of the same hash: copies go together).

    Raises:
        ChatDataError: If ``val_examples`` leaves no example to train on.
    """
    if val_examples is None:
        return keys < val_fraction
    kept = np.sort(keys[~dropped])
    if val_examples >= len(kept):
        raise ChatDataError(
            f"--val_examples {val_examples}: the input holds {len(kept)} examples"
            f" (after fitting to --seq_len); hold out fewer (at most {max(len(kept) - 1, 0)},"
            " so that one is left to train on)"
        )
    return keys <= kept[val_examples - 1]


def _meta(
    inputs: list[str],
    options: ChatPrepareOptions,
    encoder: ChatEncoder,
    fmt: str,
    splits: dict[str, list[ChatExample]],
) -> dict[str, Any]:
    counts = {split: _counts(examples) for split, examples in splits.items()}
    if not counts["train"]["examples"]:
        raise ChatDataError(
            f"{' '.join(inputs)}: no example is left to train on (dropped: over --seq_len,"
            " or held out); raise --seq_len, or hold out fewer"
        )
    tokenizer, template = encoder.tokenizer, encoder.template
    return {
        "kind": KIND,
        "version": VERSION,
        "tokenizer": tokenizer_spec(options.tokenizer),
        "vocab_size": tokenizer.vocab_size,
        "seq_len": options.seq_len,
        "pack": options.pack,
        "truncate": options.truncate,
        "train_on": options.train_on,
        "format": fmt,
        "template": {"origin": template.origin, "sha256": template.sha256},
        "eos_id": tokenizer.eos_id,
        "pad_id": tokenizer.eos_id,
        "stop_ids": encoder.stop_ids,
        "inputs": list(inputs),
        "splits": counts,
    }


def _counts(examples: list[ChatExample]) -> dict[str, int]:
    kept = [e for e in examples if not e.dropped]
    return {
        "examples": len(kept),
        "tokens": sum(len(e.ids) for e in kept),
        "targets": sum(int(e.mask.sum()) for e in kept),
        "truncated": sum(e.truncated for e in kept),
        "dropped": len(examples) - len(kept),
    }


# -- output -----------------------------------------------------------------------------


def _write_splits(folder: Path, splits: dict[str, list[ChatExample]]) -> None:
    """Each split's examples kept, and the val examples' messages."""
    for split, examples in splits.items():
        kept = [e for e in examples if not e.dropped]
        write_sequences(folder, split, [(e.ids, e.mask) for e in kept])
        if split == "val":
            write_jsonl(folder / "val.messages.jsonl", ({"messages": e.messages} for e in kept))


def write_folder(out: Path, write_splits: Callable[[Path], None], meta: dict[str, Any]) -> None:
    """Write the folder as ``out.partial`` (its splits by ``write_splits``, then
    ``meta.json``), then rename it onto ``out``."""
    staging = sibling(out, PARTIAL_SUFFIX)
    remove(staging)  # a killed run's
    staging.mkdir(parents=True)
    try:
        write_splits(staging)
        (staging / "meta.json").write_text(json.dumps(meta, indent=2) + "\n")
        fsync_tree(staging)
        publish(staging, out)
    except BaseException:
        remove(staging)
        raise


def write_sequences(
    folder: Path, split: str, sequences: Sequence[tuple[np.ndarray, np.ndarray]]
) -> None:
    """``split``'s ``(ids, mask)`` sequences back to back: ``S.ids.npy`` (uint32),
    ``S.mask.npy`` (uint8) and ``S.offsets.npy`` (int64, the ``n + 1`` starts)."""
    lengths = [len(ids) for ids, _ in sequences]
    offsets = np.concatenate([[0], np.cumsum(lengths, dtype=np.int64)]).astype(np.int64)
    ids = [ids.astype(np.uint32) for ids, _ in sequences]
    mask = [mask.astype(np.uint8) for _, mask in sequences]
    np.save(folder / f"{split}.ids.npy", np.concatenate(ids) if ids else np.zeros(0, np.uint32))
    np.save(folder / f"{split}.mask.npy", np.concatenate(mask) if mask else np.zeros(0, np.uint8))
    np.save(folder / f"{split}.offsets.npy", offsets)


def write_jsonl(path: Path, records: Iterable[Any]) -> None:
    """``records`` as JSON lines (UTF-8, not escaped)."""
    lines = (json.dumps(record, ensure_ascii=False) + "\n" for record in records)
    path.write_text("".join(lines), encoding="utf-8")


def show_examples(
    examples: list[ChatExample], splits: list[str], tokenizer: Any, count: int, stream: IO[str]
) -> None:
    """Print the first ``count`` examples kept: the decoded text with the trained text
    marked (green on a terminal, else between ⟦ and ⟧), then ``{"ids", "mask"}`` as one
    JSON line."""
    color = show_legend(stream)
    shown = [(e, s) for e, s in zip(examples, splits, strict=True) if not e.dropped][:count]
    for example, split in shown:
        stream.write(
            f"--- {example.where} ({split}): {len(example.ids)} tokens,"
            f" {int(example.mask.sum())} trained{', truncated' if example.truncated else ''}\n"
        )
        show_sequence(stream, tokenizer, example.ids, example.mask, color)


def show_legend(stream: IO[str]) -> bool:
    """Print how trained text is marked: in green if ``stream`` is a terminal (returned),
    else between ⟦ and ⟧."""
    color = stream.isatty()
    legend = "\x1b[32mgreen\x1b[0m" if color else f"between {_OPEN} and {_CLOSE}"
    stream.write(f"trained tokens are shown {legend}\n")
    return color


def show_sequence(
    stream: IO[str], tokenizer: Any, ids: np.ndarray, mask: np.ndarray, color: bool, label: str = ""
) -> None:
    """Print ``label`` and the text of ``ids``, its trained text marked (`marked_text`),
    then ``{"ids", "mask"}`` as one JSON line."""
    stream.write(f"{label}{marked_text(tokenizer, ids, mask, color)}\n")
    stream.write(json.dumps({"ids": ids.tolist(), "mask": mask.astype(int).tolist()}) + "\n")


def marked_text(tokenizer: Any, ids: np.ndarray, mask: np.ndarray, color: bool = False) -> str:
    """The text of ``ids``, each run of trained tokens in green (``color``) or ⟦ ⟧."""
    runs = np.split(np.arange(len(ids)), np.flatnonzero(np.diff(mask.astype(np.int8))) + 1)
    parts = []
    for run in runs:
        if not len(run):
            continue
        text = tokenizer.decode(ids[run].tolist())
        if mask[run[0]]:
            text = f"\x1b[32m{text}\x1b[0m" if color else f"{_OPEN}{text}{_CLOSE}"
        parts.append(text)
    return "".join(parts)
