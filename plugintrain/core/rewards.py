"""Verifiable rewards for reinforcement learning (:class:`~plugintrain.model_zoo.GRPOLM`):
programs that score a completion, named by class path in a recipe.

A reward is any callable ``reward(prompt, completion, **fields) -> float``: ``prompt`` and
``completion`` are text (the completion up to, not including, its stop token), ``fields``
the prompt's row (``answer``: the reference answer of a ``prepare chat`` example). A
recipe lists them under ``model.init_args.rewards`` with ``class_path``/``init_args``, and
their weights under ``reward_weights``; a completion's reward is the weighted sum.

Shipped: :class:`NumericMatch` (the last number in the completion equals the answer's),
:class:`ExactMatch` and :class:`Contains` (the answer, whole or inside), :class:`F1Match`
(partial credit: the F1 of the words shared with the answer, as SQuAD scores),
:class:`RegexFormat` (the completion matches a pattern), :class:`LengthPenalty` (minus a cost
per character over a budget).
"""

from __future__ import annotations

import math
import re
from collections import Counter
from collections.abc import Callable, Sequence
from typing import Any, Protocol

_WORD = re.compile(r"[^\W_]+")
_NUMBER = re.compile(r"[-+]?(?:\d[\d,]*\.?\d*|\.\d+)(?:[eE][-+]?\d+)?")


class RewardError(ValueError):
    """A reward function failed during a run: one line naming it and the prompt, which
    ``plugintrain fit`` prints last and exits 2 on."""

    one_line = True


class Reward(Protocol):
    """What a reward function is: ``(prompt, completion, **fields) -> float``."""

    def __call__(self, prompt: str, completion: str, **fields: Any) -> float: ...


def _normalized(text: str, case_sensitive: bool) -> str:
    text = " ".join(str(text).split())
    return text if case_sensitive else text.lower()


class ExactMatch:
    """1 when the completion is the answer (whitespace runs collapsed, ends stripped; case
    ignored unless ``case_sensitive``), else 0.

    Args:
        field: The row field holding the reference answer.
        case_sensitive: Compare letters' case too.
    """

    verifies = True
    """Checks the answer: counted in the run's ``accuracy``."""

    def __init__(self, field: str = "answer", case_sensitive: bool = True) -> None:
        self.field, self.case_sensitive = field, case_sensitive

    def __call__(self, prompt: str, completion: str, **fields: Any) -> float:
        answer = _normalized(fields[self.field], self.case_sensitive)
        return float(_normalized(completion, self.case_sensitive) == answer)


class Contains(ExactMatch):
    """1 when the answer appears in the completion (normalized as :class:`ExactMatch`)."""

    def __call__(self, prompt: str, completion: str, **fields: Any) -> float:
        answer = _normalized(fields[self.field], self.case_sensitive)
        return float(answer in _normalized(completion, self.case_sensitive))


class F1Match:
    """Partial credit: the F1 of the completion's words against the answer's (words: runs of
    letters and digits, case ignored; SQuAD's token F1). ``2022-11-30`` against the answer
    ``1992-11-30`` scores 2/3.

    Args:
        field: The row field holding the reference answer.
    """

    def __init__(self, field: str = "answer") -> None:
        self.field = field

    def __call__(self, prompt: str, completion: str, **fields: Any) -> float:
        want = _WORD.findall(str(fields[self.field]).lower())
        got = _WORD.findall(completion.lower())
        common = sum((Counter(want) & Counter(got)).values())
        if common == 0:
            return 0.0
        precision, recall = common / len(got), common / len(want)
        return 2 * precision * recall / (precision + recall)


class NumericMatch:
    """1 when the last number in the completion equals the answer's last number (within
    ``tolerance``, relative), else 0; thousands separators ignored (``1,024`` is 1024).

    Args:
        field: The row field holding the reference answer.
        tolerance: Relative difference still counted equal.
    """

    verifies = True
    """Checks the answer: counted in the run's ``accuracy``."""

    def __init__(self, field: str = "answer", tolerance: float = 1e-6) -> None:
        self.field, self.tolerance = field, tolerance

    def __call__(self, prompt: str, completion: str, **fields: Any) -> float:
        want, got = last_number(str(fields[self.field])), last_number(completion)
        if want is None or got is None:
            return 0.0
        return float(math.isclose(got, want, rel_tol=self.tolerance, abs_tol=self.tolerance))


def last_number(text: str) -> float | None:
    """The last number written in ``text``, or None."""
    for match in reversed(_NUMBER.findall(text)):
        try:
            return float(match.replace(",", ""))
        except ValueError:
            continue
    return None


class RegexFormat:
    """``reward`` when the completion matches ``pattern`` (the whole completion with
    ``full_match``, else anywhere in it), else 0.

    Args:
        pattern: A Python regular expression.
        full_match: The pattern must match the whole completion (ends stripped).
        reward: The reward for a match.
    """

    def __init__(self, pattern: str, full_match: bool = True, reward: float = 1.0) -> None:
        try:
            self.regex = re.compile(pattern, re.DOTALL)
        except re.error as error:
            raise ValueError(f"RegexFormat pattern {pattern!r}: {error}; fix the pattern") from None
        self.full_match, self.reward = full_match, reward

    def __call__(self, prompt: str, completion: str, **fields: Any) -> float:
        text = completion.strip()
        found = self.regex.fullmatch(text) if self.full_match else self.regex.search(text)
        return self.reward if found else 0.0


class LengthPenalty:
    """Minus ``per_char`` for each character of the completion beyond ``budget``.

    Args:
        budget: Characters allowed free.
        per_char: The cost of each character over it.
    """

    def __init__(self, budget: int = 64, per_char: float = 0.01) -> None:
        self.budget, self.per_char = budget, per_char

    def __call__(self, prompt: str, completion: str, **fields: Any) -> float:
        return -self.per_char * max(0, len(completion) - self.budget)


def reward_name(reward: Callable[..., Any]) -> str:
    """The name a reward is logged and reported under: its class's (a function's own)."""
    return getattr(reward, "__name__", None) or type(reward).__name__


def score(
    rewards: Sequence[Callable[..., Any]],
    prompt: str,
    completions: Sequence[str],
    fields: dict[str, Any],
) -> list[list[float]]:
    """Each reward of each completion, ``[completion][reward]``.

    Raises:
        RewardError: One line naming the reward and the prompt, when a reward raises or
            gives anything but a finite number.
    """
    table = []
    shown = prompt if len(prompt) <= 80 else "..." + prompt[-77:]
    fields = {k: v for k, v in fields.items() if k not in ("prompt", "completion")}
    for completion in completions:
        row = []
        for reward in rewards:
            try:
                value = reward(prompt, completion, **fields)
            except Exception as error:  # a user's program: say which, on which prompt
                raise RewardError(
                    f"reward {reward_name(reward)} raised {type(error).__name__}: {error} on"
                    f" the prompt {shown!r} (completion {completion[:40]!r}); fix the reward"
                    " function"
                ) from None
            if isinstance(value, bool):
                value = float(value)
            if not isinstance(value, int | float) or not math.isfinite(value):
                raise RewardError(
                    f"reward {reward_name(reward)} gave {value!r}, not a finite number, on the"
                    f" prompt {shown!r}; a reward must return a finite float"
                )
            row.append(float(value))
        table.append(row)
    return table
