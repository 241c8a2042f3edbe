"""The benchmark matrix behind ``plugintrain bench``.

:mod:`~plugintrain.bench.matrix` reads and expands a matrix file,
:class:`BenchRecorder` measures a ``plugintrain fit`` run from inside (a callback),
:mod:`~plugintrain.bench.baselines` holds the rows that are not ``fit`` (a plain PyTorch
loop, torch.distributed.pipelining) and :mod:`~plugintrain.bench.report` merges the
ranks' measurements into records, a Markdown table and plots.
"""

from plugintrain.bench.baselines import ZeroRedundancyAdamW
from plugintrain.bench.matrix import RUNNERS, BenchConfig, MatrixError, load_matrix
from plugintrain.bench.recorder import BenchRecorder, RankRecord

__all__ = [
    "RUNNERS",
    "BenchConfig",
    "BenchRecorder",
    "MatrixError",
    "RankRecord",
    "ZeroRedundancyAdamW",
    "load_matrix",
]
