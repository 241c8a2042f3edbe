"""What an optimizer steps under the gradient engine, and its state by parameter name.

The engine hands an optimizer one 1-D "shard parameter" per parameter: the part of the
parameter's bucket range that this rank owns. That is exact only for elementwise
optimizers (:data:`ELEMENTWISE_OPTIMIZERS`), which update each element from its own
gradient and state. :class:`OptimizerShards` re-points optimizers at the shards and turns
their state into whole tensors keyed by parameter name (single-file checkpoints, any rank
count) and back, or into this rank's flat ranges (:class:`OwnedSlice`, DCP checkpoints).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor
from torch.optim import Optimizer

from plugintrain.core.contracts import GradientLayout, GradientPiece
from plugintrain.strategies.buckets import AllReduce, Bucket, BucketLayout, local_tensor

# Optimizers whose update of an element reads only that element's gradient and state, so
# stepping slices on different ranks equals stepping the whole tensor on one.
ELEMENTWISE_OPTIMIZERS: set[type[Optimizer]] = {
    torch.optim.SGD,
    torch.optim.Adam,
    torch.optim.AdamW,
    torch.optim.Adagrad,
    torch.optim.Adadelta,
    torch.optim.Adamax,
    torch.optim.ASGD,
    torch.optim.NAdam,
    torch.optim.RAdam,
    torch.optim.RMSprop,
    torch.optim.Rprop,
}


def register_elementwise_optimizer(cls: type[Optimizer]) -> type[Optimizer]:
    """Allow the engine to shard ``cls`` (usable as a class decorator).

    Only register optimizers that update each element from its own gradient and state;
    norm-based (LAMB, LARS) or factored (Adafactor) updates would silently change.
    """
    ELEMENTWISE_OPTIMIZERS.add(cls)
    return cls


def check_shardable(optimizer: Optimizer) -> None:
    """Raise a ``TypeError`` naming the fix if ``optimizer`` cannot be stepped in slices."""
    if isinstance(optimizer, tuple(ELEMENTWISE_OPTIMIZERS)):
        return
    allowed = ", ".join(sorted(cls.__name__ for cls in ELEMENTWISE_OPTIMIZERS))
    raise TypeError(
        f"{type(optimizer).__name__} cannot be used with the data-parallel gradient engine: it"
        " steps each parameter as flat slices owned by different ranks, which is exact only for"
        f" elementwise optimizers ({allowed}). Use one of those, or register an elementwise"
        " optimizer with `plugintrain.strategies.register_elementwise_optimizer`."
    )


def optimizer_state_bytes(optimizer: Optimizer) -> int:
    """Bytes held by the tensors of ``optimizer.state`` on this rank."""
    return sum(
        value.numel() * value.element_size()
        for state in optimizer.state.values()
        for value in state.values()
        if torch.is_tensor(value)
    )


def is_elementwise(value: Any, numel: int) -> bool:
    """Whether optimizer state ``value`` has one element per parameter element (``exp_avg``),
    as opposed to a scalar such as ``step``: only the former is sliced between ranks."""
    return torch.is_tensor(value) and value.dim() > 0 and value.numel() == numel


@dataclass
class _StateMeta:
    """One parameter's optimizer state, described: scalars by value, elementwise tensors
    by ``(key, dtype)`` (their values stay sharded until gathered)."""

    scalars: dict[str, Any] = field(default_factory=dict)
    sharded: set[tuple[str, torch.dtype]] = field(default_factory=set)

    @classmethod
    def of(cls, values: dict[str, Any], numel: int) -> _StateMeta:
        """Describe ``values``, the state of a shard of ``numel`` elements, with scalar
        tensors copied to the host (see :func:`host_scalar`)."""
        meta = cls()
        for key, value in values.items():
            if is_elementwise(value, numel):
                meta.sharded.add((key, value.dtype))
            else:
                meta.scalars[key] = host_scalar(value)
        return meta


def host_scalar(value: Any) -> Any:
    """``value`` with a tensor moved to the CPU (a copy; other values as they are).

    Fused or capturable AdamW keeps ``step`` as a scalar tensor on the parameter's GPU.
    Pickled through an object collective, it would be unpickled onto that same ``cuda:k``
    on every other rank (creating a CUDA context on a GPU that is not theirs) and saved as
    a ``cuda:k`` tensor in the checkpoint; the optimizer's ``load_state_dict`` moves it
    back to each parameter's device.
    """
    return value.detach().to("cpu", copy=True) if torch.is_tensor(value) else value


@dataclass
class OptimizerShards:
    """What attached optimizers step on this rank (the shard parameters of a
    :class:`~plugintrain.strategies.buckets.BucketLayout`), and their state by parameter
    name: gathered into whole tensors and sliced back (single-file checkpoints), or as this
    rank's flat ranges (sharded DCP checkpoints).

    Args:
        layout: The engine's buckets.
        process_group: The engine's data-parallel group; None for the world.
    """

    layout: BucketLayout
    process_group: dist.ProcessGroup | None
    group_names: dict[Optimizer, list[list[str]]] = field(default_factory=dict)
    """Each attached optimizer's parameter names, group by group."""

    def attach(self, optimizer: Optimizer) -> None:
        """Re-point ``optimizer``'s groups at the shard parameters (see
        :meth:`~plugintrain.strategies.GradientEngine.attach`), resharding any state it
        already has."""
        check_shardable(optimizer)
        names = [
            [self.layout.entry_of(param).name for param in group["params"]]
            for group in optimizer.param_groups
        ]
        existing = {
            "state": {
                self.layout.entry_of(param).name: state for param, state in optimizer.state.items()
            },
            "param_groups": [
                {**group, "params": group_names}
                for group, group_names in zip(optimizer.param_groups, names, strict=True)
            ],
        }
        self.group_names[optimizer] = names
        for group in optimizer.param_groups:
            shards = (self.layout.entry_of(param).shard for param in group["params"])
            group["params"] = [shard for shard in shards if shard is not None]
        optimizer.state.clear()
        if existing["state"]:
            self.load(optimizer, existing)

    def gather(self, optimizer: Optimizer) -> dict[str, Any]:
        """The whole optimizer state keyed by parameter name, on group rank 0 (``{}`` elsewhere).

        The layout is torch's ``Optimizer.state_dict()`` with names for ids: ``state`` maps
        each name to full, parameter-shaped tensors; ``param_groups[i]["params"]`` lists the
        names in the original order, so a plain unsharded optimizer over the same groups can
        ``load_state_dict`` it directly. Every rank of the group must call this.

        Raises:
            ValueError: If some buckets reduce over groups of their own (expert
                parallelism); save those shard by shard (DCP checkpoints) instead.
        """
        scheme = self.layout.scheme
        if any(bucket.scheme is not scheme for bucket in self.layout.buckets):
            raise ValueError(
                "The whole optimizer state cannot be gathered onto one rank when some"
                " parameters are reduced over groups of their own (expert parallelism);"
                " save a sharded checkpoint (a DCP directory) instead."
            )
        meta = self._state_meta(optimizer)
        state = {name: dict(m.scalars) for name, m in meta.items()}
        no_state = _StateMeta()
        for bucket in self.layout.buckets:
            keys = {kd for entry in bucket.entries for kd in meta.get(entry.name, no_state).sharded}
            for key, dtype in sorted(keys, key=str):
                full = scheme.gather_to_root(self._owned_state(optimizer, bucket, key, dtype))
                for entry in bucket.entries if full is not None else ():
                    if (key, dtype) in meta.get(entry.name, no_state).sharded:
                        piece = full[entry.offset : entry.offset + entry.numel]
                        # On the host: the whole state would not fit beside rank 0's own
                        # on its device; one bucket's worth at a time does.
                        whole = piece.view_as(local_tensor(entry.param))
                        state[entry.name][key] = whole.to("cpu", copy=True)
        if scheme.rank != 0:
            return {}
        groups = [
            {**{k: v for k, v in group.items() if k != "params"}, "params": names}
            for group, names in zip(
                optimizer.param_groups, self.group_names[optimizer], strict=True
            )
        ]
        return {"state": state, "param_groups": groups}

    def _state_meta(self, optimizer: Optimizer) -> dict[str, _StateMeta]:
        """Per parameter name: its scalar state and the keys of its elementwise state.

        Exchanged between ranks so all of them join the same collectives, even for buckets
        whose owned slice holds no state.
        """
        local = {}
        for shard, values in optimizer.state.items():
            entry = self.layout.by_shard[shard]
            local[entry.name] = _StateMeta.of(values, shard.numel())
        everyone: list[dict[str, _StateMeta]] = [{} for _ in range(self.layout.scheme.world_size)]
        dist.all_gather_object(everyone, local, group=self.process_group)
        merged: dict[str, _StateMeta] = {}
        for rank_meta in everyone:
            for name, meta in rank_meta.items():
                merged.setdefault(name, _StateMeta(meta.scalars)).sharded.update(meta.sharded)
        return merged

    def _owned_state(
        self, optimizer: Optimizer, bucket: Bucket, key: str, dtype: torch.dtype
    ) -> Tensor:
        """This rank's owned range of a bucket, filled with state ``key`` where it exists."""
        lo, hi = bucket.owned
        owned = torch.zeros(hi - lo, dtype=dtype, device=bucket.params.device)
        for entry in bucket.entries:
            value = (
                optimizer.state.get(entry.shard, {}).get(key) if entry.shard is not None else None
            )
            if value is not None:
                start = entry.shard_offset - lo
                owned[start : start + value.numel()] = value
        return owned

    def load(self, optimizer: Optimizer, state_dict: dict[str, Any]) -> None:
        """Load a full state (from :meth:`gather` or a plain torch optimizer over the same
        groups), keeping only this rank's slices: any rank count can resume it.
        """
        _check_groups(state_dict["param_groups"], optimizer)
        full_state = _state_by_name(state_dict, self.group_names[optimizer])
        shard_states = {}
        for group in optimizer.param_groups:
            for shard in group["params"]:
                entry = self.layout.by_shard[shard]
                shard_states[shard] = {
                    key: entry.shard_of(v) if is_elementwise(v, entry.numel) else v
                    for key, v in full_state.get(entry.name, {}).items()
                }
        self.load_shards(optimizer, shard_states, state_dict["param_groups"])

    def owned(self, optimizer: Optimizer) -> list[OwnedSlice]:
        """The flat ranges of parameters that ``optimizer`` steps on this rank, in order."""
        slices = []
        for group in optimizer.param_groups:
            for shard in group["params"]:
                entry = self.layout.by_shard[shard]
                start = entry.shard_offset - entry.offset
                slices.append(OwnedSlice(entry.name, entry.param, start, shard))
        return slices

    def load_shards(
        self,
        optimizer: Optimizer,
        shard_states: dict[Tensor, dict[str, Any]],
        saved_groups: list[dict[str, Any]],
    ) -> None:
        """Give ``optimizer`` the state of each of its shard parameters (elementwise values
        already shard-sized) and the saved groups' hyperparameters."""
        _check_groups(saved_groups, optimizer)
        shards = [shard for group in optimizer.param_groups for shard in group["params"]]
        state = {i: shard_states[shard] for i, shard in enumerate(shards) if shard_states[shard]}
        groups, start = [], 0
        for group, saved in zip(optimizer.param_groups, saved_groups, strict=True):
            hyper = {k: v for k, v in saved.items() if k not in ("params", "param_names")}
            groups.append({**hyper, "params": list(range(start, start + len(group["params"])))})
            start += len(group["params"])
        optimizer.load_state_dict({"state": state, "param_groups": groups})

    def parameter_of(self, shard: Tensor) -> Tensor:
        """The model parameter that ``shard`` (a parameter the optimizer steps) is a slice of."""
        return self.layout.by_shard[shard].param

    def parameter_names(self, optimizer: Optimizer) -> list[str]:
        """Names of the parameters ``optimizer`` steps, group by group (after :meth:`attach`)."""
        return [name for group in self.group_names[optimizer] for name in group]

    def gradient_layout(self, parameters: Iterable[Tensor]) -> GradientLayout:
        """How the gradients of ``parameters`` (shard parameters) lie across the group:
        replicated on every rank of their bucket's group at stage 0, disjoint shards
        otherwise."""
        pieces = [
            GradientPiece(p.grad, _replicas(self.layout.by_shard[p].bucket.scheme))
            for p in parameters
            if p.grad is not None
        ]
        group = self.process_group or dist.group.WORLD
        device = self.layout.buckets[0].params.device
        return GradientLayout(group=group, pieces=pieces, device=device)


