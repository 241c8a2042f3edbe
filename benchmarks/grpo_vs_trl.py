"""GRPO rollout speed and memory: plugintrain against TRL's GRPOTrainer (the baseline), one
command::

    .venv/bin/python benchmarks/grpo_vs_trl.py [--rounds 2] [--rollouts 3] [--prompts 2]
        [--generations 8] [--max-new-tokens 16] [--json PATH]

A rollout is what each side does before a GRPO update: sample ``--generations`` (G)
completions of each of ``--prompts`` prompts and score them. Both sides run in this
repository's virtual environment (``trl`` is in its test extra), in fp32 on the CPU, on
the same things:

* SmolLM2-135M-Instruct as a Hugging Face directory (``plugintrain convert smollm2-135m
  --format hf``, built once in ``$PLUGINTRAIN_CACHE/grpo_vs_trl``, default
  ``~/.cache/plugintrain/grpo_vs_trl``), with LoRA r=16, alpha=32, dropout 0 on all seven
  projections (the demo recipe's; ``B = 0``, so the adapters change no number);
* the dates demo's prompts (``plugintrain prepare dates``, then ``prepare chat``), as
  ``PromptDataModule`` reads them: the chat template's conversation and assistant header,
  the same token ids on both sides (checked in each TRL run);
* the demo recipe's sampling (``recipes/smollm2_grpo_cpu.yaml``): temperature 0.7, no top-k
  or top-p, at most ``--max-new-tokens`` tokens, ending at ``<|im_end|>``; its three rewards
  (F1Match, RegexFormat, ExactMatch), TRL calling plugintrain's functions.

* plugintrain: :meth:`plugintrain.model_zoo.GRPOLM.rollout` on a ``PromptDataModule``
  batch: every prompt of the batch prefilled once (left-padded), its KV cache repeated for
  its G rows, decoded together with each token's log-prob recorded, then scored and turned
  into advantages.
* TRL (baseline): ``GRPOTrainer._generate_and_score_completions`` on the batch its sampler
  hands the training step (each prompt G times): ``transformers``' ``generate`` over the
  left-padded rows (peft's LoRA on), then the rewards and advantages. With ``beta = 0`` and
  one iteration per rollout it computes no log-probs of its own (its loss then takes the
  policy's, detached, as the sampled ones).

Runs alternate, each system in a fresh process (``--rounds`` rounds, the order swapped
every round): one untimed rollout, then ``--rollouts`` timed ones, each on new prompts.
Completion tokens are each completion's tokens through its stop token (as each side's
completion mask counts them); tokens/s is the sum over a run's timed rollouts over their
seconds. Also reported: the peak resident memory over the rollouts (VmHWM, reset once the
model is loaded) and the RSS once loaded. Nothing here asserts on time.

Results, 2026-12-07 (2 CPU cores, torch 2.13.0+cpu, trl 1.16.0, transformers 5.25.0,
peft 0.21.2), the machine otherwise idle; the defaults (the demo's settings), 93 s::

    system         tokens/s   vs TRL   per-run       RSS peak MiB   loaded MiB
    plugintrain       105.4    1.73x   118.8, 92.0           1123          996
    trl                60.8    1.00x   64.5, 57.0            1436          777

Round by round 1.84, 1.61. With ``--rounds 1 --rollouts 2 --prompts 4 --max-new-tokens
64``: plugintrain 99.0, TRL 53.9 completion tokens/s (1.84x), peak RSS 1258 and 1677 MiB.
A decode step costs about the same on both sides (the weights' memory traffic at these
batch sizes); plugintrain prefills each prompt once for its group, TRL once a row. The
RSS once loaded is higher on plugintrain's side by its imports (Lightning), not the model.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from lora_vs_litgpt import RESULT, _rss_reset, _run, _status_bytes, alternate

# Nothing from TRL or transformers at the top: the plugintrain worker must not load them
# (their import would count in its resident memory).

BASELINE = "trl"
SYSTEMS = ("plugintrain", BASELINE)
R, ALPHA = 16, 32
TEMPERATURE = 0.7
SEED = 1337
PROJECTIONS = ("wq", "wk", "wv", "wo", "w1", "w2", "w3")
HF_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
MiB = 2**20


def cache_dir() -> Path:
    """Where this benchmark's assets are built, once."""
    import os

    root = os.environ.get("PLUGINTRAIN_CACHE", str(Path.home() / ".cache" / "plugintrain"))
    return Path(root) / "grpo_vs_trl"


def ensure_assets(cache: Path) -> dict[str, Path]:
    """The Hugging Face directory and the prepared dates prompts, each built on first use
    (offline)."""
    hf, jsonl, data = cache / "hf", cache / "dates.jsonl", cache / "dates_chat"
    plugintrain = [sys.executable, "-m", "plugintrain"]
    if not (hf / "config.json").is_file():
        _run([*plugintrain, "convert", "smollm2-135m", str(hf), "--format", "hf", "--overwrite"])
    if not jsonl.is_file():
        _run([*plugintrain, "prepare", "dates", "--out", str(jsonl)])
    if not (data / "meta.json").is_file():
        prepare = ["prepare", "chat", str(jsonl), "--tokenizer", "smollm2-135m", "--seq_len"]
        prepare += ["256", "--val_examples", "100", "--out", str(data), "--overwrite"]
        _run([*plugintrain, *prepare])
    return {"hf": hf, "data": data}


