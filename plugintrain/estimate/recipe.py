"""A ``plugintrain fit`` recipe's model and layout, for ``plugintrain estimate --config``.

The strategy is built from the recipe as ``fit`` builds it (by registered name, or by
``class_path`` with its ``init_args``: no process starts), and the layout is read from
the strategy's own option objects (its degrees over ``trainer.devices x
trainer.num_nodes``, pipeline options, recomputation, bucket size), so what the strategy
would refuse is refused here, with its words. The model preset, precision, the data's
``seq_len`` and ``batch_size`` (the per-rank batch; split into the pipeline's
micro-batches) and a LoRA callback's rank, targets and ``quantize`` (QLoRA) complete it.
Lightning's own ``ddp`` is estimated as plugintrain's bucketed DDP (the same replicated
state); other strategies (the parameter server, FSDP and DeepSpeed of Lightning) are
refused.
"""

from __future__ import annotations

import inspect
from pathlib import Path
from typing import Any

from plugintrain.estimate.layout import Layout
from plugintrain.estimate.names import ENGINE_STAGE, PRECISIONS
from plugintrain.model_zoo.config import TransformerConfig

REPLICATED = ("ddp", "auto", "ddp_spawn", "ddp_fork", "ddp_notebook")
"""Lightning's data-parallel strategies: replicated state, estimated as bucketed DDP."""


def recipe_layout(path: str | Path) -> tuple[TransformerConfig, Layout]:
    """The model config and training layout of the recipe at ``path``.

    Raises:
        ValueError: One line naming the recipe, the value and the fix.
    """
    path = Path(path)
    doc = _read(path)
    trainer, model, data = (_section(doc, key, path) for key in ("trainer", "model", "data"))
    config = _config(model, path)
    world = _count(trainer, "devices", path) * _count(trainer, "num_nodes", path)
    precision = str(trainer.get("precision", "32-true"))
    if precision not in PRECISIONS:
        raise ValueError(f"{path}: precision {precision!r} is not one of {', '.join(PRECISIONS)}")
    defaults = _data_defaults()
    sizes = {
        "precision": precision,
        "seq_len": int(data.get("seq_len", defaults["seq_len"])),
        **_lora(trainer.get("callbacks")),
    }
    batch = int(data.get("batch_size", defaults["batch_size"]))
    try:
        return config, _layout(trainer.get("strategy"), world, batch, sizes)
    except (TypeError, ValueError) as error:
        raise ValueError(f"{path}: {str(error).splitlines()[0]}") from None


def _config(model: dict[str, Any], path: Path) -> TransformerConfig:
    """The model's architecture: its preset (or fields), else its weights' (read from
    their config, not their tensors). A preset beside weights is taken as it is: the
    estimate needs the shapes only, and the weights need not be on this machine (``fit``
    checks them against the preset)."""
    from plugintrain.model_zoo.pretrained import resolve_config

    config, weights = model.get("config"), model.get("weights")
    if config is None and weights is None:
        raise ValueError(
            f"{path}: model.init_args names neither a config preset nor weights; only the"
            " causal LMs' layouts are estimated"
        )
    try:
        return resolve_config(config, None if config is not None else weights)
    except (OSError, ValueError) as error:
        raise ValueError(f"{path}: {str(error).splitlines()[0]}") from None


def _read(path: Path) -> dict[str, Any]:
    import yaml

    if not path.is_file():
        raise ValueError(f"recipe {str(path)!r} does not exist; give the path of a fit YAML")
    try:
        doc = yaml.safe_load(path.read_text())
    except yaml.YAMLError as error:
        raise ValueError(f"{path}: not YAML ({str(error).splitlines()[0]})") from None
    if not isinstance(doc, dict):
        raise ValueError(f"{path}: a fit recipe is a mapping (trainer:, model:, data:)")
    return doc


def _section(doc: dict[str, Any], key: str, path: Path) -> dict[str, Any]:
    """``trainer``, or the ``init_args`` of ``model`` / ``data``."""
    value = doc.get(key) or {}
    if key != "trainer" and isinstance(value, dict):
        value = value.get("init_args") or {}
    if not isinstance(value, dict):
        raise ValueError(f"{path}: {key} must be a mapping")
    return value


def _count(trainer: dict[str, Any], key: str, path: Path) -> int:
    value = trainer.get(key, 1)
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{path}: trainer.{key}={value!r}; a layout needs a count (e.g. {key}: 8)")
    return value


