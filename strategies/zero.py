"""Lightning strategies over our gradient engine: ZeRO-1/2, bucketed DDP, parameter server.

They launch processes, detect torchrun/SLURM environments, shard the sampler and sync
metrics exactly like Lightning's ``DDPStrategy`` (which they subclass), but replace torch's
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
from lightning.fabric.strategies.registry import _StrategyRegistry
from lightning.pytorch.strategies import DDPStrategy
from torch import Tensor
from torch.distributed.constants import default_pg_timeout
from torch.optim import Optimizer
from typing_extensions import override

from plugintrain.checkpoints.dcp import load_weights
from plugintrain.core.contracts import CallsModelBuiltHooks, GradientLayout
from plugintrain.core.elastic import init_restarted_process_group
from plugintrain.strategies.blocks import BlockOptions
from plugintrain.strategies.engine_binding import EngineBinding
from plugintrain.strategies.grad_engine import (
    PARAMETER_SERVER,
    GradientEngine,
    Stage,
    validate_engine_args,
)

StartMethod = Literal["popen", "spawn", "fork", "forkserver"]

# The DDPStrategy arguments the Trainer fills in. The strategies name them instead of
# taking **kwargs: LightningCLI would follow **kwargs into DDPStrategy's and on into
# DistributedDataParallel's arguments, and pass every one of those.
_PLUMBING = ("accelerator", "parallel_devices", "cluster_environment", "checkpoint_io",
             "precision_plugin")  # fmt: skip


def _plumbing(arguments: dict[str, Any]) -> dict[str, Any]:
    """The Lightning plumbing among a constructor's ``locals()``."""
    return {key: arguments[key] for key in _PLUMBING}


class _GradientEngineStrategy(CallsModelBuiltHooks, DDPStrategy):
    """Lightning's ``DDPStrategy`` with our engine in place of torch's DDP wrapper.

    Every engine hook goes through one :class:`~plugintrain.strategies.engine_binding.
    EngineBinding`. Implements :class:`plugintrain.core.contracts.GradientLayoutProvider`, so
    plugintrain's precision plugins clip by the global norm and agree found-inf across the
    shards.
    """

    def __init__(
        self,
        engine_stage: Stage,
        bucket_size_mb: float,
        overlap_comm: bool,
        process_group_backend: str | None,
        timeout: timedelta | None,
        start_method: StartMethod,
        block_options: BlockOptions,
        **kwargs: Any,
    ) -> None:
        validate_engine_args(engine_stage, bucket_size_mb)
        self.block_options = block_options
        super().__init__(
            process_group_backend=process_group_backend,
            timeout=timeout,
            start_method=start_method,
            **kwargs,
        )
        if self._ddp_kwargs:
            raise TypeError(
                f"{type(self).__name__} got unexpected arguments {sorted(self._ddp_kwargs)}; it"
                " does not wrap the model in torch DistributedDataParallel."
            )
        self.engine_stage = engine_stage
        self.bucket_size_mb = bucket_size_mb
        self.overlap_comm = overlap_comm
        self._binding = EngineBinding(type(self).__name__)
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


class ZeroStrategy(_GradientEngineStrategy):
    """ZeRO data parallelism (stages 0, 1, 2) with our bucketed, overlapped gradient engine.

    Registered as ``ddp_bucketed`` (stage 0), ``zero1`` and ``zero2``. Stage 0 is accepted
    (as in DeepSpeed) so bucketed DDP shares the engine; stage 3 is FSDP's job.

    Args:
        stage: 1 shards optimizer state, 2 also shards gradients (reduce-scatter); 0 is
            plain bucketed all-reduce data parallelism.
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
        stage: int = 2,
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
        blocks = BlockOptions(
            activation_checkpointing, every_n_layers, compile, type(self).__name__
        )
        if stage not in (0, 1, 2) or isinstance(stage, bool):
            raise ValueError(
                f"ZeroStrategy(stage={stage!r}) is not supported: use stage=1 (shard optimizer"
                " state) or stage=2 (also shard gradients), or 0 for bucketed DDP. For"
                " parameter sharding (stage 3) use FSDP2."
            )
        super().__init__(
            stage,
            bucket_size_mb,
            overlap_comm,
            process_group_backend,
            timeout,
            start_method,
            blocks,
            **plumbing,
        )

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: _StrategyRegistry) -> None:
        entries = (
            ("ddp_bucketed", 0, "bucketed, overlapped all-reduce data parallelism"),
            ("zero1", 1, "ZeRO stage 1: optimizer state sharded over data-parallel ranks"),
            ("zero2", 2, "ZeRO stage 2: optimizer state and gradients sharded"),
        )
        for name, stage, description in entries:
            strategy_registry.register(name, cls, description=description, stage=stage)


class ParameterServerStrategy(_GradientEngineStrategy):
    """Parameter-server data parallelism: reduce gradients to rank 0, step there, broadcast.

    Registered as ``parameter_server``. Only rank 0 holds optimizer state; the other ranks
    compute gradients and receive the updated weights.

    Args:
        bucket_size_mb: Target size of each flat gradient bucket in MiB.
        overlap_comm: Launch each bucket's reduction during backward as soon as the bucket
            is complete, instead of after backward.
        activation_checkpointing: ``none``, ``full`` or ``selective`` recomputation of each
            transformer block in backward (see :class:`~plugintrain.strategies.blocks.
            BlockOptions`).
        every_n_layers: With ``full``, recompute only blocks ``0, n, 2n, ...``.
        compile: ``torch.compile`` each transformer block (after recomputation).
        process_group_backend: ``"gloo"``, ``"nccl"``, ...; default: chosen from the device.
        timeout: Timeout of the process group's collectives.
        start_method: How Lightning launches the processes (see :class:`ZeroStrategy`).
        accelerator: Lightning plumbing, as in :class:`ZeroStrategy`.
        parallel_devices: Lightning plumbing.
        cluster_environment: Lightning plumbing.
        checkpoint_io: Lightning plumbing.
        precision_plugin: Lightning plumbing.
    """

    strategy_name = PARAMETER_SERVER

    def __init__(
        self,
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
        blocks = BlockOptions(
            activation_checkpointing, every_n_layers, compile, type(self).__name__
        )
        super().__init__(
            PARAMETER_SERVER,
            bucket_size_mb,
            overlap_comm,
            process_group_backend,
            timeout,
            start_method,
            blocks,
            **plumbing,
        )

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: _StrategyRegistry) -> None:
        strategy_registry.register(
            PARAMETER_SERVER, cls, description="gradients reduced to rank 0, which steps"
        )
