"""``plugintrain generate``: sample text from a checkpoint or pretrained weights, or answer
each conversation of a file (``--chat``) in the model's chat template.

Every argument is checked before anything is loaded; a bad one ends the command with
one line naming the value and the fix, and exit status 2.
"""

from __future__ import annotations

import json
import math
from argparse import Namespace
from pathlib import Path
from typing import TYPE_CHECKING

from plugintrain.cli_messages import ConfigError
from plugintrain.tools._command import aliases, shared_help
from plugintrain.tools._models import (
    ADAPTER_HELP,
    DEVICE_HELP,
    WEIGHTS_HELP,
    load_model,
    missing_path,
    model_tokenizer,
    read_conversations,
)
from plugintrain.tools._models import pick_device as _device

if TYPE_CHECKING:
    from plugintrain.data import HFTokenizer, Tokenizer
    from plugintrain.data.tokenizers.chat_templates import ChatEncoder
    from plugintrain.model_zoo.generation import PretrainedLM


def _argument_problem(args: Namespace) -> str | None:
    """What is wrong with the arguments, before any file is read; None when nothing is."""
    if args.prompt == "":
        return "--prompt is empty; give the text to continue, e.g. --prompt 'ROMEO:'"
    problem = _chat_problem(args)
    if problem is not None:
        return problem
    if args.max_new_tokens < 1:
        return f"--max_new_tokens must be >= 1, got {args.max_new_tokens}"
    if not math.isfinite(args.temperature) or args.temperature < 0:
        return f"--temperature must be >= 0 (0 is greedy), got {args.temperature}"
    if args.top_k < 1:
        return f"--top_k must be >= 1 (1 is greedy), got {args.top_k}"
    if args.num_samples < 1:
        return f"--num_samples must be >= 1, got {args.num_samples}"
    if args.weights is None and args.adapter is None:
        return "pass --weights (a checkpoint or pretrained weights), or --adapter"
    if args.merge_lora and args.adapter is None:
        return "--merge-lora merges an --adapter; pass --adapter <a LoRA run's last.ckpt>"
    return missing_path("--weights", args.weights) or missing_path("--adapter", args.adapter)


def _chat_problem(args: Namespace) -> str | None:
    """What is wrong with ``--chat`` and the options that go with it; None if nothing."""
    if args.chat is None:
        given = "--template" if args.template is not None else "--batch_size"
        alone = args.template is not None or args.batch_size is not None
        return f"{given} goes with --chat FILE; drop it" if alone else None
    if args.prompt is not None:
        return "--chat FILE holds the prompts; drop --prompt"
    if args.num_samples != 1:
        return "--chat answers each conversation once; drop --num_samples"
    if args.batch_size is not None and args.batch_size < 1:
        return f"--batch_size must be >= 1, got {args.batch_size}"
    if not Path(args.chat).is_file():
        return f'--chat {args.chat}: no such file; pass a .jsonl file of {{"messages": [...]}}'
    template = args.template
    if template not in (None, "plain") and not Path(template).is_file():
        return f"--template {template}: no such file; pass a .jinja file, or plain"
    return None


def _prompt_problem(prompt: list[int], args: Namespace, module: PretrainedLM) -> str | None:
    """What stops ``prompt`` (token ids) from being continued by ``module``; None if nothing."""
    top, reads = max(prompt), model_tokenizer(module)
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


def _print_samples(
    module: PretrainedLM, tokenizer: Tokenizer | HFTokenizer, prompt: list[int], args: Namespace
) -> None:
    import torch

    ids = torch.tensor([prompt], dtype=torch.long, device=module.device)
    lead = int(bool(getattr(tokenizer, "add_bos", False)) and prompt[:1] == [tokenizer.bos_id])
    for i in range(args.num_samples):
        out = module.generate(
            ids,
            max_new_tokens=args.max_new_tokens,
            temperature=args.temperature,
            top_k=args.top_k,
            use_cache=not args.no_cache,
        )
        tokens = out[0].tolist()
        text = tokenizer.decode(tokens[lead:])  # the text, without the BOS the model read
        if args.json:
            print(json.dumps({"sample": i, "text": text, "tokens": tokens}))
            continue
        if args.num_samples > 1:
            print(f"--- sample {i}")
        print(text)


def _print_answers(
    module: PretrainedLM,
    tokenizer: Tokenizer | HFTokenizer,
    encoder: ChatEncoder,
    conversations: list[list[dict[str, str]]],
    args: Namespace,
) -> None:
    """Print each conversation with the model's answer appended, one JSON line each."""
    from plugintrain.model_zoo.generation import complete

    prompts = [encoder.encode_prompt(messages) for messages in conversations]
    for n, prompt in enumerate(prompts, 1):
        problem = _prompt_problem(prompt, args, module)
        if problem is not None:
            raise ConfigError(f"{args.chat} conversation {n}: {problem}")
    answers = complete(
        module.model,
        prompts,
        args.max_new_tokens,
        encoder.stop_ids,
        args.batch_size or 8,
        temperature=args.temperature,
        top_k=args.top_k,
        use_cache=not args.no_cache,
    )
    for messages, answer in zip(conversations, answers, strict=True):
        reply = {"role": "assistant", "content": tokenizer.decode(answer)}
        print(json.dumps({"messages": [*messages, reply]}, ensure_ascii=False), flush=True)


