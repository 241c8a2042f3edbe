"""plugintrain's own loggers, where Lightning's cost the training loop time
(docs/guides/tracking.md).

``MLFlowLogger``: Lightning's, writing the metrics of several steps to the store in one
call instead of one call (about 6 ms on a SQLite store) for each ``log_metrics``.

``CometLogger``: Lightning's, with its offline mode working: Lightning 2.6's
``CometLogger(online=False)`` disables the Comet experiment, so nothing is written
(Lightning-AI/pytorch-lightning#21617); this one writes the offline archive that
``comet upload`` sends.
"""

from __future__ import annotations

import atexit
import sys
import time
import weakref
from collections.abc import Mapping
from typing import Any

from lightning.pytorch.loggers import CometLogger as LightningCometLogger
from lightning.pytorch.loggers import MLFlowLogger as LightningMLFlowLogger
from lightning.pytorch.utilities import rank_zero_only

MAX_METRICS_PER_CALL = 1000
"""MLflow's limit on the metrics of one ``log_batch`` call."""
_UNWRITTEN: weakref.WeakSet[MLFlowLogger] = weakref.WeakSet()
"""Loggers holding metrics not yet written: written by the exit handlers, which run at the
interpreter's exit and before a signal-stopped run's ``os._exit``, when ``finalize`` was
skipped."""


@atexit.register
def _write_unwritten() -> None:
    for logger in list(_UNWRITTEN):
        count = len(logger._pending)
        try:
            logger.flush()
        except Exception as error:  # at exit there is no caller to raise to: say it
            print(f"MLFlowLogger: {count} metrics not written at exit: {error}", file=sys.stderr)


class _Recorder:
    """Stands in for the MLflow client while Lightning's ``log_metrics`` runs, keeping the
    metrics it would have written (already named and timestamped as Lightning names them)."""

    def __init__(self) -> None:
        self.metrics: list[Any] = []

    def log_batch(self, run_id: str, metrics: Any = (), **kwargs: Any) -> None:
        self.metrics.extend(metrics)


class MLFlowLogger(LightningMLFlowLogger):
    """Lightning's ``MLFlowLogger`` (every argument it takes, same metric names and
    timestamps), writing metrics in batches.

    Lightning's logger writes each ``log_metrics`` call to the store before the step goes
    on, and a logged step makes several (the step's metrics, the learning rate, the
    throughput): about 20 ms a logged step on a SQLite store. This one keeps the metrics,
    each with the step and time it was logged at, and writes them in one ``log_batch`` call
    (at most 1,000 a call, MLflow's limit) once ``flush_every_s`` seconds have passed since
    the last write, before a checkpoint is recorded, and when the run ends, fails or is
    stopped (Ctrl-C, SIGTERM; and by the exit handlers): nothing logged is lost unless the
    process is killed outright (SIGKILL, or the watchdog's exit after a peer's abort), which
    loses at most the last ``flush_every_s`` seconds. ``flush_every_s: 0`` writes every
    call, as Lightning's does.

    Args:
        *args: Lightning's ``MLFlowLogger`` arguments, in its order.
        flush_every_s: The longest a logged metric waits before it is written.
        **kwargs: Lightning's ``MLFlowLogger`` arguments by name (``experiment_name``,
            ``tracking_uri``, ``run_name``, ``tags``, ``artifact_location``, ...).
    """

    def __init__(self, *args: Any, flush_every_s: float = 5.0, **kwargs: Any) -> None:
        if not flush_every_s >= 0:
            raise ValueError(
                f"MLFlowLogger flush_every_s={flush_every_s}: must be 0 (write every call) or"
                " more seconds; e.g. flush_every_s: 5"
            )
        super().__init__(*args, **kwargs)
        self.flush_every_s = float(flush_every_s)
        self._pending: list[Any] = []
        self._last_write = time.monotonic()

    @rank_zero_only
    def log_metrics(self, metrics: Mapping[str, float], step: int | None = None) -> None:
        if self.flush_every_s == 0:
            super().log_metrics(metrics, step)
            return
        client = self.experiment  # starts the run on first use
        recorder = _Recorder()
        self._mlflow_client = recorder
        try:
            super().log_metrics(metrics, step)
        finally:
            self._mlflow_client = client
        self._pending.extend(recorder.metrics)
        _UNWRITTEN.add(self)
        if time.monotonic() - self._last_write >= self.flush_every_s:
            self.flush()

    @rank_zero_only
    def flush(self) -> None:
        """Write the kept metrics to the store now."""
        pending, self._pending = self._pending, []
        _UNWRITTEN.discard(self)
        self._last_write = time.monotonic()
        for start in range(0, len(pending), MAX_METRICS_PER_CALL):
            self.experiment.log_batch(
                run_id=self.run_id,
                metrics=pending[start : start + MAX_METRICS_PER_CALL],
                **self._log_batch_kwargs,
            )

    def after_save_checkpoint(self, checkpoint_callback: Any) -> None:
        self.flush()
        super().after_save_checkpoint(checkpoint_callback)

    @rank_zero_only
    def finalize(self, status: str = "success") -> None:
        if self._initialized:
            self.flush()
        super().finalize(status)


class CometLogger(LightningCometLogger):
    """Lightning's ``CometLogger`` (every argument it takes), whose ``online: false`` writes
    the run to ``offline_directory`` (a zip archive per run, made when the process ends;
    send it with ``comet upload FILE``) instead of disabling the experiment; and an empty
    ``prefix`` (a recipe's default) prefixes nothing, where Lightning's names every metric
    ``_NAME``."""

    def _create_experiment(self) -> None:
        self._prefix = self._prefix or None
        if self._online is False:
            import comet_ml

            # Lightning builds the offline config with disabled=True; build it as Comet does
            self._comet_config = comet_ml.ExperimentConfig(**self._kwargs)
        super()._create_experiment()
