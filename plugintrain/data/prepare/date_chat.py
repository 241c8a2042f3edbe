"""The chat fine-tuning demo's data: dates written the ways people write them, to be
answered in ISO 8601.

SmolLM2-135M-Instruct answers "Write 'the 5th of March, 2021' as an ISO 8601 date" with
prose or a wrong date most of the time; a few minutes of LoRA on CPU teach it the format,
and held-out dates (never seen in training) measure whether it learned the rule rather
than the examples. Built offline from Python's calendar, so every machine makes the same
rows from the same seed.
"""

from __future__ import annotations

import calendar
import datetime
import json
import random
from pathlib import Path

_ORDINALS = {1: "st", 2: "nd", 3: "rd", 21: "st", 22: "nd", 23: "rd", 31: "st"}

QUESTION = "Write this date in ISO 8601 format (YYYY-MM-DD), and nothing else: {date}"
"""The user turn; ``{date}`` is the date as written by one of :data:`STYLES`."""

TASKS = {
    "iso": (QUESTION, lambda date: date.isoformat()),
    "year": ("Which year is this date in: {date}? Answer with the year only.", lambda d: str(d.year)),
}
"""What a conversation asks of its date, and its answer: the date in ISO 8601 (the chat
and DPO demos), or its year alone (the RL demo: SmolLM2-135M-Instruct names the year in a
sentence nearly always, but never alone)."""


def _ordinal(day: int) -> str:
    return f"{day}{_ORDINALS.get(day, 'th')}"


STYLES = (
    lambda d: f"{calendar.month_name[d.month]} {d.day}, {d.year}",
    lambda d: f"{d.day} {calendar.month_name[d.month]} {d.year}",
    lambda d: f"the {_ordinal(d.day)} of {calendar.month_name[d.month]}, {d.year}",
    lambda d: f"{calendar.month_abbr[d.month]} {_ordinal(d.day)} {d.year}",
    lambda d: f"{d.month}/{d.day}/{d.year} (US)",
    lambda d: f"{d.day}.{d.month}.{d.year} (European)",
    lambda d: f"{calendar.day_name[d.weekday()]}, {d.day} {calendar.month_abbr[d.month]} {d.year}",
)
"""How the dates are written in the questions."""


def _dated_questions(
    count: int, seed: int, question: str = QUESTION
) -> list[tuple[datetime.date, str, str]]:
    """``count`` distinct dates from 1900 to 2099, each with ``question`` asking about it
    and the date as the question writes it (a style drawn from :data:`STYLES`)."""
    rng = random.Random(seed)
    first, span = datetime.date(1900, 1, 1).toordinal(), 200 * 365
    days = rng.sample(range(span), count)
    out = []
    for day in days:
        date = datetime.date.fromordinal(first + day)
        written = rng.choice(STYLES)(date)
        out.append((date, question.format(date=written), written))
    return out


def date_conversations(count: int, seed: int = 0, task: str = "iso") -> list[dict]:
    """``count`` conversations ``{"messages": [user, assistant]}``, distinct dates from
    1900 to 2099, each written in a style drawn from :data:`STYLES`, asking what ``task``
    (:data:`TASKS`) asks (the same dates for every task)."""
    question, answer = TASKS[task]
    rows = []
    for date, asked, _ in _dated_questions(count, seed, question):
        messages = [
            {"role": "user", "content": asked},
            {"role": "assistant", "content": answer(date)},
        ]
        rows.append({"messages": messages})
    return rows


def _swapped_or_off(date: datetime.date, rng: random.Random) -> str:
    """ISO with month and day swapped where that is another date, else a day off."""
    if date.day <= 12 and date.day != date.month:
        return f"{date.year:04d}-{date.day:02d}-{date.month:02d}"
    return _day_off(date, rng)


def _day_off(date: datetime.date, rng: random.Random) -> str:
    return (date + datetime.timedelta(days=rng.choice((-1, 1)))).isoformat()


NEAR_MISSES = (
    lambda date, written, rng: written,
    lambda date, written, rng: f"The date in ISO 8601 format is {date.isoformat()}.",
    lambda date, written, rng: _swapped_or_off(date, rng),
    lambda date, written, rng: _day_off(date, rng),
)
"""The DPO demo's rejected answers: the date restated in the question's style, a sentence
around the right ISO date, ISO with month and day swapped, the date a day off."""


def date_pairs(count: int, seed: int = 0) -> list[dict]:
    """``count`` preference pairs (conversational layout) of the questions
    :func:`date_conversations` asks for the same ``seed`` (the same dates, so a date held
    out of one is held out of the other): chosen the ISO date alone, rejected one of
    :data:`NEAR_MISSES`, drawn per pair from ``seed``."""
    rng = random.Random(f"near misses {seed}")
    rows = []
    for date, question, written in _dated_questions(count, seed):
        rejected = rng.choice(NEAR_MISSES)(date, written, rng)
        rows.append(
            {
                "prompt": [{"role": "user", "content": question}],
                "chosen": [{"role": "assistant", "content": date.isoformat()}],
                "rejected": [{"role": "assistant", "content": rejected}],
            }
        )
    return rows


def write_date_conversations(path: Path, count: int, seed: int = 0, task: str = "iso") -> Path:
    """Write :func:`date_conversations` as JSON lines to ``path`` (replaced atomically)."""
    return _write_rows(path, date_conversations(count, seed, task))


def write_date_pairs(path: Path, count: int, seed: int = 0) -> Path:
    """Write :func:`date_pairs` as JSON lines to ``path`` (replaced atomically)."""
    return _write_rows(path, date_pairs(count, seed))


def _write_rows(path: Path, rows: list[dict]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    staging = path.with_name(f".{path.name}.partial")
    with staging.open("w") as out:
        for row in rows:
            out.write(json.dumps(row) + "\n")
    staging.replace(path)
    return path
