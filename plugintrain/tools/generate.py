"""``plugintrain generate``: sample text from a checkpoint or pretrained weights.

Every argument is checked before anything is loaded; a bad one ends the command with
one line naming the value and the fix, and exit status 2.
"""

from __future__ import annotations

import json
import math
import sys
from argparse import Namespace
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from plugintrain.data.assets import PRETRAINED_MODELS
from plugintrain.tools._args import ToolParser

if TYPE_CHECKING:
    import torch

    from plugintrain.data import HFTokenizer, Tokenizer
    from plugintrain.model_zoo.generation import PretrainedLM


def _parser() -> ToolParser:
    parser = ToolParser(
        prog="plugintrain generate", description="Sample text from a CausalLM checkpoint."
    )
    parser.add_argument(
        "--weights",
        "--ckpt_path",
        dest="ckpt_path",
        default=None,
        help="a .ckpt written by `plugintrain fit` (a file, or the DCP directory of the"
        " sharded strategies), or pretrained weights: a Hugging Face model directory, an"
        f" llm.c .bin, a .gguf file, or one of {', '.join(PRETRAINED_MODELS)}. A LoRA run's"
        " checkpoint alone means its base with the adapters merged",
    )
    parser.add_argument(
        "--adapter",
        default=None,
        help="a LoRA run's checkpoint: its adapters on the --weights base (default: the base"
        " the adapters were trained on), kept apart from the base weights",
    )
    parser.add_argument(
        "--merge-lora",
        "--merge_lora",
        dest="merge_lora",
        action="store_true",
        help="merge the --adapter into the base weights before generating (faster)",
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
        default=None,
        help="gpt2, llama3, a pretrained model, or the path of a tokenizer.json, a directory"
        " holding one or a .gguf file (default: the tokenizer that came with the model's"
        " weights, else its family's)",
    )
    parser.add_argument(
        "--no_cache",
        action="store_true",
        help="recompute attention each step; the context is cropped to the model's block_size",
    )
    parser.add_argument(
        "--json", action="store_true", help="print one JSON object per sample (text and token ids)"
    )
    parser.add_argument(
        "--device",
        default=None,
        help="where the model runs: cpu, cuda, cuda:N, mps, ... (default: cuda when a GPU is"
        " available, else cpu)",
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
    if args.ckpt_path is None and args.adapter is None:
        return "pass --weights (a checkpoint or pretrained weights), or --adapter"
    if args.merge_lora and args.adapter is None:
        return "--merge-lora merges an --adapter; pass --adapter <a LoRA run's last.ckpt>"
    weights = "--ckpt_path" if getattr(args, "spelled_ckpt_path", False) else "--weights"
    for option, path in ((weights, args.ckpt_path), ("--adapter", args.adapter)):
        if path is not None and not Path(path).exists() and path not in PRETRAINED_MODELS:
            return (
                f"{option} {path}: no such file or directory; pass the last.ckpt that"
                " `plugintrain fit` wrote, e.g. runs/<recipe>/checkpoints/last.ckpt"
            )
    return None


def _device(spec: str | None) -> torch.device:
    """The device ``--device`` names; by default CUDA when available, else the CPU.

    Raises:
        ValueError: Naming the value, when torch knows no such device or this machine has
            none (``--device cuda`` without a GPU).
    """
    import torch

    if spec is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(spec)
    except RuntimeError:
        raise ValueError(f"--device {spec}: not a device; pass cpu, cuda, cuda:N or mps") from None
    if device.type == "cpu":
        return device
    here = torch.accelerator.current_accelerator(check_available=True)  # None: CPU only
    if here is None or here.type != device.type:
        found = "no accelerator" if here is None else f"{here.type}, not {device.type}"
        raise ValueError(f"--device {spec}: this machine has {found}; pass --device cpu")
    count = torch.accelerator.device_count()
    if device.index is not None and device.index >= count:
        raise ValueError(f"--device {spec}: this machine has {count} {device.type} device(s)")
    return device


def _prompt_problem(prompt: list[int], args: Namespace, module: PretrainedLM) -> str | None:
    """What stops ``prompt`` (token ids) from being continued by ``module``; None if nothing."""
    top, reads = max(prompt), _model_tokenizer(module)
    if top >= module.vocab_size:
        own = args.tokenizer in (None, reads)
        return (
            f"the prompt holds token id {top} ({args.tokenizer or reads} tokenizer), outside"
            f" the model's vocab_size={module.vocab_size}; "
            + (
                "use a prompt within its vocabulary"
                if own
                else f"drop --tokenizer {args.tokenizer}: the model reads {reads} tokens"
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


def _newest_in(path: str | None) -> str | None:
    """A run's checkpoint directory (``runs/<recipe>/checkpoints``) means its newest
    complete checkpoint, as ``--ckpt_path last`` does for ``fit``; anything else itself."""
    from plugintrain.checkpoints.files import newest_complete
    from plugintrain.formats import detect_format

    if path is None or not Path(path).is_dir() or path in PRETRAINED_MODELS:
        return path
    try:
        detect_format(Path(path))
        return path  # a model directory or a sharded checkpoint
    except ValueError:
        newest = newest_complete(Path(path))
    if newest is None:
        raise ValueError(f"{path} holds no complete checkpoint; pass a .ckpt file or model")
    print(f"plugintrain: using {newest} (the newest complete checkpoint)", file=sys.stderr)
    return str(newest)


def load_causal_lm(path: str | Path) -> PretrainedLM:
    """A language model from anything plugintrain reads weights from: a checkpoint file or
    DCP directory written by ``plugintrain fit``, a Hugging Face model directory, an llm.c
    ``.bin``, a ``.gguf`` file, or a pretrained name such as ``smollm2-135m``.

    Built as :class:`~plugintrain.model_zoo.CausalLM` builds its transformer, without
    Lightning: the architecture the file holds (a checkpoint's saved hyperparameters, JSON
    beside a directory's shards), on meta, then loaded tensor by tensor. A DCP directory's
    weights are read into one model on the CPU, whatever the layout that wrote them.
    Nothing is unpickled beyond tensors and plain data.
    """
    from plugintrain.model_zoo.generation import PretrainedLM

    return PretrainedLM(weights=str(path))


def load_with_adapter(weights: str | None, adapter: str, merge: bool) -> PretrainedLM:
    """The base model ``weights`` (default: the one the adapters were trained on, checked
    by sha256) with the LoRA adapters of the checkpoint ``adapter`` in it, merged into its
    weights if ``merge``."""
    from plugintrain.formats import lora_checkpoints
    from plugintrain.formats.checkpoint import CheckpointReader
    from plugintrain.model_zoo import lora

    record = CheckpointReader(Path(adapter)).lora
    if record is None or record["base"] is None:
        raise ValueError(
            f"--adapter {adapter} holds a whole model (no LoRA run's adapters on a base"
            f" file); pass it as --weights {adapter}"
        )
    base = weights or record["base"]
    lora_checkpoints.check_named_base(record, base, "--weights")
    module = load_causal_lm(base)
    lora_checkpoints.load_adapter(module, adapter)
    if merge:
        lora.merge(module)
    return module


def _print_samples(
    module: PretrainedLM, tokenizer: Tokenizer | HFTokenizer, prompt: list[int], args: Namespace
) -> None:
    import torch

    ids = torch.tensor([prompt], dtype=torch.long, device=module.device)
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


def _model_tokenizer(module: PretrainedLM) -> str:
    """The tokenizer spec the model reads: the one its weights came with, else its family's."""
    return module.config.tokenizer or module.config.family


def main(argv: Sequence[str]) -> int:
    """Run ``plugintrain generate``; prints each sample to stdout."""
    parser = _parser()
    args = parser.parse_args(list(argv))
    args.spelled_ckpt_path = any(a.startswith("--ckpt_path") for a in argv)  # for messages
    problem = _argument_problem(args)
    if problem is not None:
        parser.error(problem)

    import torch

    from plugintrain.data import get_tokenizer

    torch.manual_seed(args.seed)
    try:  # a bad --device or --tokenizer is refused before the checkpoint is read
        device = _device(args.device)
        tokenizer = get_tokenizer(args.tokenizer) if args.tokenizer else None
        args.ckpt_path, args.adapter = _newest_in(args.ckpt_path), _newest_in(args.adapter)
        if args.adapter is None:
            module = load_causal_lm(args.ckpt_path)
        else:
            module = load_with_adapter(args.ckpt_path, args.adapter, args.merge_lora)
        tokenizer = tokenizer or get_tokenizer(_model_tokenizer(module))
    except (FileNotFoundError, ValueError) as error:  # incl. unsafe or truncated files
        parser.error(str(error))
    module.to(device).eval()
    prompt = tokenizer.encode(args.prompt)
    problem = _prompt_problem(prompt, args, module)
    if problem is not None:
        parser.error(problem)
    _print_samples(module, tokenizer, prompt, args)
    return 0
