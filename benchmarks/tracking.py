"""Run tracking's costs, each against a named baseline run in the same command.

``overhead``: tokens/s of ``plugintrain fit`` logging to TensorBoard + MLflow (a SQLite
store) + CSV at once, against TensorBoard alone (the recipes' default), on the Llama 3
debug recipe, at the recipe's logging interval and at every step; MLflow through
plugintrain's logger (metrics written in batches) and through Lightning's (one write per
call). Steady-state steps only
(the first ``--warmup`` excluded); the two sides alternate over ``--rounds``, best round
each, so one noisy neighbour does not decide the ratio.

``evaluate``: the chat demo (SmolLM2-135M LoRA on the dates data) with
``plugintrain.callbacks.Evaluate`` every ``--every`` steps: exact match at each interval,
and the seconds each evaluation took inside the run, against ``plugintrain evaluate`` of
the run's last checkpoint on the same data and options (in this process, and as a fresh
command, wall time).

    plugintrain prepare shakespeare --tokenizer llama3
    plugintrain prepare dates --out data/dates.jsonl
    plugintrain prepare chat data/dates.jsonl --tokenizer smollm2-135m --out data/dates_chat \
        --seq_len 256 --val_examples 100
    python benchmarks/tracking.py
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

from plugintrain.cli import main as plugintrain_main
from plugintrain.lightning_cli import PluginTrainCLI

from _timing import StepTimer

TEXT_RECIPE = "recipes/llama3_debug_shakespeare_cpu.yaml"
CHAT_RECIPE = "recipes/smollm2_lora_chat_cpu.yaml"


MLFLOW = {
    "plugintrain": "plugintrain.loggers.MLFlowLogger",
    "Lightning": "lightning.pytorch.loggers.MLFlowLogger",
}
"""The MLflow loggers compared: the name printed -> class path."""


def _loggers(work: Path, mlflow: str | None) -> list[dict]:
    """TensorBoard alone (``mlflow`` None), or with the named MLflow logger and CSV."""
    tensorboard = {
        "class_path": "lightning.pytorch.loggers.TensorBoardLogger",
        "init_args": {"save_dir": str(work / "runs"), "name": "bench"},
    }
    if mlflow is None:
        return [tensorboard]
    return [
        tensorboard,
        {
            "class_path": MLFLOW[mlflow],
            "init_args": {
                "experiment_name": "bench",
                "tracking_uri": f"sqlite:///{work}/mlflow.db",
            },
        },
        {
            "class_path": "lightning.pytorch.loggers.CSVLogger",
            "init_args": {"save_dir": str(work / "csv"), "name": "bench"},
        },
    ]


def _config(work: Path, name: str, settings: dict) -> str:
    path = work / f"{name}.yaml"
    path.write_text(yaml.safe_dump(settings))
    return str(path)


class LoggerClock:
    """Seconds spent inside each logger's methods (metrics, parameters, files, flushes)
    while the steady-state steps ran, wrapped around the logger objects themselves."""

    METHODS = ("log_metrics", "log_hyperparams", "save", "after_save_checkpoint")

    def __init__(self, loggers: list, timer: StepTimer) -> None:
        self.seconds: dict[str, float] = {}
        self.timer = timer
        for logger in loggers:
            for method in self.METHODS:
                if hasattr(logger, method):
                    setattr(
                        logger, method, self._timed(type(logger).__name__, getattr(logger, method))
                    )

    def _timed(self, name: str, method):
        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                return method(*args, **kwargs)
            finally:
                if self.timer.start is not None:  # the timed steps only
                    self.seconds[name] = self.seconds.get(name, 0.0) + time.perf_counter() - start

        return timed


def tokens_per_second(
    work: Path, mlflow: str | None, every: int, steps: int, warmup: int
) -> tuple[float, float, dict[str, float]]:
    """Steady-state tokens/s of the text recipe with the given loggers, the timed seconds,
    and the seconds of those spent in each logger."""
    loggers = _config(work, "loggers", {"trainer": {"logger": _loggers(work, mlflow)}})
    cli = PluginTrainCLI(
        args=[
            "--config",
            TEXT_RECIPE,
            "--config",
            loggers,
            f"--trainer.max_steps={steps}",
            f"--trainer.log_every_n_steps={every}",
            "--trainer.limit_val_batches=0",
            "--trainer.num_sanity_val_steps=0",
            "--trainer.enable_progress_bar=false",
            f"--checkpoint.dirpath={work}/checkpoints",
        ],
        run=False,
    )
    timer = StepTimer(warmup)
    cli.trainer.callbacks.append(timer)
    clock = LoggerClock(cli.trainer.loggers, timer)
    cli.trainer.fit(cli.model, datamodule=cli.datamodule)
    return timer.tokens / timer.seconds, timer.seconds, clock.seconds


def overhead(args: argparse.Namespace) -> None:
    """Side by side (best round each) and, steadier on a shared machine, the share of the
    timed steps spent inside the loggers that tracking adds."""
    arms: list[str | None] = [None, *MLFLOW]
    for every in (10, 1):
        best = dict.fromkeys(arms, 0.0)
        share = dict.fromkeys(arms, 0.0)
        for round_ in range(args.rounds):
            for mlflow in arms if round_ % 2 == 0 else arms[::-1]:
                with tempfile.TemporaryDirectory() as work:
                    rate, seconds, inside = tokens_per_second(
                        Path(work), mlflow, every, args.steps, args.warmup
                    )
                best[mlflow] = max(best[mlflow], rate)
                added = inside.get("MLFlowLogger", 0.0) + inside.get("CSVLogger", 0.0)
                share[mlflow] = max(share[mlflow], added / seconds)
        print(f"logging every {every:>2} steps: TensorBoard {best[None]:,.0f} tokens/s (baseline)")
        for mlflow in MLFLOW:
            print(
                f"  + {mlflow}'s MLFlowLogger + CSV: {best[mlflow]:,.0f} tokens/s, ratio"
                f" {best[mlflow] / best[None]:.3f}; MLflow + CSV took {share[mlflow]:.2%} of the"
                f" timed steps (ratio {1 / (1 + share[mlflow]):.4f} with nothing else changed)",
                flush=True,
            )


def _evaluated(log_dir: Path) -> dict[str, dict[int, float]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(log_dir))
    events.Reload()
    tags = [tag for tag in events.Tags()["scalars"] if tag.startswith("eval/")]
    return {tag: {e.step: e.value for e in events.Scalars(tag)} for tag in tags}


def evaluate(args: argparse.Namespace) -> None:
    options = {"data": args.chat_data, "limit": args.limit, "max_new_tokens": 16}
    with tempfile.TemporaryDirectory() as work:
        evaluate_cb = {
            "class_path": "plugintrain.callbacks.Evaluate",
            "init_args": {**options, "every_n_steps": args.every},
        }
        extra = {"trainer": {"logger": _loggers(Path(work), mlflow=None)}}
        start = time.perf_counter()
        cli = PluginTrainCLI(
            args=[
                "--config",
                CHAT_RECIPE,
                "--config",
                _config(Path(work), "chat", extra),
                f"--trainer.max_steps={args.chat_steps}",
                "--trainer.limit_val_batches=0",
                "--trainer.num_sanity_val_steps=0",
                "--trainer.enable_progress_bar=false",
                f"--trainer.callbacks+={json.dumps(evaluate_cb)}",
                f"--checkpoint.dirpath={work}/checkpoints",
            ],
            run=False,
        )
        cli.trainer.fit(cli.model, datamodule=cli.datamodule)
        fit_seconds = time.perf_counter() - start
        logged = _evaluated(Path(cli.trainer.logger.log_dir))
        standalone = [
            "evaluate", "--weights", "smollm2-135m", "--adapter", f"{work}/checkpoints",
            "--data", args.chat_data, "--limit", str(args.limit), "--max_new_tokens", "16",
            "--json", f"{work}/standalone.json",
        ]  # fmt: skip
        start = time.perf_counter()
        assert plugintrain_main(standalone) == 0
        in_process = time.perf_counter() - start
        result = json.loads(Path(work, "standalone.json").read_text())
        start = time.perf_counter()
        subprocess.run([sys.executable, "-m", "plugintrain", *standalone], check=True)
        command = time.perf_counter() - start
    for step, value in sorted(logged["eval/exact_match"].items()):
        seconds = logged["eval/seconds"][step]
        print(f"step {step:>3}: exact match {value:.3f}, evaluation {seconds:.1f} s in the run")
    print(
        f"fit of {args.chat_steps} steps with its evaluations: {fit_seconds:.1f} s;"
        f" standalone evaluate of the last checkpoint: exact match {result['exact_match']:.3f},"
        f" {in_process:.1f} s in this process, {command:.1f} s as a command"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--part", choices=["overhead", "evaluate", "all"], default="all")
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--chat_data", default="data/dates_chat")
    parser.add_argument("--chat_steps", type=int, default=12)
    parser.add_argument("--every", type=int, default=4)
    parser.add_argument("--limit", type=int, default=16)
    args = parser.parse_args()
    if args.part in ("overhead", "all"):
        overhead(args)
    if args.part in ("evaluate", "all"):
        evaluate(args)


if __name__ == "__main__":
    main()
