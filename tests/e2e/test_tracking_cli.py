"""Run tracking through the command line (issue 47): several loggers at once, each read
back with its own tool, on real multi-rank layouts; and bad tracking input refused in one
line before anything starts.

Each run is ``plugintrain fit`` of the Llama 3 debug recipe on real tokens (rows of 32, 4
steps, every step logged, validation every 2), forked as torchrun starts its ranks, with
TensorBoard + MLflow (a SQLite store) + CSV (+ W&B offline) under ``trainer.logger``. Every
scalar is read back with the tool's own reader (TensorBoard's event accumulator,
``mlflow.MlflowClient``'s metric history, the CSV file, W&B's records through its
protobuf schema: ``tests/reference/wandb_records.py``) and must agree at every step, name
for name (TensorBoard stores float32). Layouts: ZeRO-2 over 2 ranks (each rank a half
batch, rank 0 logging what Lightning reduces) and a 2-stage pipeline (the loss computed
on the last stage, rank 1, logged from rank 0).
"""

from __future__ import annotations

import csv
import hashlib
import json
import math
from pathlib import Path

import pytest
import yaml

from plugintrain.cli import main

from _cli import RECIPES, run_cli

STEPS = 4
IGNORED = {"hp_metric"}  # TensorBoard's placeholder for hparams, no metric of ours


def _loggers(out: Path, every_tracker: bool) -> list[dict]:
    """TensorBoard, MLflow and CSV; with ``every_tracker``, plugintrain's MLflow logger
    (metrics written in batches: a 4-step run writes them all when it ends), W&B offline
    and Comet offline too, else Lightning's MLflow logger."""
    mlflow = "plugintrain.loggers" if every_tracker else "lightning.pytorch.loggers"
    loggers = [
        {
            "class_path": "lightning.pytorch.loggers.TensorBoardLogger",
            "init_args": {"save_dir": str(out), "name": "run"},
        },
        {
            "class_path": f"{mlflow}.MLFlowLogger",
            "init_args": {"experiment_name": "run", "tracking_uri": f"sqlite:///{out}/mlflow.db"},
        },
        {
            "class_path": "lightning.pytorch.loggers.CSVLogger",
            "init_args": {"save_dir": str(out / "csv"), "name": "run"},
        },
    ]
    if every_tracker:
        loggers += [
            {
                "class_path": "lightning.pytorch.loggers.WandbLogger",
                "init_args": {"save_dir": str(out), "offline": True, "project": "run"},
            },
            {
                "class_path": "plugintrain.loggers.CometLogger",
                "init_args": {"online": False, "offline_directory": str(out / "comet")},
            },
        ]
    return loggers


def _fit(
    work: Path,
    name: str,
    data: Path,
    ranks: int,
    strategy: object,
    every_tracker: bool,
    *extra_args: str,
) -> Path:
    out = work / name
    out.mkdir()
    extra = out / "loggers.yaml"
    loggers = _loggers(out, every_tracker)
    extra.write_text(yaml.safe_dump({"trainer": {"logger": loggers, "strategy": strategy}}))
    run_cli(
        "fit",
        "--config",
        str(RECIPES / "llama3_debug_shakespeare_cpu.yaml"),
        "--config",
        str(extra),
        f"--data.init_args.data_dir={data}",
        "--data.init_args.seq_len=32",
        "--data.init_args.batch_size=4",
        f"--trainer.max_steps={STEPS}",
        "--trainer.val_check_interval=2",
        "--trainer.limit_val_batches=1",
        "--trainer.log_every_n_steps=1",
        "--trainer.enable_progress_bar=false",
        f"--trainer.devices={ranks}",
        *extra_args,
        cwd=work,
        fresh_interpreter=False,
        ranks=ranks,
    )
    return out


def _tensorboard(out: Path) -> dict[str, dict[int, float]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(out / "run" / "version_0"))
    events.Reload()
    tags = [t for t in events.Tags()["scalars"] if t not in IGNORED]
    return {tag: {e.step: e.value for e in events.Scalars(tag)} for tag in tags}


def _csv(out: Path) -> dict[str, dict[int, float]]:
    with (out / "csv" / "run" / "version_0" / "metrics.csv").open() as file:
        rows = list(csv.DictReader(file))
    metrics: dict[str, dict[int, float]] = {}
    for row in rows:
        for name, value in row.items():
            if name != "step" and value != "":
                metrics.setdefault(name, {})[int(row["step"])] = float(value)
    return metrics


