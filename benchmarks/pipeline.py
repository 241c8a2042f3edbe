"""Our pipeline schedules against ``torch.distributed.pipelining``'s, on CPU processes (gloo).

    .venv/bin/python benchmarks/pipeline.py [--pp 2] [--microbatches 8] [--micro-batch-size 2]
        [--seq-len 128] [--n-layer 8] [--steps 10] [--warmup 2] [--layers-per-stage 6,2]

For GPipe, 1F1B and interleaved 1F1B (``vpp=2``), runs plugintrain's
:class:`~plugintrain.strategies.pipeline_executor.PipelineExecutor` and torch's ``ScheduleGPipe`` /
``Schedule1F1B`` / ``ScheduleInterleaved1F1B`` (the baseline of each row pair) on ``--pp``
forked gloo processes, one intra-op thread each. Both sides run the same stage chunks of the
same seeded Llama 3 debug model (8 layers, vocabulary 8192; two identical copies, so
gradients are not shared) on the same micro-batches, with the same fp32 cross-entropy, and
no optimizer (gradients are zeroed between steps). The first step checks that both give
the same loss and gradients. Then, alternating which goes first, ``--steps`` timed steps
each (after ``--warmup``), then one step each for memory. Printed per schedule:

- tok/s: tokens of the step over the median step time of the slowest rank (every step
  starts at a barrier; the timed steps run without the memory hooks); ratio = ours / torch.
- peak act MiB/rank: peak bytes of tensors saved for backward, counted by
  ``saved_tensors_hooks`` (each storage once, parameters and buffers excluded), per rank,
  in one extra step of each under the same hooks.
- idle/rank: ours measured (``PipelineExecutor.wait_seconds / step_seconds``: time blocked
  in receives and send completions over the step, summed over the timed steps) beside
  :func:`~plugintrain.strategies.pipeline_schedules.simulate`'s idle for the same schedule,
  with the forward:backward time ratio measured on one process (the simulator assumes
  equal stages; the last one also runs the 8192-way head and the loss).

Measured on the 2-core reference machine (``python benchmarks/pipeline.py``; step times vary
by about 3% between steps, and other processes on the machine move the absolute numbers, so
the load average is printed)::

    llama3-debug n_layer=8 vocab=8192, pp=2: 8 micro-batches x 2 x 128 = 2048 tokens per step
    torch 2.13.0+cpu, gloo, 1 thread/rank, 10 timed steps after 2 warm-up, load average 0.9 -> 1.5
    fwd/bwd ms of 1 micro-batch per stage (1 process): 25.4/46.0 51.7/92.7; simulated at 1:1.80
    step 1 gpipe       loss ours 9.0397472 torch 9.0397472 |diff| 0e+00 ok, grads rel. diff 0e+00
    step 1 1f1b        loss ours 9.0397472 torch 9.0397472 |diff| 0e+00 ok, grads rel. diff 0e+00
    step 1 interleaved loss ours 9.0397472 torch 9.0397472 |diff| 0e+00 ok, grads rel. diff 0e+00

    schedule     impl     tok/s  ratio  peak act MiB/rank     idle/rank (measured | simulated)
    gpipe        torch    1,648  1.00x  84.5 151.5
    gpipe        ours     1,675  1.02x  84.5 151.5            0.50 0.02 | 0.11 0.11
    1f1b         torch    1,619  1.00x  21.1 18.9
    1f1b         ours     1,682  1.04x  21.1 18.9             0.51 0.02 | 0.11 0.11
    interleaved  torch    1,670  1.00x  26.5 24.3
    interleaved  ours     1,665  1.00x  26.5 24.3             0.50 0.02 | 0.06 0.06
    simulated idle assumes equal stages; the last (head + loss) takes 2.0x the first,
    so the other ranks wait more and the last rank less than simulated.

    1F1B peak / GPipe peak, ours  per rank: 0.250 0.125 (meets the goal)
    1F1B peak / GPipe peak, torch per rank: 0.250 0.125 (meets the goal)
    goal: <= pp/m = 0.250 + one stage's activations of one micro-batch (GPipe peak / m),
    i.e. <= (pp+1)/m = 0.375. Saved bytes still live after the steps: 0

Balanced stages (``--layers-per-stage 6,2`` for GPipe and 1F1B: the head and loss cost
about four layers here, so the last stage gets two layers; per-stage forward 41.9 vs 41.1 ms)
bring the measured idle to the simulator's (load average ~2)::

    gpipe        torch    1,858  1.00x  126.5 109.4
    gpipe        ours     1,880  1.01x  126.5 109.4           0.14 0.09 | 0.11 0.11
    1f1b         torch    1,975  1.00x  31.6 13.7
    1f1b         ours     1,989  1.01x  31.6 13.7             0.10 0.07 | 0.11 0.11

With ``--pp 4`` (4 processes on the 2 cores, ``--steps 4``) every first-step check matched,
ours ran at 1.00x / 1.02x / 1.02x of torch's GPipe / 1F1B / interleaved, and 1F1B / GPipe peak
was 0.500 0.375 0.250 0.125 per rank on both sides (``(pp - rank) / m``). A 30-step rerun of
the pp=2 pair gave ours / torch step-time ratios (median of per-step pairs; below 1: ours
faster) of 0.97 (1F1B) and 0.98 (interleaved); with ``--seq-len 16 --micro-batch-size 1``
(framework overhead dominates) 0.98 (GPipe) and 1.00 (1F1B).
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import socket
import statistics
import sys
import time
import traceback
import weakref
from datetime import timedelta
from fractions import Fraction
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor
from torch.distributed.pipelining import (
    PipelineStage,
    Schedule1F1B,
    ScheduleGPipe,
    ScheduleInterleaved1F1B,
)

from plugintrain.bench.baselines import StageModule
from plugintrain.model_zoo import Transformer, TransformerConfig
from plugintrain.strategies.pipeline_executor import PipelineExecutor
from plugintrain.strategies.pipeline_schedules import build_schedule, simulate
from plugintrain.strategies.pipeline_stages import VirtualStage, split_model

VOCAB = 8192
SCHEDULES = {"gpipe": (1, ScheduleGPipe), "1f1b": (1, Schedule1F1B)}
SCHEDULES["interleaved"] = (2, ScheduleInterleaved1F1B)
LOSS_TOLERANCE = 1e-5


def _loss(logits: Tensor, targets: Tensor) -> Tensor:
    return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())


def _config(args: argparse.Namespace) -> TransformerConfig:
    return TransformerConfig.from_name(
        "llama3-debug", n_layer=args.n_layer, vocab_size=VOCAB, block_size=args.seq_len
    )


def _build(
    config: TransformerConfig, rank: int, pp: int, vpp: int, layers: list[int] | None = None
) -> list[VirtualStage]:
    torch.manual_seed(0)
    return split_model(Transformer(config), rank, pp, vpp, layers if vpp == 1 else None)


class ActivationMeter:
    """Live and peak bytes of the tensors autograd saves for backward.

    Use :meth:`hooks` around a step. Each storage counts once (refcounted by data
    pointer) from its first pack until the last packed handle is released; storages in
    ``exclude`` (the data pointers of the parameters and buffers) are not counted.
    """

    class _Packed:
        __slots__ = ("__weakref__", "tensor")

        def __init__(self, tensor: Tensor) -> None:
            self.tensor = tensor

    def __init__(self, exclude: set[int]) -> None:
        self.exclude = exclude
        self.live = 0
        self.peak = 0
        self._refs: dict[int, list[int]] = {}  # data pointer -> [handles, nbytes]

    def hooks(self) -> torch.autograd.graph.saved_tensors_hooks:
        return torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)

    def _pack(self, tensor: Tensor) -> _Packed:
        packed = self._Packed(tensor)
        storage = tensor.untyped_storage()
        ptr = storage.data_ptr()
        if ptr in self.exclude or storage.nbytes() == 0:
            return packed
        entry = self._refs.get(ptr)
        if entry is None:
            self._refs[ptr] = [1, storage.nbytes()]
            self.live += storage.nbytes()
            self.peak = max(self.peak, self.live)
        else:
            entry[0] += 1
        weakref.finalize(packed, self._release, ptr)
        return packed

    def _release(self, ptr: int) -> None:
        entry = self._refs[ptr]
        entry[0] -= 1
        if entry[0] == 0:
            del self._refs[ptr]
            self.live -= entry[1]

    @staticmethod
    def _unpack(packed: _Packed) -> Tensor:
        return packed.tensor


class _Pair:
    """Ours and torch's runner for one schedule on this rank, on separate model copies."""

    def __init__(
        self, name: str, rank: int, config: TransformerConfig, args: argparse.Namespace
    ) -> None:
        vpp, torch_schedule = SCHEDULES[name]
        pp, m = args.pp, args.microbatches
        self.ours_chunks = _build(config, rank, pp, vpp, args.layers_per_stage)
        self.torch_chunks = _build(config, rank, pp, vpp, args.layers_per_stage)
        self.executor = PipelineExecutor(
            self.ours_chunks, name, pp, vpp, m, rank, None, _loss, config.n_embd
        )
        self.modules = [StageModule(c, args.seq_len) for c in self.torch_chunks]
        device = torch.device("cpu")
        stages = [PipelineStage(mod, c.index, pp * vpp, device) for mod, c in zip(
            self.modules, self.torch_chunks, strict=True
        )]  # fmt: skip
        if vpp == 1:
            self.schedule = torch_schedule(stages[0], m, loss_fn=_loss)
        else:
            self.schedule = torch_schedule(stages, m, loss_fn=_loss)
        self.has_first = any(c.is_first for c in self.torch_chunks)
        self.has_last = any(c.is_last for c in self.torch_chunks)
        self.loss_scale = 1.0 / m
        models = (self.ours_chunks[0].model, self.torch_chunks[0].model)
        self.exclude = {
            t.untyped_storage().data_ptr()
            for model in models
            for t in [*model.parameters(), *model.buffers()]
        }

    def run(self, impl: str, inputs: list[Tensor], targets: list[Tensor]) -> Tensor | None:
        """One training step (forward + backward of every micro-batch); the mean loss on
        the last rank."""
        if impl == "ours":
            return self.executor.train_step(inputs, targets, self.loss_scale)
        losses: list[Tensor] = []
        args = (torch.cat(inputs),) if self.has_first else ()
        target = torch.cat(targets) if self.has_last else None
        self.schedule.step(*args, target=target, losses=losses, return_outputs=False)
        return torch.stack(losses).mean() if losses else None

    def zero_grad(self) -> None:
        for chunks in (self.ours_chunks, self.torch_chunks):
            chunks[0].model.zero_grad(set_to_none=True)

    def grad_check(self) -> tuple[float, float]:
        """Max |ours - torch| over this rank's gradients, and the max |gradient|."""
        ours = dict(self.ours_chunks[0].model.named_parameters())
        diff = scale = 0.0
        for name, p in self.torch_chunks[0].model.named_parameters():
            q = ours[name]
            if p.grad is None or q.grad is None:
                assert p.grad is None and q.grad is None, name
                continue
            diff = max(diff, (p.grad - q.grad).abs().max().item())
            scale = max(scale, p.grad.abs().max().item())
        return diff, scale


