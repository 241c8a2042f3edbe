"""PrecisionCheck: per-module statistics of activations and gradients, for run-to-run diffs.

For the chosen modules and steps it records each forward output, the gradient flowing
back into that output, and the gradients of the module's own parameters: dtype, shape,
mean, std, abs-max, NaN/Inf counts and a fingerprint of the bytes, all computed on the
tensor's device (only scalars reach the host). DTensors are gathered to the full logical
tensor first, so runs under different parallel layouts write comparable files.
``plugintrain compare`` reads them.

Files: ``<dirpath>/step_<step>/rank_<rank>.json``, one per rank per recorded step.
"""

from __future__ import annotations

import fnmatch
import json
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback
from torch import Tensor, nn
from torch.distributed.tensor import DTensor
from torch.utils.hooks import RemovableHandle
from typing_extensions import override


def _full(tensor: Tensor) -> Tensor:
    # A collective for DTensors: every rank of the mesh records the same tensors in the
    # same order, because they run the same forward and backward.
    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor


def tensor_stats(tensor: Tensor) -> dict[str, Any]:
    """Statistics of the full logical tensor (DTensor shards are gathered first).

    Computed where the tensor lives, in fp64 one chunk at a time (a GPU tensor never goes
    to the host, nor exists whole in fp64); only the scalars come back, in one copy.

    Returns:
        ``dtype``, ``shape``, ``mean``, ``std`` (population), ``absmax``, ``nan``, ``inf``
        (element counts) and ``hash`` (16 hex digits of a fingerprint of the raw bytes;
        see :func:`_fingerprint`).
    """
    full = _full(tensor.detach()).contiguous().reshape(-1)
    info = {"dtype": str(full.dtype).removeprefix("torch."), "shape": list(tensor.shape)}
    if full.numel() == 0:
        return {**info, "mean": 0.0, "std": 0.0, "absmax": 0.0, "nan": 0, "inf": 0, "hash": "0"}
    chunks = full.split(_CHUNK)
    total, absmax, nan, inf = (torch.zeros((), dtype=torch.float64, device=full.device),) * 4
    for chunk in chunks:
        values = chunk.double()
        total = total + values.sum()
        absmax = torch.maximum(absmax, values.abs().max())  # NaN propagates, as max does
        nan, inf = nan + values.isnan().sum(), inf + values.isinf().sum()
    mean = total / full.numel()
    squares = sum(((chunk.double() - mean) ** 2).sum() for chunk in chunks)  # two passes:
    std = (squares / full.numel()).sqrt()  # no cancellation for a large mean
    scalars = torch.stack([mean, std, absmax, nan, inf, *_fingerprint(full)]).tolist()
    mean, std, absmax, nan, inf, low, high = scalars
    return {
        **info,
        "mean": mean,
        "std": std,
        "absmax": absmax,
        "nan": int(nan),
        "inf": int(inf),
        "hash": f"{int(high):08x}{int(low):08x}",
    }


_CHUNK = 1 << 22
"""Elements per chunk of the statistics and the fingerprint (32 MiB in fp64 or int64)."""
_PRIME = 2**31 - 1
"""A Mersenne prime: products of two residues stay below 2**62, so int64 never overflows
and every device computes the same fingerprint."""


def _fingerprint(flat: Tensor) -> tuple[Tensor, Tensor]:
    """Two 31-bit sums over the bytes of ``flat`` (1-D), computed on its device.

    Each 16-bit word ``w`` at position ``i`` (bytes for odd element sizes) contributes
    ``((w + 1) * k_i mod p)**2 mod p`` with ``k_i`` a nonzero position weight: changing any
    one element changes the sum for sure, moving or changing several collides with
    probability about ``1/p`` per sum. Integer arithmetic, so CPU and CUDA runs of the
    same bytes give the same digits.
    """
    words = flat.view(torch.int16 if flat.element_size() % 2 == 0 else torch.uint8)
    sums = [torch.zeros((), dtype=torch.int64, device=flat.device) for _ in range(2)]
    for start in range(0, words.numel(), _CHUNK):
        word = words[start : start + _CHUNK].long() & 0xFFFF  # (n,) unsigned values
        position = torch.arange(start, start + word.numel(), device=flat.device)
        for k, (a, b) in enumerate(((48271, 11), (69621, 7))):
            weight = (position * a + b) % (_PRIME - 1) + 1  # in [1, p): never cancels a word
            term = (word + 1) * weight % _PRIME
            sums[k] = (sums[k] + (term * term % _PRIME).sum()) % _PRIME
    return sums[0].double(), sums[1].double()


def step_file(dirpath: str | Path, step: int, rank: int) -> Path:
    """Where the records of ``step`` on ``rank`` are written."""
    return Path(dirpath) / f"step_{step:06d}" / f"rank_{rank:05d}.json"


