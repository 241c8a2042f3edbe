"""Documents from the user's files: text, JSON lines, JSON, Parquet, Hugging Face datasets.

`expand_inputs` turns the command line's INPUTs (files, folders, globs, a ``save_to_disk``
directory, ``hf:NAME``) into `Source`\\ s in a fixed order; `Source.documents` streams one
source's documents as ``(ordinal, text)`` without holding the source whole. Every error in
the input (unreadable, corrupt, cut short, not UTF-8, not JSON, no text field or column,
over the size limit) is a `CorpusError` naming the file and, for line-based formats, the
line.
"""

from __future__ import annotations

import codecs
import glob
import gzip
import io
import json
import os
import zlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

TEXT_SUFFIXES = (".txt", ".md", ".text", ".markdown")
JSONL_SUFFIXES = (".jsonl", ".ndjson")
COMPRESSIONS = (".gz", ".zst")
HUB_PREFIX = "hf:"
MAX_DOC_BYTES = 64 << 20
"""Default limit of one document's UTF-8 size (``--max_doc_bytes``): a document is held
whole while it is tokenized, so a file without separators over this is refused."""
_READ_BLOCK = 1 << 20


class CorpusError(ValueError):
    """Input that cannot be read as documents; the message names the file (and line)."""


@dataclass(frozen=True)
class ReadOptions:
    """How documents are read out of every source.

    Attributes:
        text_field: Field (JSON) or column (Parquet, datasets) holding a document's text.
        separator: Splits a text file into documents; None keeps each file one document.
        errors: ``strict`` refuses bytes that are not UTF-8; ``replace`` reads them as U+FFFD.
        max_doc_bytes: Largest document, in UTF-8 bytes.
        split: Split of a hub dataset.
        hub_config: Configuration of a hub dataset.
    """

    text_field: str = "text"
    separator: str | None = None
    errors: str = "strict"
    max_doc_bytes: int = MAX_DOC_BYTES
    split: str = "train"
    hub_config: str | None = None


@dataclass(frozen=True)
class Source:
    """One input: a file, a ``save_to_disk`` directory or a hub dataset.

    Attributes:
        label: Its name as the held-out split hashes it, so moving the corpus keeps the
            split: a folder's (or a glob's fixed folder's) name and the path below it
            (``corpus/2024/a.jsonl``), a file's own name, ``hf:NAME``.
        path: The file or directory (None for a hub dataset).
        kind: ``text``, ``jsonl``, ``json``, ``parquet``, ``arrow_dir`` or ``hub``.
        size: Bytes on disk (what tasks are balanced by); 0 for a hub dataset.
    """

    label: str
    path: Path | None
    kind: str
    size: int

    def documents(self, options: ReadOptions) -> Iterator[tuple[int, str]]:
        """``(ordinal, text)`` of each record in order; the ordinal counts every record,
        empty ones included, so it names the same record in every run."""
        for ordinal, text in READERS[self.kind].read(self, options):
            # A character is 1 to 4 bytes: only a long text needs counting.
            if len(text) * 4 <= options.max_doc_bytes:
                yield ordinal, text
                continue
            size = len(text.encode("utf-8", "surrogatepass"))
            if size > options.max_doc_bytes:
                raise CorpusError(_too_long(self, ordinal, str(size), options))
            yield ordinal, text

    def where(self, ordinal: int) -> str:
        """The file and record of ``ordinal`` as an error message names them."""
        name = self.path if self.path is not None else self.label
        if self.kind == "jsonl":
            return f"{name}:{ordinal + 1}"  # records of JSON lines are counted by line
        if self.kind in ("text",):
            return f"{name} (document {ordinal + 1})"
        return f"{name} (record {ordinal + 1})"


