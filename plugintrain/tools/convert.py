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
from collections.abc import Sequence
from pathlib import Path

from plugintrain.tools._args import ToolParser

_FORMATS = ("hf", "llmc", "gguf")  # plugintrain.formats.FORMATS, known before torch loads
_EXPORT_FORMATS = (*_FORMATS, "peft")  # a LoRA run's adapters alone, for peft / vLLM
_DTYPES = ("float32", "bfloat16", "float16", "q8_0")  # each held by some format


def _parser(command: str) -> ToolParser:
    source = "CKPT" if command == "export" else "SRC"
    what = (
        "a checkpoint written by `plugintrain fit` (a .ckpt file or a sharded checkpoint directory)"
        if command == "export"
        else "weights in any format plugintrain reads: a checkpoint, a Hugging Face model"
        " directory, an llm.c .bin, a .gguf file, or a pretrained name (smollm2-135m)"
    )
    parser = ToolParser(
        prog=f"plugintrain {command}",
        description=f"Write {what} as a Hugging Face directory, an llm.c model file or GGUF"
        + (
            " (or a LoRA run's adapters as a PEFT adapter directory)."
            if command == "export"
            else "."
        ),
    )
    parser.add_argument("source", metavar=source, help=what)
    parser.add_argument(
        "out", metavar="OUT", help="output: a directory for hf and peft, a file for llmc and gguf"
    )
    parser.add_argument(
        "--format",
        choices=_EXPORT_FORMATS if command == "export" else _FORMATS,
        required=True,
        help="output format"
        + (
            "; peft: a LoRA run's adapters as PEFT writes them (adapter_config.json and"
            " adapter_model.safetensors, Hugging Face module names), for peft, transformers"
            " and vLLM"
            if command == "export"
            else ""
        ),
    )
    parser.add_argument(
        "--dtype",
        choices=_DTYPES,
        default=None,
        help="weight type written (default: the source's; q8_0 for gguf only; llm.c takes"
        " float32 or bfloat16)",
    )
    parser.add_argument(
        "--overwrite", action="store_true", help="replace OUT if it exists (atomically)"
    )
    parser.add_argument(
        "--merge-lora",
        action="store_true",
        help=f"{source} is a LoRA run's checkpoint: write its base weights with the adapters"
        " merged in (W + alpha/r B A, one tensor at a time)",
    )
    return parser


def _problem(args: object, command: str) -> str | None:
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


def _adapter_problem(args: object) -> str | None:
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


def _run(command: str, argv: Sequence[str]) -> int:
    parser = _parser(command)
    args = parser.parse_args(list(argv))
    problem = _problem(args, command)
    if problem is not None:
        parser.error(problem)
    from plugintrain.formats import convert, detect_format, resolve

    if command == "export" and detect_format(resolve(args.source)) != "checkpoint":
        parser.error(
            f"{args.source} is not a checkpoint written by `plugintrain fit`; use"
            f" `plugintrain convert {args.source} {args.out} --format {args.format}` for"
            " weights in other formats"
        )
    if args.format == "peft":
        return _export_peft(args, parser)
    try:
        problem = _adapter_problem(args)
    except ValueError as error:  # a damaged checkpoint, named
        problem = str(error)
    if problem is not None:
        parser.error(problem)
    try:
        weights = convert(args.source, Path(args.out), args.format, args.dtype, args.overwrite)
    except (ValueError, FileExistsError, FileNotFoundError) as error:
        parser.error(str(error))
    summary = {"source": str(args.source), "out": args.out, "format": args.format,
               "model": weights.config.name, "tensors": len(weights.names())}  # fmt: skip
    print(json.dumps(summary))
    return 0


def _export_peft(args: object, parser: ToolParser) -> int:
    from plugintrain.formats.peft_adapters import export_peft

    try:
        config = export_peft(args.source, Path(args.out), args.overwrite)
    except (ValueError, FileExistsError) as error:
        parser.error(str(error))
    summary = {"source": str(args.source), "out": args.out, "format": "peft",
               "r": config["r"], "lora_alpha": config["lora_alpha"],
               "modules": len(config["target_modules"])}  # fmt: skip
    print(json.dumps(summary))
    return 0


def export_main(argv: Sequence[str]) -> int:
    """Run ``plugintrain export``."""
    return _run("export", argv)


def convert_main(argv: Sequence[str]) -> int:
    """Run ``plugintrain convert``."""
    return _run("convert", argv)
