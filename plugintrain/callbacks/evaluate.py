"""``plugintrain evaluate`` during training: every N steps and at the end, logged to every
logger."""

from __future__ import annotations

import tempfile
import time
from argparse import Namespace
from pathlib import Path
from typing import Any

import torch
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.utilities import rank_zero_info
from typing_extensions import override

RESULT_METRICS = (
    "loss",
    "perplexity",
    "bits_per_byte",
    "exact_match",
    "contains",
    "preference_accuracy",
    "reward_margin",
    "reference_accuracy",
)
"""The measures of ``plugintrain evaluate --json`` that are logged (as ``eval/NAME``)."""


class Evaluate(Callback):
    """Run what ``plugintrain evaluate`` runs, every ``every_n_steps`` optimizer steps and
    at the last step, and log the results to every logger as ``eval/NAME`` (``eval/loss``,
    ``eval/exact_match``, ...; lm-eval tasks as ``eval/TASK/METRIC``), with the time it
    took as ``eval/seconds``.

    The data and options are ``evaluate``'s, checked when the recipe is read, before
    anything is launched: a file or folder of the wrong kind, a tokenizer other than the
    model's, options that do not apply, tasks lm-eval cannot run, are one line each.

    Where the weights are evaluated: where every rank holds the whole model (one device,
    DDP, ZeRO-1/2), rank 0 evaluates the live model in place (adapters unmerged, in eval
    mode, no gradients) while the other ranks wait. Where the layout shards the weights
    (tensor, pipeline, expert or context parallel, FSDP2), the run writes a checkpoint as
    ``ModelCheckpoint`` would (each rank its shards) to a temporary folder, and rank 0
    loads it as ``plugintrain evaluate --weights`` does, evaluates it and deletes it: one
    whole copy on rank 0, none on the others. Either way every rank waits at a barrier, so
    keep ``limit`` small enough that an evaluation ends inside the collective timeout.

    The newest results are kept as :attr:`latest`, which
    :class:`~plugintrain.callbacks.run_record.RunRecord` stores in checkpoints (and the
    model card of ``export`` shows).

    Args:
        data: ``evaluate --data``: a prepared text, chat or preference folder, or a .jsonl
            file of conversations ending with the reference answer.
        tasks: ``evaluate --tasks``: lm-evaluation-harness tasks, comma-separated.
        include_path: A folder of your own lm-eval task YAMLs.
        num_fewshot: lm-eval's few-shot examples.
        every_n_steps: Evaluate every this many optimizer steps; 0: only at the end.
        split: A folder's split (default: val).
        seq_len: Text: tokens a window (default: block_size).
        max_new_tokens: Chat: most tokens an answer.
        batch_size: Windows or examples a batch.
        limit: The first N windows, examples or task documents.
        template: Chat: a .jinja chat template, or plain (default: the data's, else the
            model's own).
        beta: Preference: DPO's beta, the reward margin's scale.
    """

    def __init__(
        self,
        data: str | None = None,
        tasks: str | None = None,
        include_path: str | None = None,
        num_fewshot: int | None = None,
        every_n_steps: int = 0,
        split: str | None = None,
        seq_len: int | None = None,
        max_new_tokens: int = 128,
        batch_size: int = 8,
        limit: int | None = None,
        template: str | None = None,
        beta: float = 0.1,
    ) -> None:
        if every_n_steps < 0:
            raise ValueError(
                f"Evaluate every_n_steps={every_n_steps}: pass a number of steps >= 1, or 0"
                " to evaluate only at the end"
            )
        self.every_n_steps = every_n_steps
        self.args = Namespace(
            weights=None,
            adapter=None,
            data=data,
            tasks=tasks,
            include_path=include_path,
            num_fewshot=num_fewshot,
            split=split,
            seq_len=seq_len,
            max_new_tokens=max_new_tokens,
            batch_size=batch_size,
            limit=limit,
            template=template,
            beta=beta,
            reference=None,
            reference_logps=None,
            device=None,
        )
        self.found, self.tasks = check_options(self.args)
        self.latest: dict[str, Any] | None = None
        self._evaluated_at = -1

    def check_model(self, module: Any, strategy: Any = None) -> None:
        """Refuse data of another tokenizer than ``module``'s (before launch)."""
        from plugintrain.tools.evaluate import _check_tokenizer

        if self.found is not None and getattr(module, "config", None) is not None:
            _check_tokenizer(self.found, module)

    @override
    def on_train_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, *args: Any, **kwargs: Any
    ) -> None:
        step = trainer.global_step
        due = self.every_n_steps and step % self.every_n_steps == 0
        last = trainer.max_steps > 0 and step >= trainer.max_steps  # -1: bounded by epochs
        if step > 0 and step != self._evaluated_at and (due or last):
            self.evaluate(trainer, pl_module)

    @override
    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if trainer.global_step != self._evaluated_at:  # a run bounded by epochs, or stopped
            self.evaluate(trainer, pl_module)

    def evaluate(self, trainer: Trainer, pl_module: LightningModule) -> dict[str, Any] | None:
        """Evaluate the weights as they are now (every rank calls it), log the results
        from rank 0, and return them on every rank."""
        self._evaluated_at = trainer.global_step
        started = time.perf_counter()
        if holds_whole_weights(trainer):
            found = self._in_place(trainer, pl_module) if trainer.is_global_zero else None
        else:
            found = self._from_checkpoint(trainer, pl_module)
        trainer.strategy.barrier("plugintrain-evaluate")
        found = trainer.strategy.broadcast(found)
        if found is None:
            return None
        found["seconds"] = time.perf_counter() - started
        self.latest = {"step": trainer.global_step, "data": self.args.data, **found}
        if trainer.is_global_zero:
            metrics = evaluation_metrics(found)
            for logger in trainer.loggers:
                logger.log_metrics(metrics, step=trainer.global_step)
            shown = ", ".join(f"{k.removeprefix('eval/')} {v:.4g}" for k, v in metrics.items())
            rank_zero_info(f"Evaluate at step {trainer.global_step}: {shown}")
        return self.latest

    def _in_place(self, trainer: Trainer, pl_module: LightningModule) -> dict[str, Any]:
        """Rank 0: the live module, in eval mode for the evaluation."""
        was_training = pl_module.training
        pl_module.eval()
        try:
            return self._run(pl_module)
        finally:
            pl_module.train(was_training)

    def _from_checkpoint(self, trainer: Trainer, pl_module: LightningModule) -> dict[str, Any]:
        """Every rank writes its shards; rank 0 loads the whole model and evaluates it."""
        from plugintrain.tools._models import load_model

        root = trainer.log_dir or trainer.default_root_dir
        folder = (
            Path(tempfile.mkdtemp(prefix="evaluate-", dir=root)) if trainer.is_global_zero else None
        )
        folder = Path(trainer.strategy.broadcast(str(folder)))
        path = folder / f"step-{trainer.global_step}.ckpt"
        trainer.save_checkpoint(path)
        results = None
        if trainer.is_global_zero:
            try:
                base = getattr(pl_module, "weights", None) if _has_adapter(trainer) else None
                weights, adapter = (base, str(path)) if base is not None else (str(path), None)
                module = load_model(weights, adapter, merge=True).to(pl_module.device)
                results = self._run(module)
                del module
            finally:
                _remove(folder)  # never leave a whole checkpoint behind
        return results

    def _run(self, module: Any) -> dict[str, Any]:
        """``evaluate``'s results on ``module`` (results of ``--data``, lm-eval's task
        metrics of ``--tasks``)."""
        from plugintrain.tools.evaluate import evaluate

        if self.found is not None:
            with torch.inference_mode():
                return {"results": evaluate(module, self.found, self.args), "tasks": {}}
        return {"results": {}, "tasks": run_tasks(module, self.tasks, self.args)}


