"""Small protocols shared by strategies, precision plugins and models.

Two seams, so no package imports another's internals:

- Strategies know how a model is laid out across ranks; precision plugins need that
  knowledge to agree on found-inf and to clip by the global gradient norm. A strategy
  exposes a :class:`GradientLayout` through the :class:`GradientLayoutProvider` protocol,
  and a plugin asks for one. A strategy that casts the weights itself turns a plugin's
  autocast off through :class:`AutocastSwitch`.
- Model-parallel strategies need a few things from a LightningModule: its sizes, the
  module to shard, its tensor-parallel plan, its loss and a way to log a loss they
  computed. :class:`ParallelModule` declares them (and :class:`StagedModel` what the
  pipeline needs of the model itself); :func:`check_contract` names what a module lacks.
  A model family that implements these runs under every plugintrain strategy. Mixture of
  experts adds :class:`ExpertLayer` and :class:`LocalTokenModule` (what expert and
  tensor parallelism split or replicate), :class:`ExpertShape` (what they are checked
  against) and :class:`HasAuxiliaryLoss` (the balance loss a pipeline stage adds).
"""

from __future__ import annotations

import math
from collections.abc import Collection, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.placement_types import Placement, _StridedShard


@dataclass(frozen=True)
class GradientPiece:
    """This rank's piece of one parameter's gradient.

    Attributes:
        grad: The local gradient tensor (a DTensor's local shard, never a DTensor).
        replicas: How many ranks of the layout's group hold an identical copy of ``grad``;
            each contributes ``1 / replicas`` of its squared norm, so every parameter
            counts exactly once in the global norm.
    """

    grad: Tensor
    replicas: int

    def __post_init__(self) -> None:
        if self.replicas < 1:
            raise ValueError(f"`replicas` must be >= 1, got {self.replicas}.")


@dataclass(frozen=True)
class GradientLayout:
    """Where a model's gradients live across ranks.

    Attributes:
        group: The process group spanning every rank that holds part of the model (tensor,
            pipeline and data-parallel shards); ``None`` when this process holds it all.
        pieces: This rank's gradient pieces.
        device: Device of the reduction buffers (the group's communication device).
    """

    group: dist.ProcessGroup | None
    pieces: list[GradientPiece]
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))

    def grads(self) -> list[Tensor]:
        """The local gradient tensors, for in-place scaling."""
        return [piece.grad for piece in self.pieces]

    def all_reduce(self, tensor: Tensor, op: dist.ReduceOp.RedOpType) -> Tensor:
        """All-reduce ``tensor`` in place over the group (a no-op without one)."""
        if self.group is not None:
            dist.all_reduce(tensor, op=op, group=self.group)
        return tensor

    def global_norm(self) -> Tensor:
        """The L2 norm of the whole model's gradient, identical on every rank of the group."""
        squared = torch.zeros((), dtype=torch.float32, device=self.device)
        for piece in self.pieces:
            # fp32 accumulation: bf16 grads (bf16-true) would lose the small terms.
            norm = torch.linalg.vector_norm(piece.grad, dtype=torch.float32)
            squared += norm.square() / piece.replicas
        return self.all_reduce(squared, dist.ReduceOp.SUM).sqrt()


@runtime_checkable
class GradientLayoutProvider(Protocol):
    """What a strategy implements to tell precision plugins how gradients are laid out."""

    def gradient_layout(self, parameters: Iterable[Tensor]) -> GradientLayout:
        """The layout of the gradients of ``parameters`` (those an optimizer steps)."""
        ...


@runtime_checkable
class CountsTargets(Protocol):
    """A module whose training loss can mask targets (chat data's prompts, padding).

    Its per-micro-batch loss is the sum over the scored targets divided by the number of
    positions, a denominator the batch's shape fixes; the precision plugin multiplies the
    step's gradients by ``positions / scored targets`` summed over the global batch, which
    makes them the gradient of the mean over every scored target of every micro-batch and
    rank (not a mean of per-micro-batch means).
    """

    def take_target_counts(self) -> Tensor | None:
        """``(scored targets, positions)`` of the training batches since the last call (a
        float64 ``(2,)``), or None when the data has no loss mask; every rank of a run must
        answer alike (None everywhere or a tensor everywhere), as the counts are summed."""
        ...


