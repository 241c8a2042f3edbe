"""Every figure in the documentation names the command and the date that produced it.

A figure is a table of measurements: every table of the benchmark pages
(``docs/benchmarks/``), and any other table with a measured quantity in its cells (a time,
a size in bytes, a rate, a percentage). Between the heading or table before it and the table
itself, the page must name the date it was measured (``YYYY-MM-DD``) and the command that
measured it: a command in a shell block, or an inline code span that starts with
``plugintrain``, ``python``, ``make`` or ``.venv/bin/``. A table that only looks like
measurements (a limit, a file size a format fixes) says so with ``<!-- not a measurement
-->`` on the line before it.

``python docs/hooks/figures.py`` prints one line per figure that does not, ``FILE:LINE:
what``, and exits 1 if there is any; the test suite runs it
(``tests/unit/test_docs_commands.py``).
"""

from __future__ import annotations

import re
import sys
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
BENCHMARKS = ROOT / "docs" / "benchmarks"
NOT_A_MEASUREMENT = "<!-- not a measurement -->"
DATE = re.compile(r"\b20\d\d-[01]\d-[0-3]\d\b")
COMMAND = re.compile(r"`(?:plugintrain|python3?|make|\.venv/bin/)[ \w][^`]*`")
MEASURED = re.compile(r"\b\d[\d,.]*\s?(?:ms|s|min|MiB|GiB|KiB|MB|GB|tokens/s|%)(?![\w/])")
_FENCE = re.compile(r"^\s*(`{3,}|~{3,})\s*([\w+-]*)")


@dataclass(frozen=True)
class Table:
    """One Markdown table and the text between it and the heading or table before it."""

    path: Path
    line: int
    rows: list[str]
    preamble: list[str]

    @property
    def measured(self) -> bool:
        """Whether the table holds measurements (see the module docstring)."""
        if self.preamble and self.preamble[-1].strip() == NOT_A_MEASUREMENT:
            return False
        in_benchmarks = self.path.is_relative_to(BENCHMARKS)
        return in_benchmarks or any(MEASURED.search(row) for row in self.rows[2:])

    def problem(self) -> str | None:
        """What the text before the table fails to name, if anything."""
        text = "\n".join(self.preamble)
        missing = [
            what
            for what, found in (
                ("the date it was measured (YYYY-MM-DD)", DATE.search(text)),
                (
                    "the command that measured it",
                    COMMAND.search(text) or _has_shell_block(self.preamble),
                ),
            )
            if not found
        ]
        return f"a table of measurements without {' and '.join(missing)}" if missing else None


def tables(path: Path) -> list[Table]:
    """Every table of a Markdown file outside code blocks, with its preamble."""
    found: list[Table] = []
    preamble: list[str] = []
    rows: list[str] = []
    start, fence = 0, False
    for number, line in enumerate([*path.read_text().splitlines(), ""], start=1):
        if _FENCE.match(line):
            fence = not fence
        if not fence and line.startswith("|"):
            start = start or number
            rows.append(line)
            continue
        if rows:
            found.append(Table(path, start, rows, preamble))
            preamble, rows, start = [], [], 0
        if not fence and line.startswith("#"):
            preamble = []
        else:
            preamble.append(line)
    return found


def _has_shell_block(lines: list[str]) -> bool:
    return any(
        (m := _FENCE.match(line)) and m.group(2) in ("bash", "sh", "shell", "console")
        for line in lines
    )


def check_figures(files: list[Path] | None = None) -> list[str]:
    """``FILE:LINE: what`` for every figure that does not name its command and date."""
    assets = BENCHMARKS / "assets"  # what a tool wrote, kept as written; its page names it
    paths = files or sorted(
        p for p in (ROOT / "docs").rglob("*.md") if not p.is_relative_to(assets)
    )
    return [
        f"{t.path.relative_to(ROOT) if t.path.is_relative_to(ROOT) else t.path}:{t.line}: {problem}"
        for path in paths
        for t in tables(path)
        if t.measured and (problem := t.problem()) is not None
    ]


def main() -> int:
    problems = check_figures()
    for problem in problems:
        print(problem)
    print(f"{len(problems)} figure(s) without their command and date in docs/")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
