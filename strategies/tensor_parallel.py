"""Apply a model's declarative tensor/sequence-parallel plan with DTensor.

A model family declares its plan as data (``plugintrain.model_zoo.llama3.tp_plan()``):
module path pattern -> style name. This module maps each name to a torch
``ParallelStyle`` and applies it with ``parallelize_module`` on the ``tp`` mesh, following
Megatron-LM (Shoeybi et al. 2019) for the column/row split and Korthikanti et al. 2022,
"Reducing Activation Recomputation in Large Transformer Models", for sequence
parallelism (SP). The layouts match torchtitan's ``apply_tp`` for Llama:

- without SP, each transformer layer does 2 all-reduces forward (after ``wo`` and ``w2``)
  and 2 backward (into the attention and MLP inputs);
- with SP, the residual stream stays sharded over the sequence, and each of those becomes
  an all-gather (into the column-parallel block) or a reduce-scatter (out of the
  row-parallel Linear), with no extra collective.

The LM head keeps its logits sharded over the vocabulary, and :func:`vocab_parallel_loss`
computes the cross-entropy on the shards (``loss_parallel``), never gathering ``(B, T, V)``.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Callable

from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    loss_parallel,
    parallelize_module,
)
from typing_extensions import override

from plugintrain.core.contracts import TensorParallelExtras

# Styles that exist only to keep activations sharded over the sequence (or to undo it).
SP_ONLY_STYLES = frozenset(
    {"sequence_parallel", "sequence_scatter", "gathered_tokens", "local_tokens"}
)


class _FirstInput(PrepareModuleInput):
    """``PrepareModuleInput`` for the first positional input, whatever the module's arity.

    Attention takes ``(x, rope, input_pos, mask)`` and the MLP ``(x,)``; one style serves both.
    """

    @override
    def _prepare_input_fn(self, inputs: tuple, device_mesh: DeviceMesh) -> tuple:
        return (*super()._prepare_input_fn(inputs[:1], device_mesh), *inputs[1:])


def _split_extras(
    kind: str,
    split: Callable,
    src_data_rank: int | None,
    name: str,
    module: nn.Module,
    mesh: DeviceMesh,
) -> None:
    """``split`` the Linear's weight and bias as torch does; parameters the module declares
    beside them (:class:`~plugintrain.core.contracts.TensorParallelExtras`, a LoRA adapter)
    are split along their declared dims instead."""
    if name:  # a child of the layer (a LoRA adapter's dropout): nothing to split
        return
    layout = module.tp_placements(kind) if isinstance(module, TensorParallelExtras) else {}
    extras = {n: module._parameters.pop(n) for n in layout}
    split(name, module, mesh)
    for n, param in extras.items():
        placement = Replicate() if layout[n] is None else Shard(layout[n])
        tensor = distribute_tensor(param, mesh, [placement], src_data_rank=src_data_rank)
        module.register_parameter(n, nn.Parameter(tensor, requires_grad=param.requires_grad))


class _Colwise(ColwiseParallel):
    """``ColwiseParallel`` that splits a Linear's declared extra parameters (a LoRA
    adapter: ``A`` replicated, ``B`` over the output) with it."""

    @override
    def _partition_linear_fn(self, name: str, module: nn.Module, device_mesh: DeviceMesh) -> None:
        split = super()._partition_linear_fn
        _split_extras("colwise", split, self.src_data_rank, name, module, device_mesh)


class _Rowwise(RowwiseParallel):
    """``RowwiseParallel`` that splits a Linear's declared extra parameters (a LoRA
    adapter: ``A`` over the input, ``B`` replicated) with it; the adapter's partial output
    joins the layer's own before its single reduction."""

    @override
    def _partition_linear_fn(self, name: str, module: nn.Module, device_mesh: DeviceMesh) -> None:
        split = super()._partition_linear_fn
        _split_extras("rowwise", split, self.src_data_rank, name, module, device_mesh)