def _load(args: Namespace) -> tuple[PretrainedLM, Tokenizer | HFTokenizer, ChatEncoder | None]:
    """The model on its device, the tokenizer of the prompts and, with ``--chat``, the
    encoder of the conversations; a bad option ends the command with one line."""
    from plugintrain.data import get_tokenizer

    try:  # a bad --device or --tokenizer is refused before the checkpoint is read
        device = _device(args.device)
        tokenizer = get_tokenizer(args.tokenizer) if args.tokenizer else None
        module = load_model(args.weights, args.adapter, args.merge_lora)
        spec = args.tokenizer or model_tokenizer(module)
        tokenizer = tokenizer or get_tokenizer(spec)
        encoder = None if args.chat is None else _chat_encoder(tokenizer, spec, args.template)
    except (FileNotFoundError, ValueError) as error:  # incl. unsafe or truncated files
        raise ConfigError(str(error)) from None
    return module.to(device).eval(), tokenizer, encoder


def _chat_encoder(
    tokenizer: Tokenizer | HFTokenizer, spec: str, template: str | None
) -> ChatEncoder:
    """The encoder of conversations in ``template`` (None: the tokenizer's own)."""
    from plugintrain.data.tokenizers.chat_templates import ChatEncoder, load_chat_template

    return ChatEncoder(tokenizer, load_chat_template(spec, template))


@aliases(weights="--ckpt_path", merge_lora="--merge-lora")
@shared_help(weights=WEIGHTS_HELP, adapter=ADAPTER_HELP, device=DEVICE_HELP)
def generate(
    *,
    weights: str | None = None,
    adapter: str | None = None,
    merge_lora: bool = False,
    prompt: str | None = None,
    chat: str | None = None,
    template: str | None = None,
    batch_size: int | None = None,
    max_new_tokens: int = 200,
    temperature: float = 0.8,
    top_k: int = 200,
    num_samples: int = 1,
    seed: int = 1337,
    tokenizer: str | None = None,
    no_cache: bool = False,
    json: bool = False,
    device: str | None = None,
) -> int:
    """Sample text from a checkpoint or pretrained weights, or answer conversations (--chat).

    Args:
        weights: the model's weights
        adapter: a LoRA run's or PEFT adapters on them
        merge_lora: merge the --adapter into the base weights before generating (faster)
        prompt: text to continue (not empty; default: a newline)
        chat: answer each conversation of a .jsonl file (one {"messages": [...]} a line) or
            a .json file (a list of them), rendered in the model's chat template; prints
            each with the answer appended, one JSON line per conversation
        template: with --chat: a .jinja chat template, or plain (default: the model's own)
        batch_size: with --chat: most conversations answered together, among those whose
            prompts are equally long (default: 8)
        max_new_tokens: tokens to add (>= 1)
        temperature: 0 picks the most likely token (greedy)
        top_k: sample among the k most likely (>= 1)
        num_samples: samples drawn from the prompt
        seed: seed of the sampling
        tokenizer: gpt2, llama3, a pretrained model, or the path of a tokenizer.json, a
            directory holding one or a .gguf file (default: the tokenizer that came with
            the model's weights, else its family's)
        no_cache: recompute attention each step; the context is cropped to the model's
            block_size
        json: print one JSON object per sample (text and token ids)
        device: where the model runs
    """
    args = Namespace(**locals())  # the helpers below read the options by name
    return _generate(args)


def _generate(args: Namespace) -> int:
    """``generate``'s work, its options checked first."""
    problem = _argument_problem(args)
    if problem is not None:
        raise ConfigError(problem)
    try:
        conversations = None if args.chat is None else read_conversations(Path(args.chat))
    except ValueError as error:
        raise ConfigError(str(error)) from None

    import torch

    torch.manual_seed(args.seed)
    module, tokens, encoder = _load(args)
    if encoder is not None:
        _print_answers(module, tokens, encoder, conversations, args)
        return 0
    # BOS as the family's own tokenizer does it (Llama 3 leads every text with it; GPT-2
    # and SmolLM2 do not), read from the tokenizer's configuration, as llama.cpp does.
    text = "\n" if args.prompt is None else args.prompt
    ids = tokens.encode(text, bos=bool(getattr(tokens, "add_bos", False)))
    problem = _prompt_problem(ids, args, module)
    if problem is not None:
        raise ConfigError(problem)
    _print_samples(module, tokens, ids, args)
    return 0
