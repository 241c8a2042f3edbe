"""HybridParallelStrategy: tensor (+ sequence) x data parallelism on one DeviceMesh.

The strategy applies parallelism from outside the model in torchtitan's order
(``models/llama3/infra/parallelize.py``): first the model's tensor-parallel plan on
``mesh["tp"]`` (:mod:`plugintrain.strategies.tensor_parallel`), then data parallelism on
``mesh["dp"]``: our :class:`~plugintrain.strategies.GradientEngine` for ZeRO stage 0/1/2
(bucketed all-reduce or reduce-scatter of the DTensors' local shards), or torch FSDP2
``fully_shard`` for stage 3. Lightning's ``ModelParallelStrategy`` supplies process
launch, the distributed sampler and torch.distributed.checkpoint (DCP) directories.
"""

from __future__ import annotations

import io
import math
import re
from collections.abc import Generator, Iterable
from contextlib import contextmanager, nullcontext
from datetime import timedelta
from pathlib import Path
from typing import Any, Literal

import lightning.pytorch as pl
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from lightning.fabric.strategies.registry import _StrategyRegistry
from lightning.fabric.utilities.load import _METADATA_FILENAME
from lightning.pytorch.strategies import ModelParallelStrategy
from lightning.pytorch.trainer.states import TrainerFn
from torch import Tensor, nn
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.state_dict import get_model_state_dict
from torch.distributed.constants import default_pg_timeout
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import loss_parallel
from torch.optim import Optimizer
from typing_extensions import override

from plugintrain.distributed import GradientLayout, GradientPiece, default_gradient_layout
from plugintrain.strategies.grad_engine import GradientEngine
from plugintrain.strategies.mesh import ParallelDims
from plugintrain.strategies.pipeline import (
    PipelineExecutor,
    StageChunk,
    check_layers,
    split_model,
)
from plugintrain.strategies.pipeline_schedules import validate as validate_schedule
from plugintrain.strategies.tensor_parallel import (
    apply_tensor_parallel,
    retie,
    shared_parameters,
    vocab_parallel_loss,
)
from plugintrain.strategies.zero import unwrap_optimizer

# Transformer blocks are the FSDP2 units (one all-gather per block), as in torchtitan.
_BLOCK = re.compile(r"(.*\.)?layers\.\d+")


def parallelize(
    module: nn.Module,
    plan: dict[str, str] | None,
    dims: ParallelDims,
    mesh: DeviceMesh,
    bucket_size_mb: float = 25.0,
    overlap_comm: bool = True,
) -> GradientEngine | None:
    """Apply TP(+SP), then data parallelism, to ``module`` in place.

    Args:
        module: The model (or the LightningModule holding it); ``plan`` paths are relative
            to it.
        plan: Module path pattern -> style name; None or empty when ``tensor_parallel == 1``.
        dims: The degrees.
        mesh: The mesh built by :meth:`ParallelDims.build_mesh`.
        bucket_size_mb: Gradient bucket size of the engine (ZeRO stage 0/1/2).
        overlap_comm: Reduce buckets during backward (ZeRO stage 0/1/2).

    Returns:
        The gradient engine for ZeRO stage 0/1/2 (attach the optimizer to it); None for
        FSDP2 (stage 3), whose optimizer steps the module's own sharded parameters.
    """
    shard_model(module, plan, dims, mesh)
    return build_engine(module, dims, mesh, bucket_size_mb, overlap_comm)


def shard_model(
    module: nn.Module,
    plan: dict[str, str] | None,
    dims: ParallelDims,
    mesh: DeviceMesh,
    fully_shard_dp: bool = True,
) -> None:
    """The module-rewriting part of :func:`parallelize`: TP(+SP), then FSDP2 for stage 3.

    Args:
        module: As in :func:`parallelize`; with pipeline parallelism, this rank's split
            model (plan entries for modules it does not hold are skipped).
        plan: As in :func:`parallelize`.
        dims: The degrees.
        mesh: The mesh built by :meth:`ParallelDims.build_mesh`.
        fully_shard_dp: Apply FSDP2 when ``zero_stage == 3`` (False for evaluation).
    """
    if dims.tp_enabled:
        if not plan:
            raise ValueError(
                f"tensor_parallel={dims.tensor_parallel} needs a tensor-parallel plan, but"
                f" {type(module).__name__} declares none (a `tp_plan()` method)."
            )
        apply_tensor_parallel(
            module,
            plan,
            mesh["tp"],
            dims.sequence_parallel,
            allow_missing=dims.pipeline_parallel > 1,
        )
    if dims.fsdp_enabled and fully_shard_dp:
        _fully_shard(module, mesh["dp"])


