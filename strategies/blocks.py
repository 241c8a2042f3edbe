"""What a strategy does to each transformer block besides sharding it: recompute, compile.

A strategy finds a model's transformer blocks by name (modules called ``layers.<i>``,
torchtitan's layout, which every zoo family follows) and, in torchtitan's order, after
the pipeline split and tensor parallelism and before data parallelism (FSDP2 or the
gradient engine):

1. **Activation recomputation** (:class:`BlockOptions.activation_checkpointing`):

   - ``full`` keeps only each block's input for backward and reruns the whole block
     during backward. ``every_n_layers=n`` applies it to blocks ``0, n, 2n, ...`` (by
     full-model index, so the choice does not depend on the pipeline split).
   - ``selective`` reruns only the cheap operators: norms, RoPE, the SwiGLU product,
     residual adds and casts. It keeps the outputs of the matmuls, of fused attention,
     of the collectives and of the MoE routers' top-k (so a recomputed forward routes
     tokens exactly as the first one did). This is torchtitan's op-level policy with
     every matmul saved.
     When attention runs unfused (the math kernel: with an attention mask or dropout),
     its score and softmax operators are not on the save list. They are recomputed,
     as Korthikanti et al. 2022 ("Reducing Activation Recomputation in Large Transformer
     Models", section 5) recompute the attention core.

   Recomputation is torch's non-reentrant ``checkpoint``, which also replays the
   dropout RNG state. It only runs while autograd records (not in validation or
   generation).
2. **``compile``**: ``torch.compile`` on each block (``Module.compile``, per block as
   torchtitan does), so blocks with equal shapes share one compiled graph. It captures
   the recomputation around the block, and the data-parallel hooks stay outside it. On
   CPU inductor generates C++ (it needs a C++ compiler). The first step compiles, which
   takes seconds to a minute.

Neither changes a parameter's name. Recomputation swaps the block's class for a subclass
whose ``forward`` checkpoints the original one, the same technique FSDP2's
``fully_shard`` uses. Plans, checkpoints, LoRA and seeded initialization therefore see
the same paths as without it.
"""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import (
    CheckpointPolicy,
    checkpoint,
    create_selective_checkpoint_contexts,
)

RECOMPUTE_MODES = ("none", "full", "selective")
"""The values of ``activation_checkpointing``."""

_BLOCK = re.compile(r"(?:.*\.)?layers\.(\d+)")
"""A transformer block: ``layers.<index>`` anywhere in the module tree."""

_aten = torch.ops.aten
_c10d = torch.ops._c10d_functional
_ATTENTION = (
    _aten._scaled_dot_product_flash_attention.default,
    _aten._scaled_dot_product_flash_attention_for_cpu.default,
    _aten._scaled_dot_product_efficient_attention.default,
    _aten._scaled_dot_product_cudnn_attention.default,
)
# Outputs kept by selective recomputation: matmuls (Linear layers decompose to mm/addmm,
# the grouped experts of a mixture of experts run as bmm), fused attention kernels (output
# and log-sum-exp), tensor parallelism's functional collectives, so that backward reruns
# none of them (context parallelism's K/V all-gather, inside an autograd Function, does
# run again, as the estimate counts), and the
# routers' top-k choice, so that a recomputed forward routes every token to the experts
# its first forward chose (its outputs are small: two (tokens, k) tensors).
_SAVED_OPS = frozenset(
    {
        _aten.mm.default,
        _aten.addmm.default,
        _aten.bmm.default,
        _aten.topk.default,
        *_ATTENTION,
        _c10d.all_gather_into_tensor.default,
        _c10d.reduce_scatter_tensor.default,
        _c10d.all_reduce.default,
        _c10d.all_to_all_single.default,
    }
)
# Where each fused attention kernel takes its dropout probability.
_DROPOUT_ARG = {op: [a.name for a in op._schema.arguments].index("dropout_p") for op in _ATTENTION}


