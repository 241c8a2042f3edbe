"""Pretrained weights in and out: Hugging Face directories, llm.c model files, GGUF files
and plugintrain's own checkpoints, read and written one tensor at a time, never unpickled.

:func:`open_weights` reads any of them (the format is detected from the path) as our
tensor names; :func:`load_into` copies them into a model of any parallel layout;
:func:`convert` writes them in another format, atomically (``<out>.partial``, then a
rename), refusing to replace an existing output unless asked.
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

import torch

from plugintrain.checkpoint_files import PARTIAL_SUFFIX, fsync_tree, publish, remove, sibling
from plugintrain.formats.base import (
    TensorReader,
    WeightFormatError,
    Weights,
    check_architecture,
    load_into,
    model_shapes,
)
from plugintrain.model_zoo.adapters import renamed

FORMATS = ("hf", "llmc", "gguf")
"""Output formats of :func:`convert`."""
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}

__all__ = [
    "DTYPES",
    "FORMATS",
    "TensorReader",
    "WeightFormatError",
    "Weights",
    "check_architecture",
    "check_output",
    "convert",
    "detect_format",
    "dtype_problem",
    "load_into",
    "open_weights",
    "resolve",
]


def detect_format(path: Path) -> str:
    """``checkpoint``, ``hf``, ``llmc`` or ``gguf``, from what is at ``path``.

    Raises:
        WeightFormatError: If ``path`` is none of them.
    """
    from plugintrain.data.assets import PRETRAINED_MODELS
    from plugintrain.data.gguf_metadata import is_gguf
    from plugintrain.formats import checkpoint, hf, llmc

    if not path.exists():
        raise WeightFormatError(
            f"{path}: no such file or directory; pass the path of a model (a Hugging Face"
            f" directory, .bin, .gguf or checkpoint) or one of {list(PRETRAINED_MODELS)}."
        )
    for name, test in (
        ("hf", hf.is_hf_dir),
        ("checkpoint", checkpoint.is_checkpoint),
        ("gguf", is_gguf),
        ("llmc", llmc.is_llmc_file),
    ):
        if test(path):
            return name
    raise WeightFormatError(
        f"{path}: not a weight file plugintrain reads; pass a Hugging Face model directory"
        " (config.json + safetensors), an llm.c model .bin, a .gguf file, a .ckpt or a"
        " checkpoint directory written by `plugintrain fit`."
    )


def open_weights(spec: str | Path) -> Weights:
    """The weights at ``spec`` (a path, or a pretrained name such as ``smollm2-135m``,
    fetched and checked on first use) under our tensor names, with their architecture.

    Raises:
        WeightFormatError: If the file is not a supported format or is damaged.
    """
    from plugintrain.formats import checkpoint

    path = resolve(spec)
    kind = detect_format(path)
    if kind == "checkpoint":
        reader = checkpoint.CheckpointReader(path)
        if reader.lora is not None:
            return _merged_adapters(reader)
        held = set(reader.names())
        names = {n: n if n in held else _tied_alias(n) for n in model_shapes(reader.config)}
        return Weights(reader, renamed(names))
    return Weights(_foreign_reader(kind, path.resolve(), path.stat().st_mtime_ns))


def _merged_adapters(adapters: Any) -> Weights:
    """A LoRA run's checkpoint as the whole model: its base (checked by sha256; the
    checkpoint's own tensors for a base trained from scratch) with the adapters merged,
    tensor by tensor."""
    from plugintrain.formats.checkpoint import MergedAdapterReader
    from plugintrain.lora import check_base, is_adapter_name, weights_sha256

    record = adapters.lora
    if record["base"] is None:  # the checkpoint holds every weight itself
        held = {n for n in adapters.names() if not is_adapter_name(n)}
        names = {n: n if n in held else _tied_alias(n) for n in model_shapes(adapters.config)}
        base = Weights(adapters, renamed(names))
    else:
        base = open_weights(record["base"])
        digest = weights_sha256(resolve(record["base"]))
        check_base(record, record["base"], digest, option=None)
    merged = MergedAdapterReader(adapters, base)
    return Weights(merged, renamed({name: name for name in base.names()}))


@functools.lru_cache(maxsize=4)
def _foreign_reader(kind: str, path: Path, mtime_ns: int) -> TensorReader:
    """One reader per file version and process: a model is opened for its config, then for
    its weights, and a reader's memory maps and parsed header serve both."""
    from plugintrain.formats import gguf_file, hf, llmc

    readers = {"hf": hf.HFReader, "gguf": gguf_file.GGUFFileReader, "llmc": llmc.LlmcReader}
    return readers[kind](path)


