"""The names ``plugintrain estimate`` accepts (kept apart so its ``--help`` imports nothing
heavy)."""

PRECISIONS = ("32-true", "bf16-mixed", "16-mixed", "bf16-true")
STRATEGIES = ("single", "ddp_bucketed", "zero1", "zero2", "hybrid")
"""``single``: one device, Lightning's own loop; ``ddp_bucketed``/``zero1``/``zero2``: the
ZeroStrategy names (data parallelism only); ``hybrid``: dp x tp x pp with ``zero_stage``."""
ENGINE_STAGE = {"ddp_bucketed": 0, "zero1": 1, "zero2": 2}
"""The gradient engine's ZeRO stage of each data-parallel strategy name."""
CLUSTER_NAMES = ("h100-ib", "h100-roce", "h200-ib", "a100-ib")
"""The scaling calculator's cluster presets (:data:`plugintrain.estimate.timing.CLUSTERS`)."""
