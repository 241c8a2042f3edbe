"""Lightning's (and torch's) private names, in one place.

Everything of plugintrain that reads, replaces or imports a private name of Lightning, or
replaces a private of torch or the standard library, does it through a function here;
each says why, and the versions it was checked on (:data:`CHECKED_ON`, the range
``pyproject.toml`` allows). What cannot be a function is declared here instead: the
private hooks of Lightning and torch base classes that project classes override
(:data:`OVERRIDDEN`), and the private state of a Lightning base class that a project
subclass reads on ``self`` (:data:`INHERITED`). These tables and :data:`PRIVATES` (every
name the functions use) give each name's kind and parameters:
``tests/unit/test_lightning_seam.py`` checks them against the installed Lightning and
torch and names the one that moved, and the shape test finds a private Lightning import,
a private attribute of a Lightning object or an undeclared private override anywhere
else.

Lightning and torch are imported inside the functions: importing this module imports
neither (the floor's signal watch imports it), and a private that moved fails where it
is used, not when plugintrain is imported.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, get_args

if TYPE_CHECKING:
    import lightning.pytorch as pl
    import torch
    from lightning.fabric.strategies.registry import (  # noqa: F401 (see __getattr__)
        _StrategyRegistry as LightningStrategyRegistry,
    )
    from lightning.pytorch.callbacks import ModelCheckpoint


def __getattr__(name: str) -> Any:
    """``LightningStrategyRegistry``: the type of a strategy's ``register_strategies``
    argument, Lightning's registry class, which it exports only under a private name
    (imported when asked for, so importing this module imports no Lightning).
    Checked on Lightning 2.6.6."""
    if name == "LightningStrategyRegistry":
        from lightning.fabric.strategies.registry import _StrategyRegistry

        return _StrategyRegistry
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


CHECKED_ON = "Lightning 2.6.6, torch 2.13.0"
"""The versions every function here was checked on (pyproject bounds Lightning to 2.6)."""


@dataclass(frozen=True)
class Private:
    """One private name of Lightning or torch that plugintrain relies on.

    Args:
        path: ``module:Qualified.name``.
        kind: ``function``, ``method`` (on the class), ``property``, ``attribute`` (set
            on each instance), ``class`` or ``type`` (a typing alias).
        parameters: A callable's parameter names, in order (None: not a callable, or a
            builtin without a signature).
        used_by: The function here that uses it; in :data:`OVERRIDDEN` the project
            method that overrides it, in :data:`INHERITED` the project class that reads it.
    """

    path: str
    kind: str
    parameters: tuple[str, ...] | None
    used_by: str


# -- the trainer's signal handling (GracefulStop) -------------------------------------------


def switch_off_signal_handlers(trainer: pl.Trainer) -> None:
    """Keep Lightning's signal connector from installing its handlers at ``fit``'s start:
    its SIGTERM handler runs a collective inside the handler, on whichever ranks got the
    signal, so the ranks' collectives no longer pair up (docs/guides/multi-node.md).
    Checked on Lightning 2.6.6."""
    connector = getattr(trainer, "_signal_connector", None)
    if connector is not None:
        connector.register_signal_handlers = lambda: None


def switch_off_sigterm_broadcast(trainer: pl.Trainer) -> None:
    """Skip the broadcast of rank 0's SIGTERM flag Lightning runs before every training
    batch: GracefulStop's all-reduce after each batch replaces it (one collective per
    batch, and any rank's signal counts). Checked on Lightning 2.6.6."""
    trainer.fit_loop.epoch_loop._broadcast_sigterm_tensor = lambda: None  # type: ignore[method-assign]


