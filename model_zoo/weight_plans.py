"""Weight adapters as data: how each of one model's tensors is made from another's.

A :class:`Rule` names the tensors it reads and the function that builds one tensor from
them, so a converter can stream a checkpoint one output tensor at a time (reading only
that tensor's sources) instead of converting whole state dicts. Each family module
(``gpt2.py``, ``llama3.py``) gives two plans per foreign format: ``ours <- theirs`` to
import and ``theirs <- ours`` to export, plus the mapping between its config and theirs.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass(frozen=True)
class Rule:
    """One output tensor: ``build(*[read(name) for name in sources])``."""

    sources: tuple[str, ...]
    """Names of the tensors it is built from, in the order ``build`` takes them."""
    build: Callable[..., Tensor]
    """Pure function of the source tensors (no copies beyond what the layout change needs)."""
    layout: str = "custom"
    """How the output lies in its sources, for readers that read a piece of it alone:
    ``"same"`` (the one source as it is), ``"stack"`` (source ``i`` is row ``i``: a box of
    the output reads only the sources its rows cover), or ``"custom"`` (build it whole)."""


Plan = dict[str, Rule]
"""Output tensor name -> how to build it."""


def same(name: str) -> Rule:
    """The tensor ``name`` as it is."""
    return Rule((name,), _identity, "same")


def _identity(tensor: Tensor) -> Tensor:
    return tensor


def stacked(names: Sequence[str]) -> Rule:
    """``names`` stacked along a new leading dimension (one expert per row)."""
    return Rule(tuple(names), _stack, "stack")


def _stack(*tensors: Tensor) -> Tensor:
    return torch.stack(tensors)


def transposed(name: str) -> Rule:
    """The matrix ``name`` transposed (GPT-2's ``Conv1D`` stores ``(in, out)``)."""
    return Rule((name,), lambda t: t.t())


def chunk_of(name: str, index: int, chunks: int, dim: int = 0, transpose: bool = False) -> Rule:
    """Piece ``index`` of ``chunks`` equal pieces of ``name`` along ``dim`` (after a
    transpose when ``transpose``): one of a fused query/key/value projection."""

    def build(t: Tensor) -> Tensor:
        return (t.t() if transpose else t).chunk(chunks, dim=dim)[index]

    return Rule((name,), build)


def concatenated(names: Sequence[str], dim: int = 0, transpose: bool = False) -> Rule:
    """``names`` concatenated along ``dim`` (then transposed when ``transpose``)."""

    def build(*tensors: Tensor) -> Tensor:
        joined = torch.cat(tensors, dim=dim)
        return joined.t() if transpose else joined

    return Rule(tuple(names), build)


def renamed(mapping: dict[str, str]) -> Plan:
    """A plan that only renames: output name -> source name."""
    return {out: same(src) for out, src in mapping.items()}


def apply_plan(plan: Plan, tensors: dict[str, Tensor]) -> dict[str, Tensor]:
    """Every output of ``plan`` built from the whole state dict ``tensors`` (small models and
    tests; converters stream one output at a time instead)."""
    return {name: rule.build(*(tensors[s] for s in rule.sources)) for name, rule in plan.items()}
