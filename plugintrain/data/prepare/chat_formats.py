"""Chat rows in the shapes instruction datasets come in, as ``role``/``content`` messages.

Four formats (`FORMATS`), one row each::

    messages         {"messages": [{"role": "system", "content": ...},
                                   {"role": "user", "content": ...},
                                   {"role": "assistant", "content": ...}, ...]}
    prompt_response  {"prompt": ..., "response": ..., "system": ... (optional)}
    alpaca           {"instruction": ..., "input": ... (optional, may be ""), "output": ...}
    sharegpt         {"conversations": [{"from": "system" | "human" | "gpt", "value": ...}]}

Rows are read from JSON lines, JSON arrays, Parquet, ``datasets`` ``save_to_disk``
folders and ``hf:NAME`` hub datasets, found as ``prepare text`` finds its inputs
(`text_sources.expand_inputs`).
"""

from __future__ import annotations

import json
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from plugintrain.data.prepare.text_sources import (
    CorpusError,
    ReadOptions,
    Source,
    _open_binary,  # prepare text's readers of compressed files, optional libraries and
    _optional,  # JSON lines, with their one-line errors: one reader of each in the package
    _parse_line,
    expand_inputs,
)

FORMATS = ("messages", "prompt_response", "alpaca", "sharegpt")
ROLES = ("system", "user", "assistant")
# The field that tells each format apart, in the order `detect_format` tries them.
_MARKS = {"messages": "messages", "sharegpt": "conversations", "alpaca": "instruction"}
_MARKS["prompt_response"] = "prompt"
_SHAREGPT_ROLES = {"system": "system", "human": "user", "gpt": "assistant"}
_SHAREGPT_ROLES |= {"user": "user", "assistant": "assistant"}


class ChatDataError(ValueError):
    """A row that is no conversation of its format; the message names the row."""


def detect_format(row: dict, where: str) -> str:
    """The format of ``row``, told by its fields (`FORMATS`).

    Raises:
        ChatDataError: If the row has none of the fields that tell the formats apart.
    """
    for fmt, field in _MARKS.items():
        if isinstance(row, dict) and field in row:
            return fmt
    keys = sorted(row) if isinstance(row, dict) else type(row).__name__
    raise ChatDataError(
        f"{where}: no conversation (found {keys}); give rows of messages, prompt/response,"
        " instruction/input/output (Alpaca) or conversations (ShareGPT), or name the format"
        " with --format"
    )


def to_messages(row: dict, fmt: str, where: str) -> list[dict[str, str]]:
    """``row`` of format ``fmt`` as ``role``/``content`` messages, roles `ROLES`.

    Raises:
        ChatDataError: If the row lacks a field of its format, a message's role is not one
            of `ROLES`, or a text is not a string.
    """
    if fmt not in FORMATS:
        raise ChatDataError(f"format {fmt!r}: choose auto or one of {', '.join(FORMATS)}")
    if not isinstance(row, dict):
        raise ChatDataError(f"{where}: a row is a JSON {type(row).__name__}, not an object")
    messages = _CONVERTERS[fmt](row, where)
    if not messages:
        raise ChatDataError(f"{where}: the conversation holds no message; drop the row")
    return messages


def _field(row: dict, name: str, where: str, fmt: str) -> str:
    """``row[name]``, text, or a one-line error naming the row, the field and the fix."""
    if name not in row or row[name] is None:
        raise ChatDataError(
            f"{where}: no {name!r} field (found {sorted(row)}), which a {fmt} row needs;"
            f" add it, or name the row's format with --format"
        )
    return _text(row[name], f"{where}: field {name!r}")


def _text(value: Any, what: str) -> str:
    if not isinstance(value, str):
        raise ChatDataError(f"{what} holds {type(value).__name__}, not text; give it a string")
    return value


def _turns(row: dict, field: str, where: str, fmt: str) -> list[Any]:
    if field not in row:
        _field(row, field, where, fmt)  # raises: no such field
    turns = row[field]
    if not isinstance(turns, list):
        raise ChatDataError(
            f"{where}: field {field!r} holds {type(turns).__name__}, not a list of {fmt} messages"
        )
    return turns


