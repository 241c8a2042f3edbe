"""ZeroStrategy: Lightning's DDP over our gradient engine (ZeRO-1/2, DDP, parameter server).

It launches processes, detects torchrun/SLURM environments, shards the sampler and syncs
metrics exactly like Lightning's ``DDPStrategy`` (which it subclasses), but replaces torch's
``DistributedDataParallel`` wrapper with :class:`~plugintrain.strategies.GradientEngine`.
Checkpoints are DCP directories written shard by shard from every rank (nothing gathered,
:mod:`~plugintrain.checkpoints.dcp`), keyed by parameter name, so they resume under
any number of ranks and ZeRO stage, and under the ``hybrid`` and ``pipeline`` strategies.
Single-file checkpoints of earlier versions (the whole optimizer state by name) still load.
"""

from __future__ import annotations

from collections.abc import Generator, Iterable, Mapping
from contextlib import contextmanager
from datetime import timedelta
from pathlib import Path
from typing import Any, Literal

import lightning.pytorch as pl
from lightning.pytorch.strategies import DDPStrategy, StrategyRegistry
from torch import Tensor
from torch.distributed.constants import default_pg_timeout
from torch.optim import Optimizer
from typing_extensions import override

from plugintrain.checkpoints.dcp import load_weights
from plugintrain.core.contracts import CallsModelBuiltHooks, GradientLayout
from plugintrain.core.elastic import init_restarted_process_group
from plugintrain.core.lightning_seam import LightningStrategyRegistry
from plugintrain.strategies.blocks import BlockOptions
from plugintrain.strategies.buckets import (
    PARAMETER_SERVER,
    STAGES,
    Stage,
    validate_engine_args,
)
from plugintrain.strategies.engine_binding import EngineBinding
from plugintrain.strategies.grad_engine import GradientEngine
from plugintrain.strategies.registry import register_names

StartMethod = Literal["popen", "spawn", "fork", "forkserver"]

# The DDPStrategy arguments the Trainer fills in. ZeroStrategy names them instead of
# taking **kwargs: LightningCLI would follow **kwargs into DDPStrategy's and on into
# DistributedDataParallel's arguments, and pass every one of those.
_PLUMBING = ("accelerator", "parallel_devices", "cluster_environment", "checkpoint_io",
             "precision_plugin")  # fmt: skip


def _plumbing(arguments: dict[str, Any]) -> dict[str, Any]:
    """The Lightning plumbing among a constructor's ``locals()``."""
    return {key: arguments[key] for key in _PLUMBING}


