"""Binds one :class:`~plugintrain.strategies.GradientEngine` to a Lightning strategy.

The engine knows nothing of Lightning; each strategy that drives it (``ZeroStrategy`` and
``HybridParallelStrategy``) holds one
:class:`EngineBinding` and forwards its hooks to it: attaching the optimizers, skipping
the reduction under gradient accumulation (``no_sync``), saving and loading checkpoints
shard by shard (:mod:`~plugintrain.checkpoints.dcp`), refusing clipping that would
see only a shard, and removing the hooks at teardown. Neither strategy imports the other.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.core.optimizer import LightningOptimizer
from lightning.pytorch.plugins.precision import Precision
from torch import Tensor, nn
from torch.optim import Optimizer

from plugintrain.checkpoints.dcp import DEFAULT_FILE_BYTES, check_local_path, save_directory
from plugintrain.strategies.engine_checkpoint import EngineCheckpoint
from plugintrain.strategies.grad_engine import GradientEngine
from plugintrain.strategies.tied import TiedParameters


def unwrap_optimizer(optimizer: Optimizer) -> Optimizer:
    """The torch optimizer inside Lightning's ``LightningOptimizer`` wrapper."""
    return optimizer.optimizer if isinstance(optimizer, LightningOptimizer) else optimizer


class EngineBinding:
    """One strategy's gradient engine and the Lightning hooks that drive it.

    Args:
        owner: The strategy's class name, for error messages.
    """

    def __init__(self, owner: str) -> None:
        self.owner = owner
        self._engine: GradientEngine | None = None
        self._checkpoint: EngineCheckpoint | None = None
        self.accumulating = False
        """Whether a backward under Lightning's gradient accumulation is running."""

    @property
    def bound(self) -> bool:
        """Whether an engine is installed (while fitting, after the strategy's setup)."""
        return self._engine is not None

    @property
    def engine(self) -> GradientEngine:
        """The engine; raises outside fitting."""
        if self._engine is None:
            raise RuntimeError(f"{self.owner}'s gradient engine exists only while fitting.")
        return self._engine

    def gradient_buffers(self, model: nn.Module) -> list[Tensor]:
        """The engine's gradient buckets or shards; ``model``'s ``.grad`` without an engine
        (FSDP2's sharded ones, or outside fitting)."""
        if self._engine is not None:
            return self._engine.gradient_buffers()
        return [p.grad for p in model.parameters() if p.grad is not None]

    def check_clipping(self, trainer: pl.Trainer, precision_plugin: Precision) -> None:
        """Refuse gradient clipping by a plugin that would see only this rank's shard."""
        # Lightning's own plugins clip by the norm of the local shard only: wrong under ZeRO.
        if trainer.gradient_clip_val and not hasattr(precision_plugin, "gradient_layout"):
            raise ValueError(
                f"Gradient clipping (gradient_clip_val={trainer.gradient_clip_val}) with"
                f" {self.owner} needs a layout-aware precision plugin, got"
                f" {type(precision_plugin).__name__}. Pass e.g."
                " `plugins=[plugintrain.precision_plugins.FP32Precision()]`."
            )

    def install(self, engine: GradientEngine, tied: TiedParameters | None = None) -> None:
        """Drive ``engine`` from now on; ``tied`` names the parameters tied across stages."""
        self._engine = engine
        self._checkpoint = EngineCheckpoint(engine, tied or TiedParameters())

    def bind(
        self,
        engine: GradientEngine | None,
        tied: TiedParameters,
        trainer: pl.Trainer,
        precision_plugin: Precision,
        optimizers: Iterable[Optimizer],
    ) -> None:
        """Drive ``engine`` with ``optimizers`` attached, after refusing clipping that would
        see only a shard (all at once, for a strategy that builds the engine after the
        optimizers). None binds nothing: FSDP2 (ZeRO-3) reduces, and its DTensor gradients
        know their layout."""
        if engine is None:
            return
        self.check_clipping(trainer, precision_plugin)
        self.install(engine, tied)
        self.attach(optimizers)

    def attach(self, optimizers: Iterable[Optimizer]) -> None:
        """Hand the engine every optimizer (re-pointed at this rank's shards), if installed."""
        if self._engine is not None:
            for optimizer in optimizers:
                self._engine.attach(unwrap_optimizer(optimizer))

    @contextmanager
    def no_sync(self) -> Iterator[None]:
        """Accumulate gradients without reducing them (Lightning's ``block_backward_sync``)."""
        previous, self.accumulating = self.accumulating, True
        try:
            if self._engine is None:
                yield
            else:
                with self._engine.no_sync():
                    yield
        finally:
            self.accumulating = previous

    def optimizer_state(self, optimizer: Optimizer) -> dict[str, Any]:
        """This rank's share of ``optimizer``'s state, for a sharded (DCP) checkpoint."""
        assert self._checkpoint is not None, "no engine installed"
        return self._checkpoint.optimizer_state(unwrap_optimizer(optimizer))

    def save(
        self, checkpoint: dict[str, Any], path: Any, storage_options: Any, write_metadata: bool
    ) -> None:
        """Write Lightning's checkpoint dict as a DCP directory at ``path`` (the same on every
        rank), every rank its shards, in files of at most one bucket."""
        if storage_options is not None:
            raise TypeError(f"{self.owner} does not take `storage_options`.")
        check_local_path(path, self.owner)
        # Without an engine (FSDP2, or saving outside fit): DCP's states, default file size.
        file_bytes = self.engine.bucket_bytes if self.bound else DEFAULT_FILE_BYTES
        save_directory(checkpoint, Path(path), write_metadata, file_bytes)

    def load(self, path: Path, model: nn.Module, optimizers: Iterable[Optimizer]) -> dict[str, Any]:
        """Load weights and optimizer shards from the checkpoint at ``path`` (a DCP directory
        of any layout, or one file); returns the rest of the checkpoint."""
        assert self._checkpoint is not None, "no engine installed"
        optimizers = [unwrap_optimizer(optimizer) for optimizer in optimizers]
        return self._checkpoint.load(path, model, optimizers)

    def load_optimizer_states(
        self, optimizers: Iterable[Optimizer], states: Iterable[Mapping[str, Any]]
    ) -> None:
        """Load whole states (a single-file checkpoint from any rank count, or a plain
        optimizer's), keeping this rank's slices."""
        for optimizer, state in zip(optimizers, states, strict=True):
            self.engine.load_optimizer_state_dict(unwrap_optimizer(optimizer), dict(state))

    def teardown(self) -> None:
        """Remove the engine's hooks.

        The engine itself stays, so ``trainer.save_checkpoint`` after ``fit`` still saves
        the optimizer shards it owns.
        """
        if self._engine is not None:
            self._engine.remove()
