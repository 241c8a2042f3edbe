"""Weights written in another format (``plugintrain convert`` and ``export``), atomically:
to ``<out>.partial``, then a rename; an existing output is replaced only when asked. What
each format writes, and in which dtypes, is its :class:`~plugintrain.formats.registry.
FormatSpec`'s. ``export`` adds the model card of the run (:mod:`~plugintrain.formats.
model_card`): inside a directory before it is published, beside a GGUF file."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from plugintrain.core.atomic_files import (
    PARTIAL_SUFFIX,
    fsync_tree,
    publish,
    remove,
    sibling,
    write_file_atomically,
)
from plugintrain.data.assets import PRETRAINED_MODELS
from plugintrain.formats.base import TORCH_DTYPES, WeightFormatError, Weights
from plugintrain.formats.checkpoint import CheckpointReader
from plugintrain.formats.model_card import CARD, checkpoint_facts, gguf_card_path, model_card
from plugintrain.formats.registry import FORMATS, convert_formats, dtype_problem, format_spec
from plugintrain.formats.sources import detect_format, open_weights, resolve


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


def output_problem(
    source: str, out: Path, fmt: str, dtype: str | None, overwrite: bool, merge_lora: bool
) -> str | None:
    """What is wrong with writing ``source`` to ``out`` as ``fmt``, found before anything
    is read (a missing source, a dtype the format does not hold, an existing output);
    None when nothing is."""
    if not Path(source).exists() and source not in PRETRAINED_MODELS:
        return f"{source}: no such file or directory; pass a checkpoint or model path"
    spec = format_spec(fmt)
    if spec.adapters:
        if dtype not in (None, *spec.dtypes) or merge_lora:
            return (
                f"--format {fmt} writes the adapters alone, in {', '.join(spec.dtypes)};"
                " drop --dtype and --merge-lora"
            )
    elif dtype is not None and dtype_problem(fmt, dtype) is not None:
        return dtype_problem(fmt, dtype)
    try:
        check_output(out, overwrite)
    except FileExistsError as error:
        return str(error)
    return None


def export(
    source: str,
    out: str | Path,
    fmt: str,
    dtype: str | None = None,
    overwrite: bool = False,
    merge_lora: bool = False,
    from_checkpoint: bool = False,
) -> dict[str, Any]:
    """Write the weights at ``source`` to ``out`` as ``fmt`` after every check, as
    ``plugintrain convert`` (any readable source) and ``export`` (``from_checkpoint``: a
    checkpoint of ``plugintrain fit`` only) do; returns a summary of what was written.
    ``export`` writes a model card (``README.md``) with a Hugging Face directory, a PEFT
    adapter or a GGUF file (:mod:`plugintrain.formats.model_card`).

    Raises:
        ValueError, FileExistsError: One line, before anything is written.
    """
    problem = output_problem(source, Path(out), fmt, dtype, overwrite, merge_lora)
    if problem is not None:
        raise ValueError(problem)
    if from_checkpoint and not FORMATS[detect_format(resolve(source))].own_names:
        raise ValueError(
            f"{source} is not a checkpoint written by `plugintrain fit`; use `plugintrain"
            f" convert {source} {out} --format {fmt}` for weights in other formats"
        )
    summary: dict[str, Any] = {"source": source, "out": str(out), "format": fmt}
    if format_spec(fmt).adapters:  # the writer writes the adapter's model card too
        config = format_spec(fmt).writer()(source, Path(out), overwrite)
        modules = len(config["target_modules"])
        summary["card"] = str(Path(out) / CARD)
        return summary | {"r": config["r"], "lora_alpha": config["lora_alpha"], "modules": modules}
    problem = _lora_problem(source, merge_lora)
    if problem is not None:
        raise ValueError(problem)
    card = _CardWriter.of(source, Path(out), fmt, merge_lora) if from_checkpoint else None
    weights = convert(source, Path(out), fmt, dtype, overwrite, annotate=card)
    summary |= {"card": str(card.path)} if card is not None else {}
    return summary | {"model": weights.config.name, "tensors": len(weights.names())}


@dataclass(frozen=True)
class _CardWriter:
    """The model card of a checkpoint's export (:func:`~plugintrain.formats.model_card.
    model_card`) in a format with one (its :class:`~plugintrain.formats.registry.FormatSpec`'s
    ``card``; the PEFT adapter's writer writes its own), written once the weights are: into
    the directory before it is published, or beside a file (:func:`~plugintrain.formats.
    model_card.gguf_card_path`)."""

    reader: CheckpointReader
    out: Path
    fmt: str
    merged: bool
    path: Path
    """Where the card will be."""

    @classmethod
    def of(cls, source: str, out: Path, fmt: str, merged: bool) -> _CardWriter | None:
        """The card writer of an export of ``source`` to ``out``, None for a format without
        a card; where it goes is decided now, before anything is written.

        Raises:
            ValueError: A GGUF export whose card would replace a README.md export did not
                write (see :func:`~plugintrain.formats.model_card.gguf_card_path`).
        """
        if format_spec(fmt).card is None:
            return None
        path = out / CARD if format_spec(fmt).directory else gguf_card_path(out)
        return cls(CheckpointReader(resolve(source)), out, fmt, merged, path)

    def __call__(self, weights: Weights, dtype: str, partial: Path) -> None:
        """Write the card of ``weights`` written in ``dtype`` to the output ``partial``."""
        facts = checkpoint_facts(
            self.reader.hparams,
            self.reader.lora,
            self.fmt,
            name=self.out.resolve().name,
            architecture=weights.config.name,
            dtype=dtype,
            merged=self.merged,
        )
        text = model_card(self.reader.run, facts).encode()
        if partial.is_dir():
            (partial / CARD).write_bytes(text)
        else:
            write_file_atomically(self.path, lambda stream: stream.write(text))


def _lora_problem(source: str, merge_lora: bool) -> str | None:
    """``merge_lora`` given for a LoRA run's checkpoint, and only for one."""
    path = resolve(source)
    own = FORMATS[detect_format(path)].own_names
    record = CheckpointReader(path).lora if own else None
    if record is not None and not merge_lora:
        return (
            f"{source} holds a LoRA run's adapters (base: {record['base'] or 'in it'});"
            " pass --merge-lora to write the base with the adapters merged in"
        )
    if record is None and merge_lora:
        return f"{source} holds no LoRA adapters; drop --merge-lora"
    return None


def convert(
    source: str | Path,
    out: Path,
    fmt: str,
    dtype: str | None = None,
    overwrite: bool = False,
    annotate: Callable[[Weights, str, Path], None] | None = None,
) -> Weights:
    """Write the weights at ``source`` (any readable format) to ``out`` in format ``fmt``.

    Args:
        source: A path or pretrained name (see :func:`open_weights`).
        out: The output: a directory for a directory format (``hf``), else a file.
        fmt: One of :func:`~plugintrain.formats.registry.convert_formats`.
        dtype: One of the format's dtypes (``float32``, ``bfloat16``, ``float16``; GGUF
            also ``q8_0``); None keeps the source's (fp32 for quantized GGUF sources).
        overwrite: Replace an existing ``out``.
        annotate: Called with the weights read, the dtype written and the partial output
            once the weights are written, before the output is published (a model card).

    Returns:
        The weights read (their config names the architecture written).

    Raises:
        FileExistsError: If ``out`` exists and not ``overwrite`` (nothing is touched).
        WeightFormatError: For a source that cannot be read or a model the format cannot
            hold.
    """
    if fmt not in convert_formats():
        raise WeightFormatError(f"unknown format {fmt!r}; choose one of {convert_formats()}.")
    check_output(out, overwrite)
    weights = open_weights(source)
    kind = dtype or _source_dtype(weights)
    problem = dtype_problem(fmt, kind)
    if problem is not None:
        raise WeightFormatError(f"{problem}.")
    partial = sibling(out, PARTIAL_SUFFIX)
    remove(partial)
    try:
        format_spec(fmt).writer()(weights, partial, kind)
        if annotate is not None:
            annotate(weights, kind, partial)
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
    return {v: k for k, v in TORCH_DTYPES.items()}.get(weights.reader.dtype(first), "float32")