class ZeroStrategy(CallsModelBuiltHooks, DDPStrategy):
    """Data parallelism over our bucketed, overlapped gradient engine: ZeRO stage 1 or 2,
    bucketed DDP (stage 0) or a parameter server.

    Registered as ``ddp_bucketed`` (stage 0), ``zero1``, ``zero2`` and ``parameter_server``.
    Stage 0 is accepted (as in DeepSpeed) so bucketed DDP shares the engine; stage 3 is
    FSDP's job. Every engine hook goes through one :class:`~plugintrain.strategies.
    engine_binding.EngineBinding`. Implements :class:`plugintrain.core.contracts.
    GradientLayoutProvider`, so plugintrain's precision plugins clip by the global norm and
    agree found-inf across the shards.

    Args:
        stage: 1 shards optimizer state, 2 also shards gradients (reduce-scatter); 0 is
            plain bucketed all-reduce data parallelism; ``"parameter_server"`` reduces
            gradients to rank 0, which alone holds optimizer state and steps, and
            broadcasts the weights back.
        bucket_size_mb: Target size of each flat gradient bucket in MiB.
        overlap_comm: Launch each bucket's collective during backward as soon as the bucket
            is complete, instead of after backward.
        activation_checkpointing: ``none``, ``full`` or ``selective`` recomputation of each
            transformer block in backward (see :class:`~plugintrain.strategies.blocks.
            BlockOptions`).
        every_n_layers: With ``full``, recompute only blocks ``0, n, 2n, ...``.
        compile: ``torch.compile`` each transformer block (after recomputation).
        process_group_backend: ``"gloo"``, ``"nccl"``, ...; default: chosen from the device.
        timeout: Timeout of the process group's collectives.
        start_method: How Lightning launches the processes (``"popen"`` reruns the script,
            as ``ddp`` does; ``"spawn"``/``"fork"`` as ``ddp_spawn``/``ddp_fork``).
        accelerator: Lightning plumbing, forwarded to ``DDPStrategy`` (set by the Trainer).
        parallel_devices: Lightning plumbing (set by the Trainer).
        cluster_environment: Lightning plumbing (set by the Trainer).
        checkpoint_io: Lightning plumbing (set by the Trainer).
        precision_plugin: Lightning plumbing (set by the Trainer).
    """

    strategy_name = "zero"

    def __init__(
        self,
        stage: Stage = 2,
        bucket_size_mb: float = 25.0,
        overlap_comm: bool = True,
        activation_checkpointing: str = "none",
        every_n_layers: int = 1,
        compile: bool = False,
        process_group_backend: str | None = None,
        timeout: timedelta | None = default_pg_timeout,
        start_method: StartMethod = "popen",
        accelerator: Any = None,
        parallel_devices: list[Any] | None = None,
        cluster_environment: Any = None,
        checkpoint_io: Any = None,
        precision_plugin: Any = None,
    ) -> None:
        plumbing = _plumbing(locals())
        name = type(self).__name__
        self.block_options = BlockOptions(activation_checkpointing, every_n_layers, compile, name)
        if isinstance(stage, bool) or stage not in STAGES:
            raise ValueError(
                f"{name}(stage={stage!r}) is not supported: use stage=1 (shard optimizer"
                " state) or stage=2 (also shard gradients), 0 for bucketed DDP, or"
                f" {PARAMETER_SERVER!r}. For parameter sharding (stage 3) use FSDP2."
            )
        validate_engine_args(stage, bucket_size_mb)
        super().__init__(
            process_group_backend=process_group_backend,
            timeout=timeout,
            start_method=start_method,
            **plumbing,
        )
        if self._ddp_kwargs:
            raise TypeError(
                f"{name} got unexpected arguments {sorted(self._ddp_kwargs)}; it"
                " does not wrap the model in torch DistributedDataParallel."
            )
        self.engine_stage = stage
        self.bucket_size_mb = bucket_size_mb
        self.overlap_comm = overlap_comm
        self._binding = EngineBinding(name)
        self._loaded_directory = False

    @property
    def engine(self) -> GradientEngine:
        """The gradient engine (exists while fitting, after ``setup``)."""
        return self._binding.engine

    def gradient_buffers(self) -> list[Tensor]:
        """Where this rank's gradients are (:class:`~plugintrain.core.contracts.HoldsGradients`)."""
        return self._binding.gradient_buffers(self.lightning_module)

    def check_model(self, module: pl.LightningModule, datamodule: Any = None) -> None:
        """Raise if recomputation or compile is asked for a module without transformer
        blocks; ``plugintrain fit`` calls it before any process is launched."""
        self.block_options.check(module)

    @override
    def setup(self, trainer: pl.Trainer) -> None:
        self._binding.check_clipping(trainer, self.precision_plugin)
        # torchtitan's order: recompute and compile the blocks, then data parallelism
        # (the engine, built in `configure_ddp`).
        assert self.lightning_module is not None
        self.block_options.check(self.lightning_module, built=True)
        self.block_options.apply(self.lightning_module)
        super().setup(trainer)

    @override
    def configure_ddp(self) -> None:
        # No torch DDP wrapper: the engine's gradient hooks do the reduction. Lightning
        # builds the optimizers right after, and `setup_optimizers` attaches them.
        assert self.model is not None
        engine = GradientEngine(
            self.model.named_parameters(),
            process_group=None,
            stage=self.engine_stage,
            bucket_size_mb=self.bucket_size_mb,
            overlap_comm=self.overlap_comm,
        )
        self._binding.install(engine)

    @override
    def setup_optimizers(self, trainer: pl.Trainer) -> None:
        super().setup_optimizers(trainer)
        self._binding.attach(self.optimizers)

    @contextmanager
    @override
    def block_backward_sync(self) -> Generator[None, None, None]:
        with self._binding.no_sync():
            yield

    def gradient_layout(self, parameters: Iterable[Tensor]) -> GradientLayout:
        """The layout of the optimizer's shard gradients, for the precision plugin."""
        return self.engine.gradient_layout(parameters)

    @override
    def setup_distributed(self) -> None:
        init_restarted_process_group(self._get_process_group_backend(), self._timeout)
        super().setup_distributed()

    @property
    @override
    def restore_checkpoint_after_setup(self) -> bool:
        # A sharded checkpoint loads straight into the optimizers' shards: they must exist.
        return True

    @override
    def optimizer_state(self, optimizer: Optimizer) -> dict[str, Any]:
        if not self._binding.bound:
            return super().optimizer_state(optimizer)
        return self._binding.optimizer_state(optimizer)  # this rank's shards, for DCP

    @override
    def save_checkpoint(
        self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any = None
    ) -> None:
        if not self._binding.bound:
            return super().save_checkpoint(checkpoint, filepath, storage_options)
        path = self.broadcast(filepath)
        self._binding.save(checkpoint, path, storage_options, self.is_global_zero)

    @override
    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> Any:
        # Directories and single files alike (any layout) load through DCP straight into
        # the shards; only tensors and plain data are unpickled, whatever `weights_only`.
        self._loaded_directory = False
        checkpoint_path = self.broadcast(checkpoint_path)
        if "://" in str(checkpoint_path):
            return super().load_checkpoint(checkpoint_path, weights_only=True)
        path = Path(checkpoint_path)
        assert self.model is not None
        self._loaded_directory = True
        if not self._binding.bound:  # evaluating: weights only
            return load_weights(path, self.model)
        return self._binding.load(path, self.model, self.optimizers)

    @property
    @override
    def lightning_restore_optimizer(self) -> bool:
        # `load_checkpoint` filled the optimizers' shards already.
        return not self._loaded_directory

    @override
    def load_model_state_dict(self, checkpoint: Mapping[str, Any], strict: bool = True) -> None:
        if "state_dict" in checkpoint:  # else loaded from the DCP directory already
            super().load_model_state_dict(checkpoint, strict=strict)

    @override
    def load_optimizer_state_dict(self, checkpoint: Mapping[str, Any]) -> None:
        if not self._binding.bound:
            super().load_optimizer_state_dict(checkpoint)
            return
        self._binding.load_optimizer_states(self.optimizers, checkpoint["optimizer_states"])

    @override
    def teardown(self) -> None:
        self._binding.teardown()
        super().teardown()

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: LightningStrategyRegistry) -> None:
        register_names(cls, strategy_registry)


class ParameterServerStrategy(ZeroStrategy):
    """:class:`ZeroStrategy` with ``stage="parameter_server"`` by default, the strategy the
    name ``parameter_server`` builds: gradients are reduced to rank 0, which alone holds
    optimizer state and steps, and the weights are broadcast back.

    Args:
        stage: As :class:`ZeroStrategy`'s.
        **kwargs: Any other option of :class:`ZeroStrategy`.
    """

    def __init__(self, stage: Stage = PARAMETER_SERVER, **kwargs: Any) -> None:
        super().__init__(stage=stage, **kwargs)


# Importing the module registers its names, as Lightning's own strategies' modules do.
ZeroStrategy.register_strategies(StrategyRegistry)