def _data(args: argparse.Namespace) -> Any:
    """The prompts' data module, set up for fitting."""
    from plugintrain.data import PromptDataModule

    module = PromptDataModule(str(args.data), batch_size=args.prompts)
    module.setup("fit")
    return module


def _batches(module: Any, args: argparse.Namespace) -> list[list[tuple[torch.Tensor, dict]]]:
    """The rollouts' prompt batches (the first untimed): consecutive training prompts."""
    prompts = module.train_set
    count = args.prompts * (1 + args.rollouts)
    items = [prompts[i] for i in range(count)]
    return [items[i : i + args.prompts] for i in range(0, count, args.prompts)]


# ---------------------------------------------------------------- workers (children)


def _plugintrain_worker(args: argparse.Namespace) -> dict[str, Any]:
    from plugintrain.core.rewards import ExactMatch, F1Match, RegexFormat
    from plugintrain.model_zoo import GRPOLM
    from plugintrain.model_zoo.lora import LoRASpec, inject

    data = _data(args)
    batches = _batches(data, args)
    module = GRPOLM(
        weights=str(args.weights),
        rewards=[F1Match(), RegexFormat(r"\d{4}-\d{2}-\d{2}"), ExactMatch()],
        reward_weights=[0.5, 0.5, 1.0],
        num_generations=args.generations,
        max_new_tokens=args.max_new_tokens,
        temperature=TEMPERATURE,
    )
    module.configure_model()
    module.init_weights()
    targets = tuple(
        f"*.{'attention' if p in PROJECTIONS[:4] else 'feed_forward'}.{p}" for p in PROJECTIONS
    )
    inject(module.model, LoRASpec(r=R, alpha=ALPHA, dropout=0.0, target_modules=targets))
    module.use_data(data)
    rss_loaded = _rss_reset()
    tokens, seconds = [], []
    for i, batch in enumerate(batches):
        start = time.perf_counter()
        groups = module.rollout(batch)
        elapsed = time.perf_counter() - start
        if i > 0:
            tokens.append(int(sum(g.mask.sum() for g in groups)))
            seconds.append(elapsed)
    return _result(tokens, seconds, rss_loaded)


def _trl_worker(args: argparse.Namespace) -> dict[str, Any]:
    import transformers
    from datasets import Dataset
    from peft import LoraConfig
    from trl import GRPOConfig, GRPOTrainer

    from plugintrain.core.rewards import ExactMatch, F1Match, RegexFormat

    batches = _batches(_data(args), args)
    tokenizer = transformers.AutoTokenizer.from_pretrained(args.weights)
    tokenizer.pad_token = tokenizer.eos_token
    rewards = [F1Match(), RegexFormat(r"\d{4}-\d{2}-\d{2}"), ExactMatch()]
    model = transformers.AutoModelForCausalLM.from_pretrained(args.weights, dtype=torch.float32)
    config = GRPOConfig(
        output_dir=str(args.work / "trl"), report_to="none", use_cpu=True, seed=SEED,
        per_device_train_batch_size=args.prompts * args.generations,
        num_generations=args.generations, max_completion_length=args.max_new_tokens,
        temperature=TEMPERATURE, top_p=1.0, top_k=0, beta=0.0, reward_weights=[0.5, 0.5, 1.0],
        logging_strategy="no", save_strategy="no", disable_tqdm=True,
    )  # fmt: skip
    lora = LoraConfig(r=R, lora_alpha=ALPHA, lora_dropout=0.0, target_modules=list(HF_PROJECTIONS))
    trainer = GRPOTrainer(
        model=model,
        reward_funcs=[_trl_reward(r) for r in rewards],
        args=config,
        train_dataset=Dataset.from_list([{"prompt": "x", "answer": "x"}]),
        processing_class=tokenizer,
        peft_config=lora,
    )
    rss_loaded = _rss_reset()
    tokens, seconds = [], []
    for i, batch in enumerate(batches):
        for ids, fields in batch:  # the same token ids as plugintrain's
            assert tokenizer(fields["prompt"])["input_ids"] == ids.tolist(), fields["prompt"]
        inputs = [
            {"prompt": fields["prompt"], "answer": fields["answer"]}
            for _, fields in batch
            for _ in range(args.generations)
        ]
        start = time.perf_counter()
        out = trainer._generate_and_score_completions(inputs)
        elapsed = time.perf_counter() - start
        if i > 0:
            tokens.append(int(out["completion_mask"].sum()))
            seconds.append(elapsed)
    return _result(tokens, seconds, rss_loaded)


