"""Weights written in another format (``plugintrain convert``), atomically: to
``<out>.partial``, then a rename; an existing output is replaced only when asked."""

from __future__ import annotations

from pathlib import Path

import torch

from plugintrain.core.atomic_files import PARTIAL_SUFFIX, fsync_tree, publish, remove, sibling
from plugintrain.formats import gguf_file, hf, llmc
from plugintrain.formats.base import WeightFormatError, Weights
from plugintrain.formats.sources import open_weights

FORMATS = ("hf", "llmc", "gguf")
"""Output formats of :func:`convert`."""
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


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