def build_engine(
    module: nn.Module,
    dims: ParallelDims,
    mesh: DeviceMesh,
    bucket_size_mb: float = 25.0,
    overlap_comm: bool = True,
) -> GradientEngine | None:
    """Our gradient engine on the ``dp`` group for ZeRO stage 0/1/2; None for stage 3.

    Build it last: ``Module.to()`` re-sets the ``.data`` of DTensor parameters, after which
    their gradient hooks no longer fire.
    """
    if dims.fsdp_enabled:
        return None
    return GradientEngine(
        module.named_parameters(),
        process_group=mesh["dp"].get_group(),
        stage=dims.zero_stage,
        bucket_size_mb=bucket_size_mb,
        overlap_comm=overlap_comm,
    )


def _fully_shard(module: nn.Module, dp_mesh: DeviceMesh) -> None:
    blocks = [m for name, m in module.named_modules() if _BLOCK.fullmatch(name)]
    for block in blocks:
        fully_shard(block, mesh=dp_mesh)
    fully_shard(module, mesh=dp_mesh)  # the rest: embeddings, final norm, (tied) head


def tp_replicas(param: Tensor, tp: int) -> int:
    """How many tp ranks hold the same local piece of ``param``."""
    if not isinstance(param, DTensor):
        return tp
    mesh, placements = param.device_mesh, param.placements
    names = mesh.mesh_dim_names or ()
    shards = math.prod(
        mesh.size(i) for i, p in enumerate(placements) if p.is_shard() and names[i] == "tp"
    )
    return tp // shards


def hybrid_gradient_layout(
    parameters: Iterable[Tensor],
    engine: GradientEngine | None,
    tensor_parallel: int,
    stage_replicated: Iterable[Tensor] = (),
) -> GradientLayout:
    """The layout of the gradients an optimizer steps, over the whole pp x tp x dp world.

    With the engine, a shard's gradient is replicated over the dp group at stage 0 (once
    at stage 1/2) and over the tp ranks that hold the same piece of its parameter; FSDP2
    gradients are DTensors on the 2-D mesh, which the default layout counts directly.
    Pipeline stages hold different parameters, except ``stage_replicated`` ones (an
    embedding tied to the head, held by the first and the last stage), counted twice.

    Args:
        parameters: The parameters an optimizer steps.
        engine: The gradient engine (ZeRO stage 0/1/2), or None (FSDP2).
        tensor_parallel: The tp degree.
        stage_replicated: Model parameters held by two pipeline stages.
    """
    if engine is None:
        return default_gradient_layout(parameters)
    params = [p for p in parameters if p.grad is not None]
    local = engine.gradient_layout(params)
    twice = {id(p) for p in stage_replicated}
    pieces = []
    for piece, p in zip(local.pieces, params, strict=True):
        param = engine.parameter_of(p)
        stages = 2 if id(param) in twice else 1
        pieces.append(
            GradientPiece(piece.grad, piece.replicas * tp_replicas(param, tensor_parallel) * stages)
        )
    return GradientLayout(group=dist.group.WORLD, pieces=pieces, device=local.device)


