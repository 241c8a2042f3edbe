"""HybridParallelStrategy: the Lightning face of pipeline x tensor (+ sequence) x data (x expert)
parallelism.

The jobs live beside it, one module each: :mod:`~plugintrain.strategies.mesh` (degrees and
DeviceMesh), :mod:`~plugintrain.strategies.parallel_plan` (TP/SP, experts, recomputation,
FSDP2 and the gradient engine, in torchtitan's order),
:mod:`~plugintrain.strategies.pipeline_runtime` (the steps when pp > 1),
:mod:`~plugintrain.strategies.engine_binding` (the engine's Lightning hooks) and
:mod:`~plugintrain.strategies.tied` (weights tied across stages). This class wires them
into Lightning's ``ModelParallelStrategy``; docs/architecture.md tells how a step, mixed
precision under ZeRO-3, expert parallelism and checkpoints of any layout work.
"""

from __future__ import annotations

from collections.abc import Generator, Iterable
from contextlib import contextmanager, nullcontext
from datetime import timedelta
from pathlib import Path
from typing import Any, Literal

import lightning.pytorch as pl
import torch
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.strategies import ModelParallelStrategy, StrategyRegistry
from lightning.pytorch.trainer.states import TrainerFn
from torch import Tensor
from torch.distributed.constants import default_pg_timeout
from torch.distributed.tensor.parallel import loss_parallel
from torch.optim import Optimizer
from typing_extensions import override

from plugintrain.checkpoints.dcp import load_dtensor_states
from plugintrain.core.contracts import AutocastSwitch, CallsModelBuiltHooks, GradientLayout
from plugintrain.core.elastic import init_restarted_process_group
from plugintrain.core.lightning_seam import LightningStrategyRegistry, give_module_mesh
from plugintrain.precision_plugins import PrecisionDtypes, precision_dtypes
from plugintrain.strategies.auto_split import balance_stages
from plugintrain.strategies.blocks import BlockOptions
from plugintrain.strategies.engine_binding import EngineBinding
from plugintrain.strategies.mesh import ParallelDims, batch_mesh
from plugintrain.strategies.parallel_plan import (
    build_engine,
    builds_on_meta,
    check_model_fits,
    hybrid_gradient_layout,
    prepare_model,
)
from plugintrain.strategies.pipeline_runtime import PipelineRuntime, chunk_partition
from plugintrain.strategies.pipeline_stages import AUTO, PipelineOptions, VirtualStage
from plugintrain.strategies.registry import register_names
from plugintrain.strategies.tensor_parallel import retie, shared_parameters
from plugintrain.strategies.tied import TiedParameters


