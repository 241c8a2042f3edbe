"""Rows of preference pairs (a prompt, a chosen and a rejected answer) as a prompt of
``role``/``content`` messages and the two answers' texts.

Three layouts (`FORMATS`), told by the first row (`detect_layout`) or named::

    conversational  {"prompt": [messages], "chosen": [{"role": "assistant", ...}],
                     "rejected": [{"role": "assistant", ...}]}             (TRL)
                    {"chosen": [messages..., assistant], "rejected": [messages...,
                     assistant]}                          (UltraFeedback-binarized)
    text            {"prompt": "...", "chosen": "...", "rejected": "...",
                     "system": "..." (optional)}
    hh              {"chosen": "\\n\\nHuman: ...\\n\\nAssistant: ...", "rejected": ...}
                                                                      (Anthropic HH)

**Conversational.** ``chosen``/``rejected`` are one assistant message each, answering the
``prompt`` messages (a ``prompt`` string is one user message); or whole conversations
ending with the assistant's answer, whose shared messages before it are the prompt (a
``prompt`` field beside them, UltraFeedback's copy of the first user turn, is not read).

**HH.** The prompt is the texts' shared start up to and including the last
``"\\n\\nAssistant:"`` in it; the rest of each text, stripped, is its answer. The prompt is
cut into turns at each ``"\\n\\nHuman:"`` (a user message) and ``"\\n\\nAssistant:"`` (an
assistant message), each turn's text stripped, so it renders through the chat template
like any conversation. Texts that differ before their last assistant turn (an answer
holding a ``"\\n\\nHuman:"``) have different prompts and are refused.
"""

from __future__ import annotations

import itertools
import re
from dataclasses import dataclass
from typing import Any

from plugintrain.data.prepare.chat_formats import (
    ChatDataError,
    _message,  # chat rows' checks of a message and a text, one of each in the package
    _text,
)

FORMATS = ("conversational", "text", "hh")
HUMAN, ASSISTANT = "\n\nHuman:", "\n\nAssistant:"
_HH_TURN = re.compile(f"({re.escape(HUMAN)}|{re.escape(ASSISTANT)})")


@dataclass(frozen=True)
class Pair:
    """One preference pair: the prompt's messages and the two answers' texts."""

    prompt: list[dict[str, str]]
    chosen: str
    rejected: str


def detect_layout(row: Any, where: str) -> str:
    """The layout of ``row`` (`FORMATS`), told by its fields.

    Raises:
        ChatDataError: If the row has no ``chosen`` and ``rejected`` fields.
    """
    if not isinstance(row, dict) or "chosen" not in row or "rejected" not in row:
        keys = sorted(row) if isinstance(row, dict) else type(row).__name__
        raise ChatDataError(
            f"{where}: no preference pair (found {keys}); give rows with chosen and rejected"
            " (and a prompt), or name the layout with --format"
        )
    if isinstance(row["chosen"], list):
        return "conversational"
    return "text" if "prompt" in row else "hh"


def to_pair(row: Any, layout: str, where: str) -> Pair:
    """``row`` of ``layout`` as a `Pair`.

    Raises:
        ChatDataError: For a missing or empty field, a message that is no ``role``/
            ``content`` message of `ROLES`, chosen and rejected with different prompts, or
            chosen equal to rejected; the message names ``where``.
    """
    if layout not in FORMATS:
        raise ChatDataError(f"--format {layout}: choose auto or one of {', '.join(FORMATS)}")
    if not isinstance(row, dict):
        raise ChatDataError(f"{where}: a row is a JSON {type(row).__name__}, not an object")
    pair = _CONVERTERS[layout](row, where)
    if pair.chosen == pair.rejected:
        raise ChatDataError(
            f"{where}: chosen equals rejected ({_clip(pair.chosen)!r}), so the pair prefers"
            " nothing; drop the row or fix its rejected answer"
        )
    return pair


def _clip(text: str, size: int = 40) -> str:
    return text if len(text) <= size else text[: size - 3] + "..."


def _field(row: dict, name: str, where: str, layout: str) -> Any:
    """``row[name]``: present, not None and not empty."""
    value = row.get(name)
    if value is None or (isinstance(value, str | list) and not value):
        what = "no" if value is None else "an empty"
        raise ChatDataError(
            f"{where}: {what} {name!r} field (found {sorted(row)}), which a {layout} pair"
            " needs; fill it or drop the row"
        )
    return value


def _answer_text(value: Any, what: str) -> str:
    text = _text(value, what)
    if not text.strip():
        raise ChatDataError(f"{what} is empty; give the answer's text or drop the row")
    return text