def _mlflow(out: Path) -> tuple[dict[str, dict[int, float]], object, object]:
    from mlflow import MlflowClient

    client = MlflowClient(tracking_uri=f"sqlite:///{out}/mlflow.db")
    (run,) = client.search_runs([client.get_experiment_by_name("run").experiment_id])
    metrics = {
        name: {m.step: m.value for m in client.get_metric_history(run.info.run_id, name)}
        for name in run.data.metrics
    }
    return metrics, run, client


def _wandb(out: Path) -> tuple[dict[str, dict[int, float]], dict]:
    from reference.wandb_records import config, history

    (file,) = (out / "wandb").glob("offline-run-*/run-*.wandb")
    metrics: dict[str, dict[int, float]] = {}
    for row in history(file):
        step = row.pop("trainer/global_step", None)
        for name, value in row.items():
            if not name.startswith("_") and step is not None:
                metrics.setdefault(name, {})[int(step)] = float(value)
    return metrics, config(file)


def _comet(out: Path) -> tuple[dict[str, dict[int, float]], dict]:
    """The run's metrics in its Comet offline archive, less Comet's own system metrics, with
    Lightning's ``epoch`` (which Comet keeps on each metric, not as one) left out."""
    from reference.comet_records import read

    (archive,) = (out / "comet").glob("*.zip")
    metrics, parameters = read(archive)
    ours = {
        k: v for k, v in metrics.items() if not k.startswith("sys.") and k != "process duration"
    }
    return ours, parameters


def _assert_same(got: dict[str, dict[int, float]], want: dict[str, dict[int, float]]) -> None:
    assert set(got) == set(want), set(got) ^ set(want)
    for name, series in want.items():
        assert set(got[name]) == set(series), name
        for step, value in series.items():
            assert math.isclose(got[name][step], value, rel_tol=1e-6, abs_tol=1e-12), (name, step)


def _check_run(out: Path, data: Path) -> object:
    """Every logger holds the same scalars; MLflow holds the run's parameters and files."""
    tensorboard, written = _tensorboard(out), _csv(out)
    tracked, run, client = _mlflow(out)
    _assert_same(written, tensorboard)
    _assert_same(tracked, tensorboard)
    assert set(range(STEPS)) <= set(tensorboard["train_loss"])  # every step, from rank 0
    assert {"val_loss", "val_bpb", "grad_norm"} <= set(tensorboard)
    params = run.data.params
    meta = hashlib.sha256((data / "meta.json").read_bytes()).hexdigest()
    assert params[f"data/{data.name}/meta_sha256"] == meta
    assert params["plugintrain_version"] and params["strategy"] and params["git_commit"]
    files = {a.path for a in client.list_artifacts(run.info.run_id)}
    inner = {a.path for a in client.list_artifacts(run.info.run_id, f"data/{data.name}")}
    assert "config.yaml" in files and f"data/{data.name}/meta.json" in inner
    return tensorboard


