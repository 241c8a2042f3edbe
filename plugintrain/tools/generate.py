"""``plugintrain generate``: sample text from a trained CausalLM checkpoint.

Every argument is checked before anything is loaded; a bad one ends the command with
one line naming the value and the fix, and exit status 2.
"""

from __future__ import annotations

import inspect
import json
import math
from argparse import Namespace
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from plugintrain.tools._args import ToolParser

if TYPE_CHECKING:
    from torch import Tensor

    from plugintrain.data import Tokenizer
    from plugintrain.model_zoo import CausalLM


def _parser() -> ToolParser:
    parser = ToolParser(
        prog="plugintrain generate", description="Sample text from a CausalLM checkpoint."
    )
    parser.add_argument(
        "--ckpt_path",
        required=True,
        help="a .ckpt written by `plugintrain fit`: a file, or the DCP directory of the"
        " hybrid and pipeline strategies",
    )
    parser.add_argument("--prompt", default="\n", help="text to continue (not empty)")
    parser.add_argument("--max_new_tokens", type=int, default=200, help="tokens to add (>= 1)")
    parser.add_argument(
        "--temperature", type=float, default=0.8, help="0 picks the most likely token (greedy)"
    )
    parser.add_argument(
        "--top_k", type=int, default=200, help="sample among the k most likely (>= 1)"
    )
    parser.add_argument("--num_samples", type=int, default=1)
    parser.add_argument("--seed", type=int, default=1337)
    parser.add_argument(
        "--tokenizer",
        choices=("gpt2", "llama3"),
        default=None,
        help="default: the tokenizer of the model's family",
    )
    parser.add_argument(
        "--no_cache",
        action="store_true",
        help="recompute attention each step; the context is cropped to the model's block_size",
    )
    parser.add_argument(
        "--json", action="store_true", help="print one JSON object per sample (text and token ids)"
    )
    return parser


def _argument_problem(args: Namespace) -> str | None:
    """What is wrong with the arguments, before any file is read; None when nothing is."""
    if not args.prompt:
        return "--prompt is empty; give the text to continue, e.g. --prompt 'ROMEO:'"
    if args.max_new_tokens < 1:
        return f"--max_new_tokens must be >= 1, got {args.max_new_tokens}"
    if not math.isfinite(args.temperature) or args.temperature < 0:
        return f"--temperature must be >= 0 (0 is greedy), got {args.temperature}"
    if args.top_k < 1:
        return f"--top_k must be >= 1 (1 is greedy), got {args.top_k}"
    if args.num_samples < 1:
        return f"--num_samples must be >= 1, got {args.num_samples}"
    if not Path(args.ckpt_path).exists():
        return (
            f"--ckpt_path {args.ckpt_path}: no such file or directory; pass the last.ckpt that"
            " `plugintrain fit` wrote, e.g. runs/<recipe>/checkpoints/last.ckpt"
        )
    return None


def _prompt_problem(prompt: list[int], args: Namespace, module: CausalLM) -> str | None:
    """What stops ``prompt`` (token ids) from being continued by ``module``; None if nothing."""
    top, family = max(prompt), module.config.family
    if top >= module.vocab_size:
        own = args.tokenizer in (None, family)
        return (
            f"the prompt holds token id {top} ({args.tokenizer or family} tokenizer), outside"
            f" the model's vocab_size={module.vocab_size}; "
            + (
                "use a prompt within its vocabulary"
                if own
                else f"drop --tokenizer {args.tokenizer}: the model reads {family} tokens"
            )
        )
    total, limit = len(prompt) + args.max_new_tokens, module.max_seq_len
    if args.no_cache or total <= limit:
        return None
    fewer = f"--max_new_tokens {limit - len(prompt)}, or " if len(prompt) < limit else ""
    return (
        f"the prompt's {len(prompt)} tokens + --max_new_tokens {args.max_new_tokens} = {total}"
        f" exceed the model's block_size={limit}; pass {fewer}--no_cache to crop the context"
        f" to the last {limit} tokens"
    )


def load_causal_lm(path: str | Path) -> CausalLM:
    """A CausalLM from a checkpoint file, or from a distributed (DCP) checkpoint directory.

    A DCP directory (every plugintrain strategy but Lightning's own) holds every parameter
    under its full-model name, spread over the ranks' shard files; the weights are read
    into one state dict on the CPU, whatever the layout that wrote them. Nothing is
    unpickled beyond tensors and plain data: the model is rebuilt from the saved
    hyperparameters (JSON beside a directory's shards).
    """
    from plugintrain.checkpoint_files import LIGHTNING_METADATA, load_torch_file
    from plugintrain.model_zoo import CausalLM, TransformerConfig
    from plugintrain.strategies.checkpoint import read_hparams

    path = Path(path)
    if path.is_dir():
        if not (path / LIGHTNING_METADATA).is_file():
            raise FileNotFoundError(
                f"{path} is a directory without {LIGHTNING_METADATA}: not a checkpoint written"
                " by `plugintrain fit`; pass its `last.ckpt` (file or directory)."
            )
        hparams, weights = read_hparams(path), None
    else:
        checkpoint = load_torch_file(path, map_location="cpu", mmap=True)
        hparams, weights = checkpoint.get("hyper_parameters", {}), checkpoint["state_dict"]
    # LightningCLI adds its own entries (`_class_path`, ...) beside the arguments.
    accepted = inspect.signature(CausalLM).parameters
    hparams = {k: v for k, v in hparams.items() if k in accepted}
    if isinstance(hparams.get("config"), dict):  # a config object, saved as its fields
        hparams["config"] = TransformerConfig.from_dict(hparams["config"])
    module = CausalLM(**hparams)
    module.configure_model()
    module.load_state_dict(dcp_state_dict(path) if weights is None else weights)
    return module


def dcp_state_dict(path: str | Path) -> dict[str, Tensor]:
    """The model weights of a DCP checkpoint directory by full name, on the CPU (only the
    weights are read, never the optimizer state)."""
    from plugintrain.strategies.checkpoint import read_weights

    return read_weights(Path(path))


def _print_samples(
    module: CausalLM, tokenizer: Tokenizer, prompt: list[int], args: Namespace
) -> None:
    import torch

    ids = torch.tensor([prompt], dtype=torch.long)
    for i in range(args.num_samples):
        out = module.generate(
            ids,
            max_new_tokens=args.max_new_tokens,
            temperature=args.temperature,
            top_k=args.top_k,
            use_cache=not args.no_cache,
        )
        tokens = out[0].tolist()
        if args.json:
            print(json.dumps({"sample": i, "text": tokenizer.decode(tokens), "tokens": tokens}))
            continue
        if args.num_samples > 1:
            print(f"--- sample {i}")
        print(tokenizer.decode(tokens))


def main(argv: Sequence[str]) -> int:
    """Run ``plugintrain generate``; prints each sample to stdout."""
    parser = _parser()
    args = parser.parse_args(list(argv))
    problem = _argument_problem(args)
    if problem is not None:
        parser.error(problem)

    import torch

    from plugintrain.data import get_tokenizer

    torch.manual_seed(args.seed)
    try:
        module = load_causal_lm(args.ckpt_path)
    except (FileNotFoundError, ValueError) as error:  # incl. unsafe or truncated files
        parser.error(str(error))
    module.eval()
    tokenizer = get_tokenizer(args.tokenizer or module.config.family)
    prompt = tokenizer.encode(args.prompt)
    problem = _prompt_problem(prompt, args, module)
    if problem is not None:
        parser.error(problem)
    _print_samples(module, tokenizer, prompt, args)
    return 0
