"""Baselines of the benchmark matrix that are not ``plugintrain fit``: the reference rows
every ratio is read against.

- ``plain``: a hand-written PyTorch loop, one process: the recipe's model, seed, batches
  (the same ``TokenDataModule``), optimizer, LR schedule and gradient clipping, with no
  Lightning. ``plugintrain fit`` over it is the framework's overhead.
- ``torch_pipelining``: torch.distributed.pipelining's ``Schedule1F1B`` /
  ``ScheduleGPipe`` / ``ScheduleInterleaved1F1B`` over the same stage split plugintrain's
  pipeline strategy uses (the recipe's ``pipeline_parallel``, ``virtual_pipeline_parallel``,
  ``microbatches``, ``schedule`` and ``layers_per_stage``), with AdamW on each stage.

Lightning's ``ddp`` and torch's ``ZeroRedundancyOptimizer`` need no code here: they are
``plugintrain fit`` rows (``strategy: ddp``, and the optimizer
:class:`ZeroRedundancyAdamW`). Both baselines take ``plugintrain fit``'s own arguments
(the recipe and the bench overrides, parsed by the same CLI) and write the same
``rank<N>.json`` as :class:`~plugintrain.bench.recorder.BenchRecorder`::

    python -m plugintrain.bench.baselines plain --config RECIPE [fit options]
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from lightning.pytorch.accelerators import CUDAAccelerator
from lightning.pytorch.plugins.precision import Precision
from torch import Tensor, nn
from torch.distributed.optim import ZeroRedundancyOptimizer

from plugintrain.bench.recorder import BenchRecorder, RankRecord, optimizer_tensors
from plugintrain.core.lightning_seam import split_threads_between
from plugintrain.core.memory import LiveTensorMemory, storage_bytes
from plugintrain.core.peak_flops import device_peak_flops
from plugintrain.core.profiling import device_seconds


class ZeroRedundancyAdamW(ZeroRedundancyOptimizer):
    """torch's ZeRO-1 (``ZeroRedundancyOptimizer``) over AdamW, with AdamW's arguments, so a
    recipe names it by ``class_path`` where it names ``torch.optim.AdamW``."""

    def __init__(
        self,
        params: Any,
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.01,
    ) -> None:
        super().__init__(
            params,
            optimizer_class=torch.optim.AdamW,
            lr=lr,
            betas=betas,
            eps=eps,
            weight_decay=weight_decay,
        )


class _Loop:
    """The parts both baselines share: the parsed recipe, device, autocast, timing."""

    def __init__(self, fit_args: Sequence[str], local_rank: int = 0) -> None:
        from plugintrain.lightning_cli import PluginTrainCLI  # it parses; nothing is launched

        cli = PluginTrainCLI(args=list(fit_args), run=False)
        self.module, self.data, trainer = cli.model, cli.datamodule, cli.trainer
        self.clip = trainer.gradient_clip_val
        self.max_steps = trainer.max_steps
        recorder = next(c for c in trainer.callbacks if isinstance(c, BenchRecorder))
        self.out_dir, self.warmup = recorder.out_dir, recorder.warmup
        self.strategy = trainer.strategy
        self.device = torch.device("cpu")
        if isinstance(trainer.accelerator, CUDAAccelerator):
            self.device = torch.device("cuda", local_rank)
            torch.cuda.set_device(self.device)
        self.dtype = _autocast_dtype(trainer.precision_plugin)
        self.peak_flops = device_peak_flops(self.device, self.dtype or torch.float32)

    def record(self, rank: int = 0, world_size: int = 1) -> RankRecord:
        device = torch.cuda.get_device_name(self.device) if self.device.type == "cuda" else "cpu"
        return RankRecord(rank, world_size, 1, device, peak_flops=self.peak_flops)

    def optimizer(self) -> tuple[torch.optim.Optimizer, Any]:
        """The recipe's optimizer and LR scheduler over the module's parameters."""
        self.module.lr_decay_steps = self.module.lr_decay_steps or self.max_steps  # as fit
        configured = self.module.configure_optimizers()
        return configured["optimizer"], configured["lr_scheduler"]["scheduler"]

    def finish(self, record: RankRecord, optimizer: torch.optim.Optimizer) -> None:
        """Count the weights and optimizer state this rank holds, and write its record."""
        record.param_bytes = storage_bytes(list(self.module.parameters()))
        record.optimizer_bytes = storage_bytes(optimizer_tensors([optimizer]))
        record.write(self.out_dir)

    def autocast(self) -> torch.autocast:
        """The recipe's mixed precision (bf16 autocast), or none."""
        return torch.autocast(self.device.type, self.dtype, enabled=self.dtype is not None)

    def batches(self) -> Iterator[tuple[Tensor, Tensor]]:
        """The recipe's training batches, in order, on the device, for as many steps as asked."""
        self.data.setup("fit")
        while True:
            for x, y in self.data.train_dataloader():
                yield x.to(self.device), y.to(self.device)

    def run(
        self, record: RankRecord, step: Callable[[], float | None], state: Callable[[], list]
    ) -> None:
        """Time ``step`` after warm-up as ``BenchRecorder`` times ``fit``; the last step is
        not timed: on CUDA the allocator's peak over the timed steps is read before it,
        elsewhere it runs under LiveTensorMemory."""
        cuda = self.device.type == "cuda"
        for index in range(self.max_steps):
            last = index == self.max_steps - 1
            if cuda and index == self.warmup:
                torch.cuda.reset_peak_memory_stats(self.device)
            if cuda and last:
                record.peak_bytes = torch.cuda.max_memory_allocated(self.device)
                record.peak_source = "cuda.max_memory_allocated"
            memory = LiveTensorMemory() if last and not cuda else None
            if memory is not None:
                memory.track(*state())
                memory.__enter__()
            start = device_seconds(self.device)
            loss = step()
            seconds = device_seconds(self.device) - start
            if memory is not None:
                memory.__exit__(None, None, None)
                record.peak_bytes, record.peak_source = memory.peak_bytes, "LiveTensorMemory"
            elif index >= self.warmup and not last:
                record.step_seconds.append(seconds)
                record.loss = loss if loss is not None else record.loss