def expand_inputs(
    inputs: list[str], suffixes: tuple[str, ...] = (), exclude: Path | None = None
) -> list[Source]:
    """The sources that ``inputs`` name, in order: each INPUT's files sorted by path.

    Args:
        inputs: Files, folders (walked for the known suffixes and ``suffixes``), globs
            (``**`` recurses), ``save_to_disk`` directories, or ``hf:NAME`` hub datasets.
        suffixes: More suffixes a folder walk reads as plain text (``.py``, ``.rst``).
        exclude: A folder never read (the output, when it lies inside an INPUT).

    Raises:
        CorpusError: For a path that does not exist, a glob or folder that matches no
            file, or a file named twice.
    """
    if not inputs:
        raise CorpusError("no INPUT given; name files, folders, globs or hf:NAME to read")
    extra = tuple(s if s.startswith(".") else f".{s}" for s in suffixes)
    skip = exclude.resolve() if exclude is not None else None
    sources: list[Source] = []
    for spec in inputs:
        found = _expand_one(spec, extra, skip)
        if not found:
            raise CorpusError(f"{spec}: matches no file to read; {_known()}")
        sources.extend(found)
    seen: dict[str, Source] = {}
    for source in sources:
        if source.label in seen:
            first = seen[source.label]
            same = first.path is not None and source.path is not None
            same = same and first.path.resolve() == source.path.resolve()  # type: ignore[union-attr]
            raise CorpusError(
                f"{source.label}: named twice by the INPUTs"
                + (
                    "; name each file once"
                    if same
                    else f" ({first.path} and {source.path}); give their common parent folder"
                    " as the INPUT instead"
                )
            )
        seen[source.label] = source
    return sources


def _known() -> str:
    suffixes = ", ".join(s for reader in READERS.values() for s in reader.suffixes)
    return (
        f"plugintrain reads {suffixes} (also {' or '.join(COMPRESSIONS)} compressed where the"
        " reader takes it), save_to_disk directories and hf:NAME; add --suffixes to read others"
        " as text"
    )


def _is_saved_dataset(path: Path) -> bool:
    return (path / "state.json").is_file() and (path / "dataset_info.json").is_file()


def _expand_one(spec: str, extra: tuple[str, ...], skip: Path | None) -> list[Source]:
    if spec.startswith(HUB_PREFIX):
        return [Source(spec, None, "hub", 0)]
    if glob.has_magic(spec):
        root = Path(_glob_root(spec))
        paths = sorted(Path(p) for p in glob.glob(spec, recursive=True) if Path(p).is_file())
        paths = [p for p in paths if skip is None or skip not in p.resolve().parents]
        label = root.resolve().name
        return [
            _file_source(p, f"{label}/{p.relative_to(root).as_posix()}", extra, named=True)
            for p in paths
        ]
    path = Path(spec)
    if not path.exists():
        raise CorpusError(f"{spec}: no such file or directory")
    if path.is_dir() and _is_saved_dataset(path):
        return [Source(path.resolve().name, path, "arrow_dir", _tree_size(path))]
    if path.is_dir():
        if skip is not None and path.resolve() == skip:
            raise CorpusError(
                f"{spec}: is also --out; write the prepared data to a folder of its own"
            )
        return _walk(path, extra, skip)
    return [_file_source(path, path.name, extra, named=True)]


def _walk(root: Path, extra: tuple[str, ...], skip: Path | None) -> list[Source]:
    """A folder's files of known kinds, and the ``save_to_disk`` folders in it, by path."""
    found: list[tuple[str, Source]] = []
    label = root.resolve().name
    for dirpath, dirnames, filenames in os.walk(root):
        here = Path(dirpath)
        kept = []
        for name in sorted(dirnames):
            sub = here / name
            if name.startswith(".") or (skip is not None and sub.resolve() == skip):
                continue
            if _is_saved_dataset(sub):
                relative = sub.relative_to(root).as_posix()
                found.append(
                    (relative, Source(f"{label}/{relative}", sub, "arrow_dir", _tree_size(sub)))
                )
            else:
                kept.append(name)
        dirnames[:] = kept
        for name in sorted(filenames):
            if _kind(name, extra) is not None and not name.startswith("."):
                relative = (here / name).relative_to(root).as_posix()
                source = _file_source(here / name, f"{label}/{relative}", extra, named=False)
                found.append((relative, source))
    return [source for _, source in sorted(found, key=lambda item: item[0])]