class HybridParallelStrategy(ModelParallelStrategy):
    """Pipeline x tensor (+ sequence) x data parallelism with ZeRO on the data-parallel ranks.

    Registered as ``hybrid``. The LightningModule builds a single-device model in
    ``configure_model`` and declares its plan with ``tp_plan()`` (see
    :class:`~plugintrain.model_zoo.CausalLM`); a ``loss_fn(logits, targets)`` method is
    wrapped into a vocabulary-parallel cross-entropy. Each dp rank reads its own batches;
    the tp and pp ranks of one replica read the same. Metrics are averaged over the
    world, which equals the dp average because tp and pp ranks hold identical losses.

    With ``pipeline_parallel > 1`` the module's ``model`` (a zoo ``Transformer``) is split
    into ``pipeline_parallel x virtual_pipeline_parallel`` stages and the strategy owns the
    training step: it cuts each batch into ``microbatches``, runs the ``schedule``
    (:mod:`~plugintrain.strategies.pipeline`) inside the precision plugin's autocast (FP16
    loss scaling on the last stage), reduces the gradients over dp once the schedule is
    done, and hands every rank the loss broadcast from the last stage, logged through the
    module's ``record_loss(stage, loss, batch)``. Validation runs a forward-only schedule.

    Checkpoints are DCP directories at the checkpoint path, keyed by full-model parameter
    names, so model weights reload under any layout (pp, tp, dp). Optimizer state: with
    ``tensor_parallel == 1`` (ZeRO 0-2) it is saved whole per parameter name and reloads
    under any pp and dp; with tp > 1 each rank saves its own shard (same layout to resume);
    stage 3 reshards through torch's ``get_optimizer_state_dict``.

    Args:
        data_parallel: Data-parallel degree; ``"auto"``: world size / (tp x pp).
        tensor_parallel: Ranks that split every layer (and the vocabulary).
        sequence_parallel: Shard norms and dropout over the sequence (needs tp > 1).
        pipeline_parallel: Pipeline stages (ranks).
        virtual_pipeline_parallel: Model chunks per pipeline rank (interleaved schedule).
        schedule: ``gpipe``, ``1f1b`` or ``interleaved``; default ``1f1b``, or
            ``interleaved`` when ``virtual_pipeline_parallel > 1``.
        microbatches: Micro-batches per batch with pp > 1 (must divide the per-rank batch
            size); default ``pipeline_parallel``.
        layers_per_stage: Transformer blocks of each virtual stage, in stage order (pp x
            vpp counts summing to the model's layers); default: equal. Give the last
            stage, which also runs the head and the loss, fewer to balance the pipeline.
        expert_parallel: Expert-parallel degree; only 1 yet.
        zero_stage: 0 bucketed DDP, 1 shard optimizer state, 2 also gradients (our engine);
            3 also parameters (torch FSDP2; not with pp > 1).
        bucket_size_mb: Gradient bucket size for ZeRO stage 0/1/2.
        overlap_comm: Launch each bucket's reduction during backward (stage 0/1/2, no pp).
        wire_dtype: Dtype of the activations and gradients sent between pipeline stages.
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
        layers_per_stage: list[int] | None = None,
        expert_parallel: int = 1,
        zero_stage: int = 0,
        bucket_size_mb: float = 25.0,
        overlap_comm: bool = True,
        wire_dtype: torch.dtype | str = torch.float32,
        process_group_backend: str | None = None,
        timeout: timedelta | None = default_pg_timeout,
    ) -> None:
        super().__init__(
            data_parallel_size=data_parallel,
            tensor_parallel_size=tensor_parallel,
            process_group_backend=process_group_backend,
            timeout=timeout,
        )
        if expert_parallel != 1:
            raise ValueError(
                f"expert_parallel={expert_parallel} is not supported by HybridParallelStrategy"
                " yet; set it to 1."
            )
        self.degrees: dict[str, Any] = {
            "data_parallel": data_parallel,
            "tensor_parallel": tensor_parallel,
            "sequence_parallel": sequence_parallel,
            "pipeline_parallel": pipeline_parallel,
            "virtual_pipeline_parallel": virtual_pipeline_parallel,
            "zero_stage": zero_stage,
        }
        ParallelDims(
            world_size=tensor_parallel * pipeline_parallel * _int_or(data_parallel, 1),
            **self.degrees,
        )
        self.schedule = schedule or ("interleaved" if virtual_pipeline_parallel > 1 else "1f1b")
        self.microbatches = pipeline_parallel if microbatches is None else microbatches
        self.layers_per_stage = None if layers_per_stage is None else list(layers_per_stage)
        if pipeline_parallel > 1:
            validate_schedule(
                pipeline_parallel, virtual_pipeline_parallel, self.microbatches, self.schedule
            )
            if zero_stage == 3:
                raise ValueError(
                    "zero_stage=3 (FSDP2) cannot be combined with pipeline_parallel="
                    f"{pipeline_parallel} yet; use zero_stage 0, 1 or 2 (ZeRO-1/2 shard the"
                    " optimizer state and gradients over the data-parallel ranks)."
                )
        self.wire_dtype = _dtype(wire_dtype)
        self.bucket_size_mb = bucket_size_mb
        self.overlap_comm = overlap_comm
        self.parallel_dims: ParallelDims | None = None
        self._engine: GradientEngine | None = None
        self._executor: PipelineExecutor | None = None
        self._tied: list[Tensor] = []
        self._tied_group: dist.ProcessGroup | None = None
        self._accumulating = False

    @property
    def pipelined(self) -> bool:
        """Whether the model runs as pipeline stages (``pipeline_parallel > 1``)."""
        return self.degrees["pipeline_parallel"] > 1

    @property
    def dims(self) -> ParallelDims:
        """The validated degrees (after ``setup_environment``)."""
        if self.parallel_dims is None:
            raise RuntimeError("The parallel layout is known once processes have started.")
        return self.parallel_dims

    @override
    def _configure_launcher(self) -> None:
        # Validate the layout against the real world size before spawning anything.
        ParallelDims(world_size=self.num_nodes * self.num_processes, **self.degrees)
        super()._configure_launcher()

    @override
    def setup_environment(self) -> None:
        self._setup_distributed()
        self.parallel_dims = ParallelDims(world_size=self.world_size, **self.degrees)
        self._device_mesh = self.parallel_dims.build_mesh(self.root_device.type)
        assert self.lightning_module is not None
        self.lightning_module._device_mesh = self._device_mesh

    @property
    @override
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        dp_mesh = self.device_mesh["dp"]
        return {"num_replicas": dp_mesh.size(), "rank": dp_mesh.get_local_rank()}

    @contextmanager
    @override
    def tensor_init_context(self, empty_init: bool | None = None) -> Generator[None, None, None]:
        # Build the full model on the device with its own seeded init (not on the meta
        # device as ModelParallelStrategy does, whose materialization would skip
        # Transformer.init_weights): the plan then distributes tp rank 0's weights, and the
        # engine or FSDP2 dp rank 0's, so a run starts from the single-process weights.
        with super(ModelParallelStrategy, self).tensor_init_context(empty_init=False):
            yield

    @override
    def setup(self, trainer: pl.Trainer) -> None:
        module = self.lightning_module
        assert module is not None
        self.check_model(module, trainer.datamodule)
        fitting = trainer.state.fn == TrainerFn.FITTING
        chunks = self._split(module) if self.pipelined else None
        plan = module.tp_plan() if hasattr(module, "tp_plan") else None
        shard_model(module, plan, self.dims, self.device_mesh, fully_shard_dp=fitting)
        if self.dims.tp_enabled and hasattr(module, "loss_fn"):
            module.loss_fn = vocab_parallel_loss(module.loss_fn)
        super().setup(trainer)  # moves the model, builds the optimizers
        if fitting:
            self._setup_engine(module)
        if chunks is not None:
            self._setup_pipeline(module, chunks)

    @override
    def model_to_device(self) -> None:
        # Module.to() rebuilds DTensor parameters module by module, which unties a shared
        # weight (the tied embedding and LM head) unless it is re-tied.
        assert self.model is not None
        shared = shared_parameters(self.model)
        super().model_to_device()
        retie(shared)

    def _setup_engine(self, module: pl.LightningModule) -> None:
        self._engine = build_engine(
            module, self.dims, self.device_mesh, self.bucket_size_mb, self.overlap_comm
        )
        if self._engine is not None:
            for optimizer in self.optimizers:
                self._engine.attach(unwrap_optimizer(optimizer))

    def check_model(self, module: pl.LightningModule, datamodule: Any = None) -> None:
        """Raise if the model (and the data's ``seq_len``) cannot be split by this layout.

        Needs no process group, so ``plugintrain fit`` calls it before any process is
        launched: heads, kv-heads, MLP width and vocabulary must divide by tp, and the
        sequence length too with sequence parallelism; with pp > 1 the layers must split
        into pp x vpp stages and the batch into ``microbatches``.
        """
        config = getattr(module, "config", None)
        dims = ParallelDims(world_size=self.num_nodes * self.num_processes, **self.degrees)
        if config is not None:
            dims.validate_model(config, getattr(datamodule, "seq_len", None))
        if not self.pipelined:
            return
        if config is None or not hasattr(module, "loss_fn"):
            raise ValueError(
                f"pipeline_parallel={dims.pipeline_parallel} needs a module with a `config`"
                " (TransformerConfig), a `model` built from it in configure_model and a"
                f" `loss_fn(logits, targets)`, like CausalLM; {type(module).__name__} lacks them."
            )
        check_layers(
            config.n_layer,
            dims.pipeline_parallel,
            dims.virtual_pipeline_parallel,
            self.layers_per_stage,
        )
        batch_size = getattr(datamodule, "batch_size", None)
        if isinstance(batch_size, int) and batch_size % self.microbatches:
            raise ValueError(
                f"The per-rank batch_size={batch_size} does not split into microbatches="
                f"{self.microbatches} equal micro-batches; choose a batch size that is a"
                f" multiple of {self.microbatches}, or other microbatches."
            )

    @override
    def backward(
        self, closure_loss: Tensor, optimizer: Optimizer | None, *args: Any, **kwargs: Any
    ) -> Tensor:
        if self.pipelined:
            # The schedule already ran backward inside training_step, accumulating into the
            # engine's buffers; Lightning zeroes the optimizer's gradients in between, so
            # the reduction that exposes them to the optimizer happens here.
            module = self.lightning_module
            assert module is not None
            self.pre_backward(closure_loss)
            self.precision_plugin.pre_backward(closure_loss, module)
            if not self._accumulating:
                self._finish_gradients()
            self.precision_plugin.post_backward(closure_loss, module)
            self.post_backward(closure_loss)
            return closure_loss
        # The vocabulary-parallel cross-entropy's backward runs under the same context.
        with loss_parallel() if self.dims.tp_enabled else nullcontext():
            return super().backward(closure_loss, optimizer, *args, **kwargs)

    @contextmanager
    @override
    def block_backward_sync(self) -> Generator[None, None, None]:
        previous, self._accumulating = self._accumulating, True
        try:
            with self._engine.no_sync() if self._engine is not None else nullcontext():
                yield
        finally:
            self._accumulating = previous

    def gradient_layout(self, parameters: Iterable[Tensor]) -> GradientLayout:
        """Each gradient piece with its replica count over the whole pp x tp x dp world."""
        return hybrid_gradient_layout(
            parameters, self._engine, self.dims.tensor_parallel, self._tied
        )

    # ---- pipeline parallelism ------------------------------------------------------------

    def _split(self, module: pl.LightningModule) -> list[StageChunk]:
        dims = self.dims
        pp_rank = self.device_mesh["pp"].get_local_rank()
        return split_model(
            module.model,
            pp_rank,
            dims.pipeline_parallel,
            dims.virtual_pipeline_parallel,
            self.layers_per_stage,
        )

    def _setup_pipeline(self, module: pl.LightningModule, chunks: list[StageChunk]) -> None:
        dims = self.dims
        config = module.config
        self._setup_tied_embeddings(module, chunks)
        self._executor = PipelineExecutor(
            chunks,
            self.schedule,
            dims.pipeline_parallel,
            dims.virtual_pipeline_parallel,
            self.microbatches,
            rank=self.device_mesh["pp"].get_local_rank(),
            group=self.device_mesh["pp"].get_group(),
            loss_fn=lambda logits, targets: module.loss_fn(logits, targets),
            hidden_size=config.n_embd,
            seq_divisor=dims.tensor_parallel if dims.sequence_parallel else 1,
            wire_dtype=self.wire_dtype,
            forward_context=self.precision_plugin.forward_context,
            backward_context=loss_parallel if dims.tp_enabled else nullcontext,
        )

    def _setup_tied_embeddings(self, module: pl.LightningModule, chunks: list[StageChunk]) -> None:
        """Group the first and last stage of each (dp, tp) position when the head is tied."""
        self._tied, self._tied_group = [], None
        if not module.config.tie_embeddings:
            return
        mesh = self.device_mesh.mesh  # (pp, dp, tp) global ranks
        for dp in range(mesh.size(1)):
            for tp in range(mesh.size(2)):
                ranks = [int(mesh[0, dp, tp]), int(mesh[-1, dp, tp])]
                group = dist.new_group(ranks)
                if self.global_rank in ranks:
                    self._tied_group = group
        model = module.model
        if any(chunk.is_first for chunk in chunks):
            self._tied.append(model.tok_embeddings.weight)
        if any(chunk.is_last for chunk in chunks):
            self._tied.append(model.output.weight)

    def _microbatches(self, batch: Any, count: int) -> tuple[list[Tensor], list[Tensor]]:
        x, y = batch
        if x.size(0) % count:
            raise ValueError(
                f"A batch of {x.size(0)} sequences does not split into microbatches={count};"
                f" use a batch size that is a multiple of {count}."
            )
        return list(x.chunk(count)), list(y.chunk(count))

    def _broadcast_loss(self, loss: Tensor | None) -> Tensor:
        assert self._executor is not None
        value = loss if loss is not None else torch.zeros((), device=self.root_device)
        value = value.detach().float().contiguous()
        dist.broadcast(value, src=self._executor.last_rank_global, group=self._executor.group)
        return value

    def _finish_gradients(self) -> None:
        """Sum a tied weight's gradient over the first and last stage, then reduce over dp."""
        assert self._engine is not None
        for param in self._tied:
            dist.all_reduce(self._engine.accumulated_grad(param), group=self._tied_group)
        self._engine.finish_grad_sync()

    @override
    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        if not self.pipelined:
            return super().training_step(*args, **kwargs)
        assert self._executor is not None and self._engine is not None
        module = self.lightning_module
        batch = args[0] if args else kwargs["batch"]
        inputs, targets = self._microbatches(batch, self.microbatches)
        accumulate = module.trainer.accumulate_grad_batches
        scaler = getattr(self.precision_plugin, "loss_scaler", None)
        with self._engine.no_sync():
            loss = self._executor.train_step(
                inputs,
                targets,
                loss_scale=1.0 / (self.microbatches * accumulate),
                scale_loss=scaler.scale_loss if scaler is not None else None,
            )
        loss = self._broadcast_loss(loss)
        _record(module, "train", loss, batch)
        return loss

    @override
    def validation_step(self, *args: Any, **kwargs: Any) -> Any:
        if not self.pipelined:
            return super().validation_step(*args, **kwargs)
        return self._evaluate("val", args[0] if args else kwargs["batch"])

    @override
    def test_step(self, *args: Any, **kwargs: Any) -> Any:
        if not self.pipelined:
            return super().test_step(*args, **kwargs)
        return self._evaluate("test", args[0] if args else kwargs["batch"])

    def _evaluate(self, stage: str, batch: Any) -> None:
        assert self._executor is not None
        count = math.gcd(batch[0].size(0), self.microbatches)
        inputs, targets = self._microbatches(batch, count)
        loss = self._broadcast_loss(self._executor.eval_step(inputs, targets))
        _record(self.lightning_module, stage, loss, batch)

    @override
    def optimizer_state(self, optimizer: Optimizer) -> dict[str, Any]:
        if self._engine is None:
            return super().optimizer_state(optimizer)
        optimizer = unwrap_optimizer(optimizer)
        if self.dims.tensor_parallel == 1:
            # Whole tensors keyed by parameter name, gathered to each dp group's rank 0:
            # DCP stores each name once, so any pp x dp layout (and ZeRO stage) can read it.
            full = self._engine.optimizer_state_dict(optimizer)
            groups = [
                {**{k: v for k, v in group.items() if k != "params"}, "params": []}
                for group in optimizer.param_groups
            ]
            return {"state": full.get("state", {}), "param_groups": groups}
        # Each rank saves its own shard's state; DCP stores it as an opaque byte stream.
        buffer = io.BytesIO()
        torch.save(optimizer.state_dict(), buffer)
        buffer.seek(0)
        return {self._shard_key(): buffer}

    def _shard_key(self) -> str:
        return f"rank{self.global_rank}_of{self.world_size}"

    @override
    def load_checkpoint(
        self, checkpoint_path: str | Path, weights_only: bool | None = None
    ) -> dict[str, Any]:
        if self._engine is None:
            return super().load_checkpoint(checkpoint_path, weights_only)
        path = Path(self.broadcast(checkpoint_path))
        assert self.model is not None
        saved = FileSystemReader(path).read_metadata().state_dict_metadata
        state: dict[str, Any] = {"state_dict": get_model_state_dict(self.model)}
        for i, optimizer in enumerate(self.optimizers):
            state[f"optimizer_{i}"] = self._optimizer_template(
                i, unwrap_optimizer(optimizer), saved
            )
        dcp.load(state, checkpoint_id=path)
        self.model.load_state_dict(state["state_dict"])
        for i, optimizer in enumerate(self.optimizers):
            loaded = state[f"optimizer_{i}"]
            optimizer = unwrap_optimizer(optimizer)
            if "state" in loaded:
                self._engine.load_optimizer_state_dict(optimizer, self._unalias(optimizer, loaded))
            else:
                buffer = loaded[self._shard_key()]
                buffer.seek(0)
                optimizer.load_state_dict(torch.load(buffer, weights_only=True))
        return torch.load(path / _METADATA_FILENAME, weights_only=weights_only)

    def _optimizer_template(
        self, index: int, optimizer: Optimizer, saved: dict[str, Any]
    ) -> dict[str, Any]:
        """What this rank reads of optimizer ``index``: its own parameters' tensors by name
        (under any layout), or its own byte-stream shard (a tp > 1 checkpoint)."""
        prefix = f"optimizer_{index}."
        groups = _saved_groups(saved, prefix + "param_groups.")
        if not groups:
            if prefix + self._shard_key() not in saved:
                raise ValueError(
                    f"The checkpoint's optimizer state was saved per rank by a layout with"
                    f" tensor_parallel > 1 and has no shard for rank {self.global_rank} of"
                    f" {self.world_size}; resume it with the layout that saved it."
                )
            return {self._shard_key(): io.BytesIO()}
        assert self._engine is not None
        state: dict[str, dict[str, Tensor]] = {}
        for name in self._engine.parameter_names(optimizer):
            for candidate in (name, *_tied_aliases(name)):
                keys = _state_keys(saved, f"{prefix}state.{candidate}.")
                if keys:
                    state[candidate] = {
                        key: torch.empty(meta.size, dtype=meta.properties.dtype)
                        for key, meta in keys.items()
                    }
                    break
        # DCP stores each group's hyperparameters as one entry per key; None is a slot.
        return {"state": state, "param_groups": groups}

    def _unalias(self, optimizer: Optimizer, loaded: dict[str, Any]) -> dict[str, Any]:
        """Key the loaded state by this optimizer's names (a tied head saved as the other)."""
        assert self._engine is not None
        names = set(self._engine.parameter_names(optimizer))

        def own(name: str) -> str:
            return name if name in names else next(a for a in _tied_aliases(name) if a in names)

        state = {own(name): values for name, values in loaded["state"].items()}
        return {"state": state, "param_groups": loaded["param_groups"]}

    @override
    def teardown(self) -> None:
        if self._engine is not None:
            # Hooks go; the engine stays, so `trainer.save_checkpoint` after `fit` still
            # gathers the optimizer shards it owns.
            self._engine.remove()
        self._executor = None
        super().teardown()

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: _StrategyRegistry) -> None:
        strategy_registry.register(
            cls.strategy_name,
            cls,
            description="pp x tp (+ sp) x dp with ZeRO, on a DeviceMesh",
        )


