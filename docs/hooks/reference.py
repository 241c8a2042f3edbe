"""MkDocs hook: the CLI and API reference pages, generated at every build, never by hand.

- **CLI** (``reference/cli/``): one page per ``plugintrain`` command with what the command's
  own parser prints for ``--help``: the commands' parsers (built from their functions) and
  LightningCLI's parser of ``fit``/``validate``/``test``/``predict`` (with ``--<key>.help
  CLASS`` for every class a recipe configures by class path: models, data modules,
  strategies, callbacks), each ``plugintrain prepare`` dataset apart.
- **API** (``reference/api/``): one page per public module of plugintrain (and of the
  three folders it installs under its name), rendered from the docstrings by mkdocstrings;
  a package's page lists what its ``__all__`` exports, each linked to where it is defined.

The pages exist only in the build; their place in the navigation is filled in here, under
the ``reference/cli/index.md`` and ``reference/api/index.md`` entries of ``mkdocs.yml``.
"""

from __future__ import annotations

import contextlib
import io
import os
import sys
from pathlib import Path
from typing import Any

from mkdocs.config.defaults import MkDocsConfig
from mkdocs.structure.files import File, Files

sys.path.insert(0, str(Path(__file__).parent))
from api_index import ApiIndex, load, public, source_tree
from commands import TRAINING, passthrough_parser

_PAGES: dict[str, str] = {}
HELP_COLUMNS = "100"
# What a recipe configures by class path, and the option that prints a class's help.
CLASS_OPTIONS = {
    "--model.help": ("plugintrain.model_zoo", lambda name: name in ("CausalLM", "MNISTClassifier")),
    "--data.help": ("plugintrain.data", lambda name: name.endswith("DataModule")),
    "--trainer.strategy.help": ("plugintrain.strategies", lambda name: name.endswith("Strategy")),
    "--trainer.callbacks.help": ("plugintrain.callbacks", lambda name: True),
}


def on_startup(command: str, dirty: bool) -> None:
    # Before mkdocstrings sets up griffe's search paths, which skip a folder not there yet.
    source_tree()


def on_config(config: MkDocsConfig) -> MkDocsConfig:
    _PAGES.clear()
    saved_columns, saved_argv0 = os.environ.get("COLUMNS"), sys.argv[0]
    os.environ["COLUMNS"], sys.argv[0] = HELP_COLUMNS, "plugintrain"  # stable help text
    try:
        cli = cli_pages()
    finally:
        sys.argv[0] = saved_argv0
        if saved_columns is None:
            del os.environ["COLUMNS"]
        else:
            os.environ["COLUMNS"] = saved_columns
    api = api_pages()
    _PAGES.update(cli | api)
    _fill_nav(config["nav"], "reference/cli/index.md", _nav(cli))
    _fill_nav(config["nav"], "reference/api/index.md", _nav(api))
    return config


def on_files(files: Files, config: MkDocsConfig) -> Files:
    for uri, text in _PAGES.items():
        files.append(File.generated(config, uri, content=text))
    return files


# ---- CLI ----------------------------------------------------------------------------


def cli_pages() -> dict[str, str]:
    """``reference/cli/<command>.md`` for every command, and the index."""
    from plugintrain.lightning_cli import training_parser
    from plugintrain.tools import COMMANDS, overview

    training = training_parser(documented=True)
    subcommands = training._subcommands_action._name_parser_map
    pages = {"reference/cli/index.md": _cli_index(overview(), [*TRAINING, *COMMANDS])}
    for command in TRAINING:
        classes = _class_help(training) if command == "fit" else ""
        pages[f"reference/cli/{command}.md"] = _cli_page(
            command, subcommands[command].format_help(), classes
        )
    for command in COMMANDS:
        pages[f"reference/cli/{command}.md"] = _command_page(command)
    return pages


def _command_page(command: str) -> str:
    """One command's page: its ``--help``, and each sub-command's (``prepare text``...)."""
    from plugintrain.tools import COMMANDS
    from plugintrain.tools._command import Group, group_help, parsers

    spec = COMMANDS[command]
    if spec.passthrough:
        try:
            return _cli_page(command, passthrough_parser(command).format_help(), "")
        except RuntimeError as error:  # lm-eval needs the `eval` extra
            return f"# plugintrain {command}\n\n{error}\n"
    found = parsers(command, spec)
    loaded = spec.load()
    if not isinstance(loaded, Group):
        return _cli_page(command, found[command].format_help(), "")
    sections = "".join(
        _section(f"plugintrain {name}", parser.format_help()) for name, parser in found.items()
    )
    return _cli_page(command, group_help(loaded, f"plugintrain {command}"), sections)


