"""``plugintrain.core.lazy``: a package face's ``__all__`` and ``__getattr__`` from one table."""

from __future__ import annotations

import importlib

import pytest

from plugintrain.core.lazy import lazy_exports


def test_exports_are_the_table_s_names_in_ruff_s_order() -> None:
    exports, _ = lazy_exports("pkg", {"a": ("run", "Thing", "LIMIT"), "b": ("ALPHA", "Base")})
    assert exports == ["ALPHA", "LIMIT", "Base", "Thing", "run"]


def test_a_name_is_imported_from_its_module_when_asked_for() -> None:
    _, getattr_ = lazy_exports("plugintrain.core", {"lazy": ("lazy_exports",)})
    assert getattr_("lazy_exports") is lazy_exports
    with pytest.raises(AttributeError, match=r"'plugintrain\.core' has no attribute 'other'"):
        getattr_("other")


def test_two_modules_cannot_export_one_name() -> None:
    with pytest.raises(ValueError, match="'x' is exported by a and b"):
        lazy_exports("pkg", {"a": ("x",), "b": ("x",)})


@pytest.mark.parametrize(
    "face",
    [
        "plugintrain.data",
        "plugintrain.model_zoo",
        "plugintrain.strategies",
        "plugintrain.estimate",
        "plugintrain.bench",
    ],
)
def test_every_export_of_a_face_resolves(face: str) -> None:
    module = importlib.import_module(face)
    assert module.__all__ and all(getattr(module, name) is not None for name in module.__all__)