class PrecisionCheck(Callback):
    """Record activation and gradient statistics of chosen modules at chosen steps.

    Args:
        modules: Glob patterns on module paths relative to the LightningModule (``"*"``
            matches every submodule, ``"model.blocks.*.attn"`` one kind).
        steps: Optimizer steps (``trainer.global_step`` at the start of the step) to record;
            None records every step (costly for large models: each record is a gather).
        dirpath: Output folder; None uses ``<trainer.log_dir>/precision_check``.
        record_grads: Also record output gradients and parameter gradients.
    """

    def __init__(
        self,
        modules: list[str] | None = None,
        steps: list[int] | None = None,
        dirpath: str | None = None,
        record_grads: bool = True,
    ) -> None:
        self.modules = modules or ["*"]
        self.steps = None if steps is None else set(steps)
        self.dirpath = dirpath
        self.record_grads = record_grads
        self.records: list[dict[str, Any]] = []
        self.losses: list[float] = []
        self._step: int | None = None
        self._grad_scale = 1.0
        self._handles: list[RemovableHandle] = []

    def matched_modules(self, root: nn.Module) -> dict[str, nn.Module]:
        """The submodules of ``root`` whose path matches one of the patterns."""
        return {
            name: module
            for name, module in root.named_modules()
            if name and any(fnmatch.fnmatchcase(name, pattern) for pattern in self.modules)
        }

    def attach(self, root: nn.Module) -> None:
        """Register forward hooks on the matched modules of ``root``."""
        for name, module in self.matched_modules(root).items():
            self._handles.append(module.register_forward_hook(self._forward_hook(name)))

    def detach(self) -> None:
        """Remove every hook :meth:`attach` registered."""
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    def start_step(self, step: int, grad_scale: float = 1.0) -> None:
        """Record from now on, as ``step``; ``grad_scale`` is the loss scale to divide out."""
        self._step, self._grad_scale = step, grad_scale
        self.records, self.losses = [], []

    def record(self, name: str, kind: str, tensor: Tensor) -> None:
        """Append the statistics of ``tensor`` as ``name`` (``kind``: output, grad_output, grad)."""
        self.records.append({"name": name, "kind": kind, **tensor_stats(tensor)})

    def record_param_grads(self, root: nn.Module) -> None:
        """Record the gradients of the matched modules' own parameters."""
        for module_name, module in self.matched_modules(root).items():
            for param_name, param in module.named_parameters(recurse=False):
                if param.grad is not None:
                    self.record(f"{module_name}.{param_name}", "grad", param.grad)

    def write(self, dirpath: str | Path, rank: int) -> Path:
        """Write this step's records to its file and stop recording."""
        path = step_file(dirpath, self._step, rank)
        path.parent.mkdir(parents=True, exist_ok=True)
        loss = sum(self.losses) / len(self.losses) if self.losses else None
        payload = {"step": self._step, "rank": rank, "loss": loss, "records": self.records}
        path.write_text(json.dumps(payload, indent=1))
        self._step = None
        return path

    @property
    def recording(self) -> bool:
        """Whether a step is being recorded."""
        return self._step is not None

    def _forward_hook(self, name: str):
        def hook(module: nn.Module, args: Any, output: Any) -> None:
            if not self.recording or not module.training:
                return
            for suffix, tensor in _floating_tensors(output):
                self.record(f"{name}{suffix}", "output", tensor)
                if self.record_grads and tensor.requires_grad:
                    tensor.register_hook(self._grad_hook(f"{name}{suffix}"))

        return hook

    def _grad_hook(self, name: str):
        def hook(grad: Tensor) -> None:
            # Divide out the fp16 loss scale so runs with and without scaling compare.
            self.record(name, "grad_output", grad / self._grad_scale)

        return hook

    def _dirpath(self, trainer: pl.Trainer) -> Path:
        if self.dirpath is not None:
            return Path(self.dirpath)
        return Path(trainer.log_dir or trainer.default_root_dir) / "precision_check"

    @override
    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.attach(pl_module)

    @override
    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        step = trainer.global_step
        if self._step == step or (self.steps is not None and step not in self.steps):
            return  # a later micro-batch of a step being recorded, or a step not chosen
        scaler = getattr(trainer.precision_plugin, "loss_scaler", None)
        self.start_step(step, getattr(scaler, "scale", 1.0))

    @override
    def on_before_optimizer_step(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: Any
    ) -> None:
        if self.recording and self.record_grads:
            self.record_param_grads(pl_module)

    @override
    def on_train_batch_end(
        self,
        trainer: pl.Trainer,
        pl_module: pl.LightningModule,
        outputs: Any,
        batch: Any,
        batch_idx: int,
    ) -> None:
        if not self.recording:
            return
        loss = outputs.get("loss") if isinstance(outputs, dict) else outputs
        if isinstance(loss, Tensor):
            self.losses.append(float(loss.detach().float()))
        if trainer.global_step > self._step:  # the optimizer stepped: the step is complete
            self.write(self._dirpath(trainer), trainer.global_rank)

    @override
    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.detach()


def _floating_tensors(output: Any) -> list[tuple[str, Tensor]]:
    """The floating-point tensors of a module output, with a suffix naming each one."""
    if isinstance(output, Tensor):
        return [("", output)] if output.is_floating_point() else []
    if isinstance(output, (tuple, list)):
        return [
            (f".{i}", item)
            for i, item in enumerate(output)
            if isinstance(item, Tensor) and item.is_floating_point()
        ]
    return []