def _autocast_dtype(plugin: Precision) -> torch.dtype | None:
    """bf16 for ``bf16-mixed``, None for ``32-true``; other precisions are ``fit`` rows."""
    if plugin.precision == "32-true":
        return None
    if plugin.precision == "bf16-mixed":
        return torch.bfloat16
    raise ValueError(
        f"the baselines run precision 32-true or bf16-mixed, not {plugin.precision};"
        " set precision: bf16-mixed on the row"
    )


def plain(fit_args: Sequence[str]) -> None:
    """The recipe trained by a hand-written loop in one process."""
    loop = _Loop(fit_args)
    module = loop.module
    module.configure_model()
    module.to(loop.device)
    optimizer, scheduler = loop.optimizer()
    batches = loop.batches()
    record = loop.record()

    def step() -> float:
        x, y = next(batches)
        record.tokens_per_step = x.numel()
        record.flops_per_token = module.config.flops_per_token(x.size(1))
        with loop.autocast():
            loss = module.loss_fn(module(x), y)
        loss.backward()
        record.grad_bytes = storage_bytes([p.grad for p in module.parameters()])
        if loop.clip:
            torch.nn.utils.clip_grad_norm_(module.parameters(), loop.clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        scheduler.step()
        return loss.item()

    def state() -> list[Tensor]:
        return [*module.parameters(), *module.buffers(), *optimizer_tensors([optimizer])]

    loop.run(record, step, state)
    loop.finish(record, optimizer)


class StageModule(nn.Module):
    """One virtual stage as the ``nn.Module`` torch's ``PipelineStage`` wants. Only the
    stage's own modules are registered (torch scales their gradients by 1/microbatches):
    its blocks, and on the first or last stage the rank's other modules (embeddings, or
    the final norm and head; ``keep_stage`` dropped the rest)."""

    def __init__(self, chunk: Any, seq_len: int) -> None:
        super().__init__()
        model = chunk.model
        self.chunk = chunk  # a dataclass, not a module: stored as a plain attribute
        self.seq_len = seq_len
        self.blocks = nn.ModuleList(model.layers[key] for key in chunk.layer_keys)
        ends = chunk.is_first or chunk.is_last
        self.ends = nn.ModuleList(m for n, m in model.named_children() if ends and n != "layers")

    def forward(self, x: Tensor) -> Tensor:
        return self.chunk(x, self.seq_len)


def _loss(logits: Tensor, targets: Tensor) -> Tensor:
    return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())


