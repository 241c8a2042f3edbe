"""Training throughput of the precision plugins on debug GPT-2.

    .venv/bin/python benchmarks/precision.py [--seq-len 64] [--batch-size 4] [--steps 6]

Prints tokens/s for ``32-true``, ``bf16-mixed`` and ``16-mixed`` and their ratio to fp32.
Each run uses Lightning's Trainer with plugintrain's plugin, random tokens and AdamW;
the first ``--warmup`` steps are excluded from the timing. On a CPU without bf16/fp16
arithmetic (no AVX512-BF16/AMX) autocast emulates the low-precision GEMMs and is much
slower than fp32; the table shows by how much.
"""

from __future__ import annotations

import argparse

import lightning as L
import torch
from torch.utils.data import DataLoader, TensorDataset

from plugintrain.model_zoo import CausalLM
from plugintrain.precision_plugins import precision_plugin_from_name

from _timing import StepTimer

PRECISIONS = ("32-true", "bf16-mixed", "16-mixed")


def tokens_per_second(precision: str, args: argparse.Namespace) -> float:
    """Measured training tokens/s of debug GPT-2 under ``precision``."""
    L.seed_everything(0, verbose=False)
    model = CausalLM("gpt2-debug", warmup_steps=0)
    steps = args.warmup + args.steps
    tokens = torch.randint(0, model.vocab_size, (steps * args.batch_size, args.seq_len))
    loader = DataLoader(TensorDataset(tokens, tokens), batch_size=args.batch_size)
    timer = StepTimer(args.warmup)
    trainer = L.Trainer(
        accelerator="cpu",
        plugins=[precision_plugin_from_name(precision)],
        max_steps=steps,
        callbacks=[timer],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(model, loader)
    return timer.tokens / timer.seconds


def main() -> None:
    """Run every precision and print the table."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--steps", type=int, default=4, help="timed steps per precision")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps first")
    args = parser.parse_args()
    results = {precision: tokens_per_second(precision, args) for precision in PRECISIONS}
    print(
        f"\ndebug GPT-2, B={args.batch_size} T={args.seq_len}, {torch.get_num_threads()} threads,"
        f" CPU capability {torch.backends.cpu.get_cpu_capability()}, torch {torch.__version__}"
    )
    print("| precision  | tokens/s | vs 32-true |\n|------------|---------:|-----------:|")
    for precision, rate in results.items():
        print(f"| {precision:<10} | {rate:8.0f} | {rate / results['32-true']:9.2f}x |")


if __name__ == "__main__":
    main()
