"""``plugintrain generate``: sample text from a trained CausalLM checkpoint."""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="plugintrain generate", description="Sample text from a CausalLM checkpoint."
    )
    parser.add_argument("--ckpt_path", required=True, help="a .ckpt written by `plugintrain fit`")
    parser.add_argument("--prompt", default="\n", help="text to continue")
    parser.add_argument("--max_new_tokens", type=int, default=200)
    parser.add_argument(
        "--temperature", type=float, default=0.8, help="0 picks the most likely token (greedy)"
    )
    parser.add_argument("--top_k", type=int, default=200, help="sample among the k most likely")
    parser.add_argument("--num_samples", type=int, default=1)
    parser.add_argument("--seed", type=int, default=1337)
    parser.add_argument(
        "--tokenizer",
        choices=("gpt2", "llama3"),
        default=None,
        help="default: the tokenizer of the model's family",
    )
    parser.add_argument("--no_cache", action="store_true", help="recompute attention each step")
    parser.add_argument(
        "--json", action="store_true", help="print one JSON object per sample (text and token ids)"
    )
    return parser


def main(argv: Sequence[str]) -> int:
    """Run ``plugintrain generate``; prints each sample to stdout."""
    import torch

    from plugintrain.data import get_tokenizer
    from plugintrain.model_zoo import CausalLM

    args = _parser().parse_args(list(argv))
    torch.manual_seed(args.seed)
    module = CausalLM.load_from_checkpoint(args.ckpt_path, map_location="cpu")
    module.eval()
    tokenizer = get_tokenizer(args.tokenizer or module.config.family)
    prompt = torch.tensor([tokenizer.encode(args.prompt)], dtype=torch.long)
    for i in range(args.num_samples):
        out = module.generate(
            prompt,
            max_new_tokens=args.max_new_tokens,
            temperature=args.temperature,
            top_k=args.top_k,
            use_cache=not args.no_cache,
        )
        ids = out[0].tolist()
        if args.json:
            print(json.dumps({"sample": i, "text": tokenizer.decode(ids), "tokens": ids}))
            continue
        if args.num_samples > 1:
            print(f"--- sample {i}")
        print(tokenizer.decode(ids))
    return 0