class _SumGradient(ParallelStyle):
    """Identity forward on the module's first input, whose gradient is summed over the tp
    ranks in backward: the input is the same on every rank, but each uses it for its own
    heads only (MLA's RoPE key, shared by all heads), so each computes part of its
    gradient. Megatron's ``f`` operator for one tensor, through a DTensor whose local
    gradient is marked ``Partial``."""

    @override
    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        def summed(_: nn.Module, inputs: tuple) -> tuple:
            shared = DTensor.from_local(inputs[0], device_mesh, [Replicate()], run_check=False)
            return (shared.to_local(grad_placements=[Partial()]), *inputs[1:])

        module.register_forward_pre_hook(summed)
        return module


def _tp_input(sp: bool) -> ParallelStyle:
    # One replicated DTensor feeds all of a block's column-parallel Linears (q, k, v or
    # w1, w3), so backward reduces the input gradient once (Megatron's `f` operator), not
    # once per Linear. With SP the input arrives sequence-sharded and is all-gathered (`g`).
    source = Shard(1) if sp else Replicate()
    return _FirstInput(input_layouts=(source,), desired_input_layouts=(Replicate(),))


def style(name: str, sequence_parallel: bool) -> ParallelStyle:
    """The torch ``ParallelStyle`` for a plan's style ``name``.

    Args:
        name: ``colwise``, ``rowwise``, ``vocab_embedding``, ``vocab_head``, ``tp_input``,
            ``head_norm``, ``head_shared``, ``sequence_parallel``, ``sequence_scatter``,
            ``gathered_tokens`` or ``local_tokens``.
        sequence_parallel: Whether the residual stream is sharded over the sequence.

    Raises:
        ValueError: On an unknown name.
    """
    seq = Shard(1)
    builders: dict[str, Callable[[], ParallelStyle]] = {
        "colwise": _Colwise,
        # Reduce-scatter into sequence shards with SP (Korthikanti et al. §4.2.2), else all-reduce.
        "rowwise": lambda: _Rowwise(output_layouts=seq if sequence_parallel else None),
        # The embedding output is all-reduced in full even with SP, so GPT-2's learned
        # positions are added to whole sequences; `sequence_scatter` then splits it locally.
        "vocab_embedding": lambda: RowwiseParallel(input_layouts=Replicate()),
        # Logits stay sharded over the vocabulary as a DTensor for `loss_parallel`.
        "vocab_head": lambda: _Colwise(
            input_layouts=seq if sequence_parallel else Replicate(),
            output_layouts=Shard(-1),
            use_local_output=False,
        ),
        "tp_input": lambda: _tp_input(sequence_parallel),
        # A norm over each head's channels (Qwen3's q_norm/k_norm) on the (B, T, nh, hs)
        # output of a column-parallel wq/wk: each rank holds whole heads, so the input is
        # Shard(2) and the norm runs locally; the replicated weight's gradient differs per
        # rank: it is left Partial over tp and summed where it is reduced. With or without SP.
        "head_norm": lambda: SequenceParallel(sequence_dim=2, use_local_output=True),
        # An input every head uses (MLA's RoPE key): its gradient is summed over tp.
        "head_shared": _SumGradient,
        "sequence_parallel": SequenceParallel,
        # SP only: the module runs replicated on the whole sequence as plain tensors (MLA's
        # latent projections; its output comes from a row-parallel Linear, so no slicing).
        # Every rank's input gradient is then whole and the same: backward slices, no comm.
        "gathered_tokens": lambda: _FirstInput(
            input_layouts=(seq,), desired_input_layouts=(Replicate(),), use_local_output=True
        ),
        # SP only: the module runs on the rank's own sequence shard as plain tensors (a
        # mixture of experts; its replicated parameters' gradients are partial, see
        # plugintrain.strategies.expert_parallel). No communication.
        "local_tokens": lambda: _FirstInput(
            input_layouts=(seq,), desired_input_layouts=(seq,), use_local_output=True
        ),
        # Replicate -> Shard(1) is a local slice: no communication.
        "sequence_scatter": lambda: PrepareModuleInput(
            input_layouts=(Replicate(),), desired_input_layouts=(seq,), use_local_output=True
        ),
    }
    if name not in builders:
        raise ValueError(f"Unknown tensor-parallel style {name!r}; use one of {sorted(builders)}.")
    return builders[name]()


