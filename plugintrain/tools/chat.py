"""``plugintrain chat``: talk to a model in its chat template.

Each line read is a user message. The conversation is kept as messages and rendered in
the model's chat template every turn; the reply is printed while it is generated and
ends at the template's end of turn. A conversation that outgrows the model's context
loses its oldest exchanges (never the system prompt). ``/reset`` starts over, ``/exit``,
the end of input and Ctrl-C end the command (exit status 0).

Every option is checked before the model loads; a bad one ends the command with one line
naming the value and the fix, and exit status 2.
"""

from __future__ import annotations

import contextlib
import math
import sys
from argparse import Namespace
from pathlib import Path
from typing import TYPE_CHECKING, TextIO

from plugintrain.cli_messages import ConfigError
from plugintrain.tools._command import shared_help
from plugintrain.tools._models import (
    DEVICE_HELP,
    MERGED_ADAPTER_HELP,
    WEIGHTS_HELP,
    load_model,
    missing_path,
    model_tokenizer,
    pick_device,
)

if TYPE_CHECKING:
    from plugintrain.data import HFTokenizer, Tokenizer
    from plugintrain.data.tokenizers.chat_templates import ChatEncoder
    from plugintrain.model_zoo.generation import PretrainedLM

COMMANDS = {"/reset": "start the conversation over", "/exit": "end the chat"}


def _argument_problem(args: Namespace) -> str | None:
    """What is wrong with the arguments, before any file is read; None when nothing is."""
    if args.max_new_tokens is not None and args.max_new_tokens < 1:
        return f"--max_new_tokens must be >= 1, got {args.max_new_tokens}"
    if not math.isfinite(args.temperature) or args.temperature < 0:
        return f"--temperature must be >= 0 (0 is greedy), got {args.temperature}"
    if args.top_k < 1:
        return f"--top_k must be >= 1 (1 is greedy), got {args.top_k}"
    if args.system == "":
        return "--system is empty; give the instructions, or drop --system"
    if args.weights is None and args.adapter is None:
        return "pass --weights (a checkpoint or pretrained weights), or --adapter"
    if args.template not in (None, "plain") and not Path(args.template).is_file():
        return f"--template {args.template}: no such file; pass a .jinja file, or plain"
    return missing_path("--weights", args.weights) or missing_path("--adapter", args.adapter)


class Conversation:
    """The messages so far, kept within the prompt tokens the model has room for.

    Args:
        encoder: Renders and tokenizes messages in the model's chat template.
        system: The system prompt, kept when older turns are dropped; None: none.
        budget: Most prompt tokens: the model's ``block_size`` less the reply's tokens.
    """

    def __init__(self, encoder: ChatEncoder, system: str | None, budget: int) -> None:
        self.encoder = encoder
        self.system = [] if system is None else [{"role": "system", "content": system}]
        self.budget = budget
        self.messages = list(self.system)
        self.dropped_any = False
        """Whether a turn was ever dropped (said once, the first time)."""

    def reset(self) -> None:
        """Forget every turn; the system prompt stays."""
        self.messages = list(self.system)

    def ask(self, text: str) -> list[int] | None:
        """Add the user message ``text``; the prompt's ids, or None (and the message
        dropped) when it does not fit even after every older turn is gone."""
        self.messages.append({"role": "user", "content": text})
        prompt = self.encoder.encode_prompt(self.messages)
        while len(prompt) > self.budget and self._drop_oldest_turn():
            prompt = self.encoder.encode_prompt(self.messages)
        if len(prompt) > self.budget:
            self.messages.pop()
            return None
        return prompt

    def answer(self, text: str) -> None:
        """Add the assistant's reply ``text``."""
        self.messages.append({"role": "assistant", "content": text})

    def _drop_oldest_turn(self) -> bool:
        """Drop the oldest user message and the reply to it; False if only the newest
        message is left to drop."""
        first = len(self.system)
        if len(self.messages) - first < 3:
            return False
        del self.messages[first : first + 2]
        if not self.dropped_any:
            self.dropped_any = True
            _note(
                f"the conversation outgrew the model's context ({self.budget} prompt tokens);"
                " dropping its oldest turns"
            )
        return True


class TextStream:
    """The text of a growing list of token ids, handed out in pieces that never split a
    character: a token may hold part of a multi-byte one, which decodes to U+FFFD until
    the rest arrives.

    Args:
        tokenizer: Decodes the ids.
    """

    def __init__(self, tokenizer: Tokenizer | HFTokenizer) -> None:
        self.tokenizer = tokenizer
        self.ids: list[int] = []
        self.shown = ""

    def push(self, token: int) -> str:
        """Add ``token``; the text it completes (empty while a character is incomplete)."""
        self.ids.append(token)
        text = self.tokenizer.decode(self.ids)
        if text.endswith("\ufffd"):
            return ""
        new, self.shown = text[len(self.shown) :], text
        return new

    def finish(self) -> str:
        """The text not handed out yet, complete or not."""
        text = self.tokenizer.decode(self.ids)
        new, self.shown = text[len(self.shown) :], text
        return new


