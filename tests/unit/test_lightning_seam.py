"""Lightning's privates, checked against the installed versions
(``plugintrain/core/lightning_seam.py``): every private name the seam uses, and every
private hook a project class overrides, still exists with the kind and parameters the
seam was written for. When Lightning (or torch) moves one, the failure names it and the
seam function to update. Also: the installed Lightning lies in pyproject's bound, and the
seam's functions do what they say on a real trainer.
"""

from __future__ import annotations

import importlib
import inspect
import re
from importlib.metadata import version
from pathlib import Path
from typing import Any, get_args

import pytest
from packaging.requirements import Requirement

from plugintrain.core import lightning_seam as seam
from plugintrain.core.lightning_seam import INHERITED, OVERRIDDEN, PRIVATES, Private

ROOT = Path(__file__).resolve().parents[2]
SEAM = "plugintrain/core/lightning_seam.py"


def _package(path: str) -> str:
    top = path.split(".")[0]
    if top in ("lightning", "lightning_fabric", "pytorch_lightning"):
        return f"Lightning {version('lightning')}"
    if top == "torch":
        return f"torch {version('torch')}"
    return "Python"


def _where(private: Private) -> str:
    if private in OVERRIDDEN:
        return f"update the override {private.used_by} (listed in {SEAM}:OVERRIDDEN)"
    if private in INHERITED:
        return f"update {private.used_by}, which reads it (listed in {SEAM}:INHERITED)"
    return f"update {SEAM}:{private.used_by}"


def _moved(private: Private, what: str) -> str:
    return f"{_package(private.path)} moved `{private.path}` ({what}): {_where(private)}"


@pytest.fixture(scope="module")
def instances() -> dict[str, Any]:
    """One live object of each class whose instance attributes the seam reads."""
    from lightning.pytorch import LightningModule, Trainer
    from lightning.pytorch.callbacks import ModelCheckpoint, ThroughputMonitor
    from lightning.pytorch.strategies import DDPStrategy, ModelParallelStrategy

    trainer = Trainer(
        accelerator="cpu",
        devices=1,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
    )
    return {
        "Trainer": trainer,
        "_TrainingEpochLoop": trainer.fit_loop.epoch_loop,
        "ModelCheckpoint": ModelCheckpoint(),
        "LightningModule": LightningModule(),
        "DDPStrategy": DDPStrategy(),
        "ModelParallelStrategy": ModelParallelStrategy(),
        "ThroughputMonitor": ThroughputMonitor(batch_size_fn=len),
    }


def _resolve(private: Private, instances: dict[str, Any]) -> Any:
    """What ``private.path`` names in the installed packages; fails naming it."""
    module_name, qualname = private.path.split(":")
    try:
        owner: Any = importlib.import_module(module_name)
    except ImportError:
        pytest.fail(_moved(private, f"module {module_name} is gone"))
    *classes, name = qualname.split(".")
    for part in classes:
        if not hasattr(owner, part):
            pytest.fail(_moved(private, f"{part} is gone from {owner.__name__}"))
        owner = getattr(owner, part)
    if private.kind == "attribute":
        if classes[-1] not in instances:
            pytest.fail(f"the test builds no {classes[-1]} to look for {name} on")
        owner = instances[classes[-1]]
        assert hasattr(owner, name), _moved(private, f"a new {classes[-1]} has no {name}")
        return getattr(owner, name)
    if private.kind in ("method", "property"):
        # Looked up on the class, not an instance: the name must be a class member.
        found = inspect.getattr_static(owner, name, None)
        assert found is not None, _moved(private, f"{owner.__name__} has no {name}")
        return found
    assert hasattr(owner, name), _moved(private, "gone")
    return getattr(owner, name)


def _check_kind(private: Private, found: Any) -> None:
    kinds = {
        "function": callable,
        "method": lambda f: inspect.isfunction(f),
        "property": lambda f: isinstance(f, property),
        "class": inspect.isclass,
        "type": lambda f: bool(get_args(f)),
        "attribute": lambda f: True,
    }
    assert kinds[private.kind](found), _moved(private, f"no longer a {private.kind}: {found!r}")
    if private.parameters is not None:
        names = tuple(inspect.signature(found).parameters)
        assert names == private.parameters, _moved(
            private, f"parameters now {names}, written for {private.parameters}"
        )


@pytest.mark.parametrize(
    "private", PRIVATES + OVERRIDDEN + INHERITED, ids=lambda p: p.path.split(":")[1]
)
def test_each_private_is_where_the_seam_expects_it(private: Private, instances) -> None:
    _check_kind(private, _resolve(private, instances))


@pytest.mark.parametrize("private", INHERITED, ids=lambda p: p.path.split(":")[1])
def test_each_inherited_private_is_read_by_a_subclass_of_its_owner(private: Private) -> None:
    module_name, qualname = private.path.split(":")
    base = getattr(importlib.import_module(module_name), qualname.split(".")[0])
    module_path, class_name = private.used_by.rsplit(".", 1)
    cls = getattr(importlib.import_module(module_path), class_name)
    assert issubclass(cls, base), f"{private.used_by} is no longer a {base.__name__}"
    name = qualname.split(".")[-1]
    assert f"self.{name}" in inspect.getsource(cls), f"{private.used_by} no longer reads {name}"


@pytest.mark.parametrize("private", PRIVATES, ids=lambda p: p.path.split(":")[1])
def test_each_private_names_the_seam_function_that_uses_it(private: Private) -> None:
    source = inspect.getsource(seam)
    name = private.path.split(":")[1].split(".")[-1]
    if private.used_by == "LightningStrategyRegistry":  # the module's __getattr__ hands it out
        assert seam.LightningStrategyRegistry.__name__ == name
        return
    assert re.search(rf"^def {private.used_by}\b", source, re.M), private
    assert name in inspect.getsource(getattr(seam, private.used_by)), (
        f"{private.used_by} does not use {name}"
    )


