"""The loggers of ``trainer.logger`` checked before launch (``plugintrain.tracking``): a
missing package names a pip extra that exists and installs it; MLflow's defaults; a store
that cannot be written is one line."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import tomllib

from plugintrain.tracking import check_loggers, logger_home

REPO = Path(__file__).resolve().parents[2]


def _entry(name: str, **init_args: object) -> dict:
    return {"class_path": f"lightning.pytorch.loggers.{name}", "init_args": dict(init_args)}


@pytest.mark.parametrize(
    "logger,module",
    [("WandbLogger", "wandb"), ("MLFlowLogger", "mlflow"), ("CometLogger", "comet_ml")],
)
def test_a_missing_package_names_the_extra_that_installs_it(
    monkeypatch: pytest.MonkeyPatch, logger: str, module: str
) -> None:
    monkeypatch.setitem(sys.modules, module, None)  # import fails, as when not installed
    with pytest.raises(ValueError) as error:
        check_loggers([_entry("TensorBoardLogger"), _entry(logger)])
    message = str(error.value)
    assert "\n" not in message and f"trainer.logger {logger} needs the {module} package" in message
    extra = message.split("pip install 'plugintrain[")[1].split("]'")[0]
    # the hint works: the extra exists and requires the package
    extras = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    requirements = extras["optional-dependencies"][extra]
    assert any(r.startswith(module) for r in requirements), requirements


def test_mlflow_tracks_to_a_sqlite_store_under_runs_by_default(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    logger = _entry("MLFlowLogger", experiment_name="demo")
    check_loggers(logger)
    assert logger["init_args"]["tracking_uri"] == "sqlite:///runs/mlflow.db"
    assert logger["init_args"]["artifact_location"] == str(tmp_path / "runs" / "mlartifacts")
    assert (tmp_path / "runs" / "mlflow.db").is_file()  # made once, before any rank opens it
    assert logger_home([logger]) == ("runs", "demo")


def test_a_store_in_a_folder_that_cannot_be_made_is_one_line(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("")
    uri = f"sqlite:///{blocker}/runs/mlflow.db"
    with pytest.raises(ValueError) as error:
        check_loggers(_entry("MLFlowLogger", tracking_uri=uri))
    message = str(error.value)
    assert f"tracking_uri {uri}: {blocker} is not a writable folder" in message
    assert "tracking_uri: sqlite:///runs/mlflow.db" in message and "\n" not in message


def test_comet_offline_through_lightnings_logger_is_refused_with_a_fix_that_works(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Lightning's CometLogger(online=False) writes nothing; the line names plugintrain's,
    which passes the same check and gets a folder under runs/."""
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ValueError) as error:
        check_loggers(_entry("CometLogger", online=False, project="demo"))
    message = str(error.value)
    assert "\n" not in message and "Lightning-AI/pytorch-lightning#21617" in message
    fixed = message.split("use class_path: ")[1].split(",")[0]
    logger = {"class_path": fixed, "init_args": {"online": False, "project": "demo"}}
    check_loggers(logger)
    assert logger["init_args"]["offline_directory"] == "runs/comet"
    assert logger_home([logger]) == ("runs", "demo")


def test_comet_online_without_an_api_key_is_one_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("COMET_API_KEY", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))  # no ~/.comet.config
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ValueError) as error:
        check_loggers(_entry("CometLogger", project="demo"))
    message = str(error.value)
    assert "\n" not in message and "no Comet API key" in message and "online: false" in message
    check_loggers(_entry("CometLogger", project="demo", api_key="set"))  # a key is enough


def test_neptune_which_lightning_removed_is_one_line_naming_what_to_use() -> None:
    with pytest.raises(ValueError) as error:
        check_loggers([_entry("TensorBoardLogger"), _entry("NeptuneLogger")])
    message = str(error.value)
    assert "\n" not in message and "Neptune has been sunset" in message
    assert "MLFlowLogger, WandbLogger or CometLogger" in message
