"""Parameters tied across pipeline stages (an embedding tied to the LM head).

In one process a tied head is the embedding's ``Parameter``; on a pipeline the first
stage holds the embedding and the last the head, two copies that must stay equal (as in
nanotron's ``parallel/tied_parameters.py`` and Megatron's embedding group). Everything
about them lives here:

- which names are tied (the model declares them: ``StagedModel.tied_parameters()``),
  and each name's alias, so a checkpoint saved by either layout finds the other's state;
- the process groups joining each (dp, tp) position's first and last pipeline stage;
- summing the two copies' gradients before the optimizer step, so both take the same
  step from the same (whole-model) gradient;
- the copies this rank holds, which the global gradient norm counts once per stage.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh

from plugintrain.core.contracts import StagedModel
from plugintrain.strategies.grad_engine import GradientEngine


class TiedParameters:
    """The tied parameter pairs of one model, under names relative to the LightningModule.

    Args:
        pairs: ``(name, name)`` pairs of one parameter, e.g. ``("model.tok_embeddings.weight",
            "model.output.weight")``.
    """

    def __init__(self, pairs: Iterable[tuple[str, str]] = ()) -> None:
        self.pairs = list(pairs)
        self.group: dist.ProcessGroup | None = None
        self.held: list[Tensor] = []

    @classmethod
    def of(cls, module: nn.Module) -> TiedParameters:
        """The pairs that ``module.model`` (a :class:`StagedModel`) declares; none otherwise."""
        model = getattr(module, "model", None)
        if not isinstance(model, StagedModel):
            return cls()
        return cls((f"model.{a}", f"model.{b}") for a, b in model.tied_parameters())

    def aliases(self, name: str) -> tuple[str, ...]:
        """The other names of the parameter called ``name`` (none if it is not tied)."""
        return tuple(b if name == a else a for a, b in self.pairs if name in (a, b))

    def join_stages(self, module: nn.Module, mesh: DeviceMesh, global_rank: int) -> None:
        """Group each (dp, tp) position's first and last stage and note the copies held here.

        Every rank must call this (``new_group`` is collective over the world).

        Args:
            module: The LightningModule after pipeline splitting.
            mesh: The ``("pp", "dp", "tp")`` mesh (``dp``/``tp`` may be of size 1).
            global_rank: This process's rank.
        """
        self.group, self.held = None, []
        if not self.pairs:
            return
        ranks = mesh.mesh.reshape(mesh.size(0), -1)  # (pp, dp * tp) global ranks
        for position in range(ranks.size(1)):
            ends = [int(ranks[0, position]), int(ranks[-1, position])]
            group = dist.new_group(ends)
            if global_rank in ends:
                self.group = group
        params = dict(module.named_parameters())
        # A frozen tied weight (LoRA's base) has no gradient to sum.
        held = (params[n] for pair in self.pairs for n in pair if n in params)
        self.held = [p for p in held if p.requires_grad]

    def sum_gradients(self, engine: GradientEngine) -> None:
        """Sum each held copy's accumulated gradient with the other stage's copy.

        Runs before the data-parallel reduction, which it is folded into.
        """
        for param in self.held:
            dist.all_reduce(engine.accumulated_grad(param), group=self.group)
