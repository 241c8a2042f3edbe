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

    Writes a checkpoint written by `plugintrain fit` (a .ckpt file, a sharded checkpoint
    directory, or a run's checkpoints folder, meaning its newest) as a Hugging Face
    directory, an llm.c model file or GGUF (or a LoRA run's adapters as a PEFT adapter
    directory), one tensor at a time, into OUT.partial renamed into place; every check
    runs before anything is written.

    Args:
        ckpt: a checkpoint written by `plugintrain fit` (a .ckpt file, a sharded
            checkpoint directory, or a run's checkpoints folder: its newest complete one)
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
    from plugintrain.tools._models import newest_in

    try:
        ckpt = newest_in(ckpt) or ckpt
    except ValueError as error:
        raise ConfigError(str(error)) from None
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


def _run(job: _Job) -> int:
    """Every check, then the write (:func:`plugintrain.formats.export`); its summary as one
    JSON line."""
    from plugintrain.formats import export

    try:
        summary = export(
            job.source,
            job.out,
            job.format,
            job.dtype,
            job.overwrite,
            job.merge_lora,
            from_checkpoint=job.command == "export",
        )
    except (ValueError, FileExistsError, FileNotFoundError) as error:
        raise ConfigError(str(error)) from None
    print(json.dumps(summary))
    return 0
