"""Framework overhead: ``plugintrain fit`` against a plain PyTorch loop.

Both sides train the same model (same preset and seed), on the same
batches from the same ``TokenDataModule``, with the same AdamW, schedule and gradient
clipping. The ``plugintrain fit`` side is the real CLI run of a recipe (its logger,
checkpoint, LR and throughput callbacks all active), with validation off so both sides
time training steps only. Steady-state steps are timed (the first ``--warmup`` steps
are excluded) and the rounds alternate, best round reported, so one noisy neighbour
does not decide the ratio.

    python benchmarks/framework_overhead.py --recipe recipes/gpt2_debug_shakespeare_cpu.yaml
"""

from __future__ import annotations

import argparse
import time

import torch

from plugintrain.lightning_cli import PluginTrainCLI

from _timing import StepTimer


def _cli(recipe: str, steps: int, extra: list[str]) -> PluginTrainCLI:
    args = [
        "--config", recipe,
        f"--trainer.max_steps={steps}",
        "--trainer.limit_val_batches=0",
        "--trainer.num_sanity_val_steps=0",
        "--trainer.enable_progress_bar=false",
        "--trainer.logger.init_args.save_dir=runs/bench",
        *extra,
    ]  # fmt: skip
    return PluginTrainCLI(args=args, run=False)


def run_framework(recipe: str, steps: int, warmup: int, extra: list[str]) -> float:
    """Seconds per step of ``plugintrain fit`` on the recipe."""
    cli = _cli(recipe, steps, extra)
    timer = StepTimer(warmup)
    cli.trainer.callbacks.append(timer)
    cli.trainer.fit(cli.model, datamodule=cli.datamodule)
    return timer.seconds / (steps - warmup)


def run_plain(recipe: str, steps: int, warmup: int, extra: list[str]) -> tuple[float, int]:
    """Seconds per step and tokens per step of a hand-written loop on the same setup."""
    cli = _cli(recipe, steps, extra)  # only to read the same resolved config and seed
    module, data, trainer = cli.model, cli.datamodule, cli.trainer
    module.configure_model()
    module.lr_decay_steps = module.lr_decay_steps or steps  # what fit derives from max_steps
    optimizers = module.configure_optimizers()
    optimizer = optimizers["optimizer"]
    scheduler = optimizers["lr_scheduler"]["scheduler"]
    data.setup("fit")
    loader = iter(data.train_dataloader())
    clip = trainer.gradient_clip_val
    start, tokens = 0.0, 0
    for step in range(steps):
        if step == warmup:
            start = time.perf_counter()
        x, y = next(loader)
        tokens = x.numel()
        loss = module.loss_fn(module(x), y)
        loss.backward()
        if clip:
            torch.nn.utils.clip_grad_norm_(module.parameters(), clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        scheduler.step()
    return (time.perf_counter() - start) / (steps - warmup), tokens


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--recipe", default="recipes/gpt2_debug_shakespeare_cpu.yaml")
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("overrides", nargs="*", help="extra CLI overrides, e.g. --data.seq_len=128")
    args = parser.parse_args()
    plain, framework, tokens = [], [], 0
    for _ in range(args.rounds):
        step_s, tokens = run_plain(args.recipe, args.steps, args.warmup, args.overrides)
        plain.append(step_s)
        framework.append(run_framework(args.recipe, args.steps, args.warmup, args.overrides))
    plain_tps, fw_tps = tokens / min(plain), tokens / min(framework)
    print(f"\nrecipe {args.recipe}, {tokens} tokens/step, torch threads {torch.get_num_threads()}")
    print(f"{'run':<22}{'tokens/s':>12}{'ratio':>8}")
    print(f"{'plain PyTorch loop':<22}{plain_tps:>12,.0f}{1.0:>8.3f}")
    print(f"{'plugintrain fit':<22}{fw_tps:>12,.0f}{fw_tps / plain_tps:>8.3f}")
    print(f"framework overhead: {100 * (1 - fw_tps / plain_tps):.1f}% (goal: at most 5%)")


if __name__ == "__main__":
    main()