# A head tied to the embedding is one parameter in one process and two on a pipeline
# (first and last stage); either name finds the other's saved optimizer state.
_TIED_NAMES = ("tok_embeddings.weight", "output.weight")


def _tied_aliases(name: str) -> tuple[str, ...]:
    for mine, other in (_TIED_NAMES, _TIED_NAMES[::-1]):
        if name.endswith(mine):
            return (name[: -len(mine)] + other,)
    return ()


def _saved_groups(saved: dict[str, Any], prefix: str) -> list[dict[str, None]]:
    """Slots for each saved param group's entries under ``prefix`` (``lr``, ``betas``...)."""
    groups: dict[int, dict[str, None]] = {}
    for key in saved:
        if key.startswith(prefix):
            index, _, name = key[len(prefix) :].partition(".")
            groups.setdefault(int(index), {})[name] = None
    return [groups[i] for i in sorted(groups)]


def _state_keys(saved: dict[str, Any], prefix: str) -> dict[str, Any]:
    """Saved tensor entries directly under ``prefix`` (``exp_avg``, ``step``, ...)."""
    return {
        key[len(prefix) :]: meta
        for key, meta in saved.items()
        if key.startswith(prefix) and "." not in key[len(prefix) :] and hasattr(meta, "size")
    }


def _int_or(value: int | str, default: int) -> int:
    return value if isinstance(value, int) else default


def _dtype(value: torch.dtype | str) -> torch.dtype:
    if isinstance(value, torch.dtype):
        return value
    dtype = getattr(torch, str(value).removeprefix("torch."), None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"wire_dtype={value!r} is not a torch dtype; use e.g. 'float32'.")
    return dtype


def _record(module: pl.LightningModule, stage: str, loss: Tensor, batch: Any) -> None:
    """Log a loss the strategy computed: the module's ``record_loss`` or ``<stage>_loss``."""
    record = getattr(module, "record_loss", None)
    if callable(record):
        record(stage, loss, batch)
    else:
        module.log(f"{stage}_loss", loss, prog_bar=True, sync_dist=stage != "train")