def _messages(row: dict, where: str) -> list[dict[str, str]]:
    turns = _turns(row, "messages", where, "messages")
    return [_message(message, f"{where}: message {n}") for n, message in enumerate(turns, 1)]


def _message(message: Any, at: str) -> dict[str, str]:
    """``message``, checked to be a ``role``/``content`` message of `ROLES` (``at`` names
    it in the error)."""
    if not isinstance(message, dict) or "role" not in message or "content" not in message:
        found = sorted(message) if isinstance(message, dict) else type(message).__name__
        raise ChatDataError(f"{at} has no role and content (found {found}); give both")
    return {"role": _role(message["role"], at), "content": _text(message["content"], at)}


def _role(role: Any, at: str) -> str:
    if role not in ROLES:
        raise ChatDataError(
            f"{at} has the role {role!r}; chat data holds system, user and assistant"
            " messages: rename or drop it"
        )
    return role


def _prompt_response(row: dict, where: str) -> list[dict[str, str]]:
    fmt = "prompt_response"
    system = [] if row.get("system") is None else [("system", _field(row, "system", where, fmt))]
    turns = [*system, ("user", _field(row, "prompt", where, fmt))]
    turns.append(("assistant", _field(row, "response", where, fmt)))
    return [{"role": role, "content": content} for role, content in turns]


def _alpaca(row: dict, where: str) -> list[dict[str, str]]:
    instruction = _field(row, "instruction", where, "alpaca")
    extra = "" if row.get("input") is None else _text(row["input"], f"{where}: field 'input'")
    prompt = f"{instruction}\n\n{extra}" if extra else instruction
    answer = _field(row, "output", where, "alpaca")
    return [{"role": "user", "content": prompt}, {"role": "assistant", "content": answer}]


def _sharegpt(row: dict, where: str) -> list[dict[str, str]]:
    out = []
    for n, turn in enumerate(_turns(row, "conversations", where, "sharegpt"), start=1):
        at = f"{where}: conversation turn {n}"
        if not isinstance(turn, dict) or "from" not in turn or "value" not in turn:
            found = sorted(turn) if isinstance(turn, dict) else type(turn).__name__
            raise ChatDataError(f"{at} has no from and value (found {found}); give both")
        if turn["from"] not in _SHAREGPT_ROLES:
            raise ChatDataError(
                f"{at} is from {turn['from']!r}; ShareGPT turns are from system, human or"
                " gpt: rename or drop it"
            )
        out.append({"role": _SHAREGPT_ROLES[turn["from"]], "content": _text(turn["value"], at)})
    return out


_CONVERTERS = {
    "messages": _messages,
    "prompt_response": _prompt_response,
    "alpaca": _alpaca,
    "sharegpt": _sharegpt,
}


# -- reading rows -----------------------------------------------------------------------


def read_chat_rows(
    inputs: list[str], read: ReadOptions | None = None, exclude: Path | None = None
) -> Iterator[tuple[str, dict]]:
    """``(where, row)`` of every row of ``inputs``, in order (``where`` as
    ``"data/x.jsonl:17"`` or ``"data/x.parquet (record 3)"``).

    Args:
        inputs: Files (``.jsonl``, ``.json``, ``.parquet``, also ``.gz``/``.zst``
            compressed), folders, globs, ``save_to_disk`` folders or ``hf:NAME``.
        read: The split and configuration of a hub dataset, and how bytes that are not
            UTF-8 are read (``errors``).
        exclude: A folder never read (the output, when it lies inside an INPUT).

    Raises:
        CorpusError: For an input that cannot be read, or holds text rather than rows.
    """
    read = read or ReadOptions()
    for source in expand_inputs(inputs, exclude=exclude):
        if source.kind not in _READERS:
            raise CorpusError(
                f"{source.path}: a text file holds no chat rows; give .jsonl, .json or"
                " .parquet files, save_to_disk folders or hf:NAME"
            )
        yield from _READERS[source.kind](source, read)


