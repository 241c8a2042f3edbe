"""Pretrained weights in and out: Hugging Face directories, llm.c model files, GGUF files
and plugintrain's own checkpoints, read and written one tensor at a time, never unpickled.

:func:`open_weights` reads any of them (the format is detected from the path) as our
tensor names; :func:`load_into` copies them into a model of any parallel layout;
:func:`convert` writes them in another format, atomically.
"""

from plugintrain.formats.base import (
    TensorReader,
    WeightFormatError,
    Weights,
    check_architecture,
    load_into,
)
from plugintrain.formats.convert import (
    DTYPES,
    FORMATS,
    OUTPUT_DTYPES,
    check_output,
    convert,
    dtype_problem,
)
from plugintrain.formats.sources import detect_format, open_pretrained, open_weights, resolve

__all__ = [
    "DTYPES",
    "FORMATS",
    "OUTPUT_DTYPES",
    "TensorReader",
    "WeightFormatError",
    "Weights",
    "check_architecture",
    "check_output",
    "convert",
    "detect_format",
    "dtype_problem",
    "load_into",
    "open_pretrained",
    "open_weights",
    "resolve",
]