def check_options(args: Namespace) -> tuple[Any, Any]:
    """``evaluate``'s checks of the options and the data (or the tasks), before launch:
    the data opened (None for tasks) and the tasks checked
    (:func:`plugintrain.tools.lm_eval_tasks.check_tasks`; None for data).

    Raises:
        ValueError: One line naming the option and the fix.
    """
    from plugintrain.tools.evaluate import _argument_problem, _options_problem, open_data

    problem = _argument_problem(Namespace(**{**vars(args), "weights": "."}))  # the run's
    if problem is not None:
        raise ValueError(f"Evaluate: {problem.replace('--', '')}")
    if args.tasks is not None:
        from plugintrain.tools.lm_eval_tasks import check_tasks

        tasks = [t for t in args.tasks.split(",") if t]
        try:
            return None, check_tasks(tasks, args.include_path, args.num_fewshot)
        except ValueError as error:
            raise ValueError(f"Evaluate: {str(error).replace('--', '')}") from None
    found = open_data(Path(args.data), args.split, args.limit)
    problem = _options_problem(args, found)
    if problem is not None:
        raise ValueError(f"Evaluate: {problem.replace('--', '')}")
    return found, None


def run_tasks(module: Any, checked: Any, args: Namespace) -> dict[str, dict[str, float]]:
    """lm-eval's tasks (checked before launch) on the live ``module``: each task's numeric
    metrics."""
    from plugintrain.tools.lm_eval_model import PluginTrainLM
    from plugintrain.tools.lm_eval_tasks import run_tasks as run_checked

    model = PluginTrainLM(
        module=module, batch_size=args.batch_size, max_gen_toks=args.max_new_tokens
    )
    results = run_checked(checked, model, args.limit)
    return {
        task: {k: float(v) for k, v in values.items() if isinstance(v, int | float)}
        for task, values in results["results"].items()
    }


