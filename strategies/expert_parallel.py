"""Expert parallelism, and mixture-of-experts layers under tensor parallelism.

Applied from outside the model, after the tensor-parallel plan and before recomputation,
compile and data parallelism (torchtitan's order), to every
:class:`~plugintrain.core.contracts.ExpertLayer` (the zoo's ``MoE``) a module holds:

- **Expert parallelism** (``expert_parallel = ep > 1``, ranks borrowed from dp; see
  :mod:`~plugintrain.strategies.mesh`): the stacked expert weights become DTensors
  sharded on dim 0 (the expert index) over ``mesh["ep"]`` (over ``("ep", "tp")`` as
  ``(Shard(0), Replicate())`` when tp > 1), so ep rank ``r`` holds experts
  ``[r E / ep, (r + 1) E / ep)``, and the layer's ``ep_group`` is set: it exchanges tokens
  with two all-to-alls (``model_zoo.moe.dispatch_and_combine``). The router and the
  shared experts stay replicated. An expert's gradient is reduced over the ``edp`` ranks
  that hold it (:func:`expert_reduce_groups`, given to the gradient engine), not over dp.
- **Tensor parallelism**: MoE layers are not split by tp. Without sequence parallelism
  every tp rank runs the layer on the same (whole) tokens, so its gradients are
  identical. With SP the plan's ``local_tokens`` style hands each rank its own sequence
  shard; every parameter of the layer becomes a DTensor replicated over tp and its
  :class:`~plugintrain.core.contracts.LocalTokenModule` parts mark their gradients
  ``Partial``, which the gradient engine sums over tp (as it does for sequence-parallel
  norms). The layer's ``sequence_group`` is set too: the sequence-wise balance loss sums
  each sequence's expert picks over it, so the ranks' losses add up to the sequence's.

Parameters still on the meta device (shard-first builds) are sharded there: each rank
later allocates only its local experts (``parallelize.materialize``).
"""

from __future__ import annotations

from collections.abc import Sequence

from torch import nn
from torch.distributed import ProcessGroup
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Placement, Replicate, Shard, distribute_tensor

from plugintrain.core.contracts import ExpertLayer, LocalTokenModule
from plugintrain.strategies.mesh import ParallelDims, expert_data_mesh


def expert_layers(module: nn.Module) -> list[tuple[str, ExpertLayer]]:
    """``(path, layer)`` of every mixture-of-experts layer ``module`` holds."""
    return [(name, m) for name, m in module.named_modules() if isinstance(m, ExpertLayer)]


def parallelize_experts(module: nn.Module, dims: ParallelDims, mesh: DeviceMesh) -> None:
    """Split the experts of ``module``'s MoE layers over ``mesh["ep"]`` and, under sequence
    parallelism, replicate the layers over ``mesh["tp"]`` with partial gradients (see the
    module documentation). A no-op for a model without MoE layers or when neither applies.

    Args:
        module: The model, or this pipeline rank's part of it, after the tp plan.
        dims: The degrees.
        mesh: The mesh of :meth:`ParallelDims.build_mesh`.
    """
    for _, layer in expert_layers(module):
        if dims.ep_enabled:
            expert_mesh = mesh["ep", "tp"] if dims.tp_enabled else mesh["ep"]
            placements = (Shard(0), Replicate()) if dims.tp_enabled else (Shard(0),)
            _distribute_parameters(layer.experts, expert_mesh, placements)
            layer.ep_group = mesh["ep"].get_group()
        if dims.sequence_parallel:
            layer.sequence_group = mesh["tp"].get_group()
            _distribute_parameters(layer, mesh["tp"], (Replicate(),))
            for part in layer.modules():
                if isinstance(part, LocalTokenModule):
                    part.partial_grad = True


def expert_reduce_groups(module: nn.Module, mesh: DeviceMesh) -> dict[str, ProcessGroup]:
    """Name (as ``module.named_parameters()`` gives it) -> the ``edp`` group, for every
    expert weight sharded over ``mesh["ep"]``: the ranks holding the same experts, over
    which the gradient engine reduces them (times the cp ranks, which hold other tokens of
    the same rows: :func:`~plugintrain.strategies.mesh.expert_data_mesh`). Empty without
    expert parallelism."""
    edp = expert_data_mesh(mesh)
    if edp is None:
        return {}
    group = edp.get_group()
    return {
        f"{path}.experts.{name}": group
        for path, layer in expert_layers(module)
        for name, _ in layer.experts.named_parameters()
    }


def _distribute_parameters(
    module: nn.Module, mesh: DeviceMesh, placements: Sequence[Placement]
) -> None:
    """Make every parameter of ``module`` (and its children) that is not yet a DTensor one
    on ``mesh`` with ``placements``; a meta parameter stays on meta, a real one is sent
    from the mesh's first rank (``distribute_tensor``)."""
    for part in module.modules():
        for name, param in list(part.named_parameters(recurse=False)):
            if isinstance(param, DTensor):
                continue
            tensor = distribute_tensor(param.detach(), mesh, placements)
            part.register_parameter(name, nn.Parameter(tensor, param.requires_grad))