def expand_plan(
    model: nn.Module, plan: dict[str, str], sequence_parallel: bool, allow_missing: bool = False
) -> dict[str, str]:
    """Resolve the plan's ``*`` patterns to the model's module paths, in plan order.

    SP-only styles are dropped without sequence parallelism (those modules stay replicated).

    Args:
        model: The module the plan's paths are relative to.
        plan: Module path pattern -> style name.
        sequence_parallel: Whether SP-only styles apply.
        allow_missing: Skip patterns that match nothing (a pipeline stage holds only some
            of the modules) instead of raising.

    Raises:
        ValueError: If a pattern matches no module (a typo would silently skip sharding).
    """
    names = [name for name, _ in model.named_modules() if name]
    resolved: dict[str, str] = {}
    for pattern, name in plan.items():
        matches = fnmatch.filter(names, pattern)
        if not matches and allow_missing:
            continue
        if not matches:
            raise ValueError(f"Tensor-parallel plan entry {pattern!r} matches no module.")
        if name in SP_ONLY_STYLES and not sequence_parallel:
            continue
        resolved.update(dict.fromkeys(matches, name))
    return resolved


def apply_tensor_parallel(
    model: nn.Module,
    plan: dict[str, str],
    tp_mesh: DeviceMesh,
    sequence_parallel: bool,
    allow_missing: bool = False,
) -> nn.Module:
    """Shard ``model`` in place over ``tp_mesh`` by ``plan``; weights come from tp rank 0.

    A weight tied between the embedding and the head (both split over the vocabulary) is
    re-tied afterwards: distributing replaces each module's parameter on its own.

    Args:
        model: A single-device :class:`~plugintrain.model_zoo.Transformer`.
        plan: Module path pattern -> style name (the family's ``tp_plan()``).
        tp_mesh: The one-dimensional tensor-parallel mesh.
        sequence_parallel: Shard norms and dropout over the sequence (Megatron-style SP).
        allow_missing: Skip plan entries with no module (a pipeline stage's model).
    """
    shared = shared_parameters(model)
    frozen = {name for name, p in model.named_parameters() if not p.requires_grad}
    resolved = expand_plan(model, plan, sequence_parallel, allow_missing)
    styles = {path: style(name, sequence_parallel) for path, name in resolved.items()}
    parallelize_module(model, tp_mesh, styles)
    retie(shared)
    # torch's SequenceParallel re-creates the norms' parameters as trainable (2.13).
    for name, param in model.named_parameters():
        if name in frozen:
            param.requires_grad_(False)
    return model


SharedParameters = list[list[tuple[nn.Module, str]]]


def shared_parameters(model: nn.Module) -> SharedParameters:
    """Every parameter held by more than one module, as ``(module, attribute)`` groups."""
    owners: dict[int, list[tuple[nn.Module, str]]] = {}
    for module in model.modules():
        for name, param in module.named_parameters(recurse=False, remove_duplicate=False):
            owners.setdefault(id(param), []).append((module, name))
    return [group for group in owners.values() if len(group) > 1]


def retie(shared: SharedParameters) -> None:
    """Point every owner in each group at the first owner's (possibly new) parameter."""
    for (first, first_name), *others in shared:
        param = getattr(first, first_name)
        for module, name in others:
            setattr(module, name, param)


def vocab_parallel_loss(loss_fn: Callable[[Tensor, Tensor], Tensor]) -> Callable:
    """Wrap ``loss_fn(logits, targets)`` to run on vocabulary-sharded DTensor logits.

    Inside ``loss_parallel`` torch's cross-entropy reduces the max, the sum of exponentials
    and the target logit over the tp group (three small all-reduces, Megatron's
    ``vocab_parallel_cross_entropy``) instead of gathering the ``(B, T, V)`` logits. The
    backward pass must also run under ``loss_parallel()``.
    """

    def wrapped(logits: Tensor, targets: Tensor) -> Tensor:
        with loss_parallel():
            loss = loss_fn(logits, targets)
        # The mean loss is replicated: a plain tensor for logging and metrics.
        return loss.to_local() if isinstance(loss, DTensor) else loss

    return wrapped
