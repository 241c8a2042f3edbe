"""End to end: the documentation site builds with ``mkdocs build --strict``, as ``make docs``
runs it, and what it built works as a site.

Strict: a broken link or anchor, a page left out of the navigation, a docstring naming an
object that is not there (``docs/hooks/griffe_roles.py``) or a missing API reference fails
the build. Then, in what was built: every navigation link of the home page resolves to a
page, the generated CLI reference has a page per command with that command's ``--help``,
the API reference links across pages, and the search index holds the guides' text.
"""

from __future__ import annotations

import html
import json
import os
import re
import sys
from pathlib import Path
from urllib.parse import urljoin, urlparse

import pytest
from _processes import run_command

from plugintrain.cli import TRAINING_COMMANDS
from plugintrain.tools import COMMANDS

pytestmark = pytest.mark.slow
REPO = Path(__file__).resolve().parents[2]


_HREF = re.compile(r'<a\b[^>]*?\shref="([^"]+)"')
_NAV = re.compile(r"<nav\b.*?</nav>", re.DOTALL)


def _links(page: Path, nav_only: bool = False) -> list[str]:
    """The ``href`` of every link of a built page (of its navigation only)."""
    text = page.read_text()
    return _HREF.findall("".join(_NAV.findall(text)) if nav_only else text)


def _target(site: Path, page: Path, href: str) -> Path | None:
    """The file a relative link of ``page`` opens in the built site (None: external)."""
    url = urlparse(href)
    if url.scheme or url.netloc or not url.path:
        return None
    base = "/" + page.relative_to(site).as_posix()
    target = site / urljoin(base, url.path).lstrip("/")
    return target / "index.html" if url.path.endswith("/") or target.is_dir() else target


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("site")
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    build = [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(out)]
    proc = run_command(build, cwd=REPO, timeout=600, env=env)
    assert proc.returncode == 0, f"mkdocs build --strict failed:\n{proc.stdout}\n{proc.stderr}"
    assert "WARNING" not in proc.stderr, proc.stderr
    return out


def test_every_navigation_link_opens_a_page(site: Path) -> None:
    home = site / "index.html"
    nav = _links(home, nav_only=True)
    pages = {t for href in nav if (t := _target(site, home, href)) is not None}
    for guide in ("data", "chat", "lora", "strategies", "precision", "checkpoints", "estimate"):
        assert site / "guides" / guide / "index.html" in pages
    assert site / "reference" / "cli" / "fit" / "index.html" in pages
    assert [str(p.relative_to(site)) for p in sorted(pages) if not p.is_file()] == []


def test_every_link_between_pages_resolves(site: Path) -> None:
    broken = [
        f"{page.relative_to(site)} -> {href}"
        for page in sorted(site.rglob("*.html"))
        for href in _links(page)
        if (target := _target(site, page, html.unescape(href))) is not None and not target.exists()
    ]
    assert broken == []


def test_the_cli_reference_is_every_command_s_own_help(site: Path) -> None:
    for command in (*TRAINING_COMMANDS, *COMMANDS):
        page = site / "reference" / "cli" / command / "index.html"
        assert page.is_file(), command
        if command != "lm-eval":  # lm-evaluation-harness's own parser and prog
            assert "usage: plugintrain" in page.read_text(), command
    fit = (site / "reference" / "cli" / "fit" / "index.html").read_text()
    assert "--trainer.strategy" in fit and "plugintrain.strategies.ZeroStrategy" in fit
    prepare = (site / "reference" / "cli" / "prepare" / "index.html").read_text()
    assert "plugintrain prepare text" in prepare and "--val_docs" in prepare


def test_the_api_reference_renders_docstrings_with_links_between_pages(site: Path) -> None:
    page = site / "reference" / "api" / "plugintrain.strategies.zero" / "index.html"
    text = page.read_text()
    assert "ZeroStrategy" in text
    # Sphinx roles in docstrings became links to the objects' own pages.
    assert re.search(r'href="[^"]*plugintrain\.strategies\.grad_engine/#plugintrain', text)
    assert ":class:`" not in text


def test_search_indexes_the_guides(site: Path) -> None:
    index = json.loads((site / "search" / "search_index.json").read_text())
    locations = {doc["location"] for doc in index["docs"]}
    assert "guides/data/" in locations and "guides/chat/" in locations
    text = " ".join(doc["text"] for doc in index["docs"])
    assert "prepare text" in text and "ZeroStrategy" in text


def test_the_benchmark_plots_are_in_the_site(site: Path) -> None:
    matrix = (site / "benchmarks" / "matrix" / "index.html").read_text()
    for plot in ("throughput.png", "memory.png"):
        assert f"assets/cpu-small/{plot}" in matrix
        assert (site / "benchmarks" / "assets" / "cpu-small" / plot).is_file()