def _bench(rank: int, args: argparse.Namespace) -> dict[str, Any]:
    """Every schedule, ours and torch's, on this rank."""
    config = _config(args)
    m, b, t = args.microbatches, args.micro_batch_size, args.seq_len
    gen = torch.Generator().manual_seed(1)
    data = torch.randint(0, VOCAB, (m * b, t + 1), generator=gen)
    inputs = list(data[:, :-1].split(b))
    targets = list(data[:, 1:].split(b))
    out: dict[str, Any] = {}
    for name in SCHEDULES:
        pair = _Pair(name, rank, config, args)
        row: dict[str, Any] = {"times": {"ours": [], "torch": []}, "wait": 0.0, "step": 0.0}
        # First step: the same loss and gradients, so the comparison is apples to apples.
        losses = {impl: pair.run(impl, inputs, targets) for impl in ("ours", "torch")}
        row["loss"] = (
            (losses["ours"].item(), losses["torch"].item()) if losses["ours"] is not None else None
        )
        row["grad_diff"], row["grad_max"] = pair.grad_check()
        pair.zero_grad()
        for _ in range(args.warmup - 1):
            for impl in ("ours", "torch"):
                pair.run(impl, inputs, targets)
                pair.zero_grad()
        for step in range(args.steps):
            for impl in ("ours", "torch") if step % 2 == 0 else ("torch", "ours"):
                dist.barrier()
                start = time.perf_counter()
                pair.run(impl, inputs, targets)
                row["times"][impl].append(time.perf_counter() - start)
                pair.zero_grad()
                if impl == "ours":
                    row["wait"] += pair.executor.wait_seconds
                    row["step"] += pair.executor.step_seconds
        row["peak"], row["leftover"] = {}, {}
        for impl in ("ours", "torch"):
            meter = ActivationMeter(pair.exclude)
            dist.barrier()
            with meter.hooks():
                pair.run(impl, inputs, targets)
            pair.zero_grad()
            row["peak"][impl], row["leftover"][impl] = meter.peak, meter.live
        out[name] = row
        del pair
        dist.barrier()
    return out