def _glob_root(spec: str) -> str:
    """The folder part of a glob before its first wildcard (what labels are relative to)."""
    parts = Path(spec).parts
    fixed = [p for p in parts[: next(i for i, p in enumerate(parts) if glob.has_magic(p))]]
    return str(Path(*fixed)) if fixed else "."


def _file_source(path: Path, label: str, extra: tuple[str, ...], named: bool) -> Source:
    kind = _kind(path.name, extra)
    if kind is None:
        if not named:
            raise AssertionError(path)  # folder walks keep known suffixes only
        kind = "text"  # a file named on the command line is read as text whatever its suffix
    return Source(label, path, kind, path.stat().st_size)


def _kind(name: str, extra: tuple[str, ...]) -> str | None:
    stem = name.lower()
    for compression in COMPRESSIONS:
        stem = stem.removesuffix(compression)
    suffix = Path(stem).suffix
    if suffix in extra:
        return "text"
    compressed = stem != name.lower()
    return next(
        (
            kind
            for kind, reader in READERS.items()
            if suffix in reader.suffixes and (reader.compressed or not compressed)
        ),
        None,
    )


def _tree_size(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def _open_binary(path: Path) -> IO[bytes]:
    """The file's bytes, decompressed as its suffix says."""
    name = path.name.lower()
    if name.endswith(".gz"):
        return gzip.open(path, "rb")
    if name.endswith(".zst"):
        return io.BufferedReader(_ZstdReader(path), _READ_BLOCK)
    return open(path, "rb")


class _ZstdReader(io.RawIOBase):
    """A ``.zst`` file's decompressed bytes, frame after frame; a file cut short inside a
    frame is an error, not an end."""

    def __init__(self, path: Path) -> None:
        self._zstd = _optional("zstandard", path)
        self.path = path
        self._file = open(path, "rb")  # noqa: SIM115 (closed by close())
        self._frame = self._zstd.ZstdDecompressor().decompressobj()
        self._fed = False  # whether the current frame has been given any input
        self._pending = b""

    def readable(self) -> bool:
        return True

    def _feed(self, compressed: bytes) -> None:
        try:
            self._pending = self._frame.decompress(compressed)
        except self._zstd.ZstdError as error:
            raise CorpusError(f"{self.path}: not a whole zstd file ({error})") from None
        self._fed = True

    def readinto(self, buffer: Any) -> int:
        while not self._pending:
            if self._fed and self._frame.eof:  # the next frame, if any
                rest = self._frame.unused_data
                self._frame = self._zstd.ZstdDecompressor().decompressobj()
                self._fed = False
                if rest:
                    self._feed(rest)
                continue
            compressed = self._file.read(_READ_BLOCK)
            if not compressed:
                if self._fed:
                    raise CorpusError(f"{self.path}: the zstd stream ends early (cut short?)")
                return 0
            self._feed(compressed)
        size = min(len(buffer), len(self._pending))
        buffer[:size] = self._pending[:size]
        self._pending = self._pending[size:]
        return size

    def close(self) -> None:
        self._file.close()
        super().close()


def _optional(module: str, path: Path | str) -> Any:
    """An optional reader library, or a one-line error saying how to install it."""
    import importlib

    try:
        return importlib.import_module(module)
    except ImportError:
        raise CorpusError(
            f"{path}: reading it needs the {module} package; install it with"
            " `pip install 'plugintrain[data]'`"
        ) from None


def _decoded_blocks(source: Source, options: ReadOptions) -> Iterator[str]:
    """The text of a file in blocks; a byte that is not UTF-8 is named by its offset."""
    assert source.path is not None
    decoder = codecs.getincrementaldecoder("utf-8")(options.errors)
    offset = 0  # bytes read; the decoder may still hold the start of a character

    def where(error: UnicodeDecodeError) -> str:
        return _not_utf8(source.path, offset - held + error.start)  # type: ignore[arg-type]

    try:
        with _open_binary(source.path) as stream:
            while block := stream.read(_READ_BLOCK):
                held = len(decoder.getstate()[0])
                try:
                    yield decoder.decode(block)
                except UnicodeDecodeError as error:
                    raise CorpusError(where(error)) from None
                offset += len(block)
            held = len(decoder.getstate()[0])
            try:
                yield decoder.decode(b"", final=True)
            except UnicodeDecodeError as error:  # a character cut off by the end
                raise CorpusError(where(error)) from None
    except (OSError, EOFError, zlib.error) as error:
        raise CorpusError(f"{source.path}: cannot read it ({error})") from None


def _whole_text(source: Source, options: ReadOptions, refusal: Callable[[int], str]) -> str:
    """A file's text whole, refused (``refusal(characters read)``) as soon as it is surely
    over ``--max_doc_bytes`` (a character is at least one byte), never read further."""
    blocks, chars = [], 0
    for block in _decoded_blocks(source, options):
        blocks.append(block)
        chars += len(block)
        if chars > options.max_doc_bytes:
            raise CorpusError(refusal(chars))
    return "".join(blocks)


def _too_long(source: Source, ordinal: int, size: str, options: ReadOptions) -> str:
    split = "split the file with --separator or " if source.kind == "text" else ""
    return (
        f"{source.where(ordinal)}: a document of {size} bytes, over --max_doc_bytes="
        f"{options.max_doc_bytes}; {split}raise --max_doc_bytes"
    )


def _not_utf8(path: Path, offset: int) -> str:
    return (
        f"{path}: not UTF-8 at byte {offset} (of its decompressed bytes); fix the file or add"
        " --errors replace to read such bytes as U+FFFD"
    )


def _text_documents(source: Source, options: ReadOptions) -> Iterator[tuple[int, str]]:
    """One document per file, or the pieces between separators (streamed)."""
    separator = options.separator
    if not separator:  # held whole, so refused as soon as it is surely too long
        yield (
            0,
            _whole_text(
                source, options, lambda chars: _too_long(source, 0, f"over {chars}", options)
            ),
        )
        return
    pending, ordinal = "", 0
    for block in _decoded_blocks(source, options):
        pending += block
        *whole, pending = pending.split(separator)
        for text in whole:
            yield ordinal, text
            ordinal += 1
        if len(pending.encode("utf-8", "surrogatepass")) > options.max_doc_bytes:
            yield ordinal, pending  # refused by `documents` with the size
    yield ordinal, pending


def _jsonl_documents(source: Source, options: ReadOptions) -> Iterator[tuple[int, str]]:
    """One document per non-empty line; the ordinal is the line's index. A line is read
    up to a bound (JSON may escape each byte of text in up to 6), never held unbounded."""
    assert source.path is not None
    limit = 6 * options.max_doc_bytes + 1024
    try:
        with _open_binary(source.path) as raw:
            stream = io.BufferedReader(raw, _READ_BLOCK)  # type: ignore[arg-type]
            offset, index = 0, 0
            while line := stream.readline(limit + 1):
                if len(line) > limit:
                    raise CorpusError(_too_long(source, index, f"over {limit}", options))
                if index == 0:
                    line = line.removeprefix(b"\xef\xbb\xbf")  # a byte order mark
                if line.strip():
                    record = _parse_line(source, line, index, offset, options)
                    yield index, _record_text(source, index, record, options)
                offset += len(line)
                index += 1
    except (OSError, EOFError, zlib.error) as error:
        raise CorpusError(f"{source.path}: cannot read it ({error})") from None


def _parse_line(source: Source, line: bytes, index: int, offset: int, options: ReadOptions) -> Any:
    try:
        text = line.decode("utf-8", options.errors)
    except UnicodeDecodeError as error:
        raise CorpusError(
            f"{source.path}:{index + 1}: not UTF-8 at byte {offset + error.start} of the file;"
            " fix the file or add --errors replace to read such bytes as U+FFFD"
        ) from None
    try:
        return json.loads(text)
    except json.JSONDecodeError as error:
        shape = (
            "a .json file must be one JSON array of objects, or one JSON object a line"
            if source.kind == "json"
            else "each line of a .jsonl file must be one JSON object"
        )
        raise CorpusError(
            f"{source.path}:{index + 1}: not JSON ({error.msg} at column {error.colno}); {shape}"
        ) from None


def _record_text(source: Source, ordinal: int, record: Any, options: ReadOptions) -> str:
    field = options.text_field
    if not isinstance(record, dict) or field not in record:
        keys = sorted(record) if isinstance(record, dict) else type(record).__name__
        raise CorpusError(
            f"{source.where(ordinal)}: no {field!r} field (found {keys}); name the text's"
            " field with --text_field"
        )
    text = record[field]
    if not isinstance(text, str):
        raise CorpusError(
            f"{source.where(ordinal)}: field {field!r} holds {type(text).__name__}, not text;"
            " name the text's field with --text_field"
        )
    return text


def _json_documents(source: Source, options: ReadOptions) -> Iterator[tuple[int, str]]:
    """A ``.json`` file: an array of objects (read whole, so no larger than
    ``--max_doc_bytes``), or JSON lines under that name."""
    assert source.path is not None
    try:
        with _open_binary(source.path) as stream:
            head = stream.read(_READ_BLOCK).removeprefix(b"\xef\xbb\xbf").lstrip()
    except (OSError, EOFError, zlib.error) as error:
        raise CorpusError(f"{source.path}: cannot read it ({error})") from None
    if not head.startswith(b"["):
        yield from _jsonl_documents(source, options)
        return
    array = f"{source.path}: a JSON array is read whole and this one is over"
    text = _whole_text(
        source,
        options,
        lambda _: (
            f"{array} --max_doc_bytes={options.max_doc_bytes}; write it as JSON lines"
            " (.jsonl, which is streamed) or raise --max_doc_bytes"
        ),
    )
    try:
        records = json.loads(text.removeprefix("\ufeff"))
    except json.JSONDecodeError as error:
        raise CorpusError(
            f"{source.path}:{error.lineno}: not JSON ({error.msg} at column {error.colno})"
        ) from None
    for ordinal, record in enumerate(records):
        yield ordinal, _record_text(source, ordinal, record, options)


def _parquet_documents(source: Source, options: ReadOptions) -> Iterator[tuple[int, str]]:
    """Rows of a Parquet file, one column read in record batches."""
    parquet = _optional("pyarrow.parquet", source.path)  # type: ignore[arg-type]
    try:
        file = parquet.ParquetFile(source.path)
    except Exception as error:  # pyarrow raises ArrowInvalid and OSError subclasses
        raise CorpusError(f"{source.path}: not a Parquet file ({error})") from None
    yield from _column_rows(
        source,
        file.schema_arrow.names,
        options,
        lambda columns: file.iter_batches(batch_size=1024, columns=columns),
    )


def _arrow_documents(source: Source, options: ReadOptions) -> Iterator[tuple[int, str]]:
    """Rows of a ``datasets`` ``save_to_disk`` directory: its Arrow stream files in order."""
    pa = _optional("pyarrow", source.path)  # type: ignore[arg-type]
    assert source.path is not None
    try:
        state = json.loads((source.path / "state.json").read_text())
        files = [source.path / f["filename"] for f in state.get("_data_files", [])]
        names = pa.ipc.open_stream(pa.memory_map(str(files[0]))).schema.names if files else []
    except (OSError, ValueError, KeyError, TypeError) as error:  # pyarrow's errors included
        raise CorpusError(
            f"{source.path}: not a readable datasets save_to_disk folder ({error})"
        ) from None

    def batches(columns: list[str]) -> Iterator[Any]:
        for file in files:
            reader = pa.ipc.open_stream(pa.memory_map(str(file)))
            for batch in reader:
                yield batch.select(columns)

    yield from _column_rows(source, names, options, batches)


def _column_rows(
    source: Source, names: list[str], options: ReadOptions, batches: Any
) -> Iterator[tuple[int, str]]:
    field = options.text_field
    if field not in names:
        raise CorpusError(
            f"{source.path}: no column {field!r} (columns: {', '.join(names)}); name the text's"
            " column with --text_field"
        )
    ordinal = 0
    try:
        for batch in batches([field]):
            yield from _column_texts(source, batch.column(0).to_pylist(), ordinal, field)
            ordinal += batch.num_rows
    except (OSError, ValueError) as error:  # pyarrow's ArrowInvalid / ArrowIOError
        if isinstance(error, CorpusError):
            raise
        raise CorpusError(f"{source.path}: cannot read it ({error})") from None


def _column_texts(
    source: Source, values: list[Any], first: int, field: str
) -> Iterator[tuple[int, str]]:
    for ordinal, text in enumerate(values, start=first):
        if text is not None and not isinstance(text, str):
            raise CorpusError(
                f"{source.where(ordinal)}: column {field!r} holds {type(text).__name__},"
                " not text; name the text's column with --text_field"
            )
        yield ordinal, text or ""


def _hub_documents(source: Source, options: ReadOptions) -> Iterator[tuple[int, str]]:
    """A Hugging Face hub dataset, streamed (needs the network and ``datasets``)."""
    datasets = _optional("datasets", source.label)
    name = source.label.removeprefix(HUB_PREFIX)
    try:
        rows = datasets.load_dataset(name, options.hub_config, split=options.split, streaming=True)
    except Exception as error:  # network, unknown name or split: datasets' own message
        raise CorpusError(f"{source.label}: cannot open it ({error})") from None
    for ordinal, row in enumerate(rows):
        yield ordinal, _record_text(source, ordinal, row, options)


def document_ordinals(source: Source, options: ReadOptions) -> Iterator[int]:
    """The ordinals of ``source``'s documents that hold text (the ones ``prepare text``
    tokenizes), for ``--val_docs``'s ranking: a plain text file by its size, anything else
    by reading it (nothing is tokenized)."""
    if source.kind == "hub":
        raise CorpusError(
            f"{source.label}: --val_docs needs every document counted, which a streamed hub"
            " dataset cannot give; use --val_fraction"
        )
    plain = source.path is not None and not source.path.name.lower().endswith(COMPRESSIONS)
    if source.kind == "text" and not options.separator and plain:
        if source.size:  # any byte is at least one character (or a refused one)
            yield 0
        return
    for ordinal, text in source.documents(options):
        if text:
            yield ordinal


@dataclass(frozen=True)
class Reader:
    """How one kind of source is read (an entry of :data:`READERS`)."""

    suffixes: tuple[str, ...]
    """The file suffixes read as this kind (none: the kind is told by the path's shape)."""
    read: Callable[[Source, ReadOptions], Iterator[tuple[int, str]]]
    """The source's documents as ``(ordinal, text)`` in order; an ordinal counts every
    record, empty ones included. Errors are :class:`CorpusError` naming the file."""
    compressed: bool = False
    """Whether ``.gz`` and ``.zst`` files of these suffixes are read too (the reader opens
    them with :func:`_open_binary`)."""


READERS: dict[str, Reader] = {
    "text": Reader(TEXT_SUFFIXES, _text_documents, compressed=True),
    "jsonl": Reader(JSONL_SUFFIXES, _jsonl_documents, compressed=True),
    "json": Reader((".json",), _json_documents, compressed=True),
    "parquet": Reader((".parquet",), _parquet_documents),
    "arrow_dir": Reader((), _arrow_documents),  # a save_to_disk directory
    "hub": Reader((), _hub_documents),  # hf:NAME
}
"""Every kind of source (:attr:`Source.kind`) and its reader: the one place an input format
is declared (:func:`register_reader` adds one)."""


def register_reader(
    kind: str,
    suffixes: tuple[str, ...],
    read: Callable[[Source, ReadOptions], Iterator[tuple[int, str]]],
    compressed: bool = False,
) -> None:
    """Read files of ``suffixes`` as ``kind`` with ``read`` (see :class:`Reader`).

    Raises:
        ValueError: If ``kind`` or one of ``suffixes`` is taken already.
    """
    taken = {s: k for k, reader in READERS.items() for s in reader.suffixes}
    clashes = {s: taken[s] for s in suffixes if s in taken}
    if kind in READERS or clashes:
        raise ValueError(f"input format {kind!r} clashes with the registered ones: {clashes}")
    READERS[kind] = Reader(tuple(suffixes), read, compressed)