def wrap_save_checkpoint(trainer: pl.Trainer, wrap: Callable[[Callable], Callable]) -> None:
    """Replace this trainer's ``save_checkpoint`` by ``wrap(save_checkpoint)``, once (a
    second fit of the same trainer keeps the first wrapper): every save, a callback's or
    the user's, goes through it. Checked on Lightning 2.6.6."""
    if not getattr(trainer.save_checkpoint, "plugintrain_wrapped", False):
        wrapped = wrap(trainer.save_checkpoint)
        wrapped.plugintrain_wrapped = True  # type: ignore[attr-defined]
        trainer.save_checkpoint = wrapped  # type: ignore[method-assign]


def skip_validation_on_stop(trainer: pl.Trainer) -> None:
    """Skip the validation Lightning runs when a run stops early (``should_stop``).
    Checked on Lightning 2.6.6."""
    epoch_loop = trainer.fit_loop.epoch_loop
    if hasattr(epoch_loop, "_skip_next_val"):
        epoch_loop._skip_next_val = True


def cluster_environment(trainer: pl.Trainer) -> Any:
    """The trainer's cluster environment (SLURM's, torchrun's, ...), also under a
    single-device strategy, which has no public ``cluster_environment``.
    Checked on Lightning 2.6.6."""
    connector = getattr(trainer, "_accelerator_connector", None)
    return getattr(connector, "cluster_environment", None)


def save_last_checkpoint(callback: ModelCheckpoint, trainer: pl.Trainer) -> str:
    """Save the step just finished as ``callback``'s ``last`` checkpoint through its own
    atomic path (every rank takes part, as in a periodic save), also where ``save_last``
    is off or a link, and not twice for one step; its path. ModelCheckpoint has no public
    "save now". Checked on Lightning 2.6.6."""
    candidates = callback._monitor_candidates(trainer)
    if callback.save_last is True:
        saved = callback._last_global_step_saved == trainer.global_step
        if not (saved and callback.last_model_path):
            callback._save_last_checkpoint(trainer, candidates)
        return callback.last_model_path
    path = callback.format_checkpoint_name(candidates, callback.CHECKPOINT_NAME_LAST)
    callback._save_checkpoint(trainer, path)
    callback.last_model_path = path
    return path


def silence_launcher_observer() -> None:
    """Stop Lightning's launcher from watching its child ranks: from rank 0 it SIGKILLs
    every process as soon as one exits nonzero, but once a run stops together the
    children's 128 + signal statuses are expected, and rank 0 must be left to finish. The
    observer thread is found by its name; its next look ends its loop.
    Checked on Lightning 2.6.6."""
    for thread in threading.enumerate():
        if thread.name == LAUNCHER_OBSERVER:
            thread._run = lambda: True  # type: ignore[attr-defined]


LAUNCHER_OBSERVER = "child-process-observer"
"""The name Lightning's ``_ChildProcessObserver`` gives its thread."""


# -- torch and the interpreter ----------------------------------------------------------------