def _torch_schedule(stages: list[Any], schedule: str, microbatches: int) -> Any:
    from torch.distributed.pipelining import Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B

    if len(stages) > 1:
        return ScheduleInterleaved1F1B(stages, microbatches, loss_fn=_loss)
    kind = ScheduleGPipe if schedule == "gpipe" else Schedule1F1B
    return kind(stages[0], microbatches, loss_fn=_loss)


def _pipeline_layout(strategy: Any, world: int) -> tuple[int, int, Any]:
    """The recipe strategy's pp, vpp and pipeline options, where torch's schedules run them."""
    dims = strategy.parallel_dims.with_world_size(world)
    options = strategy.pipeline_options
    if dims.pipeline_parallel != world:
        raise ValueError(
            f"runner torch_pipelining runs pipeline parallelism alone; set devices to"
            f" pipeline_parallel={dims.pipeline_parallel} (devices={world})"
        )
    if options.layers_per_stage == "auto":
        raise ValueError(
            "runner torch_pipelining runs a given split; set layers_per_stage to block"
            " counts (the split plugintrain's auto row logs), not auto"
        )
    return dims.pipeline_parallel, dims.virtual_pipeline_parallel, options


def torch_pipelining(fit_args: Sequence[str]) -> None:
    """The recipe's pipeline split run by torch.distributed.pipelining's schedules, on the
    ranks this process is one of (``RANK``/``WORLD_SIZE`` from the launcher).

    The same model, stage split, micro-batches, optimizer and LR schedule as the recipe's
    ``strategy: pipeline`` run; no gradient clipping (torch's schedules have no global
    norm across stages), which leaves the baseline a little less work.
    """
    from torch.distributed.pipelining import PipelineStage

    from plugintrain.strategies.pipeline_stages import split_model

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    loop = _Loop(fit_args, local_rank=int(os.environ.get("LOCAL_RANK", rank)))
    pp, vpp, options = _pipeline_layout(loop.strategy, world)
    dist.init_process_group("nccl" if loop.device.type == "cuda" else "gloo")
    split_threads_between(world)  # the cores split between the ranks, as in `fit`
    module = loop.module
    module.configure_model()
    chunks = split_model(module.model, rank, pp, vpp, options.layers_per_stage)
    module.to(loop.device)
    stages = [
        PipelineStage(StageModule(c, loop.data.seq_len), c.index, pp * vpp, loop.device)
        for c in chunks
    ]
    schedule = _torch_schedule(stages, options.schedule, options.microbatches)
    optimizer, scheduler = loop.optimizer()  # over the parameters this rank kept
    batches = loop.batches()
    first, last = chunks[0].is_first, any(c.is_last for c in chunks)
    record = loop.record(rank, world)

    def step() -> float | None:
        x, y = next(batches)
        record.tokens_per_step = x.numel()
        record.flops_per_token = module.config.flops_per_token(x.size(1))
        losses: list[Tensor] = []
        with loop.autocast():
            schedule.step(*((x,) if first else ()), target=y if last else None, losses=losses)
        record.grad_bytes = storage_bytes([p.grad for p in module.parameters()])
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        scheduler.step()
        return torch.stack(losses).mean().item() if losses else None

    def state() -> list[Tensor]:
        return [*module.parameters(), *optimizer_tensors([optimizer])]

    try:
        loop.run(record, step, state)
        loop.finish(record, optimizer)
    finally:
        dist.destroy_process_group()


BASELINES: dict[str, Callable[[Sequence[str]], None]] = {
    "plain": plain,
    "torch_pipelining": torch_pipelining,
}


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] not in BASELINES:
        print(
            f"usage: python -m plugintrain.bench.baselines {{{','.join(BASELINES)}}} "
            "[plugintrain fit options]",
            file=sys.stderr,
        )
        return 2
    BASELINES[args[0]](args[1:])
    return 0


if __name__ == "__main__":
    sys.exit(main())
