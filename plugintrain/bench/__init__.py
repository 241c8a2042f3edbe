"""The benchmark matrix behind ``plugintrain bench``, and ``make gpu-check``'s checks.

:mod:`~plugintrain.bench.matrix` reads and expands a matrix file,
:class:`BenchRecorder` measures a ``plugintrain fit`` run from inside (a callback),
:mod:`~plugintrain.bench.baselines` holds the rows that are not ``fit`` (a plain PyTorch
loop, torch.distributed.pipelining), :mod:`~plugintrain.bench.report` merges the ranks'
measurements into records, a Markdown table and plots, and
:mod:`~plugintrain.bench.gpu_checks` is what ``make gpu-check`` runs on one CUDA device.
Names are imported from their modules on first use, so reading a matrix loads no torch.
"""

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from plugintrain.bench.baselines import ZeroRedundancyAdamW
    from plugintrain.bench.matrix import RUNNERS, BenchConfig, MatrixError, load_matrix
    from plugintrain.bench.recorder import BenchRecorder, RankRecord

_HOME = {
    "ZeroRedundancyAdamW": "baselines",
    "RUNNERS": "matrix",
    "BenchConfig": "matrix",
    "MatrixError": "matrix",
    "load_matrix": "matrix",
    "BenchRecorder": "recorder",
    "RankRecord": "recorder",
}

__all__ = [
    "RUNNERS",
    "BenchConfig",
    "BenchRecorder",
    "MatrixError",
    "RankRecord",
    "ZeroRedundancyAdamW",
    "load_matrix",
]


def __getattr__(name: str) -> Any:
    """Each public name from its module, imported when first asked for."""
    if name in _HOME:
        return getattr(importlib.import_module(f"{__name__}.{_HOME[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