@pytest.fixture(scope="module")
def work(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("tracking")


def test_zero2_on_two_ranks_logs_the_same_scalars_to_every_tracker(
    work: Path, shakespeare_llama3: Path
) -> None:
    out = _fit(work, "zero2", shakespeare_llama3, 2, "zero2", every_tracker=True)
    tensorboard = _check_run(out, shakespeare_llama3)
    reported, settings = _wandb(out)
    _assert_same(reported, tensorboard)
    assert settings["plugintrain_version"]
    commented, parameters = _comet(out)
    _assert_same(commented, {k: v for k, v in tensorboard.items() if k != "epoch"})
    assert parameters["plugintrain_version"] == settings["plugintrain_version"]


def test_a_two_stage_pipeline_logs_its_last_stage_loss_and_evaluation_to_every_tracker(
    work: Path, shakespeare_llama3: Path
) -> None:
    """Each rank holds half the layers: the Evaluate callback writes a checkpoint of both
    stages' shards and rank 0 evaluates it whole; what it logs at the last step is what
    ``plugintrain evaluate`` gives the run's last checkpoint."""
    pipeline = {
        "class_path": "plugintrain.strategies.HybridParallelStrategy",
        "init_args": {"pipeline_parallel": 2, "schedule": "1f1b"},
    }
    options = ["--seq_len", "32", "--limit", "4", "--batch_size", "2"]
    evaluate = [
        "--trainer.callbacks+=plugintrain.callbacks.Evaluate",
        f"--trainer.callbacks.data={shakespeare_llama3}",
        "--trainer.callbacks.every_n_steps=2",
        "--checkpoint.every_n_train_steps=4",
        *(f"--trainer.callbacks.{k.removeprefix('--')}={v}" for k, v in _pairs(options)),
    ]
    out = _fit(work, "pp2", shakespeare_llama3, 2, pipeline, False, *evaluate)
    tensorboard = _check_run(out, shakespeare_llama3)
    assert set(tensorboard["eval/loss"]) == {2, 4}
    result = out / "standalone.json"
    weights = out / "run" / "checkpoints"
    args = ["evaluate", "--weights", str(weights), "--data", str(shakespeare_llama3), *options]
    assert main([*args, "--json", str(result)]) == 0
    measured = json.loads(result.read_text())
    for measure in ("loss", "bits_per_byte"):
        assert tensorboard[f"eval/{measure}"][4] == pytest.approx(measured[measure], rel=1e-5)
    assert not list(out.rglob("evaluate-*"))  # the temporary checkpoints are gone


def _pairs(options: list[str]) -> list[tuple[str, str]]:
    return list(zip(options[::2], options[1::2], strict=True))


def _refused(work: Path, data: Path, name: str, settings: dict) -> str:
    """The last line of ``fit``'s stderr with ``settings``, which must be refused (exit 2)
    before anything is written."""
    extra = work / f"{name}.yaml"
    extra.write_text(yaml.safe_dump(settings))
    out = work / name
    proc = run_cli(
        "fit", "--config", str(RECIPES / "llama3_debug_shakespeare_cpu.yaml"),
        "--config", str(extra), f"--data.init_args.data_dir={data}",
        f"--trainer.default_root_dir={out}",
        cwd=work, exit_code=2, fresh_interpreter=False,
    )  # fmt: skip
    assert "Traceback" not in proc.stderr and "usage:" not in proc.stderr, proc.stderr
    assert not out.exists() and not (work / "runs").exists()
    return proc.stderr.strip().splitlines()[-1]


def test_an_unreachable_tracking_server_is_one_line_before_launch(
    work: Path, shakespeare_llama3: Path
) -> None:
    logger = {
        "class_path": "lightning.pytorch.loggers.MLFlowLogger",
        "init_args": {"tracking_uri": "http://127.0.0.1:9"},  # the discard port: refused
    }
    line = _refused(work, shakespeare_llama3, "unreachable", {"trainer": {"logger": logger}})
    assert "tracking_uri http://127.0.0.1:9: unreachable (" in line
    assert "mlflow server --backend-store-uri sqlite:///runs/mlflow.db" in line


def test_an_evaluation_file_of_the_wrong_kind_is_one_line_before_launch(
    work: Path, shakespeare_llama3: Path
) -> None:
    evaluate = {"class_path": "plugintrain.callbacks.Evaluate", "init_args": {"data": __file__}}
    line = _refused(work, shakespeare_llama3, "wrong_kind", {"trainer": {"callbacks": [evaluate]}})
    assert f"--data {__file__}: not a file of conversations" in line


def test_mlflow_alone_tracks_to_its_default_store_with_the_recipe_beside_the_checkpoints(
    work: Path, shakespeare_llama3: Path
) -> None:
    """MLflow as the only logger (no folder of its own): the SQLite store under runs/ by
    default, config.yaml and the checkpoints under runs/<experiment>/, the recipe logged."""
    from mlflow import MlflowClient

    out = work / "alone"
    out.mkdir()
    logger = {
        "class_path": "lightning.pytorch.loggers.MLFlowLogger",
        "init_args": {"experiment_name": "alone"},
    }
    (out / "logger.yaml").write_text(yaml.safe_dump({"trainer": {"logger": logger}}))
    run_cli(
        "fit", "--config", str(RECIPES / "llama3_debug_shakespeare_cpu.yaml"),
        "--config", str(out / "logger.yaml"), f"--data.init_args.data_dir={shakespeare_llama3}",
        "--data.init_args.seq_len=32", "--data.init_args.batch_size=2",
        "--trainer.max_steps=2", "--trainer.limit_val_batches=0",
        "--trainer.log_every_n_steps=1", "--trainer.enable_progress_bar=false",
        cwd=out, fresh_interpreter=False,
    )  # fmt: skip
    assert (out / "runs/alone/config.yaml").is_file()
    assert (out / "runs/alone/checkpoints/last.ckpt").is_file()
    client = MlflowClient(tracking_uri=f"sqlite:///{out}/runs/mlflow.db")
    (run,) = client.search_runs([client.get_experiment_by_name("alone").experiment_id])
    assert [m.step for m in client.get_metric_history(run.info.run_id, "train_loss")] == [0, 1]
    assert "config.yaml" in {a.path for a in client.list_artifacts(run.info.run_id)}
