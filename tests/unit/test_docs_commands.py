"""The documentation cannot drift from the command line, nor show a figure without its origin.

Every command of README.md and docs/ is checked against the real parsers (and the cheap
ones run: ``docs/hooks/commands.py``), and every table of measurements names the command
and date that produced it (``docs/hooks/figures.py``). Each checker is also run on a
planted fault, so a checker that stopped seeing faults would fail here.
"""

from __future__ import annotations

import re
import shutil
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "docs" / "hooks"))
from commands import Checker, check_docs, doc_files, extract  # noqa: E402
from figures import check_figures  # noqa: E402

GUIDE = ROOT / "docs" / "guides" / "data.md"


@pytest.fixture(scope="module")
def checker() -> Checker:
    """One checker: LightningCLI's parser is built once for every test here."""
    return Checker()


def _plant(tmp_path: Path, source: Path, old: str, new: str) -> tuple[Path, int]:
    """A copy of ``source`` with the first ``old`` inside a command replaced by ``new``;
    returns the copy and the line of the change."""
    copy = tmp_path / source.name
    shutil.copy(source, copy)
    lines = copy.read_text().splitlines()
    line = next(i for i, text in enumerate(lines) if old in text and "plugintrain" in text)
    lines[line] = lines[line].replace(old, new, 1)
    copy.write_text("\n".join(lines) + "\n")
    return copy, line + 1


def test_every_command_in_the_readme_and_the_docs_is_accepted(checker: Checker) -> None:
    commands = [c for path in doc_files() for c in extract(path)]
    assert len(commands) > 100  # the extractor still finds them
    assert [str(p) for p in checker.check(commands)] == []


def test_the_readme_quick_start_and_its_three_command_recipes_are_checked() -> None:
    readme = [c.text for c in extract(ROOT / "README.md") if not c.inline]
    assert readme[1:3] == [
        "make train    # venv + runtime, fetch SmolLM2-135M and Shakespeare offline, LoRA"
        " fine-tune on CPU, sample",
        "make test     # venv + runtime + test/docs extras, ruff lint/format check, full"
        " test suite",
    ]
    assert sum(c.startswith("plugintrain prepare text") for c in readme) == 1
    assert sum(c.startswith("plugintrain prepare chat") for c in readme) == 1


@pytest.mark.parametrize(
    ("old", "new", "named"),
    [
        ("--tokenizer smollm2-135m --out data/my_corpus", "--tokenizr smollm2-135m", "--tokenizr"),
        (
            "--data.init_args.data_dir data/my_corpus",
            "--data.init_args.data_dirr data/my_corpus",
            "data_dirr",
        ),  # a training command's nested option (LightningCLI's parser)
        ("smollm2_continue_text_cpu.yaml", "smollm2_continue_txt_cpu.yaml", "continue_txt"),
    ],
)
def test_a_planted_wrong_option_in_a_guide_is_reported_with_its_file_and_line(
    tmp_path: Path, checker: Checker, old: str, new: str, named: str
) -> None:
    copy, line = _plant(tmp_path, GUIDE, old, new)
    problems = checker.check(extract(copy))
    assert len(problems) == 1, [str(p) for p in problems]
    report = str(problems[0])
    assert report.startswith(f"{copy}:{line}: ") and named in report


def test_planted_faults_of_every_other_kind_are_reported(tmp_path: Path, checker: Checker) -> None:
    page = tmp_path / "page.md"
    page.write_text(
        "Prose naming `plugintrain generate --max_new_tokenz 5`.\n\n"
        "```bash\n"
        "make trian\n"
        "make train RECIPES=recipes/mnist.yaml\n"
        "python benchmarks/pipeline.py --ppp 4\n"
        "torchrun --num_procs 2 -m plugintrain fit --config recipes/mnist.yaml\n"
        "plugintrain schedule --pp 3 --microbatches 8 --schedule interleaved --vpp 2\n"
        "plugintrian fit\n"
        "```\n\n"
        "```console\n"
        "$ plugintrain fit --config recipes/mnist.yaml --trainer.strategy zero2\n"
        "plugintrain fit: error: unknown strategy 'zero2'\n"
        "```\n"
    )
    problems = {p.command.line: p.message for p in checker.check(extract(page))}
    assert sorted(problems) == [1, 4, 5, 6, 7, 8, 9, 13], problems
    assert "--max_new_tokenz" in problems[1]
    assert "no target 'trian'" in problems[4] and "no variable RECIPES" in problems[5]
    assert "--ppp" in problems[6] and "torchrun refuses" in problems[7]
    assert problems[8].startswith("exits 2")  # run: interleaved needs m divisible by pp
    assert "unknown program 'plugintrian'" in problems[9]
    assert "the docs show it refused" in problems[13]


def test_a_refusal_the_docs_show_must_be_the_one_printed(tmp_path: Path, checker: Checker) -> None:
    page = tmp_path / "page.md"
    shown = "plugintrain fit: error: unknown strategy 'zero3'; did you mean 'zero2' or 'zero1'? ..."
    page.write_text(
        "```console\n$ plugintrain fit --config recipes/mnist.yaml --trainer.strategy zero3\n"
        f"{shown}\n```\n\n"
        "`plugintrain fit --trainer.max_step 5` (a typo) <!-- refused -->\n"
    )
    assert checker.check(extract(page)) == []
    page.write_text(page.read_text().replace("'zero2' or 'zero1'", "'zero1' or 'zero2'"))
    assert [p.command.line for p in checker.check(extract(page))] == [2]


def test_every_figure_names_the_command_and_date_that_produced_it() -> None:
    assert check_figures() == []


def test_a_planted_figure_without_its_date_is_reported(tmp_path: Path) -> None:
    page = tmp_path / "figures.md"
    page.write_text(
        "# Figures\n\nMeasured with `python benchmarks/zero.py`:\n\n"
        "| strategy | tokens/s |\n|---|---:|\n| zero2 | 1,059 tokens/s |\n\n"
        "Measured on 2026-12-01 with `python benchmarks/zero.py`:\n\n"
        "| strategy | tokens/s |\n|---|---:|\n| zero2 | 1,059 tokens/s |\n\n"
        "## A limit, not a measurement\n\n<!-- not a measurement -->\n"
        "| format | shards |\n|---|---|\n| Hugging Face | 5 GiB |\n"
    )
    assert check_figures([page]) == [
        f"{page}:5: a table of measurements without the date it was measured (YYYY-MM-DD)"
    ]


def test_check_docs_covers_the_readme_and_every_page() -> None:
    files = doc_files()
    assert files[0] == ROOT / "README.md"
    assert ROOT / "docs" / "guides" / "data.md" in files
    assert check_docs([ROOT / "README.md"], run_cheap=False) == []


def test_every_link_of_the_readme_opens_a_file_of_the_checkout() -> None:
    readme = (ROOT / "README.md").read_text()
    links = [link.split("#")[0] for link in re.findall(r"\]\(([^)\s]+)\)", readme)]
    local = [link for link in links if link and "://" not in link]
    assert len(local) > 20
    assert [link for link in local if not (ROOT / link).is_file()] == []