class HybridParallelStrategy(CallsModelBuiltHooks, ModelParallelStrategy):
    """Pipeline x tensor (+ sequence) x context x data (x expert) parallelism with ZeRO on dp.

    Registered as ``hybrid``, and as ``pipeline`` with two stages. With tp, pp, ep or cp
    > 1 the LightningModule implements :class:`plugintrain.core.contracts.ParallelModule`.

    Args:
        data_parallel: Data-parallel degree; ``"auto"``: world size / (tp x pp x cp).
        tensor_parallel: Ranks that split every layer (and the vocabulary).
        sequence_parallel: Shard norms and dropout over the sequence (needs tp > 1).
        pipeline_parallel: Pipeline stages (ranks).
        virtual_pipeline_parallel: Model chunks per pipeline rank (interleaved schedule).
        schedule: ``gpipe``, ``1f1b`` or ``interleaved``; default ``1f1b``, or
            ``interleaved`` when ``virtual_pipeline_parallel > 1``.
        microbatches: Micro-batches per rank's batch with pp > 1 (dividing it); default pp.
        layers_per_stage: Transformer blocks of each virtual stage (pp x vpp counts summing
            to the model's layers; fewer on the last, which also runs the head and loss);
            default: equal; ``auto``: measured and chosen at setup.
        expert_parallel: Ranks that split each MoE layer's routed experts, borrowed from
            dp (dividing dp and the expert count); not with ``zero_stage=3``.
        context_parallel: Ranks that split every sequence, a chunk from each end each.
        zero_stage: 0 bucketed DDP, 1 shard optimizer state, 2 also gradients (our engine);
            3 also parameters (torch FSDP2, gathered in the compute dtype; not with pp > 1).
        bucket_size_mb: Gradient bucket size for ZeRO stage 0/1/2.
        overlap_comm: Launch each bucket's reduction during backward (stage 0/1/2; with
            pp, a chunk's once its last backward of the step has run).
        wire_dtype: Dtype of the activations and gradients sent between pipeline stages;
            default: the compute dtype (bf16, fp16 under ``16-mixed``, fp32 for ``32-true``).
        activation_checkpointing: ``none``, ``full`` or ``selective`` recomputation of each
            transformer block (:class:`~plugintrain.strategies.BlockOptions`).
        every_n_layers: With ``full``, recompute only blocks ``0, n, 2n, ...``.
        compile: ``torch.compile`` each transformer block (with tp, needs SP).
        process_group_backend: ``"gloo"``, ``"nccl"``, ...; default: chosen from the device.
        timeout: Timeout of the process group's collectives.
    """

    strategy_name = "hybrid"

    def __init__(
        self,
        data_parallel: int | Literal["auto"] = "auto",
        tensor_parallel: int = 1,
        sequence_parallel: bool = False,
        pipeline_parallel: int = 1,
        virtual_pipeline_parallel: int = 1,
        schedule: str | None = None,
        microbatches: int | None = None,
        layers_per_stage: list[int] | Literal["auto"] | None = None,
        expert_parallel: int = 1,
        context_parallel: int = 1,
        zero_stage: int = 0,
        bucket_size_mb: float = 25.0,
        overlap_comm: bool = True,
        wire_dtype: torch.dtype | str | None = None,
        activation_checkpointing: str = "none",
        every_n_layers: int = 1,
        compile: bool = False,
        process_group_backend: str | None = None,
        timeout: timedelta | None = default_pg_timeout,
    ) -> None:
        name = type(self).__name__
        self.block_options = BlockOptions(activation_checkpointing, every_n_layers, compile, name)
        self.block_options.check_tensor_parallel(tensor_parallel, sequence_parallel)
        super().__init__(
            data_parallel_size=data_parallel,
            tensor_parallel_size=tensor_parallel,
            process_group_backend=process_group_backend,
            timeout=timeout,
        )
        # Validated once here; the world size is filled in when it is known.
        self.parallel_dims = ParallelDims(
            data_parallel=data_parallel,
            tensor_parallel=tensor_parallel,
            sequence_parallel=sequence_parallel,
            pipeline_parallel=pipeline_parallel,
            virtual_pipeline_parallel=virtual_pipeline_parallel,
            expert_parallel=expert_parallel,
            context_parallel=context_parallel,
            zero_stage=zero_stage,
        )
        self.pipeline_options = PipelineOptions.resolve(
            self.parallel_dims, schedule, microbatches, layers_per_stage, wire_dtype
        )
        self.bucket_size_mb = bucket_size_mb
        self.overlap_comm = overlap_comm
        self._binding = EngineBinding(name)
        self._pipeline: PipelineRuntime | None = None

    @property
    def dims(self) -> ParallelDims:
        """The validated degrees over the world (after ``setup_environment``)."""
        if self.parallel_dims.world_size is None:
            raise RuntimeError("The parallel layout is known once processes have started.")
        return self.parallel_dims

    def _layout_for(self, world_size: int) -> ParallelDims:
        self.parallel_dims = self.parallel_dims.with_world_size(world_size)
        return self.parallel_dims

    @override
    def _configure_launcher(self) -> None:
        # Validate the layout against the real world size before spawning anything.
        self._layout_for(self.num_nodes * self.num_processes)
        super()._configure_launcher()

    @override
    def setup_environment(self) -> None:
        init_restarted_process_group(self._get_process_group_backend(), self._timeout)
        self._setup_distributed()
        self._device_mesh = self._layout_for(self.world_size).build_mesh(self.root_device.type)
        assert self.lightning_module is not None
        give_module_mesh(self.lightning_module, self._device_mesh)

    @property
    @override
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        readers = batch_mesh(self.device_mesh)  # each dp rank its own; cp peers the same
        return {"num_replicas": readers.size(), "rank": readers.get_local_rank()}

    @contextmanager
    @override
    def tensor_init_context(self, empty_init: bool | None = None) -> Generator[None, None, None]:
        # Shard-first for a module that initializes its own shards (`prepare_model`); any
        # other is built whole, and tp, the engine or FSDP2 distribute rank 0's weights.
        if empty_init is not False and builds_on_meta(self.lightning_module):
            with torch.device("meta"), self.precision_plugin.tensor_init_context():
                yield
            return
        with super(ModelParallelStrategy, self).tensor_init_context(empty_init=False):
            yield

    def check_model(self, module: pl.LightningModule, datamodule: Any = None) -> None:
        """Raise if the model and data cannot run on this layout (:func:`~plugintrain.
        strategies.parallel_plan.check_model_fits`); ``fit`` calls it before any launch."""
        dims = self._layout_for(self.num_nodes * self.num_processes)
        check_model_fits(module, dims, self.pipeline_options, datamodule, type(self).__name__)
        self.block_options.check(module, built=self.model is not None)  # built: in `setup`

    @override
    def setup(self, trainer: pl.Trainer) -> None:
        module = self.lightning_module
        assert module is not None
        self.check_model(module, trainer.datamodule)  # the whole model, before the split
        dims, mesh = self.dims, self.device_mesh
        fitting = trainer.state.fn == TrainerFn.FITTING
        options = self.pipeline_options
        if options.layers_per_stage == AUTO:  # measure the blocks, choose the split
            options = self.pipeline_options = balance_stages(
                module, dims, options, trainer.datamodule, self.root_device, self.precision_plugin
            )
        dtypes = _cast_by_fsdp(self.precision_plugin, fitting and dims.fsdp_enabled)
        stages = prepare_model(
            module, dims, options, mesh, self.root_device, fitting, self.block_options, dtypes
        )
        super().setup(trainer)  # moves the model, builds the optimizers
        if fitting:
            self._bind_engine(module, stages)
        if stages is not None:
            self._pipeline = PipelineRuntime(
                module, stages, dims, options, mesh, self.precision_plugin, self.global_rank
            )

    def _bind_engine(self, module: pl.LightningModule, stages: list[VirtualStage] | None) -> None:
        """Build the gradient engine (ZeRO 0-2; None under FSDP2) and attach the optimizers."""
        tied = TiedParameters.of(module)
        # Under a pipeline, each chunk's buckets are its own, to reduce it once it is done.
        partition = chunk_partition(module, stages, tied) if stages is not None else None
        mesh, compiled = self.device_mesh, self.block_options.compile
        engine = build_engine(
            module, self.dims, mesh, self.bucket_size_mb, self.overlap_comm, compiled, partition
        )
        self._binding.bind(engine, tied, module.trainer, self.precision_plugin, self.optimizers)

    @override
    def model_to_device(self) -> None:
        # Module.to() rebuilds DTensor parameters module by module, which unties a shared
        # weight (the tied embedding and LM head) unless it is re-tied.
        assert self.model is not None
        shared = shared_parameters(self.model)
        super().model_to_device()
        retie(shared)

    @override
    def backward(
        self, closure_loss: Tensor, optimizer: Optimizer | None, *args: Any, **kwargs: Any
    ) -> Tensor:
        if self._pipeline is not None:
            self.pre_backward(closure_loss)
            self._pipeline.backward(closure_loss, self._binding)
            self.post_backward(closure_loss)
            return closure_loss
        # The vocabulary-parallel cross-entropy's backward runs under the same context.
        with loss_parallel() if self.dims.tp_enabled else nullcontext():
            return super().backward(closure_loss, optimizer, *args, **kwargs)

    @contextmanager
    @override
    def block_backward_sync(self) -> Generator[None, None, None]:
        with self._binding.no_sync():
            yield

    def gradient_buffers(self) -> list[Tensor]:
        """Where this rank's gradients are (:class:`~plugintrain.core.contracts.HoldsGradients`)."""
        return self._binding.gradient_buffers(self.lightning_module)

    def gradient_layout(self, parameters: Iterable[Tensor]) -> GradientLayout:
        """Each gradient piece with its replica count over the whole pp x tp x dp world."""
        engine = self._binding.engine if self._binding.bound else None
        tied = self._pipeline.tied.held if self._pipeline is not None else ()
        return hybrid_gradient_layout(parameters, engine, self.dims.tensor_parallel, tied)

    @property
    def records_compute_ranges(self) -> bool:
        """Whether the pipeline records ``forward``/``backward`` per micro-batch (pp > 1)."""
        return self._pipeline is not None

    @override
    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        if self._pipeline is None:
            return super().training_step(*args, **kwargs)
        accumulate = self.lightning_module.trainer.accumulate_grad_batches
        return self._pipeline.training_step(_batch(args, kwargs), self._binding.engine, accumulate)

    @override
    def validation_step(self, *args: Any, **kwargs: Any) -> Any:
        if self._pipeline is None:
            return super().validation_step(*args, **kwargs)
        return self._pipeline.evaluate("val", _batch(args, kwargs))

    @override
    def test_step(self, *args: Any, **kwargs: Any) -> Any:
        if self._pipeline is None:
            return super().test_step(*args, **kwargs)
        return self._pipeline.evaluate("test", _batch(args, kwargs))

    @override
    def optimizer_state(self, optimizer: Optimizer) -> dict[str, Any]:
        if not self._binding.bound:
            return super().optimizer_state(optimizer)
        return self._binding.optimizer_state(optimizer)

    @override
    def save_checkpoint(
        self, checkpoint: dict[str, Any], filepath: str | Path, storage_options: Any = None
    ) -> None:
        path = self.broadcast(filepath)
        self._binding.save(checkpoint, path, storage_options, self.global_rank == 0)

    @override
    def load_checkpoint(
        self, checkpoint_path: str | Path, weights_only: bool | None = None
    ) -> dict[str, Any]:
        # Any layout's directory or a single file; only tensors and plain data unpickled.
        assert self.model is not None
        path = Path(self.broadcast(checkpoint_path))
        if self._binding.bound:
            return self._binding.load(path, self.model, self.optimizers)
        fitting = self.lightning_module.trainer.state.fn == TrainerFn.FITTING
        return load_dtensor_states(path, self.model, self.optimizers if fitting else [])

    @override
    def teardown(self) -> None:
        self._binding.teardown()
        self._pipeline = None
        super().teardown()

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: LightningStrategyRegistry) -> None:
        register_names(cls, strategy_registry)