@runtime_checkable
class HoldsGradients(Protocol):
    """A strategy whose gradients live outside ``param.grad`` (flat buckets, shards)."""

    def gradient_buffers(self) -> list[Tensor]:
        """The tensors holding this rank's gradients right now."""
        ...


@runtime_checkable
class ModelShape(Protocol):
    """The sizes a parallel layout is checked against (``TransformerConfig`` has them)."""

    name: str
    n_layer: int
    """Transformer blocks (split over pipeline stages)."""
    n_embd: int
    """Width of the hidden states sent between pipeline stages."""
    n_head: int
    kv_heads: int
    ffn_dim: int
    vocab_size: int
    """Each of ``n_head``, ``kv_heads``, ``ffn_dim`` and ``vocab_size`` is split by tp."""


@runtime_checkable
class StagedModel(Protocol):
    """A model that a pipeline cuts into stages: an embedding, a ``ModuleDict`` of blocks
    (keyed by their full-model index) and a head. ``Transformer`` is one."""

    layers: nn.ModuleDict

    def embed(self, tokens: Tensor, positions: Tensor) -> Tensor:
        """Token ids ``(B, T)`` at ``positions`` ``(T,)`` -> hidden states ``(B, T, C)``."""
        ...

    def run_layers(self, h: Tensor, keys: Iterable[str], positions: Tensor) -> Tensor:
        """Hidden states through the blocks ``layers[key]`` for ``key`` in ``keys``, in order.

        ``positions`` are those of the full sequence (hidden states may be sequence shards).
        """
        ...

    def head(self, h: Tensor) -> Tensor:
        """Hidden states -> logits ``(B, T, V)`` (final norm and output projection)."""
        ...

    def keep_stage(self, layer_keys: Collection[str], first: bool, last: bool) -> None:
        """Drop, in place, every block not in ``layer_keys``, the embedding unless ``first``
        and the head unless ``last``; what stays keeps its full-model name."""
        ...

    def tied_parameters(self) -> list[tuple[str, str]]:
        """Pairs of parameter names (relative to the model) that are one parameter, such as
        an embedding tied to the head; a pipeline holds the two on different stages."""
        ...


@runtime_checkable
class ParallelModule(Protocol):
    """What plugintrain's model-parallel strategies read from a LightningModule.

    ``hybrid`` with ``tensor_parallel > 1`` or ``pipeline_parallel > 1`` (and ``pipeline``)
    require it; ``model`` must also be a :class:`StagedModel` for pipelines. Data
    parallelism alone needs none of it.
    """

    config: ModelShape
    """The sizes the layout is validated against, before any process starts."""
    model: nn.Module | None
    """The module to shard, built in ``configure_model``; plan paths start with ``model.``."""

    def tp_plan(self) -> dict[str, str]:
        """Module path pattern (relative to the LightningModule) -> tensor-parallel style name
        (see :func:`plugintrain.strategies.tensor_parallel.style`)."""
        ...

    def loss_fn(self, logits: Tensor, targets: Tensor) -> Tensor:
        """Mean loss of ``logits`` ``(B, T, V)`` against ``targets`` ``(B, T)``; under tp the
        strategy wraps it into a vocabulary-parallel loss."""
        ...

    def record_loss(self, stage: str, loss: Tensor, batch: Any) -> None:
        """Log ``loss`` of ``batch`` for ``stage`` (``train``/``val``/``test``) as the module's
        own steps do; a pipeline computes the loss itself and hands it here."""
        ...


@runtime_checkable
class SplitsSequences(Protocol):
    """A LightningModule that trains on a share of every sequence: what ``hybrid`` with
    ``context_parallel > 1`` requires (besides :class:`ParallelModule`)."""

    def split_sequences(self, shard: Any) -> None:
        """From now on compute on ``shard``'s chunks of every row (a
        :class:`~plugintrain.core.context_shard.ContextShard`), its attention over
        every chunk of the row, and a loss whose mean over the cp ranks is the rows' loss."""
        ...


