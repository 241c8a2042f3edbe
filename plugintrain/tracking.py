"""The loggers a recipe names under ``trainer.logger``, checked and completed before the
run is launched (docs/guides/tracking.md).

Any of Lightning's loggers may be named, one or a list. Before anything is launched:

- a logger whose package is not installed is one line naming the pip extra to install
  (``pip install 'plugintrain[mlflow]'``), not Lightning's ``ModuleNotFoundError``;
- ``MLFlowLogger`` without a ``tracking_uri`` (and no ``MLFLOW_TRACKING_URI``) tracks to a
  SQLite database, ``runs/mlflow.db``, and a SQLite store's artifacts go to
  ``mlartifacts`` beside the database (not ``./mlruns`` of wherever the run starts): a real
  tracking store in one file, which ``mlflow ui --backend-store-uri sqlite:///runs/mlflow.db``
  shows (Lightning's default, a ``./mlruns`` file store, is deprecated by MLflow 3);
- a tracking URI that cannot be reached (a server that does not answer, a database in a
  folder that cannot be made) is one line naming it, before training starts rather than
  at the first logged metric;
- ``CometLogger``: offline (``online: false``) only through ``plugintrain.loggers.CometLogger``
  (Lightning's writes nothing offline), into ``runs/comet`` unless ``offline_directory`` says
  otherwise; online only with an API key;
- ``NeptuneLogger``, which Lightning 2.6 removed (Neptune has been sunset), is one line
  naming the loggers to use instead.
"""

from __future__ import annotations

import importlib
import os
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

DEFAULT_MLFLOW_STORE = "runs/mlflow.db"
DEFAULT_COMET_FOLDER = "runs/comet"
PACKAGES = {
    "MLFlowLogger": ("mlflow", "'plugintrain[mlflow]'"),
    "WandbLogger": ("wandb", "'plugintrain[wandb]'"),
    "CometLogger": ("comet_ml", "'plugintrain[comet]'"),
    "LitLogger": ("litlogger", "litlogger"),
}
"""Lightning's loggers that need a package of their own: logger -> (module, pip argument)."""
GONE = {
    "NeptuneLogger": "Neptune has been sunset and Lightning 2.6 no longer has its logger",
}
"""Loggers a recipe may still name that no longer work: logger -> why."""
COMET_OFFLINE_FAULT = (
    "with online: false writes nothing (Lightning disables its offline Comet experiment,"
    " Lightning-AI/pytorch-lightning#21617)"
)
CONNECT_TIMEOUT_S = 10.0


def logger_entries(logger: Any) -> list[Any]:
    """The configured loggers (``trainer.logger``: one, a list, or none/True/False)."""
    if logger is None or isinstance(logger, bool):
        return []
    return list(logger) if isinstance(logger, list | tuple) else [logger]


def _class_name(entry: Any) -> str:
    class_path = entry.get("class_path") if hasattr(entry, "get") else None
    return str(class_path or type(entry).__name__).rsplit(".", 1)[-1]


def check_loggers(logger: Any) -> None:
    """Check each configured logger's package and store, and fill in MLflow's defaults.

    Args:
        logger: ``trainer.logger`` as parsed (class_path/init_args entries), changed in
            place: an ``MLFlowLogger`` without a tracking URI gets the SQLite store.

    Raises:
        ValueError: One line naming the logger or the URI and the fix.
    """
    for entry in logger_entries(logger):
        name = _class_name(entry)
        if name in GONE:
            raise ValueError(
                f"trainer.logger {name}: {GONE[name]}; log to MLFlowLogger, WandbLogger or"
                " CometLogger instead (docs/guides/tracking.md)"
            )
        if name in PACKAGES:
            module, pip = PACKAGES[name]
            try:
                importlib.import_module(module)
            except ImportError:
                raise ValueError(
                    f"trainer.logger {name} needs the {module} package, which is not"
                    f" installed; pip install {pip}"
                ) from None
        init_args = entry.get("init_args") if hasattr(entry, "get") else None
        if name == "MLFlowLogger" and init_args is not None:
            if not init_args.get("tracking_uri"):
                init_args["tracking_uri"] = f"sqlite:///{DEFAULT_MLFLOW_STORE}"
            uri = init_args["tracking_uri"]
            if uri.startswith("sqlite:///") and not init_args.get("artifact_location"):
                # beside the database, not in ./mlruns of wherever the run starts
                database = Path(uri.removeprefix("sqlite:///"))
                init_args["artifact_location"] = str(database.resolve().parent / "mlartifacts")
            check_tracking_uri(uri)
            if uri.startswith("sqlite:///"):
                make_sqlite_store(uri)
        if name == "CometLogger" and init_args is not None:
            _check_comet(entry, init_args)


