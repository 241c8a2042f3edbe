"""Subcommands that run beside LightningCLI's ``fit/validate/test/predict``.

Each tool is a function ``(argv) -> exit code`` registered in :data:`TOOLS`; the
``plugintrain`` entry point dispatches to it by its first argument.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Sequence

from plugintrain.tools.bench import main as bench_main
from plugintrain.tools.chat import main as chat_main
from plugintrain.tools.compare import main as compare_main
from plugintrain.tools.convert import convert_main, export_main
from plugintrain.tools.estimate import main as estimate_main
from plugintrain.tools.evaluate import main as evaluate_main
from plugintrain.tools.generate import main as generate_main
from plugintrain.tools.prepare import main as prepare_main
from plugintrain.tools.recipes import main as recipes_main
from plugintrain.tools.schedule import main as schedule_main


def gpu_check_main(argv: Sequence[str]) -> int:
    """``plugintrain gpu-check``; its module is imported only here, so that ``python -m
    plugintrain.tools.gpu_check`` (``make gpu-check``) runs it as ``__main__`` cleanly."""
    from plugintrain.tools.gpu_check import main

    return main(argv)


def lm_eval_main(argv: Sequence[str]) -> int:
    """``plugintrain lm-eval``: lm-evaluation-harness's command line with plugintrain's
    model type registered (lm_eval is imported only here: an optional dependency)."""
    try:
        from plugintrain.tools.lm_eval_model import lm_eval_main as run
    except ImportError as error:
        print(f"plugintrain lm-eval: {error}; pip install lm_eval==0.4.13", file=sys.stderr)
        return 2
    return run(argv)


TOOLS: dict[str, Callable[[Sequence[str]], int]] = {
    "prepare": prepare_main,
    "generate": generate_main,
    "chat": chat_main,
    "evaluate": evaluate_main,
    "compare": compare_main,
    "schedule": schedule_main,
    "export": export_main,
    "convert": convert_main,
    "estimate": estimate_main,
    "bench": bench_main,
    "recipes": recipes_main,
    "gpu-check": gpu_check_main,
    "lm-eval": lm_eval_main,
}

_OVERVIEW = """\
usage: plugintrain <command> [options]

Training (LightningCLI; `plugintrain fit --help` lists every option):
  fit        train a model:           plugintrain fit --config <recipe>  (a name or a .yaml file)
  validate   run the validation loop
  test       run the test loop
  predict    run prediction

Tools:
  recipes    list the recipes shipped with plugintrain, or print one to copy and edit:
               plugintrain recipes gpt2_debug_shakespeare_cpu > my.yaml
  prepare    build real datasets offline: plugintrain prepare shakespeare --tokenizer gpt2
  generate   sample text from a checkpoint or pretrained weights:
               plugintrain generate --ckpt_path smollm2-135m --prompt 'The capital of France is'
               (or answer each conversation of a file: --chat conversations.jsonl)
  chat       talk to a model in its chat template: plugintrain chat --weights smollm2-135m
  evaluate   loss, perplexity, bits per byte, or a chat model's answers on held-out data:
               plugintrain evaluate --weights last.ckpt --data data/shakespeare_gpt2
               (or lm-evaluation-harness tasks: --tasks hellaswag,gsm8k)
  lm-eval    lm-evaluation-harness's own command line, with --model plugintrain:
               plugintrain lm-eval run --model plugintrain --model_args weights=W --tasks T
  export     a checkpoint for transformers, llm.c or llama.cpp, or its LoRA adapters for peft:
               plugintrain export last.ckpt out_dir --format hf (or peft)
  convert    weights between formats: plugintrain convert model.gguf out_dir --format hf
  compare    diff two runs' losses/module stats: plugintrain compare RUN_A RUN_B --dtype bf16
  schedule   simulate a pipeline schedule: plugintrain schedule --pp 4 --vpp 2 --microbatches 8
  estimate   per-rank memory of a layout, or the layouts that fit:
               plugintrain estimate llama3.1-8b --dp 8 --zero_stage 2 (or --fit 80GiB --gpus 64)
             and every rank of a recipe's layout built on the real code path, on this machine:
               plugintrain estimate --config recipes/scale/llama3_405b_1024gpu.yaml --dry_run
  bench      benchmark a matrix of runs: plugintrain bench --matrix benchmarks/cpu.yaml
  gpu-check  the CUDA path against the CPU on one GPU, with tokens/s and MFU (make gpu-check)

Run `plugintrain <command> --help` for the options of one command.
"""


def print_overview() -> None:
    """Print the list of commands (the top-level ``--help``)."""
    print(_OVERVIEW, end="")