class Chat:
    """A model, the tokenizer and chat template of its conversations, and how it samples.

    Args:
        module: The model, on its device.
        tokenizer: Its tokenizer.
        encoder: Renders and tokenizes messages in its chat template.
        args: ``max_new_tokens``, ``temperature`` and ``top_k`` of each reply.
    """

    def __init__(
        self,
        module: PretrainedLM,
        tokenizer: Tokenizer | HFTokenizer,
        encoder: ChatEncoder,
        args: Namespace,
    ) -> None:
        self.module, self.tokenizer, self.encoder = module, tokenizer, encoder
        self.sampling = (args.max_new_tokens, args.temperature, args.top_k)

    def reply(self, prompt: list[int], out: TextIO) -> str:
        """Generate the answer to ``prompt`` (ids), writing its text to ``out`` as it
        comes; returns the whole text, without the end of turn."""
        import torch

        from plugintrain.model_zoo.generation import generate_tokens

        stop_ids = set(self.encoder.stop_ids)
        stream = TextStream(self.tokenizer)
        idx = torch.tensor([prompt], dtype=torch.long, device=self.module.device)
        steps = generate_tokens(self.module.model, idx, *self.sampling, stop_ids=stop_ids)
        with contextlib.closing(steps):  # a stop or Ctrl-C frees the KV cache
            for step in steps:
                token = int(step[0, 0])
                if token in stop_ids:
                    break
                out.write(stream.push(token))
                out.flush()
        out.write(stream.finish() + "\n")
        return stream.shown

    def converse(self, conversation: Conversation) -> None:
        """Read messages from stdin and answer each, until ``/exit`` or the end of input."""
        while True:
            try:
                text = input("> " if sys.stdin.isatty() else "").strip()
            except EOFError:
                return
            if text == "/exit":
                return
            if text == "/reset":
                conversation.reset()
                _note("conversation cleared")
            elif text.startswith("/"):
                known = "; ".join(f"{name} to {what}" for name, what in COMMANDS.items())
                _note(f"unknown command {text.split()[0]}: type {known}")
            elif text:
                prompt = conversation.ask(text)
                if prompt is None:
                    _note(
                        f"that message alone fills the {conversation.budget} prompt tokens"
                        " the model has room for; send a shorter one, or start again with"
                        " fewer --max_new_tokens"
                    )
                    continue
                conversation.answer(self.reply(prompt, sys.stdout))


def _note(text: str) -> None:
    """Tell the user ``text`` on stderr, apart from the conversation on stdout."""
    print(f"({text})", file=sys.stderr)


def _start(args: Namespace) -> tuple[Chat, Conversation]:
    """The chat with the model on its device and an empty conversation; a bad option ends
    the command with one line."""
    from plugintrain.data import get_tokenizer
    from plugintrain.data.tokenizers.chat_templates import ChatEncoder, load_chat_template

    try:  # a bad --device is refused before the checkpoint is read
        device = pick_device(args.device)
        module = load_model(args.weights, args.adapter, merge=True)
        spec = model_tokenizer(module)
        tokenizer = get_tokenizer(spec)
        encoder = ChatEncoder(tokenizer, load_chat_template(spec, args.template))
    except (FileNotFoundError, ValueError) as error:  # incl. a template that does not render
        raise ConfigError(str(error)) from None
    args.max_new_tokens = args.max_new_tokens or min(256, module.max_seq_len // 4)
    budget = module.max_seq_len - args.max_new_tokens
    if budget < 1:
        raise ConfigError(
            f"--max_new_tokens {args.max_new_tokens} leaves no room for the conversation in"
            f" the model's block_size={module.max_seq_len}; pass --max_new_tokens"
            f" {module.max_seq_len // 4}"
        )
    conversation = Conversation(encoder, args.system, budget)
    if args.system is not None and len(encoder.encode_prompt(conversation.messages)) >= budget:
        raise ConfigError(
            f"--system fills the {budget} prompt tokens the model has room for with"
            f" --max_new_tokens {args.max_new_tokens}; shorten it"
        )
    return Chat(module.to(device), tokenizer, encoder, args), conversation


@shared_help(weights=WEIGHTS_HELP, adapter=MERGED_ADAPTER_HELP, device=DEVICE_HELP)
def chat(
    *,
    weights: str | None = None,
    adapter: str | None = None,
    template: str | None = None,
    system: str | None = None,
    max_new_tokens: int | None = None,
    temperature: float = 0.7,
    top_k: int = 50,
    seed: int = 1337,
    device: str | None = None,
) -> int:
    """Talk to a model in its chat template.

    Each line is a message, the reply streams back. /reset starts over, /exit (or Ctrl-D)
    ends the chat.

    Args:
        weights: the model's weights
        adapter: a LoRA run's or PEFT adapters on them
        template: a .jinja chat template, or plain (default: the one that came with the
            model's tokenizer)
        system: a system prompt, kept all along
        max_new_tokens: most tokens a reply (default: 256, at most a quarter of the model's
            block_size)
        temperature: 0 picks the most likely token (greedy)
        top_k: sample among the k most likely
        seed: seed of the sampling
        device: where the model runs
    """
    args = Namespace(**locals())  # the helpers below read the options by name
    problem = _argument_problem(args)
    if problem is not None:
        raise ConfigError(problem)

    import torch

    torch.manual_seed(seed)
    talk, conversation = _start(args)
    try:
        talk.converse(conversation)
    except KeyboardInterrupt:  # Ctrl-C ends the chat as /exit does
        print(file=sys.stderr)
    return 0