@runtime_checkable
class OneBlockModule(Protocol):
    """A LightningModule whose pipeline split ``layers_per_stage: auto`` chooses by timing."""

    def one_block_model(self) -> nn.Module:
        """A :class:`StagedModel` of this module's architecture with one block (of the kind
        most of its blocks are), built in the current device and dtype context: what is
        timed, instead of the whole model."""
        ...


@runtime_checkable
class MicroBatchShape(Protocol):
    """A datamodule whose batches are ``(batch_size, seq_len)`` token windows."""

    batch_size: int
    seq_len: int


@runtime_checkable
class ShardFirstModule(Protocol):
    """A :class:`ParallelModule` that can be built on the meta device.

    Given these, ``hybrid`` and ``pipeline`` build its model on the meta device, split the
    pipeline stages and shard it (tp, FSDP2) there, then allocate only this rank's part
    and call :meth:`init_weights`: no rank ever holds the whole model. Without them, every
    rank builds the whole model and keeps its part.
    """

    init_seed: int
    """What the weights derive from; strategies give every rank global rank 0's."""

    def init_weights(self) -> None:
        """Initialize, in place, every parameter and buffer this rank holds (a DTensor's
        local shard only) to its part of the weights one process would build from
        ``init_seed`` (see :func:`plugintrain.core.initialization.seeded_normal_`)."""
        ...


@runtime_checkable
class HasAuxiliaryLoss(Protocol):
    """A model whose training forwards leave a loss term to add to the task loss (the zoo's
    ``Transformer``: its mixture-of-experts balance losses). A pipeline stage takes it
    after each micro-batch's forward and backpropagates it with the loss's scaling."""

    def take_aux_loss(self) -> Tensor | None:
        """The auxiliary loss of the forwards since the last call (None: none), cleared."""
        ...


@runtime_checkable
class ExpertShape(Protocol):
    """A model config that may hold mixture-of-experts layers (``TransformerConfig``):
    what expert parallelism is checked against before any process starts."""

    name: str
    n_layer: int
    moe: Any
    """The layers' routing settings (``n_routed_experts``, ``first_k_dense``,
    ``aux_loss_coeff``, ``is_moe_layer(i)``), or None: every layer is dense."""


@runtime_checkable
class ExpertLayer(Protocol):
    """A mixture-of-experts layer that expert parallelism splits (the zoo's ``MoE``).

    ``experts`` holds every routed expert's weights stacked along dim 0; once ``ep_group``
    is set, the layer exchanges tokens over it and expects rank ``r`` of the group to
    hold experts ``[r E / ep, (r + 1) E / ep)`` as the local shards of its DTensors.
    Under sequence parallelism ``sequence_group`` is the group holding the other
    sequence shards of its tokens (a sequence-wise balance loss sums over it).
    """

    experts: nn.Module
    ep_group: dist.ProcessGroup | None
    sequence_group: dist.ProcessGroup | None


@runtime_checkable
class LocalTokenModule(Protocol):
    """A module that runs replicated parameters on this rank's own tokens (a sequence shard)
    as plain tensors: with ``partial_grad`` set it marks their DTensor gradients
    ``Partial``, to be summed over the ranks that share the parameters."""

    partial_grad: bool


@runtime_checkable
class AutocastSwitch(Protocol):
    """A precision plugin whose forwards autocast, which a strategy that casts the weights
    itself (FSDP2 with a ``MixedPrecisionPolicy``) turns off: autocast would keep a second
    low-precision copy of every weight beside the one the strategy gathered."""

    autocast: bool
    """Whether forwards run under autocast."""


@runtime_checkable
class TensorParallelExtras(Protocol):
    """A Linear layer holding parameters besides ``weight`` and ``bias`` (a LoRA adapter):
    tensor parallelism splits the weight by the plan's style, and these as declared."""

    def tp_placements(self, kind: str) -> dict[str, int | None]:
        """Parameter name -> the dim it is split along when the layer is split ``kind``
        (``colwise`` or ``rowwise``), None for replicated."""
        ...


class CallsModelBuiltHooks:
    """Strategy mixin (put first among the bases): call the callbacks' ``on_model_built``
    as Lightning leaves ``model_sharded_context``, which it enters around
    ``configure_model`` inside ``tensor_init_context``."""

    calls_on_model_built = True

    @contextmanager
    def model_sharded_context(self) -> Iterator[None]:
        with super().model_sharded_context():  # type: ignore[misc]
            yield
        call_model_built_hooks(self.lightning_module.trainer)