@pytest.mark.parametrize("private", OVERRIDDEN, ids=lambda p: p.used_by)
def test_each_overridden_hook_is_overridden_by_the_named_method(private: Private) -> None:
    """The project method exists, in a subclass of the Lightning class, with the hook's
    parameters (so Lightning still calls it)."""
    module_name, qualname = private.path.split(":")
    base_name, hook = qualname.rsplit(".", 1)
    base = getattr(importlib.import_module(module_name), base_name)
    owner_path, method = private.used_by.rsplit(".", 1)
    module_path, class_name = owner_path.rsplit(".", 1)
    cls = getattr(importlib.import_module(module_path), class_name)
    assert method == hook and hook in vars(cls), f"{cls.__name__} no longer overrides {hook}"
    assert issubclass(cls, base), f"{cls.__name__} is no longer a {base.__name__}"
    ours = tuple(inspect.signature(vars(cls)[hook]).parameters)
    assert ours == private.parameters, f"{private.used_by}{ours} != {private.parameters}"


def test_the_launcher_observer_thread_has_the_name_the_seam_looks_for() -> None:
    from lightning.fabric.strategies.launchers.subprocess_script import _ChildProcessObserver

    observer = _ChildProcessObserver(main_pid=0, child_processes=[])
    assert observer.name == seam.LAUNCHER_OBSERVER, _moved(
        Private(
            "lightning.fabric.strategies.launchers.subprocess_script:_ChildProcessObserver",
            "class",
            None,
            "silence_launcher_observer",
        ),
        f"its thread is now named {observer.name!r}",
    )


def test_installed_lightning_is_in_the_bound_pyproject_declares() -> None:
    (line,) = re.findall(r'^ +"(lightning[<>=!~].*)",', (ROOT / "pyproject.toml").read_text(), re.M)
    bound = Requirement(line)
    installed = version("lightning")
    assert bound.specifier.contains(installed), f"Lightning {installed} outside {bound}"
    assert bound.specifier.contains("2.6.0") and not bound.specifier.contains("2.7.0"), bound
    assert f"Lightning {installed}" in seam.CHECKED_ON, (
        f"the seam was checked on {seam.CHECKED_ON}, Lightning {installed} is installed:"
        f" check each function in {SEAM} and update CHECKED_ON"
    )


def test_importing_the_seam_imports_no_lightning() -> None:
    import subprocess
    import sys

    code = (
        "import sys; import plugintrain.core.lightning_seam;"
        "print(sorted(m for m in sys.modules if m.split('.')[0] in ('lightning', 'torch')))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out.stdout


def test_the_seam_functions_act_on_a_real_trainer(instances, tmp_path) -> None:
    from lightning.pytorch.callbacks import ModelCheckpoint

    trainer = instances["Trainer"]
    seam.switch_off_signal_handlers(trainer)
    assert trainer._signal_connector.register_signal_handlers() is None
    seam.switch_off_sigterm_broadcast(trainer)
    assert trainer.fit_loop.epoch_loop._broadcast_sigterm_tensor() is None
    seam.skip_validation_on_stop(trainer)
    assert trainer.fit_loop.epoch_loop._skip_next_val is True
    calls = []
    seam.wrap_save_checkpoint(trainer, lambda save: lambda *a, **k: calls.append(a))
    seam.wrap_save_checkpoint(trainer, lambda save: pytest.fail("wrapped twice"))
    trainer.save_checkpoint("x")
    assert calls == [("x",)]
    assert seam.cluster_environment(trainer) is not None
    assert seam.logs_this_step(trainer) in (True, False)
    assert "bf16-mixed" in seam.precision_names() and "64" in seam.precision_names()
    assert str(seam.compute_dtype(trainer.precision_plugin)) == "torch.float32"
    assert seam.default_store() is None  # no process group in this process
    module = instances["LightningModule"]
    seam.give_module_mesh(module, "mesh")
    assert module.device_mesh == "mesh"
    assert isinstance(instances["ModelCheckpoint"], ModelCheckpoint)


_SIGNALS = "lightning.pytorch.trainer.connectors.signal_connector:_SignalConnector"


@pytest.mark.parametrize(
    ("private", "message"),
    [
        (
            Private(
                f"{_SIGNALS}.register_handlers", "method", ("self",), "switch_off_signal_handlers"
            ),
            f"moved `{_SIGNALS}.register_handlers` (_SignalConnector has no register_handlers):"
            f" update {SEAM}:switch_off_signal_handlers",
        ),
        (
            Private(f"{_SIGNALS}.register_signal_handlers", "method", ("self", "x"), "f"),
            "(parameters now ('self',), written for ('self', 'x')): update",
        ),
        (
            Private("lightning.pytorch.trainer.trainer:Trainer._signals", "attribute", None, "f"),
            "(a new Trainer has no _signals)",
        ),
        (
            Private("lightning.pytorch.gone:Trainer", "class", None, "f"),
            "(module lightning.pytorch.gone is gone)",
        ),
        (
            Private("torch.distributed.distributed_c10d:_get_store", "function", (), "f"),
            f"torch {version('torch')} moved `torch.distributed.distributed_c10d:_get_store`",
        ),
    ],
)
def test_a_private_that_moved_is_named(private: Private, message: str, instances) -> None:
    with pytest.raises((AssertionError, pytest.fail.Exception)) as failure:
        _check_kind(private, _resolve(private, instances))
    assert message in str(failure.value)
    assert re.match(r"(Lightning|torch) [0-9.+a-z]+ moved `", str(failure.value))
