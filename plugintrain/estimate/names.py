"""The names ``plugintrain estimate`` accepts (kept apart so its ``--help`` imports nothing
heavy): the strategies come from :mod:`plugintrain.strategies.registry`, plain data too."""

from plugintrain.strategies.registry import STRATEGIES as _REGISTERED

PRECISIONS = ("32-true", "bf16-mixed", "16-mixed", "bf16-true")
SINGLE = "single"
"""One device, Lightning's own loop: the layout without a plugintrain strategy."""
STRATEGIES = (SINGLE, *(s.name for s in _REGISTERED.values() if s.estimated))
""":data:`SINGLE`, then the registered names the estimate models, in registration order:
those of data parallelism only (:data:`ENGINE_STAGE`), and the hybrid one (dp x tp x pp
with ``zero_stage``)."""
ENGINE_STAGE = {
    s.name: s.engine_stage for s in _REGISTERED.values() if s.estimated and s.data_parallel_only
}
"""The gradient engine's ZeRO stage of each data-parallel strategy name."""
CLUSTER_NAMES = ("h100-ib", "h100-roce", "h100-500w-roce", "h200-ib", "a100-ib")
"""The scaling calculator's cluster presets (:data:`plugintrain.estimate.timing.CLUSTERS`)."""