def _jsonl_rows(source: Source, read: ReadOptions) -> Iterator[tuple[str, dict]]:
    """One row per non-empty line."""
    try:
        with _open_binary(source.path) as raw:  # type: ignore[arg-type]
            offset = 0
            for index, line in enumerate(raw):
                if index == 0:
                    line = line.removeprefix(b"\xef\xbb\xbf")  # a byte order mark
                if line.strip():
                    yield source.where(index), _parse_line(source, line, index, offset, read)
                offset += len(line)
    except (OSError, EOFError, zlib.error) as error:
        raise CorpusError(f"{source.path}: cannot read it ({error})") from None


def _json_rows(source: Source, read: ReadOptions) -> Iterator[tuple[str, dict]]:
    """A ``.json`` file: one array of rows, or JSON lines under that name."""
    try:
        with _open_binary(source.path) as stream:  # type: ignore[arg-type]
            data = stream.read().removeprefix(b"\xef\xbb\xbf")
    except (OSError, EOFError, zlib.error) as error:
        raise CorpusError(f"{source.path}: cannot read it ({error})") from None
    if not data.lstrip().startswith(b"["):
        yield from _jsonl_rows(source, read)
        return
    try:
        rows = json.loads(data.decode("utf-8", read.errors))
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        raise CorpusError(f"{source.path}: not a JSON array of rows ({error})") from None
    for ordinal, row in enumerate(rows):
        yield source.where(ordinal), row


def _parquet_rows(source: Source, read: ReadOptions) -> Iterator[tuple[str, dict]]:
    parquet = _optional("pyarrow.parquet", source.path)  # type: ignore[arg-type]
    try:
        batches = parquet.ParquetFile(source.path).iter_batches(batch_size=1024)
        yield from _table_rows(source, batches)
    except (OSError, ValueError) as error:  # pyarrow's ArrowInvalid and ArrowIOError
        raise CorpusError(f"{source.path}: not a readable Parquet file ({error})") from None


def _arrow_rows(source: Source, read: ReadOptions) -> Iterator[tuple[str, dict]]:
    """A ``datasets`` ``save_to_disk`` folder: its Arrow stream files in order."""
    pa = _optional("pyarrow", source.path)  # type: ignore[arg-type]
    assert source.path is not None
    try:
        state = json.loads((source.path / "state.json").read_text())
        files = [source.path / f["filename"] for f in state.get("_data_files", [])]
        readers = (pa.ipc.open_stream(pa.memory_map(str(file))) for file in files)
        yield from _table_rows(source, (batch for reader in readers for batch in reader))
    except (OSError, ValueError, KeyError, TypeError) as error:  # pyarrow's errors included
        raise CorpusError(
            f"{source.path}: not a readable datasets save_to_disk folder ({error})"
        ) from None


def _table_rows(source: Source, batches: Iterator[Any]) -> Iterator[tuple[str, dict]]:
    ordinal = 0
    for batch in batches:
        for row in batch.to_pylist():
            yield source.where(ordinal), row
            ordinal += 1


def _hub_rows(source: Source, read: ReadOptions) -> Iterator[tuple[str, dict]]:
    """A Hugging Face hub dataset, streamed (needs the network and ``datasets``)."""
    datasets = _optional("datasets", source.label)
    name = source.label.removeprefix("hf:")
    try:
        rows = datasets.load_dataset(name, read.hub_config, split=read.split, streaming=True)
    except Exception as error:  # network, unknown name or split: datasets' own message
        raise CorpusError(f"{source.label}: cannot open it ({error})") from None
    for ordinal, row in enumerate(rows):
        yield source.where(ordinal), row


_READERS = {
    "jsonl": _jsonl_rows,
    "json": _json_rows,
    "parquet": _parquet_rows,
    "arrow_dir": _arrow_rows,
    "hub": _hub_rows,
}