def call_model_built_hooks(trainer: Any) -> None:
    """Call ``on_model_built(trainer, pl_module)`` on every callback that defines it.

    Lightning 2.6 has no callback hook between building the model and sharding it or
    building optimizers (Lightning#19658); plugintrain's strategies call this one right
    after the module's ``configure_model``, inside the same device and dtype context (the
    meta device for shard-first models), and mark themselves ``calls_on_model_built``.
    """
    module = trainer.lightning_module
    for callback in trainer.callbacks:
        hook = getattr(callback, "on_model_built", None)
        if callable(hook):
            hook(trainer, module)


def contract_members(protocol: type) -> list[str]:
    """The attributes and methods that ``protocol`` declares, in declaration order."""
    names = list(getattr(protocol, "__annotations__", {}))
    names += [n for n, v in vars(protocol).items() if callable(v) and not n.startswith("_")]
    return names


def check_contract(obj: Any, protocol: type, needed_by: str) -> None:
    """Raise a ``TypeError`` naming every member of ``protocol`` that ``obj`` lacks.

    Args:
        obj: The module to check.
        protocol: :class:`ParallelModule` or :class:`StagedModel`.
        needed_by: Who needs it, e.g. ``"HybridParallelStrategy(tensor_parallel=2)"``.
    """
    missing = [name for name in contract_members(protocol) if not hasattr(obj, name)]
    if missing:
        raise TypeError(
            f"{needed_by} needs {type(obj).__name__} to implement"
            f" plugintrain.core.contracts.{protocol.__name__}; it lacks {', '.join(missing)}."
            f" Implement them (CausalLM and Transformer are complete examples)."
        )


def _world_group() -> dist.ProcessGroup | None:
    return dist.group.WORLD if dist.is_available() and dist.is_initialized() else None


def _distinct_shards(tensor: DTensor) -> int:
    """Number of different local pieces a DTensor is split into across its mesh."""
    placements = tensor.placements
    if any(placement.is_partial() for placement in placements):
        raise ValueError(f"Gradient has pending Partial placements {placements}; reduce it first.")
    mesh = tensor.device_mesh
    return math.prod(mesh.size(dim) for dim, p in enumerate(placements) if _splits(p))


def _splits(placement: Placement) -> bool:
    # FSDP2 over a tensor-parallel dim shards with `_StridedShard`, which `is_shard()`
    # does not report (torch 2.13): it still splits the tensor across that mesh dim.
    return placement.is_shard() or isinstance(placement, _StridedShard)


def _pieces(parameters: Iterable[Tensor], world_size: int) -> Iterator[GradientPiece]:
    for param in parameters:
        grad = param.grad
        if grad is None:
            continue
        if isinstance(grad, DTensor):
            yield GradientPiece(grad.to_local(), world_size // _distinct_shards(grad))
        else:
            yield GradientPiece(grad, world_size)


def default_gradient_layout(parameters: Iterable[Tensor]) -> GradientLayout:
    """The layout of a model that every rank holds whole, possibly as DTensor shards.

    Right for one process, DDP (every gradient replicated world-size times) and DTensor
    tensor/FSDP sharding over the whole world (a DTensor's piece is replicated
    ``world_size / shards`` times). Not right for pipeline stages, which hold different
    parameters: a pipeline strategy must provide its own layout.

    Args:
        parameters: The parameters whose gradients the layout describes.
    """
    group = _world_group()
    world_size = dist.get_world_size(group) if group is not None else 1
    pieces = list(_pieces(parameters, world_size))
    device = pieces[0].grad.device if pieces else torch.device("cpu")
    return GradientLayout(group=group, pieces=pieces, device=device)


@runtime_checkable
class TokenBytesSource(Protocol):
    """Something that knows the UTF-8 bytes of text each token id stands for."""

    @property
    def token_bytes(self) -> torch.Tensor | None:
        """Bytes per id, int ``(vocab_size,)`` (0 for special tokens); None if unknown."""
        ...