def _cast_by_fsdp(plugin: Precision, fsdp: bool) -> PrecisionDtypes | None:
    """The training dtypes when FSDP2 casts the weights (its ``MixedPrecisionPolicy``), with
    the plugin's autocast turned off then and on otherwise; None without FSDP2."""
    dtypes = precision_dtypes(plugin)
    if isinstance(plugin, AutocastSwitch):
        plugin.autocast = not (fsdp and dtypes.mixed)
    return dtypes if fsdp else None


def _batch(args: tuple, kwargs: dict[str, Any]) -> Any:
    """The batch among a Lightning step hook's arguments."""
    return args[0] if args else kwargs["batch"]


class PipelineStrategy(HybridParallelStrategy):
    """:class:`HybridParallelStrategy` with two pipeline stages by default, the strategy the
    name ``pipeline`` builds: ``devices x num_nodes`` ranks form ``world /
    pipeline_parallel`` data-parallel replicas of ``pipeline_parallel`` stages.

    Args:
        pipeline_parallel: Pipeline stages (ranks per replica).
        **kwargs: Any other option of :class:`HybridParallelStrategy`.
    """

    def __init__(self, pipeline_parallel: int = 2, **kwargs: Any) -> None:
        super().__init__(pipeline_parallel=pipeline_parallel, **kwargs)


# Importing the module registers its names, as Lightning's own strategies' modules do.
HybridParallelStrategy.register_strategies(StrategyRegistry)
