"""A ``plugintrain fit`` recipe's model and layout, for ``plugintrain estimate --config``.

Reads what the recipe's YAML names (``model.init_args.config``, ``trainer.devices`` x
``trainer.num_nodes``, ``trainer.precision``, the strategy by name or by ``class_path`` with
its ``init_args``, ``data.init_args.seq_len`` and ``batch_size``) into the
:class:`~plugintrain.estimate.Layout` the strategy would build: a 1,024-GPU recipe can be
estimated and dry-run on a laptop before its allocation starts. Lightning's own ``ddp`` is
estimated as plugintrain's bucketed DDP (the same replicated state).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from plugintrain.estimate.layout import Layout
from plugintrain.estimate.names import ENGINE_STAGE, PRECISIONS
from plugintrain.model_zoo.config import TransformerConfig

_HYBRID = {"HybridParallelStrategy": 1, "hybrid": 1, "PipelineStrategy": 2, "pipeline": 2}
"""Hybrid strategy names -> their default pipeline degree."""
_ZERO = {"ZeroStrategy": None, "ParameterServerStrategy": None}


def recipe_layout(path: str | Path) -> tuple[TransformerConfig, Layout]:
    """The model config and training layout of the recipe at ``path``.

    Raises:
        ValueError: One line naming the recipe, the value and the fix.
    """
    import yaml

    path = Path(path)
    if not path.is_file():
        raise ValueError(f"recipe {str(path)!r} does not exist; give the path of a fit YAML")
    doc = yaml.safe_load(path.read_text()) or {}
    trainer = doc.get("trainer") or {}
    model = ((doc.get("model") or {}).get("init_args")) or {}
    data = ((doc.get("data") or {}).get("init_args")) or {}
    name = model.get("config")
    if name is None:
        raise ValueError(f"{path}: no model.init_args.config; name a model preset there")
    config = (
        TransformerConfig.from_name(name)
        if isinstance(name, str)
        else TransformerConfig.from_dict(name)
    )
    world = int(trainer.get("devices", 1)) * int(trainer.get("num_nodes", 1))
    precision = str(trainer.get("precision", "32-true"))
    if precision not in PRECISIONS:
        raise ValueError(f"{path}: precision {precision!r} is not one of {', '.join(PRECISIONS)}")
    sizes = {
        "precision": precision,
        "seq_len": int(data.get("seq_len", min(2048, config.block_size))),
    }
    batch = int(data.get("batch_size", 1))
    strategy, options = _strategy(trainer.get("strategy"))
    return config, _layout(strategy, options, world, batch, sizes)


def _strategy(value: Any) -> tuple[str, dict[str, Any]]:
    """The strategy's name (a class's last dotted part) and init arguments."""
    if isinstance(value, dict):
        return str(value.get("class_path", "auto")).rsplit(".", 1)[-1], value.get("init_args") or {}
    return str(value or "auto").rsplit(".", 1)[-1], {}


def _layout(
    strategy: str, options: dict[str, Any], world: int, batch: int, sizes: dict[str, Any]
) -> Layout:
    blocks = {
        "recompute": options.get("activation_checkpointing", "none"),
        "every_n_layers": options.get("every_n_layers", 1),
    }
    bucket = float(options.get("bucket_size_mb", 25.0))
    if strategy in _HYBRID:
        pp = int(options.get("pipeline_parallel", _HYBRID[strategy]))
        tp = int(options.get("tensor_parallel", 1))
        dp = options.get("data_parallel", "auto")
        dp = world // (tp * pp) if dp == "auto" else int(dp)
        microbatches = options.get("microbatches")
        per_micro = batch // (microbatches or pp) if pp > 1 else batch
        counts = options.get("layers_per_stage")
        return Layout.of(
            "hybrid", dp=dp, tp=tp, sp=bool(options.get("sequence_parallel", False)), pp=pp,
            vpp=int(options.get("virtual_pipeline_parallel", 1)),
            ep=int(options.get("expert_parallel", 1)),
            zero_stage=int(options.get("zero_stage", 0)), schedule=options.get("schedule"),
            microbatches=microbatches, layers_per_stage=None if counts == "auto" else counts,
            micro_batch=max(1, per_micro), bucket_size_mb=bucket, **blocks, **sizes,
        )  # fmt: skip
    if strategy in _ZERO:
        stage = options.get("stage", 2)
        strategy = {0: "ddp_bucketed", 1: "zero1", 2: "zero2"}.get(stage, "ddp_bucketed")
    if strategy in ENGINE_STAGE:
        return Layout.of(strategy, dp=world, micro_batch=batch, bucket_size_mb=bucket,
                         **blocks, **sizes)  # fmt: skip
    if world == 1:
        return Layout.of("single", micro_batch=batch, **blocks, **sizes)
    return Layout.of("ddp_bucketed", dp=world, micro_batch=batch, **blocks, **sizes)
