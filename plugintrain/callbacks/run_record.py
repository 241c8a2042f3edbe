"""What a run was, for the trackers and for the model card: the resolved recipe, the
plugintrain version and git commit, the data, the hardware, the last metrics."""

from __future__ import annotations

import hashlib
import json
import math
import subprocess
from pathlib import Path
from typing import Any

import torch
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.cli import SaveConfigCallback
from lightning.pytorch.loggers import Logger
from typing_extensions import override

import plugintrain
from plugintrain.core.peak_flops import cpu_name
from plugintrain.formats.model_card import RUN_RECORD_KEY

RUN_RECORD = RUN_RECORD_KEY
"""The checkpoint's top-level entry holding :meth:`RunRecord.record` (plain data), read
by ``export`` for the model card (:mod:`plugintrain.formats.model_card`)."""


class RunRecord(SaveConfigCallback):
    """LightningCLI's ``SaveConfigCallback`` (``config.yaml`` in the log directory) that
    also tells every logger what the run is, and stores it in each checkpoint.

    On global rank 0, once per run, each logger of ``trainer.loggers`` gets the run's
    parameters (``plugintrain_version``, ``git_commit``, ``strategy``, ``precision``,
    ``accelerator``, ``device_name``, ``devices``, ``num_nodes``, and per data folder
    ``data/NAME/meta_sha256`` and ``data/NAME/tokenizer``) through ``log_hyperparams``,
    and the files as artifacts where the logger keeps files: MLflow and W&B get
    ``config.yaml`` and each folder's ``meta.json`` (under ``data/NAME/``); TensorBoard
    gets the recipe as a text summary. Every checkpoint holds the same record, with the
    step, the last value of each logged metric and the newest evaluation
    (:class:`~plugintrain.callbacks.Evaluate`), under :data:`RUN_RECORD`.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._record: dict[str, Any] | None = None
        self._config_path: Path | None = None
        self._recipe: str | None = None

    @override
    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        if self._record is None:
            self._record = self._describe(trainer, pl_module)
            # trainer.log_dir is a broadcast: read it here, on every rank, never in
            # save_config, which runs on rank 0 alone
            log_dir = trainer.log_dir
            if log_dir is None and self.save_to_log_dir:
                log_dir = self._save_beside_checkpoints(trainer)
            self._config_path = Path(log_dir or ".") / self.config_filename
        super().setup(trainer, pl_module, stage)

    def _save_beside_checkpoints(self, trainer: Trainer) -> str:
        """Where the first logger has no folder (an MLflow store in a database, W&B):
        ``config.yaml`` goes beside the run's checkpoints (``runs/<experiment>/``), written
        here on rank 0, as Lightning's callback would have in the logger's folder."""
        from plugintrain.tracking import logger_home

        config = self.config.get(str(self.config.get("subcommand")), self.config)
        home = logger_home(config.get("trainer", {}).get("logger"))
        folder = Path(*home) if home is not None else Path(trainer.default_root_dir)
        self.save_to_log_dir = False
        if trainer.is_global_zero:
            folder.mkdir(parents=True, exist_ok=True)
            self.parser.save(
                self.config,
                str(folder / self.config_filename),
                skip_none=False,
                overwrite=self.overwrite,
                multifile=self.multifile,
            )
        return str(folder)

    @override
    def save_config(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        config = self._config_path or Path(self.config_filename)
        if config.is_file():  # just written by this rank: the recipe without a second dump
            self._recipe = config.read_text()
        record = {**(self._record or self._describe(trainer, pl_module)), "recipe": self.recipe()}
        for logger in trainer.loggers:
            logger.log_hyperparams(run_parameters(record))
            _log_files(logger, record, config if config.is_file() else None)

    def recipe(self) -> str:
        """The resolved recipe, as ``config.yaml`` holds it (dumped once, where this rank
        did not write the file)."""
        if self._recipe is None:
            self._recipe = self.parser.dump(self.config, skip_none=False)
        return self._recipe

    def record(self, trainer: Trainer) -> dict[str, Any]:
        """The run's record now: what :meth:`setup` found, the step, the last metrics and
        the newest evaluation."""
        evaluation = next(
            (c.latest for c in trainer.callbacks if getattr(c, "latest", None) is not None),
            None,
        )
        return {
            **(self._record or {}),
            "recipe": self.recipe(),
            "step": trainer.global_step,
            "epoch": trainer.current_epoch,
            "metrics": _scalars(trainer.callback_metrics),
            "evaluation": evaluation,
        }

    @override
    def on_save_checkpoint(
        self, trainer: Trainer, pl_module: LightningModule, checkpoint: dict[str, Any]
    ) -> None:
        checkpoint[RUN_RECORD] = self.record(trainer)

    def _describe(self, trainer: Trainer, pl_module: LightningModule) -> dict[str, Any]:
        model = self.config.get(str(self.config.get("subcommand")), self.config).get("model")
        init = (model.get("init_args") if model is not None else None) or {}
        return {
            "plugintrain_version": plugintrain.__version__,
            "git_commit": git_commit(Path.cwd()),
            "model": {
                "class_path": type(pl_module).__module__ + "." + type(pl_module).__qualname__,
                "weights": init.get("weights"),
                "config": init.get("config") if isinstance(init.get("config"), str) else None,
            },
            "data": [_folder(path) for path in data_folders(trainer)],
            "hardware": hardware(trainer),
            "strategy": type(trainer.strategy).__name__,
            "precision": str(trainer.precision),
            "adapter": _adapter(trainer),
        }


def run_parameters(record: dict[str, Any]) -> dict[str, Any]:
    """The record's flat parameters, as trackers take them (strings and numbers)."""
    hardware = record.get("hardware") or {}
    params: dict[str, Any] = {
        "plugintrain_version": record.get("plugintrain_version"),
        "git_commit": record.get("git_commit") or "none",
        "strategy": record.get("strategy"),
        "precision": record.get("precision"),
        **{
            key: hardware.get(key) for key in ("accelerator", "device_name", "devices", "num_nodes")
        },
    }
    for folder in record.get("data") or []:
        params[f"data/{folder['name']}/meta_sha256"] = folder["meta_sha256"]
        params[f"data/{folder['name']}/tokenizer"] = folder["meta"].get("tokenizer") or "none"
    return params