def _worker(rank: int, port: int, args: argparse.Namespace, results: mp.Queue) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)  # ranks share the cores; oversubscription stalls gloo
    try:
        dist.init_process_group("gloo", rank=rank, world_size=args.pp, timeout=timedelta(minutes=5))
        results.put((rank, True, _bench(rank, args)))
    except BaseException:
        results.put((rank, False, traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def _run_ranks(args: argparse.Namespace) -> list[dict[str, Any]]:
    ctx = mp.get_context("fork")
    results = ctx.Queue()
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    procs = [ctx.Process(target=_worker, args=(r, port, args, results)) for r in range(args.pp)]
    for proc in procs:
        proc.start()
    outcomes = {}
    for _ in procs:
        rank, ok, value = results.get(timeout=1800)
        if not ok:
            for proc in procs:
                proc.kill()
            raise RuntimeError(f"rank {rank} failed:\n{value}")
        outcomes[rank] = value
    for proc in procs:
        proc.join()
    return [outcomes[r] for r in range(args.pp)]


def _stage_times(args: argparse.Namespace) -> list[tuple[float, float]]:
    """Median forward and backward seconds of one micro-batch through each stage (vpp=1),
    on this one process with one thread."""
    config = _config(args)
    b, t = args.micro_batch_size, args.seq_len
    gen = torch.Generator().manual_seed(2)
    tokens = torch.randint(0, VOCAB, (b, t + 1), generator=gen)
    times = []
    for rank in range(args.pp):
        chunk = _build(config, rank, args.pp, 1, args.layers_per_stage)[0]
        fwd, bwd = [], []
        for i in range(7):
            x = tokens[:, :-1] if chunk.is_first else torch.randn(b, t, config.n_embd)
            x.requires_grad_(not chunk.is_first)
            start = time.perf_counter()
            y = chunk(x, t)
            if chunk.is_last:
                y = _loss(y, tokens[:, 1:])
            mid = time.perf_counter()
            y.backward(None if chunk.is_last else torch.randn_like(y))
            end = time.perf_counter()
            if i >= 2:
                fwd.append(mid - start)
                bwd.append(end - mid)
        times.append((statistics.median(fwd), statistics.median(bwd)))
    return times


def _report(
    args: argparse.Namespace, ranks: list[dict], stage_times: list, load: tuple[float, float]
) -> bool:
    pp, m = args.pp, args.microbatches
    tokens = m * args.micro_batch_size * args.seq_len
    tf = statistics.mean(f for f, _ in stage_times)
    tb = statistics.mean(b for _, b in stage_times)
    ratio = Fraction(tb / tf).limit_denominator(20)
    print(
        f"llama3-debug n_layer={args.n_layer} vocab={VOCAB}, pp={pp}: {m} micro-batches x"
        f" {args.micro_batch_size} x {args.seq_len} = {tokens} tokens per step"
    )
    print(
        f"torch {torch.__version__}, gloo, 1 thread/rank, {args.steps} timed steps after"
        f" {args.warmup} warm-up, load average {load[0]:.1f} -> {load[1]:.1f}"
    )
    print(
        "fwd/bwd ms of 1 micro-batch per stage (1 process): "
        + " ".join(f"{f * 1e3:.1f}/{b * 1e3:.1f}" for f, b in stage_times)
        + f"; simulated at 1:{float(ratio):.2f}"
    )
    ok = True
    for name in SCHEDULES:
        ours, theirs = ranks[-1][name]["loss"]
        diff = abs(ours - theirs)
        ok &= diff <= LOSS_TOLERANCE
        grads = max(r[name]["grad_diff"] for r in ranks)
        scale = max(r[name]["grad_max"] for r in ranks)
        verdict = "ok" if diff <= LOSS_TOLERANCE else "MISMATCH"
        print(
            f"step 1 {name:<11} loss ours {ours:.7f} torch {theirs:.7f} |diff| {diff:.0e}"
            f" {verdict}, grads rel. diff {grads / scale:.0e}"
        )
    print()
    print(
        f"{'schedule':<12} {'impl':<6} {'tok/s':>7} {'ratio':>6}  {'peak act MiB/rank':<22}"
        "idle/rank (measured | simulated)"
    )
    peaks: dict[str, dict[str, list[float]]] = {}
    for name in SCHEDULES:
        vpp = SCHEDULES[name][0]
        sim = simulate(build_schedule(name, pp, vpp, m), forward_time=1, backward_time=ratio)
        rates = {}
        for impl in ("torch", "ours"):
            per_step = zip(*(r[name]["times"][impl] for r in ranks), strict=True)
            step = statistics.median(max(ts) for ts in per_step)
            rates[impl] = tokens / step
            peak = [r[name]["peak"][impl] / 2**20 for r in ranks]
            peaks.setdefault(impl, {})[name] = peak
            idle = ""
            if impl == "ours":
                measured = " ".join(f"{r[name]['wait'] / r[name]['step']:.2f}" for r in ranks)
                simulated = " ".join(f"{float(i):.2f}" for i in sim.idle)
                idle = f"{measured} | {simulated}"
            row = f"{name:<12} {impl:<6} {rates[impl]:>7,.0f} {rates[impl] / rates['torch']:>5.2f}x"
            print(f"{row}  {' '.join(f'{p:.1f}' for p in peak):<22}{idle}".rstrip())
    first, last = (sum(t) for t in (stage_times[0], stage_times[-1]))
    print(
        f"simulated idle assumes equal stages; the last (head + loss) takes {last / first:.1f}x"
        " the first,\nso the other ranks wait more and the last rank less than simulated."
    )
    leftover = max(r[n]["leftover"][i] for r in ranks for n in SCHEDULES for i in peaks)
    print()
    for impl in ("ours", "torch"):
        ratios = [o / g for o, g in zip(peaks[impl]["1f1b"], peaks[impl]["gpipe"], strict=True)]
        met = "meets" if max(ratios) <= (pp + 1) / m else "MISSES"
        listed = " ".join(f"{r:.3f}" for r in ratios)
        print(f"1F1B peak / GPipe peak, {impl:<5} per rank: {listed} ({met} the goal)")
    print(
        f"goal: <= pp/m = {pp / m:.3f} + one stage's activations of one micro-batch"
        f" (GPipe peak / m),\ni.e. <= (pp+1)/m = {(pp + 1) / m:.3f}."
        f" Saved bytes still live after the steps: {leftover}"
    )
    return ok


def main() -> None:
    args = _parse()
    torch.set_num_threads(1)
    for name, (vpp, _) in SCHEDULES.items():
        build_schedule(name, args.pp, vpp, args.microbatches)  # fail early on bad layouts
    load = os.getloadavg()[0]
    stage_times = _stage_times(args)
    ranks = _run_ranks(args)
    if not _report(args, ranks, stage_times, (load, os.getloadavg()[0])):
        sys.exit("ours and torch's first-step losses differ")


def _parse() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pp", type=int, default=2, help="pipeline ranks (processes)")
    parser.add_argument("--microbatches", type=int, default=8)
    parser.add_argument("--micro-batch-size", type=int, default=2)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--n-layer", type=int, default=8, help="divisible by 2 * pp")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=2, help="at least 1 (the checked step)")
    parser.add_argument(
        "--layers-per-stage",
        type=lambda text: [int(n) for n in text.split(",")],
        default=None,
        help="uneven split for gpipe/1f1b, e.g. 5,3 (interleaved keeps equal chunks)",
    )
    args = parser.parse_args()
    if args.warmup < 1:
        parser.error("--warmup must be at least 1: the first step is the checked one")
    return args


if __name__ == "__main__":
    main()