def resolve(spec: str | Path) -> Path:
    """The path of ``spec``: a pretrained name's fetched file, else ``spec`` itself."""
    from plugintrain.data.assets import resolve_model_path

    return resolve_model_path(spec)


def _tied_alias(name: str) -> str:
    """A tied head saved once, under the embedding's name."""
    return "tok_embeddings.weight" if name == "output.weight" else name


def check_output(out: Path, overwrite: bool) -> None:
    """Refuse, before anything is read or written, to replace an existing output.

    Raises:
        FileExistsError: If ``out`` exists (a non-empty directory or a file) and not
            ``overwrite``.
    """
    exists = out.is_file() or (out.is_dir() and any(out.iterdir()))
    if exists and not overwrite:
        raise FileExistsError(
            f"{out} already exists and is not empty; choose another output, or pass"
            " --overwrite to replace it (the old one is kept until the new one is complete)."
        )


def convert(
    source: str | Path,
    out: Path,
    fmt: str,
    dtype: str | None = None,
    overwrite: bool = False,
) -> Weights:
    """Write the weights at ``source`` (any readable format) to ``out`` in format ``fmt``.

    Args:
        source: A path or pretrained name (see :func:`open_weights`).
        out: The output: a directory for ``hf``, a file for ``llmc`` and ``gguf``.
        fmt: One of :data:`FORMATS`.
        dtype: ``float32``, ``bfloat16`` or ``float16`` (GGUF also ``q8_0``); None keeps
            the source's (fp32 for quantized GGUF sources).
        overwrite: Replace an existing ``out``.

    Returns:
        The weights read (their config names the architecture written).

    Raises:
        FileExistsError: If ``out`` exists and not ``overwrite`` (nothing is touched).
        WeightFormatError: For a source that cannot be read or a model the format cannot
            hold.
    """
    from plugintrain.formats import gguf_file, hf, llmc

    if fmt not in FORMATS:
        raise WeightFormatError(f"unknown format {fmt!r}; choose one of {FORMATS}.")
    check_output(out, overwrite)
    weights = open_weights(source)
    kind = dtype or _source_dtype(weights)
    _check_dtype(fmt, kind)
    partial = sibling(out, PARTIAL_SUFFIX)
    remove(partial)
    try:
        if fmt == "hf":
            hf.write_hf(weights, partial, DTYPES[kind])
        elif fmt == "llmc":
            llmc.write_llmc(weights, partial, DTYPES[kind])
        else:
            gguf_file.write_gguf(weights, partial, _gguf_type(kind))
    except BaseException:
        remove(partial)
        raise
    fsync_tree(partial)  # on disk before the rename makes it the output
    if out.is_dir() and not any(out.iterdir()):
        out.rmdir()
    publish(partial, out)
    return weights


def _source_dtype(weights: Weights) -> str:
    first = weights.plan[weights.names()[0]].sources[0]
    return {v: k for k, v in DTYPES.items()}.get(weights.reader.dtype(first), "float32")


OUTPUT_DTYPES = {"hf": tuple(DTYPES), "llmc": ("float32", "bfloat16"), "gguf": (*DTYPES, "q8_0")}
"""The weight types each output format holds."""


def dtype_problem(fmt: str, dtype: str) -> str | None:
    """Why ``fmt`` cannot hold weights of ``dtype``; None when it can."""
    if dtype in OUTPUT_DTYPES[fmt]:
        return None
    choices = ", ".join(OUTPUT_DTYPES[fmt])
    return f"--dtype {dtype} cannot be written as --format {fmt}; choose one of {choices}"


def _check_dtype(fmt: str, dtype: str) -> None:
    problem = dtype_problem(fmt, dtype)
    if problem is not None:
        raise WeightFormatError(f"{problem}.")


def _gguf_type(dtype: str) -> str:
    return {"float32": "f32", "bfloat16": "bf16", "float16": "f16"}.get(dtype, dtype)