def _selective_policy(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
    """Keep the outputs of ``_SAVED_OPS``, rerun everything else.

    A fused attention kernel that draws dropout masks is rerun too: recomputation replays
    the random stream from the block's start, so every operator that draws from it must run
    again, in order, or the ones after it (the residual dropout) would draw other masks.
    """
    if op in _DROPOUT_ARG:
        index = _DROPOUT_ARG[op]
        dropout = kwargs.get("dropout_p", args[index] if len(args) > index else 0.0)
        if dropout > 0:
            return CheckpointPolicy.PREFER_RECOMPUTE
    return CheckpointPolicy.MUST_SAVE if op in _SAVED_OPS else CheckpointPolicy.PREFER_RECOMPUTE


def _selective_context() -> Any:
    return create_selective_checkpoint_contexts(_selective_policy)


def transformer_blocks(module: nn.Module) -> list[tuple[int, nn.Module]]:
    """``(full-model index, block)`` of every module named ``layers.<index>``, in order."""
    blocks = []
    for name, child in module.named_modules():
        match = _BLOCK.fullmatch(name)
        if match:
            blocks.append((int(match.group(1)), child))
    return blocks


class _Recomputed:
    """Mixin placed before a block's class: its ``forward`` runs under ``checkpoint``."""

    _recompute: str  # "full" or "selective"

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        inner = super().forward  # type: ignore[misc]
        if not torch.is_grad_enabled():
            return inner(*args, **kwargs)
        context = {"context_fn": _selective_context} if self._recompute == "selective" else {}
        return checkpoint(inner, *args, use_reentrant=False, **context, **kwargs)


@functools.cache
def _recomputed_class(cls: type) -> type:
    return type(f"Recomputed{cls.__name__}", (_Recomputed, cls), {})


def recompute(block: nn.Module, mode: str) -> None:
    """Make ``block`` recompute its activations in backward (``full`` or ``selective``),
    in place; its parameters keep their names."""
    if mode not in ("full", "selective"):
        raise ValueError(f"recompute mode {mode!r} is not 'full' or 'selective'.")
    if not isinstance(block, _Recomputed):
        block.__class__ = _recomputed_class(type(block))
    block._recompute = mode


def is_recomputed(block: nn.Module) -> str | None:
    """The recomputation mode of ``block``, or None."""
    return block._recompute if isinstance(block, _Recomputed) else None


def _builds_in_configure_model(module: nn.Module) -> bool:
    """Whether ``module`` is a LightningModule that overrides ``configure_model``."""
    from lightning.pytorch import LightningModule  # only when applied: estimates need none

    return (
        isinstance(module, LightningModule)
        and type(module).configure_model is not LightningModule.configure_model
    )


@dataclass(frozen=True)
class BlockOptions:
    """Activation recomputation and ``torch.compile`` for a strategy's transformer blocks.

    Args:
        activation_checkpointing: ``none``, ``full`` (rerun whole blocks in backward) or
            ``selective`` (rerun norms and element-wise work, keep matmul and attention
            outputs).
        every_n_layers: With ``full``, recompute blocks ``0, n, 2n, ...`` only (1: every
            block), trading memory for speed.
        compile: ``torch.compile`` each block.
        strategy_name: Who asks, for error messages.
    """

    activation_checkpointing: str = "none"
    every_n_layers: int = 1
    compile: bool = False
    strategy_name: str = "the strategy"

    def __post_init__(self) -> None:
        mode = self.activation_checkpointing
        if mode not in RECOMPUTE_MODES:
            raise ValueError(
                f"{self.strategy_name}: activation_checkpointing={mode!r} is not one of"
                f" {list(RECOMPUTE_MODES)}; use 'full' or 'selective' to save memory, 'none'"
                " to keep every activation."
            )
        n = self.every_n_layers
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise ValueError(
                f"{self.strategy_name}: every_n_layers={n!r} must be a positive integer;"
                " use 1 to recompute every block, 2 for every other one."
            )
        if n != 1 and mode != "full":
            raise ValueError(
                f"{self.strategy_name}: every_n_layers={n} needs"
                f" activation_checkpointing='full', got {mode!r}; set"
                " activation_checkpointing: full or every_n_layers: 1."
            )
        if not isinstance(self.compile, bool):
            raise ValueError(
                f"{self.strategy_name}: compile={self.compile!r} must be true or false."
            )

    def check_tensor_parallel(self, tensor_parallel: int, sequence_parallel: bool) -> None:
        """Raise if ``compile`` meets tensor parallelism without sequence parallelism.

        torch 2.13's compiled block backward hands DTensor's redistribution of a replicated
        block input a plain tensor ("'Tensor' object has no attribute '_local_tensor'");
        with SP the block input is sequence-sharded and the backward is right.
        """
        if self.compile and tensor_parallel > 1 and not sequence_parallel:
            raise ValueError(
                f"{self.strategy_name}: compile=True with tensor_parallel={tensor_parallel}"
                " needs sequence_parallel=True (torch 2.13 cannot compile the backward of"
                " tensor-parallel blocks whose input is replicated); set sequence_parallel:"
                " true or compile: false."
            )

    @property
    def enabled(self) -> bool:
        """Whether these options change anything."""
        return self.activation_checkpointing != "none" or self.compile

    def check(self, module: nn.Module, built: bool = False) -> None:
        """Raise if the options are on but ``module`` has no transformer blocks to apply them
        to; needs no process group, so it runs before any process is launched.

        Args:
            module: The LightningModule (or model).
            built: Whether ``configure_model`` has run. Before it, a module that builds its
                model there is given the benefit of the doubt.
        """
        if not self.enabled or transformer_blocks(module):
            return
        if not built and _builds_in_configure_model(module):
            return
        asked = []
        if self.activation_checkpointing != "none":
            asked.append(
                (
                    f"activation_checkpointing={self.activation_checkpointing!r}",
                    "activation_checkpointing: none",
                )
            )
        if self.compile:
            asked.append(("compile=True", "compile: false"))
        given = " and ".join(option for option, _ in asked)
        unset = ", ".join(fix for _, fix in asked)
        raise ValueError(
            f"{self.strategy_name}: {given} applies to transformer blocks (modules named"
            f" `layers.<i>`), but {type(module).__name__} has none; set {unset}."
        )

    def apply(self, module: nn.Module) -> None:
        """Recompute, then compile, ``module``'s transformer blocks in place (after tensor
        parallelism, before data parallelism). A pipeline stage may hold none: call
        :meth:`check` on the whole model first."""
        for index, block in transformer_blocks(module):
            mode = self.activation_checkpointing
            if mode == "full" and index % self.every_n_layers:
                continue
            if mode != "none":
                recompute(block, mode)
        if self.compile:
            for _, block in transformer_blocks(module):
                block.compile()
