"""docs/tests.md's module -> test-file table is what ``docs/hooks/tests_table.py`` reads from
the tests now, so it never goes stale; and the reading finds each kind of evidence it
documents (planted in a copy of the tests, never in the real ones)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "docs" / "hooks"))
import tests_table  # noqa: E402


@pytest.fixture(scope="module")
def generated() -> str:
    """The table as the tests are now (built once: it parses every module and test)."""
    return tests_table.table()


def test_the_page_holds_the_generated_table(generated: str) -> None:
    text = tests_table.PAGE.read_text()
    assert text == tests_table.rewritten(text, generated), (
        "docs/tests.md's module -> test table is stale: run"
        " `.venv/bin/python docs/hooks/tests_table.py` and commit docs/tests.md"
    )


def test_every_library_module_has_a_row(generated: str) -> None:
    rows = generated.splitlines()[2:]
    named = [row.split("`")[1] for row in rows]
    assert named == sorted(tests_table.library_modules())


def _cells(monkeypatch: pytest.MonkeyPatch, tests: Path) -> dict[str, str]:
    monkeypatch.setattr(tests_table, "TESTS", tests)
    rows = tests_table.table().splitlines()[2:]
    return {row.split("`")[1]: row.split(" | ", 1)[1].removesuffix(" |") for row in rows}


@pytest.fixture
def planted(tmp_path: Path) -> Path:
    """A test tree with one file per kind of evidence."""
    unit = tmp_path / "unit"
    unit.mkdir()
    (unit / "test_a.py").write_text(
        "def test():\n    from plugintrain.strategies import ParallelDims\n"
    )
    (unit / "test_b.py").write_text(
        'def test(monkeypatch):\n    monkeypatch.setattr("plugintrain.tools.recipes.X", 1)\n'
    )
    (unit / "_helper.py").write_text("import plugintrain.data.idx\n")
    (unit / "test_c.py").write_text("from _helper import x\n")
    (unit / "test_d.py").write_text('def test(main):\n    main(["schedule", "--pp", "2"])\n')
    return tmp_path


def test_each_kind_of_evidence_is_found(monkeypatch: pytest.MonkeyPatch, planted: Path) -> None:
    cells = _cells(monkeypatch, planted)
    # A name from a lazy package face counts for the face and the module that defines it.
    assert cells["plugintrain.strategies.mesh"] == "`unit/test_a.py`"
    assert cells["plugintrain.strategies"] == "`unit/test_a.py`"
    assert cells["plugintrain.tools.recipes"] == "`unit/test_b.py`"
    assert cells["plugintrain.data.idx"] == "through `unit/_helper.py`: `unit/test_c.py`"
    assert cells["plugintrain.tools.schedule"] == "through `plugintrain schedule`: `unit/test_d.py`"
    # mesh (tested by test_a) imports the contracts, which no planted file names.
    assert (
        cells["plugintrain.core.contracts"] == "through the tests of `plugintrain.strategies.mesh`"
    )
    assert cells["plugintrain.__main__"] == "none"  # nothing runs `python -m plugintrain`


def test_only_the_part_between_the_markers_is_rewritten(generated: str) -> None:
    text = tests_table.PAGE.read_text()
    before, after = text.split(tests_table.BEGIN)[0], text.split(tests_table.END)[1]
    stale = tests_table.rewritten(text, "| module | test files |\n|---|---|")
    fresh = tests_table.rewritten(stale, generated)
    assert fresh.startswith(before + tests_table.BEGIN) and fresh.endswith(tests_table.END + after)
    assert generated in fresh and generated not in stale
    with pytest.raises(ValueError, match="lacks the markers"):
        tests_table.rewritten("no markers here", "")
