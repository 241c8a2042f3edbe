"""``plugintrain export`` and ``plugintrain convert``: weights out to other tools.

``export CKPT OUT --format hf|llmc|gguf`` writes a checkpoint of ``plugintrain fit`` (one
file, or the DCP directory of any sharded layout) for ``transformers``, llm.c or
llama.cpp; ``convert SRC OUT --format ...`` does the same from any format plugintrain
reads. Both read and write one tensor at a time, write ``OUT.partial`` and rename it into
place, and refuse an existing ``OUT`` without ``--overwrite``: every check runs before
anything is written.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from plugintrain.cli_messages import ConfigError
from plugintrain.formats.registry import convert_formats, dtypes, export_formats
from plugintrain.tools._command import aliases

# The choices of --format and --dtype, read from the format registry (no torch needed).
ConvertFormat = Literal[tuple(convert_formats())]  # type: ignore[valid-type]
ExportFormat = Literal[tuple(export_formats())]  # type: ignore[valid-type]
Dtype = Literal[tuple(dtypes())]  # type: ignore[valid-type]


@dataclass(frozen=True)
class _Job:
    """What one ``export`` or ``convert`` writes."""

    command: str
    source: str
    out: str
    format: str
    dtype: str | None
    overwrite: bool
    merge_lora: bool


@aliases(merge_lora="--merge-lora")
def export(
    ckpt: str,
    out: str,
    *,
    format: ExportFormat,
    dtype: Dtype | None = None,
    overwrite: bool = False,
    merge_lora: bool = False,
) -> int:
    """A checkpoint for transformers, llm.c or llama.cpp, or its LoRA adapters for peft.

    Writes a checkpoint written by `plugintrain fit` (a .ckpt file or a sharded checkpoint
    directory) as a Hugging Face directory, an llm.c model file or GGUF (or a LoRA run's
    adapters as a PEFT adapter directory), one tensor at a time, into OUT.partial renamed
    into place; every check runs before anything is written.

    Args:
        ckpt: a checkpoint written by `plugintrain fit` (a .ckpt file or a sharded
            checkpoint directory)
        out: output: a directory for hf and peft, a file for llmc and gguf
        format: output format; peft: a LoRA run's adapters as PEFT writes them
            (adapter_config.json and adapter_model.safetensors, Hugging Face module names),
            for peft, transformers and vLLM
        dtype: weight type written (default: the source's; q8_0 for gguf only; llm.c takes
            float32 or bfloat16)
        overwrite: replace OUT if it exists (atomically)
        merge_lora: CKPT is a LoRA run's checkpoint: write its base weights with the
            adapters merged in (W + alpha/r B A, one tensor at a time)
    """
    return _run(_Job("export", ckpt, out, format, dtype, overwrite, merge_lora))


@aliases(merge_lora="--merge-lora")
def convert(
    src: str,
    out: str,
    *,
    format: ConvertFormat,
    dtype: Dtype | None = None,
    overwrite: bool = False,
    merge_lora: bool = False,
) -> int:
    """Weights between formats.

    Writes weights in any format plugintrain reads (a checkpoint, a Hugging Face model
    directory, an llm.c .bin, a .gguf file, or a pretrained name such as smollm2-135m) as a
    Hugging Face directory, an llm.c model file or GGUF, one tensor at a time, into
    OUT.partial renamed into place; every check runs before anything is written.

    Args:
        src: weights in any format plugintrain reads: a checkpoint, a Hugging Face model
            directory, an llm.c .bin, a .gguf file, or a pretrained name (smollm2-135m)
        out: output: a directory for hf, a file for llmc and gguf
        format: output format
        dtype: weight type written (default: the source's; q8_0 for gguf only; llm.c takes
            float32 or bfloat16)
        overwrite: replace OUT if it exists (atomically)
        merge_lora: SRC is a LoRA run's checkpoint: write its base weights with the
            adapters merged in (W + alpha/r B A, one tensor at a time)
    """
    return _run(_Job("convert", src, out, format, dtype, overwrite, merge_lora))


def _problem(args: _Job) -> str | None:
    """What is wrong before anything is read; None when nothing is."""
    from plugintrain.data.assets import PRETRAINED_MODELS
    from plugintrain.formats import check_output, dtype_problem

    source, out = str(args.source), Path(args.out)
    if not Path(source).exists() and source not in PRETRAINED_MODELS:
        return f"{source}: no such file or directory; pass a checkpoint or model path"
    if args.format == "peft":
        if args.dtype not in (None, "float32") or args.merge_lora:
            return (
                "--format peft writes the adapters alone, in float32; drop --dtype and --merge-lora"
            )
    elif args.dtype is not None and dtype_problem(args.format, args.dtype) is not None:
        return dtype_problem(args.format, args.dtype)
    try:
        check_output(out, args.overwrite)
    except FileExistsError as error:
        return str(error)
    return None


def _adapter_problem(args: _Job) -> str | None:
    """``--merge-lora`` given for a LoRA run's checkpoint, and only for one."""
    from plugintrain.formats import detect_format, resolve
    from plugintrain.formats.checkpoint import CheckpointReader

    path = resolve(args.source)
    record = CheckpointReader(path).lora if detect_format(path) == "checkpoint" else None
    if record is not None and not args.merge_lora:
        return (
            f"{args.source} holds a LoRA run's adapters (base: {record['base'] or 'in it'});"
            " pass --merge-lora to write the base with the adapters merged in"
        )
    if record is None and args.merge_lora:
        return f"{args.source} holds no LoRA adapters; drop --merge-lora"
    return None


def _run(args: _Job) -> int:
    problem = _problem(args)
    if problem is not None:
        raise ConfigError(problem)
    from plugintrain.formats import convert, detect_format, resolve

    if args.command == "export" and detect_format(resolve(args.source)) != "checkpoint":
        raise ConfigError(
            f"{args.source} is not a checkpoint written by `plugintrain fit`; use"
            f" `plugintrain convert {args.source} {args.out} --format {args.format}` for"
            " weights in other formats"
        )
    if args.format == "peft":
        return _export_peft(args)
    try:
        problem = _adapter_problem(args)
    except ValueError as error:  # a damaged checkpoint, named
        problem = str(error)
    if problem is not None:
        raise ConfigError(problem)
    try:
        weights = convert(args.source, Path(args.out), args.format, args.dtype, args.overwrite)
    except (ValueError, FileExistsError, FileNotFoundError) as error:
        raise ConfigError(str(error)) from None
    summary = {
        "source": str(args.source),
        "out": args.out,
        "format": args.format,
        "model": weights.config.name,
        "tensors": len(weights.names()),
    }
    print(json.dumps(summary))
    return 0


def _export_peft(args: _Job) -> int:
    from plugintrain.formats.peft_adapters import export_peft

    try:
        config = export_peft(args.source, Path(args.out), args.overwrite)
    except (ValueError, FileExistsError) as error:
        raise ConfigError(str(error)) from None
    summary = {
        "source": str(args.source),
        "out": args.out,
        "format": "peft",
        "r": config["r"],
        "lora_alpha": config["lora_alpha"],
        "modules": len(config["target_modules"]),
    }
    print(json.dumps(summary))
    return 0
