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


def date_conversations(count: int, seed: int = 0) -> list[dict]:
    """``count`` conversations ``{"messages": [user, assistant]}``, distinct dates from
    1900 to 2099, each written in a style drawn from :data:`STYLES`."""
    rng = random.Random(seed)
    first, span = datetime.date(1900, 1, 1).toordinal(), 200 * 365
    days = rng.sample(range(span), count)
    rows = []
    for day in days:
        date = datetime.date.fromordinal(first + day)
        question = QUESTION.format(date=rng.choice(STYLES)(date))
        messages = [
            {"role": "user", "content": question},
            {"role": "assistant", "content": date.isoformat()},
        ]
        rows.append({"messages": messages})
    return rows


def write_date_conversations(path: Path, count: int, seed: int = 0) -> Path:
    """Write :func:`date_conversations` as JSON lines to ``path`` (replaced atomically)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    staging = path.with_name(f".{path.name}.partial")
    with staging.open("w") as out:
        for row in date_conversations(count, seed):
            out.write(json.dumps(row) + "\n")
    staging.replace(path)
    return path
