"""The benchmark matrix behind ``plugintrain bench``, and ``make gpu-check``'s checks.

:mod:`~plugintrain.bench.matrix` reads and expands a matrix file,
:class:`BenchRecorder` measures a ``plugintrain fit`` run from inside (a callback),
:mod:`~plugintrain.bench.baselines` holds the rows that are not ``fit`` (a plain PyTorch
loop, torch.distributed.pipelining), :mod:`~plugintrain.bench.report` merges the ranks'
measurements into records, a Markdown table and plots, and
:mod:`~plugintrain.bench.gpu_checks` is what ``make gpu-check`` runs on one CUDA device.
Names are imported from their modules on first use, so reading a matrix loads no torch.
"""

from plugintrain.core.lazy import lazy_exports

__all__, __getattr__ = lazy_exports(
    __name__,
    {
        "baselines": ("ZeroRedundancyAdamW",),
        "matrix": ("RUNNERS", "BenchConfig", "MatrixError", "load_matrix"),
        "recorder": ("BenchRecorder", "RankRecord"),
    },
)