def _text_pair(row: dict, where: str) -> Pair:
    system = row.get("system")
    prompt = [] if system is None else [{"role": "system", "content": _text(system, where)}]
    question = _text(_field(row, "prompt", where, "text"), f"{where}: field 'prompt'")
    prompt.append({"role": "user", "content": question})
    chosen, rejected = (
        _answer_text(_field(row, name, where, "text"), f"{where}: field {name!r}")
        for name in ("chosen", "rejected")
    )
    return Pair(prompt, chosen, rejected)


def _messages(value: Any, what: str) -> list[dict[str, str]]:
    """``value`` as ``role``/``content`` messages (a string: one user message)."""
    if isinstance(value, str):
        return [{"role": "user", "content": value}]
    if not isinstance(value, list):
        raise ChatDataError(f"{what} holds {type(value).__name__}, not a list of messages")
    return [_message(message, f"{what} message {n}") for n, message in enumerate(value, 1)]


def _conversational(row: dict, where: str) -> Pair:
    layout = "conversational"
    chosen, rejected = (
        _messages(_field(row, name, where, layout), f"{where}: field {name!r}")
        for name in ("chosen", "rejected")
    )
    for name, turns in (("chosen", chosen), ("rejected", rejected)):
        if turns[-1]["role"] != "assistant":
            raise ChatDataError(
                f"{where}: field {name!r} ends with a {turns[-1]['role']} message, not the"
                " assistant's answer; end it with the answer"
            )
    if len(chosen) == len(rejected) == 1:  # TRL's: the answers alone, beside the prompt
        prompt = _messages(_field(row, "prompt", where, layout), f"{where}: field 'prompt'")
    elif chosen[:-1] != rejected[:-1]:
        raise ChatDataError(
            f"{where}: chosen and rejected have different prompts (their messages before the"
            " final answer differ); give both the same conversation before the answer"
        )
    else:  # UltraFeedback's: whole conversations sharing the prompt
        prompt = chosen[:-1]
    if not prompt:
        raise ChatDataError(f"{where}: the pair has no prompt message; give the prompt")
    answers = (
        _answer_text(turns[-1]["content"], f"{where}: field {name!r}'s answer")
        for name, turns in (("chosen", chosen), ("rejected", rejected))
    )
    return Pair(prompt, *answers)


def _hh(row: dict, where: str) -> Pair:
    chosen, rejected = (
        _text(_field(row, name, where, "hh"), f"{where}: field {name!r}")
        for name in ("chosen", "rejected")
    )
    shared = chosen[: _shared_length(chosen, rejected)]
    end = shared.rfind(ASSISTANT) + len(ASSISTANT)
    if end < len(ASSISTANT):
        raise ChatDataError(
            f"{where}: chosen and rejected share no start ending in {ASSISTANT.strip()!r}, so"
            " they have different prompts; give both the same conversation before the answer"
        )
    answers = [text[end:].strip() for text in (chosen, rejected)]
    if any(HUMAN in answer for answer in answers):
        raise ChatDataError(
            f"{where}: chosen and rejected differ before their last assistant turn, so they"
            " have different prompts; give both the same conversation before the answer"
        )
    for name, answer in zip(("chosen", "rejected"), answers, strict=True):
        _answer_text(answer, f"{where}: field {name!r}'s answer")
    return Pair(_hh_turns(shared[:end], where), *answers)


def _shared_length(a: str, b: str) -> int:
    """How many characters ``a`` and ``b`` start with alike."""
    alike = itertools.takewhile(lambda ab: ab[0] == ab[1], zip(a, b, strict=False))
    return sum(1 for _ in alike)


def _hh_turns(prompt: str, where: str) -> list[dict[str, str]]:
    """The HH prompt ``"\\n\\nHuman: a\\n\\nAssistant: b ... \\n\\nAssistant:"`` as
    messages (the last, empty assistant turn left out: the answer goes there)."""
    parts = _HH_TURN.split(prompt)  # [before, marker, text, marker, text, ...]
    if parts[0].strip():
        raise ChatDataError(
            f"{where}: the conversation starts with {_clip(parts[0].strip())!r} before its"
            f" first {HUMAN.strip()!r}; start it with a turn"
        )
    roles = {HUMAN: "user", ASSISTANT: "assistant"}
    turns = [
        {"role": roles[marker], "content": text.strip()}
        for marker, text in zip(parts[1::2], parts[2::2], strict=True)
    ]
    return turns[:-1]


_CONVERTERS = {"conversational": _conversational, "text": _text_pair, "hh": _hh}