def _log_files(logger: Logger, record: dict[str, Any], config: Path | None) -> None:
    """The recipe and the data's ``meta.json`` files, where ``logger`` keeps files."""
    from lightning.pytorch.loggers import CometLogger, MLFlowLogger, TensorBoardLogger, WandbLogger

    metas = [(Path(f["path"]) / "meta.json", f"data/{f['name']}") for f in record["data"]]
    metas = [(file, where) for file, where in metas if file.is_file()]
    if isinstance(logger, MLFlowLogger):
        for file, where in [*([(config, None)] if config else []), *metas]:
            logger.experiment.log_artifact(logger.run_id, str(file), where)
    elif isinstance(logger, WandbLogger):
        for file, _ in [*([(config, None)] if config else []), *metas]:
            logger.experiment.save(str(file), base_path=str(file.parent.parent), policy="now")
    elif isinstance(logger, CometLogger):
        for file, where in [*([(config, None)] if config else []), *metas]:
            name = f"{where}/{file.name}" if where else file.name
            logger.experiment.log_asset(str(file), file_name=name)
    elif isinstance(logger, TensorBoardLogger):
        recipe = "\n".join(f"    {line}" for line in record["recipe"].splitlines())
        logger.experiment.add_text("recipe", recipe, 0)


def _scalars(metrics: dict[str, Any]) -> dict[str, float]:
    """The finite scalar metrics of ``metrics``, as floats."""
    scalars = {}
    for name, value in metrics.items():
        number = float(value.item() if isinstance(value, torch.Tensor) else value)
        if math.isfinite(number):
            scalars[name] = number
    return scalars


def git_commit(where: Path) -> str | None:
    """The commit checked out at ``where`` (``+dirty`` with uncommitted changes to tracked
    files), or None outside a git work tree or without git."""
    try:
        head = subprocess.run(
            ["git", "-C", str(where), "rev-parse", "HEAD"],
            capture_output=True,
            text=True,
            timeout=10,
            check=True,
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "-C", str(where), "status", "--porcelain", "--untracked-files=no"],
            capture_output=True,
            text=True,
            timeout=10,
            check=True,
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None
    return f"{head}+dirty" if dirty else head


def data_folders(trainer: Trainer) -> list[Path]:
    """The prepared folders the datamodule reads (its ``data_dir`` and a mixture's)."""
    datamodule = getattr(trainer, "datamodule", None)
    folders = [getattr(datamodule, "data_dir", None)]
    folders += [path for path, _ in getattr(datamodule, "mix", None) or []]
    return [Path(f) for f in dict.fromkeys(folders) if f is not None and Path(f).is_dir()]


def _folder(path: Path) -> dict[str, Any]:
    file = path / "meta.json"
    raw = file.read_bytes() if file.is_file() else b"{}"
    meta = json.loads(raw)
    return {
        "path": str(path),
        "name": path.name,
        "meta": meta if isinstance(meta, dict) else {},
        "meta_sha256": hashlib.sha256(raw).hexdigest() if file.is_file() else None,
    }


def hardware(trainer: Trainer) -> dict[str, Any]:
    """The accelerator, its device's name, the number of processes and of nodes."""
    root = trainer.strategy.root_device
    name = torch.cuda.get_device_name(root) if root.type == "cuda" else cpu_name()
    return {
        "accelerator": root.type,
        "device_name": name,
        "devices": trainer.world_size,
        "num_nodes": trainer.num_nodes,
    }


def _adapter(trainer: Trainer) -> dict[str, Any] | None:
    """The LoRA callback's rank, alpha, target modules and base quantization, if the run
    has one."""
    for callback in trainer.callbacks:
        spec = getattr(callback, "spec", None)
        if type(callback).__name__ == "LoRA" and spec is not None:
            return {
                "r": spec.r,
                "alpha": spec.alpha,
                "target_modules": list(spec.target_modules),
                "quantize": spec.quantize,
            }
    return None
