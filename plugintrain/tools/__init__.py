"""The commands that run beside LightningCLI's ``fit/validate/test/predict``.

:data:`COMMANDS` is the one list of them: the ``plugintrain`` entry point dispatches by it,
``plugintrain --help`` lists it, and the tests and the documentation's CLI reference read
it. Each entry names a typed function (or a group of them, ``prepare``) whose parser
jsonargparse builds from its signature and docstring (:mod:`plugintrain.tools._command`);
nothing is imported until the command runs.
"""

from __future__ import annotations

from plugintrain.tools._command import CommandSpec, run, summary

__all__ = ["COMMANDS", "CommandSpec", "overview", "run_command"]

COMMANDS: dict[str, CommandSpec] = {
    "recipes": CommandSpec(
        "plugintrain.tools.recipes:recipes",
        ("plugintrain recipes gpt2_debug_shakespeare_cpu > my.yaml",),
    ),
    "prepare": CommandSpec(
        "plugintrain.tools.prepare:PREPARE",
        ("plugintrain prepare shakespeare --tokenizer gpt2",),
    ),
    "generate": CommandSpec(
        "plugintrain.tools.generate:generate",
        (
            "plugintrain generate --ckpt_path smollm2-135m --prompt 'The capital of France is'",
            "(or answer each conversation of a file: --chat conversations.jsonl)",
        ),
    ),
    "chat": CommandSpec(
        "plugintrain.tools.chat:chat",
        ("plugintrain chat --weights smollm2-135m",),
    ),
    "evaluate": CommandSpec(
        "plugintrain.tools.evaluate:evaluate_command",
        (
            "plugintrain evaluate --weights last.ckpt --data data/shakespeare_gpt2",
            "(or lm-evaluation-harness tasks: --tasks hellaswag,gsm8k)",
        ),
    ),
    "lm-eval": CommandSpec(
        "plugintrain.tools.lm_eval_cli:lm_eval",
        ("plugintrain lm-eval run --model plugintrain --model_args weights=W --tasks T",),
        passthrough=True,
    ),
    "export": CommandSpec(
        "plugintrain.tools.convert:export",
        ("plugintrain export last.ckpt out_dir --format hf (or peft)",),
    ),
    "convert": CommandSpec(
        "plugintrain.tools.convert:convert",
        ("plugintrain convert model.gguf out_dir --format hf",),
    ),
    "compare": CommandSpec(
        "plugintrain.tools.compare:compare",
        ("plugintrain compare RUN_A RUN_B --dtype bf16",),
    ),
    "schedule": CommandSpec(
        "plugintrain.tools.schedule:schedule",
        ("plugintrain schedule --pp 4 --vpp 2 --microbatches 8",),
    ),
    "estimate": CommandSpec(
        "plugintrain.tools.estimate:estimate",
        (
            "plugintrain estimate llama3.1-8b --dp 8 --zero_stage 2 (or --fit 80GiB --gpus 64)",
            "and every rank of a recipe's layout built on the real code path, on this machine:",
            "plugintrain estimate --config recipes/scale/llama3_405b_1024gpu.yaml --dry_run",
        ),
    ),
    "bench": CommandSpec(
        "plugintrain.tools.bench:bench", ("plugintrain bench --matrix benchmarks/cpu.yaml",)
    ),
    "gpu-check": CommandSpec("plugintrain.tools.gpu_check:gpu_check", ("make gpu-check",)),
}
"""Every command beside training, by name, in the order ``plugintrain --help`` lists them."""

_TRAINING = (
    ("fit", "train a model", "plugintrain fit --config <recipe>  (a name or a .yaml file)"),
    ("validate", "run the validation loop", ""),
    ("test", "run the test loop", ""),
    ("predict", "run prediction", ""),
)


def run_command(name: str, argv: list[str]) -> int:
    """Run ``plugintrain NAME ARGV``; its exit status (2 after a one-line refusal)."""
    return run(name, COMMANDS[name], argv)


def overview() -> str:
    """The top-level ``plugintrain --help``: every command with its summary and examples."""
    width = max(map(len, [*COMMANDS, *(name for name, _, _ in _TRAINING)]))
    lines = ["usage: plugintrain <command> [options]", ""]
    lines.append("Training (LightningCLI; `plugintrain fit --help` lists every option):")
    for name, what, example in _TRAINING:
        lines.append(f"  {name:<{width}}  {what}" + (f": {example}" if example else ""))
    lines += ["", "Tools:"]
    for name, spec in COMMANDS.items():
        lines.append(f"  {name:<{width}}  {summary(spec.load())}")
        lines += [f"  {'':<{width}}    {example}" for example in spec.examples]
    lines += ["", "Run `plugintrain <command> --help` for the options of one command."]
    return "\n".join(lines) + "\n"
