"""Pretrained weights in and out: Hugging Face directories, llm.c model files, GGUF files,
PEFT adapters and plugintrain's own checkpoints, read and written one tensor at a time,
never unpickled.

Each format is declared once in :mod:`plugintrain.formats.registry` (:data:`FORMATS`).
:func:`open_weights` reads any of them (the format is detected from the path) as our
tensor names; :func:`load_into` copies them into a model of any parallel layout;
:func:`convert` writes them in another format, atomically.

Names are imported from their modules on first use (PEP 562), so the registry's names
and dtypes (``plugintrain convert --help``) come without importing torch.
"""

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from plugintrain.formats.base import (
        TORCH_DTYPES,
        TensorReader,
        WeightFormatError,
        Weights,
        check_architecture,
        load_into,
    )
    from plugintrain.formats.conversion import check_output, convert, export, output_problem
    from plugintrain.formats.registry import (
        FORMATS,
        FormatSpec,
        convert_formats,
        dtype_problem,
        dtypes,
        export_formats,
        format_spec,
        register_format,
        weight_formats,
    )
    from plugintrain.formats.sources import (
        detect_adapters,
        detect_format,
        open_pretrained,
        open_weights,
        read_adapters,
        resolve,
    )

_MODULES = {
    "base": (
        "TORCH_DTYPES",
        "TensorReader",
        "WeightFormatError",
        "Weights",
        "check_architecture",
        "load_into",
    ),
    "conversion": ("check_output", "convert", "export", "output_problem"),
    "registry": (
        "FORMATS",
        "FormatSpec",
        "convert_formats",
        "dtype_problem",
        "dtypes",
        "export_formats",
        "format_spec",
        "register_format",
        "weight_formats",
    ),
    "sources": (
        "detect_adapters",
        "detect_format",
        "open_pretrained",
        "open_weights",
        "read_adapters",
        "resolve",
    ),
}
_HOME = {name: module for module, names in _MODULES.items() for name in names}

__all__ = [
    "FORMATS",
    "TORCH_DTYPES",
    "FormatSpec",
    "TensorReader",
    "WeightFormatError",
    "Weights",
    "check_architecture",
    "check_output",
    "convert",
    "convert_formats",
    "detect_adapters",
    "detect_format",
    "dtype_problem",
    "dtypes",
    "export",
    "export_formats",
    "format_spec",
    "load_into",
    "open_pretrained",
    "open_weights",
    "output_problem",
    "read_adapters",
    "register_format",
    "resolve",
    "weight_formats",
]


def __getattr__(name: str) -> Any:
    """Each public name from its module, imported when first asked for."""
    if name in _HOME:
        return getattr(importlib.import_module(f"{__name__}.{_HOME[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
