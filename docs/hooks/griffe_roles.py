"""Griffe extension: the Sphinx roles in plugintrain's docstrings become cross-references.

plugintrain's docstrings name other objects the way Sphinx does (``:class:`~plugintrain.
strategies.GradientEngine```, ``:meth:`merge```). mkdocstrings renders Markdown, where
those would print as they are written; this extension rewrites each one, once the package
is loaded, into an autorefs link to the object's page (``[`GradientEngine`][plugintrain.
strategies.grad_engine.GradientEngine]``), or into plain code for an object the reference
has no page for (private helpers, torch and Lightning). A name that means nothing (a
renamed or removed object, a typo) is a warning, which ``mkdocs build --strict`` turns into
a failed build: docstrings cannot point at what is no longer there.
"""

from __future__ import annotations

import logging
import re
import sys
from pathlib import Path
from typing import Any

import griffe

sys.path.insert(0, str(Path(__file__).parent))
from api_index import PACKAGE, ApiIndex, walk

ROLE = re.compile(r":(?:py:)?(?:class|func|meth|mod|data|attr|exc|obj|const):`(~?)([^`<]+?)\s*`")
LOG = logging.getLogger("mkdocs.plugins.griffe_roles")


class SphinxRoles(griffe.Extension):
    """Rewrite every Sphinx role of the loaded ``plugintrain`` package's docstrings."""

    def on_package(self, *, pkg: griffe.Module, loader: griffe.GriffeLoader, **kwargs: Any) -> None:
        if pkg.name != PACKAGE:
            return
        index = ApiIndex(pkg)
        for obj in walk(pkg):
            if obj.docstring is not None:
                text = obj.docstring.value
                obj.docstring.value = ROLE.sub(lambda m, o=obj: _link(index, o, m), text)


def _link(index: ApiIndex, obj: griffe.Object, role: re.Match[str]) -> str:
    target = re.sub(r"\s+", "", role.group(2))
    shown = target.rsplit(".", 1)[-1] if role.group(1) else target
    path = index.resolve(obj, target)
    if path is None and (target.startswith(f"{PACKAGE}.") or "." not in target):
        LOG.warning(
            "%s: the docstring of %s names %r, which is nowhere", _where(obj), obj.path, target
        )
    if path is not None and index.rendered(path):
        return f"[`{shown}`][{path}]"
    return f"`{shown}`"


def _where(obj: griffe.Object) -> str:
    return f"{obj.relative_filepath}:{obj.docstring.lineno if obj.docstring else obj.lineno}"
