"""LightningModule hooks that make checkpoints portable across layouts and safe to read.

Torch keys an optimizer's state by the position of each parameter in its groups, and a
position means nothing under another layout (a pipeline stage's optimizer holds other
parameters than one process's). :class:`PortableCheckpoints` names the positions when it
saves, and turns name-keyed state (a sharded checkpoint read in one process) back into
positions when it loads. It also stores hyperparameters as plain data, so checkpoints
load with ``weights_only=True``.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from torch import nn
from torch.optim import Optimizer

from plugintrain.checkpoints.files import OPTIMIZER_NAMES_KEY, SOURCE_KEY, shape_mismatch


def group_names(module: nn.Module, optimizer: Optimizer) -> list[list[str]]:
    """The names of ``optimizer``'s parameters in ``module``, group by group, in order."""
    by_id = {id(param): name for name, param in module.named_parameters()}
    return [[by_id[id(param)] for param in group["params"]] for group in optimizer.param_groups]


def is_position_keyed(state: dict[str, Any]) -> bool:
    """Whether an optimizer state dict refers to its parameters by position (torch's own,
    whose groups list every parameter's position; a name-keyed state of a stateless
    optimizer, SGD without momentum, lists none)."""
    keys = [key for group in state.get("param_groups", []) for key in group.get("params", [])]
    return (
        bool(keys)
        and all(isinstance(key, int) for key in keys)
        and all(isinstance(key, int) for key in state.get("state", {}))
    )


def to_positions(state: dict[str, Any], names: list[list[str]]) -> dict[str, Any]:
    """Name-keyed optimizer state as torch's position-keyed state for groups of ``names``."""
    groups, by_name, start = [], state["state"], 0
    position_state = {}
    for saved, group in zip(state["param_groups"], names, strict=True):
        hyper = {k: v for k, v in saved.items() if k not in ("params", "param_names")}
        groups.append({**hyper, "params": list(range(start, start + len(group)))})
        for position, name in enumerate(group, start):
            if name in by_name:
                position_state[position] = by_name[name]
        start += len(group)
    return {"state": position_state, "param_groups": groups}


def plain_hyperparameters(hparams: Any) -> dict[str, Any]:
    """Hyperparameters with dataclass values (a model config object) as their fields."""
    return {
        key: dataclasses.asdict(value)
        if dataclasses.is_dataclass(value) and not isinstance(value, type)
        else value
        for key, value in dict(hparams).items()
    }


def check_weight_shapes(checkpoint: dict[str, Any], model_state: dict[str, Any]) -> None:
    """The checkpoint's weights have the model's shapes, or one line says which does not.

    Raises:
        ValueError: Naming the checkpoint (``SOURCE_KEY``), the tensor and both shapes;
            torch's own error lists every mismatch over dozens of lines.
    """
    where = checkpoint.get(SOURCE_KEY, "the checkpoint")
    for name, saved in (checkpoint.get("state_dict") or {}).items():
        tensor = model_state.get(name)
        if tensor is not None and tuple(saved.shape) != tuple(tensor.shape):
            raise shape_mismatch(where, name, saved.shape, tensor.shape)


class PortableCheckpoints:
    """Mixin for LightningModules: checkpoints that resume under any layout.

    Saving adds ``optimizer_param_names`` when the optimizers' state is keyed by position
    (single process, Lightning's ``ddp``), and keeps hyperparameters as plain data.
    Loading name-keyed optimizer state (a sharded checkpoint read in one process) converts
    it to positions in ``on_fit_start``: the optimizers exist by then, and Lightning loads
    their state right after, from the same list.
    """

    _name_keyed_states: list[dict[str, Any]] | None = None

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        if checkpoint.get("hyper_parameters"):
            checkpoint["hyper_parameters"] = plain_hyperparameters(checkpoint["hyper_parameters"])
        states = checkpoint.get("optimizer_states") or []
        if states and all(is_position_keyed(state) for state in states):
            optimizers = self.trainer.optimizers  # type: ignore[attr-defined]
            checkpoint[OPTIMIZER_NAMES_KEY] = [group_names(self, opt) for opt in optimizers]  # type: ignore[arg-type]

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        check_weight_shapes(checkpoint, self.state_dict())  # type: ignore[attr-defined]
        states = checkpoint.get("optimizer_states") or []
        if states and not all(is_position_keyed(state) for state in states):
            self._name_keyed_states = states  # the list Lightning reads the states from

    def on_fit_start(self) -> None:
        states, self._name_keyed_states = self._name_keyed_states, None
        for i, optimizer in enumerate(self.trainer.optimizers if states else []):  # type: ignore[attr-defined]
            if not is_position_keyed(states[i]):  # type: ignore[index]
                states[i] = to_positions(states[i], group_names(self, optimizer))  # type: ignore[index,arg-type]