def _check_comet(entry: Any, init_args: Any) -> None:
    """Comet offline (``online: false``) needs plugintrain's logger and gets a folder under
    ``runs/``; online needs an API key, checked before launch."""
    class_path = str(entry.get("class_path"))
    if init_args.get("online") is False:
        if not class_path.startswith("plugintrain."):
            raise ValueError(
                f"trainer.logger {class_path} {COMET_OFFLINE_FAULT}; use class_path:"
                " plugintrain.loggers.CometLogger, which writes the offline archive"
            )
        if not init_args.get("offline_directory"):
            init_args["offline_directory"] = DEFAULT_COMET_FOLDER
        return
    from comet_ml.config import get_config

    if not (init_args.get("api_key") or get_config()["comet.api_key"]):
        raise ValueError(
            "trainer.logger CometLogger: no Comet API key (api_key, COMET_API_KEY or"
            " ~/.comet.config); set one (comet login), or log offline with class_path:"
            " plugintrain.loggers.CometLogger and online: false"
        )


def check_tracking_uri(uri: str) -> None:
    """Refuse an MLflow tracking URI that cannot be reached: an HTTP server that does not
    answer, or a SQLite database whose folder cannot be made.

    Raises:
        ValueError: One line naming the URI, what failed, and the fix.
    """
    fix = (
        f"start the server (mlflow server --backend-store-uri sqlite:///{DEFAULT_MLFLOW_STORE})"
        f" or track to a file: tracking_uri: sqlite:///{DEFAULT_MLFLOW_STORE}"
    )
    if uri.startswith(("http://", "https://")):
        try:
            with urllib.request.urlopen(f"{uri.rstrip('/')}/health", timeout=CONNECT_TIMEOUT_S):
                return
        except urllib.error.HTTPError:
            return  # it answered: a server (maybe behind a proxy without /health)
        except (urllib.error.URLError, OSError, ValueError) as error:
            reason = getattr(error, "reason", error)
            raise ValueError(
                f"trainer.logger MLFlowLogger tracking_uri {uri}: unreachable ({reason}); {fix}"
            ) from None
    if uri.startswith("sqlite:///"):
        folder = Path(uri.removeprefix("sqlite:///")).parent
        existing = next(p for p in [folder, *folder.parents] if p.exists())
        if not existing.is_dir() or not os.access(existing, os.W_OK):
            raise ValueError(
                f"trainer.logger MLFlowLogger tracking_uri {uri}: {existing} is not a writable"
                f" folder; pass a database path in a folder you can write, e.g. tracking_uri:"
                f" sqlite:///{DEFAULT_MLFLOW_STORE}"
            )


def make_sqlite_store(uri: str) -> None:
    """Create (or migrate) the MLflow tables of the SQLite store ``uri`` while holding a
    lock on its folder, so that the ranks of a run, which each build an ``MLFlowLogger``
    (and each open the store), never race to create the same tables: the first makes
    them, the others find them made."""
    import fcntl

    from mlflow.tracking import MlflowClient

    folder = Path(uri.removeprefix("sqlite:///")).parent
    folder.mkdir(parents=True, exist_ok=True)
    descriptor = os.open(folder, os.O_RDONLY)
    try:
        fcntl.flock(descriptor, fcntl.LOCK_EX)
        MlflowClient(tracking_uri=uri)  # opening a SQLite store creates or migrates it
    finally:
        os.close(descriptor)  # releases the lock


def logger_home(logger: Any) -> tuple[str, str] | None:
    """The ``(save_dir, name)`` a run's checkpoints go under: the first configured logger
    with a folder of its own (TensorBoard, CSV), else an MLflow experiment's or a W&B
    project's name under ``runs/``; None without a logger."""
    entries = logger_entries(logger)
    for entry in entries:
        init_args = entry.get("init_args") if hasattr(entry, "get") else None
        own_folder = _class_name(entry) not in ("MLFlowLogger", "WandbLogger", "CometLogger")
        if (
            own_folder
            and init_args is not None
            and init_args.get("save_dir")
            and "name" in init_args
        ):
            return str(init_args["save_dir"]), str(init_args.get("name") or "")
    for entry in entries:
        init_args = entry.get("init_args") if hasattr(entry, "get") else None
        if init_args is None:
            continue
        if _class_name(entry) == "MLFlowLogger":
            return "runs", str(init_args.get("experiment_name") or "lightning_logs")
        if _class_name(entry) == "WandbLogger":
            return "runs", str(init_args.get("project") or init_args.get("name") or "wandb")
        if _class_name(entry) == "CometLogger":
            return "runs", str(init_args.get("project") or "comet")
    return None