def _trl_reward(reward: Any) -> Any:
    """plugintrain's reward as TRL calls one: lists of prompts and completions, and the
    dataset's other columns as lists."""

    def call(
        prompts: list[str], completions: list[str], answer: list[str], **_: Any
    ) -> list[float]:
        return [
            float(reward(p, c, answer=a))
            for p, c, a in zip(prompts, completions, answer, strict=True)
        ]

    call.__name__ = type(reward).__name__
    return call


def _result(tokens: list[int], seconds: list[float], rss_loaded: int) -> dict[str, Any]:
    return {
        "tokens": tokens,
        "seconds": seconds,
        "tokens_per_s": sum(tokens) / sum(seconds),
        "rss_loaded_bytes": rss_loaded,
        "rss_peak_bytes": _status_bytes("VmHWM"),
    }


# ---------------------------------------------------------------- runs (parent)


def _worker_command(
    system: str, work: Path, assets: dict[str, Path], args: argparse.Namespace
) -> list[str]:
    return [
        *(sys.executable, str(Path(__file__).resolve()), "--worker", system, "--work", str(work)),
        *("--weights", str(assets["hf"]), "--data", str(assets["data"])),
        *("--rollouts", str(args.rollouts), "--prompts", str(args.prompts)),
        *("--generations", str(args.generations), "--max-new-tokens", str(args.max_new_tokens)),
    ]


def _describe(name: str, result: dict[str, Any]) -> str:
    seconds = " ".join(f"{s:.2f}" for s in result["seconds"])
    return (
        f"{name:<11} {result['tokens_per_s']:6.1f} completion tokens/s"
        f" ({sum(result['tokens'])} tokens; rollouts {seconds} s)"
        f" RSS peak {result['rss_peak_bytes'] / MiB:.0f} MiB"
    )


def _report(runs: dict[str, list[dict[str, Any]]], args: argparse.Namespace) -> str:
    base = statistics.median(r["tokens_per_s"] for r in runs[BASELINE])
    lines = [
        f"SmolLM2-135M-Instruct + LoRA r={R} (fp32, CPU, {torch.get_num_threads()} threads):"
        f" {args.prompts} prompts x G={args.generations}, at most {args.max_new_tokens} new"
        f" tokens, temperature {TEMPERATURE}; {args.rounds} runs each x {args.rollouts} timed"
        " rollouts",
        "",
        f"{'system':<13} {'tokens/s':>9} {'vs TRL':>8}   per-run       RSS peak MiB   loaded MiB",
    ]
    for system in SYSTEMS:
        rs = runs[system]
        rate = statistics.median(r["tokens_per_s"] for r in rs)
        per_run = ", ".join(f"{r['tokens_per_s']:.1f}" for r in rs)
        peak = statistics.median(r["rss_peak_bytes"] for r in rs) / MiB
        loaded = statistics.median(r["rss_loaded_bytes"] for r in rs) / MiB
        lines.append(
            f"{system:<13} {rate:9.1f} {rate / base:7.2f}x   {per_run:<13} {peak:12.0f}"
            f" {loaded:12.0f}"
        )
    ratios = [
        a["tokens_per_s"] / b["tokens_per_s"]
        for a, b in zip(runs["plugintrain"], runs[BASELINE], strict=True)
    ]
    lines += ["", "plugintrain / TRL round by round: " + ", ".join(f"{x:.2f}" for x in ratios)]
    return "\n".join(lines)


def _parse(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=2, help="runs of each system")
    parser.add_argument("--rollouts", type=int, default=3, help="timed rollouts per run")
    parser.add_argument("--prompts", type=int, default=2, help="prompts per rollout")
    parser.add_argument("--generations", type=int, default=8, help="completions per prompt (G)")
    parser.add_argument("--max-new-tokens", type=int, default=16, help="most tokens a completion")
    parser.add_argument("--json", type=Path, help="also write the results to this file")
    parser.add_argument("--worker", choices=SYSTEMS, help=argparse.SUPPRESS)
    parser.add_argument("--work", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--weights", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--data", type=Path, help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def main() -> None:
    args = _parse()
    if args.worker is not None:
        torch.manual_seed(SEED)
        run = _plugintrain_worker if args.worker == "plugintrain" else _trl_worker
        print(RESULT + json.dumps(run(args)), flush=True)
        return
    print("$", " ".join(sys.argv), flush=True)
    started = time.perf_counter()
    assets = ensure_assets(cache_dir())
    with tempfile.TemporaryDirectory() as work:
        commands = {s: _worker_command(s, Path(work), assets, args) for s in SYSTEMS}
        runs = alternate(commands, args.rounds, _describe)
    print()
    print(_report(runs, args))
    print(f"\n{time.perf_counter() - started:.0f} s in all")
    if args.json is not None:
        args.json.write_text(json.dumps({"args": vars(args), "runs": runs}, default=str, indent=2))


if __name__ == "__main__":
    main()