@dataclass(frozen=True)
class OwnedSlice:
    """A flat range of one parameter's local tensor that this rank's optimizer steps."""

    name: str
    """The parameter's name (the checkpoint key)."""
    param: Tensor
    """The model parameter (a DTensor under tensor parallelism)."""
    start: int
    """Where the range starts in the parameter's local tensor, flattened."""
    shard: Tensor
    """The 1-D parameter the optimizer steps: the range itself."""


def _replicas(scheme: AllReduce) -> int:
    """Ranks holding the same reduced gradient slice: the group at stage 0, else one."""
    return scheme.world_size if scheme.replicated else 1


def _check_groups(saved_groups: list[dict[str, Any]], optimizer: Optimizer) -> None:
    if len(saved_groups) != len(optimizer.param_groups):
        raise ValueError(
            f"The checkpoint has {len(saved_groups)} optimizer param groups, the optimizer"
            f" has {len(optimizer.param_groups)}; build the optimizer with the same groups"
            " to resume."
        )


def _state_by_name(state_dict: dict[str, Any], names: list[list[str]]) -> dict[str, Any]:
    """``state_dict["state"]`` keyed by parameter name.

    Checkpoints written by the engine are already keyed by name; a plain torch optimizer's
    are keyed by position in its groups, which the original group order maps to names.
    """
    keys = [key for group in state_dict["param_groups"] for key in group["params"]]
    flat_names = [name for group in names for name in group]
    if all(isinstance(key, str) for key in keys):
        return dict(state_dict["state"])
    if len(keys) != len(flat_names):
        raise ValueError(
            f"The checkpoint's optimizer steps {len(keys)} parameters, this one"
            f" {len(flat_names)}; they must match to resume."
        )
    rename = dict(zip(keys, flat_names, strict=True))
    return {rename[key]: value for key, value in state_dict["state"].items()}
