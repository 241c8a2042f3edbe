"""Pretrained weights in and out: Hugging Face directories, llm.c model files, GGUF files,
PEFT adapters and plugintrain's own checkpoints, read and written one tensor at a time,
never unpickled.

Each format is declared once in :mod:`plugintrain.formats.registry`
(:data:`~plugintrain.formats.registry.FORMATS`).
:func:`~plugintrain.formats.sources.open_weights` reads any of them (the format is detected
from the path) as our tensor names; :func:`~plugintrain.formats.base.load_into` copies them
into a model of any parallel layout; :func:`~plugintrain.formats.conversion.convert` writes
them in another format, atomically.

Names are imported from their modules on first use (PEP 562), so the registry's names
and dtypes (``plugintrain convert --help``) come without importing torch.
"""

from plugintrain.core.lazy import lazy_exports

__all__, __getattr__ = lazy_exports(
    __name__,
    {
        "base": (
            "TORCH_DTYPES",
            "TensorReader",
            "WeightFormatError",
            "Weights",
            "check_architecture",
            "load_into",
        ),
        "conversion": ("check_output", "convert", "export", "output_problem"),
        "model_card": ("RUN_RECORD_KEY", "CardFacts"),
        "registry": (
            "FORMATS",
            "CardSpec",
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
    },
)