def default_store() -> Any:
    """The default process group's store (the run's rendezvous store), or None: torch has
    no public getter. Checked on torch 2.13.0."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return None
    try:
        return dist.distributed_c10d._get_default_store()
    except (RuntimeError, ValueError):
        return None


def run_exit_handlers() -> None:
    """Run the ``atexit`` handlers now, before an ``os._exit`` that skips the
    interpreter's finalization (seconds of process-group and thread teardown a stopped
    run has no use for). Checked on Python 3.10-3.13."""
    import atexit

    atexit._run_exitfuncs()


# -- what callbacks, commands and strategies read ---------------------------------------------


def logs_this_step(trainer: pl.Trainer) -> bool:
    """Whether the trainer logs this step (``log_every_n_steps``), the same on every rank.
    Checked on Lightning 2.6.6."""
    return trainer._logger_connector.should_update_logs


def log_metrics(trainer: pl.Trainer, metrics: dict[str, Any], step: int | None) -> None:
    """Send ``metrics`` to the trainer's loggers at ``step``, as Lightning's own
    ``ThroughputMonitor`` does (outside ``LightningModule.log``'s reduction).
    Checked on Lightning 2.6.6."""
    trainer._logger_connector.log_metrics(metrics, step=step)


def accumulating(trainer: pl.Trainer) -> bool:
    """Whether this micro-batch is not a step's last (gradient accumulation goes on).
    Checked on Lightning 2.6.6."""
    return trainer.fit_loop._should_accumulate()


def compute_dtype(precision_plugin: Any) -> torch.dtype:
    """The dtype a precision plugin computes in (what peak FLOP/s are looked up for), by
    Lightning's own rule. Checked on Lightning 2.6.6."""
    from lightning.pytorch.callbacks.throughput_monitor import _plugin_to_compute_dtype

    return _plugin_to_compute_dtype(precision_plugin)


def format_summary_table(*args: Any) -> str:
    """Lightning's model-summary table, for a summary that replaces its FLOPs column:
    ``format_summary_table(total, trainable, size, modes, flops, *columns)``.
    Checked on Lightning 2.6.6."""
    from lightning.pytorch.utilities.model_summary.model_summary import _format_summary_table

    return _format_summary_table(*args)


def split_threads_between(processes: int) -> None:
    """Split the CPU threads between ``processes`` ranks on one machine, as ``fit`` does.
    Checked on Lightning 2.6.6."""
    from lightning.fabric.utilities.distributed import _set_num_threads_if_needed

    _set_num_threads_if_needed(processes)


def precision_names() -> list[str]:
    """Every ``trainer.precision`` value Lightning accepts, in its order.
    Checked on Lightning 2.6.6."""
    from lightning.fabric.plugins.precision.precision import _PRECISION_INPUT

    names = (str(v) for literal in get_args(_PRECISION_INPUT) for v in get_args(literal))
    return list(dict.fromkeys(names))


def give_module_mesh(module: pl.LightningModule, mesh: Any) -> None:
    """Hand the strategy's device mesh to the module (its public ``device_mesh`` reads
    it), as Lightning's ``ModelParallelStrategy.setup_environment`` does.
    Checked on Lightning 2.6.6."""
    module._device_mesh = mesh


_L = "lightning.pytorch"
_CHECKPOINT = f"{_L}.callbacks.model_checkpoint:ModelCheckpoint"
_EPOCH_LOOP = f"{_L}.loops.training_epoch_loop:_TrainingEpochLoop"
_TRAINER = f"{_L}.trainer.trainer:Trainer"
_LOGGER_CONNECTOR = f"{_L}.trainer.connectors.logger_connector.logger_connector:_LoggerConnector"

PRIVATES: tuple[Private, ...] = (
    Private(f"{_TRAINER}._signal_connector", "attribute", None, "switch_off_signal_handlers"),
    Private(
        f"{_L}.trainer.connectors.signal_connector:_SignalConnector.register_signal_handlers",
        "method",
        ("self",),
        "switch_off_signal_handlers",
    ),
    Private(
        f"{_EPOCH_LOOP}._broadcast_sigterm_tensor",
        "method",
        ("self",),
        "switch_off_sigterm_broadcast",
    ),
    Private(f"{_EPOCH_LOOP}._skip_next_val", "attribute", None, "skip_validation_on_stop"),
    Private(f"{_TRAINER}._accelerator_connector", "attribute", None, "cluster_environment"),
    Private(
        f"{_CHECKPOINT}._monitor_candidates", "method", ("self", "trainer"), "save_last_checkpoint"
    ),
    Private(
        f"{_CHECKPOINT}._save_last_checkpoint",
        "method",
        ("self", "trainer", "monitor_candidates"),
        "save_last_checkpoint",
    ),
    Private(
        f"{_CHECKPOINT}._save_checkpoint",
        "method",
        ("self", "trainer", "filepath"),
        "save_last_checkpoint",
    ),
    Private(f"{_CHECKPOINT}._last_global_step_saved", "attribute", None, "save_last_checkpoint"),
    Private(
        "lightning.fabric.strategies.launchers.subprocess_script:_ChildProcessObserver._run",
        "method",
        ("self",),
        "silence_launcher_observer",
    ),
    Private(
        "torch.distributed.distributed_c10d:_get_default_store", "function", (), "default_store"
    ),
    Private("atexit:_run_exitfuncs", "function", None, "run_exit_handlers"),  # a builtin
    Private(f"{_TRAINER}._logger_connector", "attribute", None, "logs_this_step"),
    Private(f"{_LOGGER_CONNECTOR}.should_update_logs", "property", None, "logs_this_step"),
    Private(
        f"{_LOGGER_CONNECTOR}.log_metrics", "method", ("self", "metrics", "step"), "log_metrics"
    ),
    Private(
        f"{_L}.loops.fit_loop:_FitLoop._should_accumulate", "method", ("self",), "accumulating"
    ),
    Private(
        f"{_L}.callbacks.throughput_monitor:_plugin_to_compute_dtype",
        "function",
        ("plugin",),
        "compute_dtype",
    ),
    Private(
        f"{_L}.utilities.model_summary.model_summary:_format_summary_table",
        "function",
        (
            "total_parameters",
            "trainable_parameters",
            "model_size",
            "total_training_modes",
            "total_flops",
            "cols",
        ),
        "format_summary_table",
    ),
    Private(
        "lightning.fabric.utilities.distributed:_set_num_threads_if_needed",
        "function",
        ("num_processes",),
        "split_threads_between",
    ),
    Private(
        "lightning.fabric.plugins.precision.precision:_PRECISION_INPUT",
        "type",
        None,
        "precision_names",
    ),
    Private(
        f"{_L}.core.module:LightningModule._device_mesh", "attribute", None, "give_module_mesh"
    ),
    Private(
        "lightning.fabric.strategies.registry:_StrategyRegistry",
        "class",
        None,
        "LightningStrategyRegistry",
    ),
)
"""Every private name the functions above use."""

OVERRIDDEN: tuple[Private, ...] = (
    Private(
        f"{_L}.strategies.model_parallel:ModelParallelStrategy._configure_launcher",
        "method",
        ("self",),
        "plugintrain.strategies.hybrid.HybridParallelStrategy._configure_launcher",
    ),
    Private(
        f"{_L}.plugins.precision.precision:Precision._after_closure",
        "method",
        ("self", "model", "optimizer"),
        "plugintrain.precision_plugins.base.LayoutAwarePrecision._after_closure",
    ),
    Private(
        f"{_L}.callbacks.progress.rich_progress:RichProgressBar._get_train_description",
        "method",
        ("self", "current_epoch"),
        "plugintrain.callbacks.display.StepProgressBar._get_train_description",
    ),
    Private(
        f"{_L}.callbacks.throughput_monitor:ThroughputMonitor._start",
        "method",
        ("self", "trainer"),
        "plugintrain.callbacks.throughput.TokenThroughputMonitor._start",
    ),
    Private(
        f"{_L}.callbacks.throughput_monitor:ThroughputMonitor._update",
        "method",
        ("self", "trainer", "pl_module", "batch", "iter_num"),
        "plugintrain.callbacks.throughput.TokenThroughputMonitor._update",
    ),
    Private(
        f"{_L}.callbacks.throughput_monitor:ThroughputMonitor._compute",
        "method",
        ("self", "trainer", "iter_num"),
        "plugintrain.callbacks.throughput.TokenThroughputMonitor._compute",
    ),
    Private(
        f"{_L}.cli:LightningCLI._parse_ckpt_path",
        "method",
        ("self",),
        "plugintrain.lightning_cli.PluginTrainCLI._parse_ckpt_path",
    ),
    Private(
        f"{_L}.cli:LightningCLI._instantiate_trainer",
        "method",
        ("self", "config", "callbacks"),
        "plugintrain.lightning_cli.PluginTrainCLI._instantiate_trainer",
    ),
    Private(
        f"{_L}.cli:LightningCLI._run_subcommand",
        "method",
        ("self", "subcommand"),
        "plugintrain.lightning_cli.PluginTrainCLI._run_subcommand",
    ),
    # torch's tensor-parallel styles: the hooks a custom style overrides (checked on 2.13.0).
    Private(
        "torch.distributed.tensor.parallel.style:PrepareModuleInput._prepare_input_fn",
        "method",
        ("self", "inputs", "device_mesh"),
        "plugintrain.strategies.tensor_parallel._FirstInput._prepare_input_fn",
    ),
    Private(
        "torch.distributed.tensor.parallel.style:ColwiseParallel._partition_linear_fn",
        "method",
        ("self", "name", "module", "device_mesh"),
        "plugintrain.strategies.tensor_parallel._Colwise._partition_linear_fn",
    ),
    Private(
        "torch.distributed.tensor.parallel.style:RowwiseParallel._partition_linear_fn",
        "method",
        ("self", "name", "module", "device_mesh"),
        "plugintrain.strategies.tensor_parallel._Rowwise._partition_linear_fn",
    ),
    Private(
        "torch.distributed.tensor.parallel.style:ParallelStyle._apply",
        "method",
        ("self", "module", "device_mesh"),
        "plugintrain.strategies.tensor_parallel._SumGradient._apply",
    ),
    Private(
        "torch.nn.modules.module:Module._apply",
        "method",
        ("self", "fn", "recurse"),
        "plugintrain.model_zoo.moe._FP32Buffers._apply",
    ),
)
"""The private hooks of Lightning and torch base classes that project classes override (each
marked ``@override``): renamed underneath, an override would silently stop being called."""

_ZERO, _HYBRID = "plugintrain.strategies.zero.ZeroStrategy", "plugintrain.strategies.hybrid"
_DDP, _MODEL_PARALLEL = f"{_L}.strategies.ddp:DDPStrategy", f"{_L}.strategies.model_parallel"
_THROUGHPUT = f"{_L}.callbacks.throughput_monitor:ThroughputMonitor"
_TOKENS = "plugintrain.callbacks.throughput.TokenThroughputMonitor"

INHERITED: tuple[Private, ...] = (
    Private(f"{_DDP}._timeout", "attribute", None, _ZERO),
    Private(f"{_DDP}._ddp_kwargs", "attribute", None, _ZERO),
    Private(f"{_DDP}._get_process_group_backend", "method", ("self",), _ZERO),
    Private(
        f"{_MODEL_PARALLEL}:ModelParallelStrategy._timeout",
        "attribute",
        None,
        f"{_HYBRID}.HybridParallelStrategy",
    ),
    Private(
        f"{_MODEL_PARALLEL}:ModelParallelStrategy._device_mesh",
        "attribute",
        None,
        f"{_HYBRID}.HybridParallelStrategy",
    ),
    Private(
        f"{_MODEL_PARALLEL}:ModelParallelStrategy._get_process_group_backend",
        "method",
        ("self",),
        f"{_HYBRID}.HybridParallelStrategy",
    ),
    Private(
        f"{_MODEL_PARALLEL}:ModelParallelStrategy._setup_distributed",
        "method",
        ("self",),
        f"{_HYBRID}.HybridParallelStrategy",
    ),
    Private(f"{_THROUGHPUT}._throughputs", "attribute", None, _TOKENS),
    Private(f"{_THROUGHPUT}._t0s", "attribute", None, _TOKENS),
    Private(f"{_THROUGHPUT}._lengths", "attribute", None, _TOKENS),
    Private(f"{_THROUGHPUT}._samples", "attribute", None, _TOKENS),
    Private(
        f"{_L}.cli:LightningCLI._get",
        "method",
        ("self", "config", "key", "default"),
        "plugintrain.lightning_cli.PluginTrainCLI",
    ),
)
"""Private members of Lightning base classes that project subclasses read on ``self``
(their own state, which Lightning gives no public name): ``used_by`` is the subclass."""