def _data_defaults() -> dict[str, int]:
    """The token data module's own ``seq_len`` and ``batch_size`` defaults."""
    from plugintrain.data import TokenDataModule

    params = inspect.signature(TokenDataModule.__init__).parameters
    return {key: params[key].default for key in ("seq_len", "batch_size")}


def _lora(callbacks: Any) -> dict[str, Any]:
    """A LoRA callback's rank, targets and quantization, as ``Layout.of`` takes them."""
    for callback in callbacks if isinstance(callbacks, list) else [callbacks]:
        if isinstance(callback, dict) and str(callback.get("class_path", "")).endswith("LoRA"):
            args = callback.get("init_args") or {}
            return {
                "lora_r": int(args.get("r", 8)),
                "lora_targets": args.get("target_modules"),
                "lora_quantize": args.get("quantize"),
            }
    return {}


def _strategy(value: Any) -> Any:
    """The strategy object ``fit`` would build (or Lightning's name, for its own)."""
    from lightning.pytorch.strategies import StrategyRegistry

    import plugintrain.strategies  # noqa: F401 (registers the names)
    from plugintrain.estimate.names import STRATEGIES

    if isinstance(value, dict):
        from importlib import import_module

        module, _, name = str(value.get("class_path", "")).rpartition(".")
        cls = getattr(import_module(module), name, None) if module else None
        if cls is None:
            raise ValueError(f"strategy class_path {value.get('class_path')!r} not found")
        return cls(**(value.get("init_args") or {}))
    name = str(value or "auto")
    if name in REPLICATED:
        return name
    if name not in StrategyRegistry:
        raise ValueError(f"strategy {name!r} is not modelled; estimate one of {STRATEGIES}")
    return StrategyRegistry.get(name)


def _layout(value: Any, world: int, batch: int, sizes: dict[str, Any]) -> Layout:
    from plugintrain.strategies import HybridParallelStrategy, ZeroStrategy

    strategy = _strategy(value)
    if isinstance(strategy, str):  # Lightning's own data parallelism
        if world == 1:
            return Layout.of("single", micro_batch=batch, **sizes)
        return Layout.of("ddp_bucketed", dp=world, micro_batch=batch, **sizes)
    blocks = strategy.block_options
    sizes = {
        "recompute": blocks.activation_checkpointing,
        "every_n_layers": blocks.every_n_layers,
        "bucket_size_mb": strategy.bucket_size_mb,
        **sizes,
    }
    if isinstance(strategy, HybridParallelStrategy):
        return _hybrid_layout(strategy, world, batch, sizes)
    if isinstance(strategy, ZeroStrategy) and strategy.engine_stage in (0, 1, 2):
        name = {stage: n for n, stage in ENGINE_STAGE.items()}[strategy.engine_stage]
        return Layout.of(name, dp=world, micro_batch=batch, **sizes)
    raise ValueError(f"{type(strategy).__name__} is not modelled by the estimate yet")


def _hybrid_layout(strategy: Any, world: int, batch: int, sizes: dict[str, Any]) -> Layout:
    """A :class:`HybridParallelStrategy`'s layout over ``world`` ranks, ``batch`` rows per
    dp replica (cut into the pipeline's micro-batches; a replica's cp ranks read the same
    rows, each holding its share of every one)."""
    dims = strategy.parallel_dims.with_world_size(world)  # refuses what a launch would
    options = strategy.pipeline_options
    if dims.pp > 1 and batch % options.microbatches:
        raise ValueError(
            f"data.batch_size={batch} does not split into microbatches="
            f"{options.microbatches} equal micro-batches; use a multiple of"
            f" {options.microbatches}"
        )
    if options.layers_per_stage == "auto":
        raise ValueError(
            "layers_per_stage: auto is measured at launch; give the counts to estimate"
        )
    return Layout.of(
        "hybrid",
        dp=dims.dp,
        tp=dims.tp,
        sp=dims.sequence_parallel,
        pp=dims.pp,
        vpp=dims.vpp,
        ep=dims.ep,
        cp=dims.cp,
        zero_stage=dims.zero_stage,
        schedule=options.schedule,
        microbatches=options.microbatches,
        layers_per_stage=options.layers_per_stage,
        micro_batch=batch // options.microbatches if dims.pp > 1 else batch,
        **sizes,
    )
