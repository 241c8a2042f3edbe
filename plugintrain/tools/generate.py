"""``plugintrain generate``: sample text from a trained CausalLM checkpoint."""

from __future__ import annotations

import argparse
import inspect
import json
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from torch import Tensor

    from plugintrain.model_zoo import CausalLM


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="plugintrain generate", description="Sample text from a CausalLM checkpoint."
    )
    parser.add_argument(
        "--ckpt_path",
        required=True,
        help="a .ckpt written by `plugintrain fit`: a file, or the DCP directory of the"
        " hybrid and pipeline strategies",
    )
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


def load_causal_lm(path: str | Path) -> CausalLM:
    """A CausalLM from a checkpoint file, or from a distributed (DCP) checkpoint directory.

    A DCP directory (every plugintrain strategy but Lightning's own) holds every parameter
    under its full-model name, spread over the ranks' shard files; the weights are read
    into one state dict on the CPU, whatever the layout that wrote them.
    """
    from lightning.fabric.utilities.load import _METADATA_FILENAME

    from plugintrain.model_zoo import CausalLM, TransformerConfig
    from plugintrain.strategies.checkpoint import read_hparams

    path = Path(path)
    if not path.is_dir():
        return CausalLM.load_from_checkpoint(path, map_location="cpu")
    if not (path / _METADATA_FILENAME).is_file():
        raise FileNotFoundError(
            f"{path} is a directory without {_METADATA_FILENAME}: not a checkpoint written by"
            " `plugintrain fit`; pass its `last.ckpt` (file or directory)."
        )
    # LightningCLI adds its own entries (`_class_path`, ...) beside the arguments.
    accepted = inspect.signature(CausalLM).parameters
    hparams = {k: v for k, v in read_hparams(path).items() if k in accepted}
    if isinstance(hparams.get("config"), dict):  # a config object, saved as its fields
        hparams["config"] = TransformerConfig.from_dict(hparams["config"])
    module = CausalLM(**hparams)
    module.configure_model()
    module.load_state_dict(dcp_state_dict(path))
    return module


def dcp_state_dict(path: str | Path) -> dict[str, Tensor]:
    """The model weights of a DCP checkpoint directory by full name, on the CPU (only the
    weights are read, never the optimizer state)."""
    from plugintrain.strategies.checkpoint import read_weights

    return read_weights(Path(path))


def main(argv: Sequence[str]) -> int:
    """Run ``plugintrain generate``; prints each sample to stdout."""
    import torch

    from plugintrain.data import get_tokenizer

    args = _parser().parse_args(list(argv))
    torch.manual_seed(args.seed)
    module = load_causal_lm(args.ckpt_path)
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
