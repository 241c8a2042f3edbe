"""plugintrain's own loggers (``plugintrain.loggers``), each against Lightning's.

``MLFlowLogger`` writes metrics in batches: what reaches the store (read back with
``mlflow.MlflowClient``) must be what Lightning's ``MLFlowLogger`` writes for the same
calls, name for name and step for step, once the run ends, fails, or a checkpoint is
recorded; and nothing before ``flush_every_s`` has passed. ``CometLogger`` offline writes
the archive ``comet upload`` reads (checked with Comet's own schemas and message classes),
where Lightning's writes nothing.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
from lightning.pytorch.loggers import MLFlowLogger as LightningMLFlowLogger

from plugintrain.loggers import MAX_METRICS_PER_CALL, CometLogger, MLFlowLogger

STEPS = 30


def _history(uri: str, experiment: str) -> dict[str, list[tuple[int, float, int]]]:
    """Metric name -> (step, value, timestamp) of the experiment's one run, in the store."""
    from mlflow import MlflowClient

    client = MlflowClient(tracking_uri=uri)
    found = client.get_experiment_by_name(experiment)
    if found is None:
        return {}
    (run,) = client.search_runs([found.experiment_id])
    return {
        name: sorted(
            (m.step, m.value, m.timestamp) for m in client.get_metric_history(run.info.run_id, name)
        )
        for name in run.data.metrics
    }


def _log(logger: object) -> None:
    """What a training loop logs: a step's metrics, then the learning rate, each call apart."""
    for step in range(STEPS):
        logger.log_metrics({"train_loss": 1 / (step + 1), "grad_norm": float(step)}, step=step)
        logger.log_metrics({"lr-AdamW": 1e-3 * math.cos(step)}, step=step)


def test_batched_metrics_reach_the_store_as_lightnings_do(tmp_path: Path) -> None:
    uri = f"sqlite:///{tmp_path}/mlflow.db"
    reference = LightningMLFlowLogger(experiment_name="lightning", tracking_uri=uri)
    batched = MLFlowLogger(experiment_name="batched", tracking_uri=uri, flush_every_s=3600)
    _log(reference)
    _log(batched)
    assert _history(uri, "batched") == {}  # kept: nothing written within the hour
    batched.finalize("success")
    want, got = _history(uri, "lightning"), _history(uri, "batched")
    assert set(got) == set(want) == {"train_loss", "grad_norm", "lr-AdamW"}
    for name in want:
        assert [(s, v) for s, v, _ in got[name]] == [(s, v) for s, v, _ in want[name]], name
        # each keeps the time it was logged at, not the time it was written
        assert [t for *_, t in got[name]] == sorted(t for *_, t in got[name])


def test_metrics_are_written_once_flush_every_s_has_passed_and_before_a_checkpoint(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import plugintrain.loggers as loggers

    now = [1000.0]
    monkeypatch.setattr(loggers.time, "monotonic", lambda: now[0])
    uri = f"sqlite:///{tmp_path}/mlflow.db"
    logger = MLFlowLogger(experiment_name="e", tracking_uri=uri, flush_every_s=5)
    logger.log_metrics({"train_loss": 2.0}, step=0)
    now[0] += 4.9
    logger.log_metrics({"train_loss": 1.5}, step=1)
    assert _history(uri, "e") == {}
    now[0] += 0.1
    logger.log_metrics({"train_loss": 1.0}, step=2)  # 5 s since the logger began: written
    assert [s for s, *_ in _history(uri, "e")["train_loss"]] == [0, 1, 2]
    logger.log_metrics({"train_loss": 0.5}, step=3)
    logger.after_save_checkpoint(checkpoint_callback=_NoCheckpoint())
    assert [s for s, *_ in _history(uri, "e")["train_loss"]] == [0, 1, 2, 3]


class _NoCheckpoint:
    save_top_k = 1


def test_a_failed_run_and_the_exit_handlers_lose_nothing(tmp_path: Path) -> None:
    import plugintrain.loggers as loggers

    uri = f"sqlite:///{tmp_path}/mlflow.db"
    failed = MLFlowLogger(experiment_name="failed", tracking_uri=uri, flush_every_s=3600)
    failed.log_metrics({"train_loss": 1.0}, step=0)
    failed.finalize("failed")
    assert len(_history(uri, "failed")["train_loss"]) == 1
    left = MLFlowLogger(experiment_name="left", tracking_uri=uri, flush_every_s=3600)
    left.log_metrics({"train_loss": 1.0}, step=0)
    loggers._write_unwritten()  # what atexit runs when finalize never came
    assert len(_history(uri, "left")["train_loss"]) == 1


def test_more_metrics_than_one_call_takes_are_written_in_several(tmp_path: Path) -> None:
    uri = f"sqlite:///{tmp_path}/mlflow.db"
    logger = MLFlowLogger(experiment_name="many", tracking_uri=uri, flush_every_s=3600)
    count = MAX_METRICS_PER_CALL + 7
    for step in range(count):
        logger.log_metrics({"x": float(step)}, step=step)
    logger.flush()
    assert [s for s, *_ in _history(uri, "many")["x"]] == list(range(count))


def test_flush_every_s_zero_writes_every_call_and_a_negative_one_is_refused(tmp_path: Path) -> None:
    uri = f"sqlite:///{tmp_path}/mlflow.db"
    logger = MLFlowLogger(experiment_name="now", tracking_uri=uri, flush_every_s=0)
    logger.log_metrics({"train_loss": 1.0}, step=0)
    assert len(_history(uri, "now")["train_loss"]) == 1
    with pytest.raises(ValueError, match=r"flush_every_s=-1: must be 0 .* e\.g\. flush_every_s: 5"):
        MLFlowLogger(tracking_uri=uri, flush_every_s=-1)


def test_comet_offline_writes_the_archive_comet_upload_reads(tmp_path: Path) -> None:
    from reference.comet_records import read

    logger = CometLogger(online=False, offline_directory=str(tmp_path / "comet"), project="demo")
    _log(logger)
    logger.log_hyperparams({"strategy": "zero2"})
    logger.finalize("success")
    logger.experiment.end()  # what Comet's exit handler does when the process ends
    (archive,) = (tmp_path / "comet").glob("*.zip")
    metrics, parameters = read(archive)
    assert metrics["train_loss"] == {step: 1 / (step + 1) for step in range(STEPS)}
    assert metrics["lr-AdamW"] == {step: 1e-3 * math.cos(step) for step in range(STEPS)}
    assert parameters["strategy"] == "zero2"