def evaluation_metrics(found: dict[str, Any]) -> dict[str, float]:
    """The logged metrics of one evaluation: ``eval/NAME`` of ``evaluate``'s measures,
    ``eval/TASK/METRIC`` of lm-eval's (its ``acc,none`` written ``acc``)."""
    metrics = {
        f"eval/{name}": float(value)
        for name, value in found["results"].items()
        if name in RESULT_METRICS and value is not None
    }
    for task, values in found["tasks"].items():
        for name, value in values.items():
            metric, _, flt = name.partition(",")
            suffix = "" if flt in ("", "none") else f"_{flt}"
            metrics[f"eval/{task}/{metric}{suffix}"] = value
    if "seconds" in found:
        metrics["eval/seconds"] = float(found["seconds"])
    return metrics


def holds_whole_weights(trainer: Trainer) -> bool:
    """Whether every rank holds the whole model and runs it alone: no tensor, pipeline,
    expert or context parallelism and no FSDP2 (``hybrid``'s layout), and not Lightning's
    own ``fsdp`` or ``deepspeed``; any other strategy (one device, DDP, ZeRO-1/2)."""
    from lightning.pytorch.strategies import DeepSpeedStrategy, FSDPStrategy

    if isinstance(trainer.strategy, FSDPStrategy | DeepSpeedStrategy):
        return False  # Lightning's own sharding: a forward on one rank would wait for peers
    dims = getattr(trainer.strategy, "dims", None)
    if dims is None:
        return True
    single = dims.tp == 1 and dims.pp == 1 and dims.ep == 1 and dims.cp == 1
    return single and not dims.fsdp_enabled


def _has_adapter(trainer: Trainer) -> bool:
    return any(type(c).__name__ == "LoRA" for c in trainer.callbacks)


def _remove(folder: Path) -> None:
    import shutil

    shutil.rmtree(folder, ignore_errors=True)