def _cli_index(overview: str, commands: list[str]) -> str:
    links = "\n".join(f"- [`plugintrain {c}`]({c}.md)" for c in commands)
    return (
        "# Command line\n\nEverything runs through one command, `plugintrain`. This reference is"
        " generated at every build from the parsers themselves (`--help` of each command), so"
        " it is never out of date. What `plugintrain --help` prints:\n\n"
        f"```text\n{overview}```\n\n## Commands\n\n{links}\n"
    )


def _cli_page(command: str, help_text: str, more: str) -> str:
    return (
        f"# plugintrain {command}\n\nGenerated from `plugintrain {command} --help` at build"
        f" time.\n\n```text\n{help_text.rstrip()}\n```\n{more}"
    )


def _section(title: str, text: str) -> str:
    return f"\n## {title}\n\n```text\n{text.rstrip()}\n```\n"


def _class_help(training: Any) -> str:
    """``plugintrain fit --<key>.help CLASS`` of every class a recipe configures."""
    import importlib

    sections = ["\n## Classes a recipe configures\n\nEach with its documented options,"
                " as `plugintrain fit --<key>.help CLASS` prints them.\n"]  # fmt: skip
    for option, (package, wanted) in CLASS_OPTIONS.items():
        module = importlib.import_module(package)
        for name in sorted(n for n in module.__all__ if wanted(n)):
            args = ["fit", option, f"{package}.{name}"]
            out = io.StringIO()
            with contextlib.suppress(SystemExit), contextlib.redirect_stdout(out):
                training.parse_args(args)
            sections.append(_section(f"`{package}.{name}`", out.getvalue()).replace(
                "\n```text\n", f"\n`plugintrain {' '.join(args)}`\n\n```text\n", 1))  # fmt: skip
    return "".join(sections)


# ---- API ----------------------------------------------------------------------------


def api_pages() -> dict[str, str]:
    """``reference/api/<module>.md`` for every public module, and the index."""
    index = ApiIndex(load())
    pages = {f"reference/api/{m.path}.md": _api_page(index, m) for m in index.modules()}
    listing = "\n".join(f"- [`{m.path}`]({m.path}.md)" for m in index.modules())
    pages["reference/api/index.md"] = (
        "# Python API\n\nGenerated at every build from the docstrings (mkdocstrings), one page"
        " per public module. A package's page lists what it exports; the strategies, the model"
        " zoo and the precision plugins install as `plugintrain.strategies`,"
        f" `plugintrain.model_zoo` and `plugintrain.precision_plugins`.\n\n{listing}\n"
    )
    return pages


def _api_page(index: ApiIndex, module: Any) -> str:
    page = f"# `{module.path}`\n\n::: {module.path}\n"
    if not module.is_init_module:
        return page + "    options:\n      show_root_heading: false\n      show_submodules: false\n"
    # The package's own objects here (what it imports is on its home module's page).
    own = [n for n, m in module.members.items() if not (m.is_alias or m.is_module) and public(n)]
    page += f"    options:\n      show_root_heading: false\n      members: {own or 'false'}\n"
    exports = module.exports or _lazy_exports(module.path)
    if exports:
        rows = "\n".join(f"| {_export(index, module, str(name))} |" for name in exports)
        page += f"\n## Exports\n\n| name | defined in |\n|---|---|\n{rows}\n"
    return page


def _lazy_exports(package: str) -> list[str]:
    """A lazy face's ``__all__``, which ``plugintrain.core.lazy.lazy_exports`` makes when
    the package is imported (griffe reads the file and cannot compute it)."""
    import importlib

    return list(getattr(importlib.import_module(package), "__all__", []))


def _export(index: ApiIndex, package: Any, name: str) -> str:
    path = index.resolve(package, name) or index.home(package.path, name)
    if path is None or not path.startswith("plugintrain."):
        return f"`{name}` | {f'`{path}`' if path else '(outside plugintrain)'}"
    home = path.rpartition(".")[0]
    shown = f"[`{name}`][{path}]" if index.rendered(path) else f"`{name}`"
    where = f"[`{home}`][{home}]" if public(home) and index.rendered(home) else f"`{home}`"
    return f"{shown} | {where}"


# ---- navigation ---------------------------------------------------------------------


def _nav(pages: dict[str, str]) -> list[Any]:
    """The pages as a navigation list: the index first, then one entry per page by title."""
    uris = sorted(pages, key=lambda u: (not u.endswith("/index.md"), u))
    return [uris[0], *({pages[u].splitlines()[0].lstrip("# ").strip("`"): u} for u in uris[1:])]


def _fill_nav(nav: list[Any], placeholder: str, entries: list[Any]) -> bool:
    """Replace the nav entry ``{title: placeholder}`` with the section ``{title: entries}``."""
    for item in nav:
        if isinstance(item, dict):
            for title, value in item.items():
                if value == placeholder:
                    item[title] = entries
                    return True
                if isinstance(value, list) and _fill_nav(value, placeholder, entries):
                    return True
    return False
