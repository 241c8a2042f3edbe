"""End to end: the wheel, installed in a fresh virtual environment, trains from an empty folder.

The wheel is built from a copy of the checkout's files (``git ls-files``: no stale
``build/`` output can slip into it) and installed into a new virtual environment without
pip. Its dependencies come from this environment through a ``.pth`` file that adds our
site-packages to the new one's ``sys.path``: torch is not installed again, yet nothing of
the editable install is active there (``.pth`` files of a directory added that way are
not run, so the editable finder never loads), and every ``plugintrain`` module must import
from the new environment's site-packages, so a package missing from the wheel fails here.
Every command runs from an empty folder, as after ``pip install plugintrain``.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
from _launch_env import reset_launch_environment

from _cli import RECIPES, REPO

pytestmark = pytest.mark.slow

# Source folder -> its import name. Written out here, not read from setup.py, so that
# the wheel is checked against the folders themselves.
PACKAGE_FOLDERS = {
    "plugintrain": "plugintrain",
    "strategies": "plugintrain.strategies",
    "model_zoo": "plugintrain.model_zoo",
    "precision_plugins": "plugintrain.precision_plugins",
}
RECIPE = "gpt2_debug_shakespeare_cpu"
_BUILD_WARNING = re.compile(r"\w*(?:Deprecation|BuildBackend)Warning")


def _source_packages() -> set[str]:
    """Every folder with an ``__init__.py`` under the package folders, by import name."""
    found = set()
    for folder, package in PACKAGE_FOLDERS.items():
        for init in (REPO / folder).rglob("__init__.py"):
            parts = init.parent.relative_to(REPO / folder).parts
            found.add(".".join((package, *parts)))
    return found


def _run(*command: str | Path, cwd: Path) -> subprocess.CompletedProcess:
    """Run ``command`` with nothing of this checkout on ``PYTHONPATH``; fail with its output
    unless it exits 0."""
    reset_launch_environment()
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    proc = subprocess.run(
        [str(c) for c in command],
        cwd=cwd,
        env={**env, "PYTHONUNBUFFERED": "1"},
        capture_output=True,
        text=True,
        timeout=600,
    )
    if proc.returncode != 0:
        pytest.fail(
            f"{' '.join(map(str, command))} exited {proc.returncode}:\n{proc.stdout}\n{proc.stderr}"
        )
    return proc


def _checkout_copy(dest: Path) -> Path:
    """The checkout's files as git sees them (tracked and new, ignored ones left out)."""
    listed = _run("git", "ls-files", "-z", "--cached", "--others", "--exclude-standard", cwd=REPO)
    for name in filter(None, listed.stdout.split("\0")):
        if (REPO / name).is_file():  # a tracked file deleted in the working tree is gone
            (dest / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(REPO / name, dest / name)
    return dest


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    """The wheel built offline from a copy of the checkout, and the build's log."""
    root = tmp_path_factory.mktemp("wheel")
    source = _checkout_copy(root / "source")
    build = _run(
        sys.executable, "-m", "pip", "wheel", "-v", "--no-deps", "--no-build-isolation",
        "--no-index", "--wheel-dir", root / "dist", source,
        cwd=root,
    )  # fmt: skip
    (path,) = (root / "dist").glob("plugintrain-*.whl")
    return path, build.stdout + build.stderr


@pytest.fixture(scope="module")
def venv(wheel: tuple[Path, str], tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A new virtual environment holding the wheel, its dependencies borrowed from ours."""
    root = tmp_path_factory.mktemp("venv")
    _run(sys.executable, "-m", "venv", "--without-pip", root, cwd=root)
    python = root / "bin" / "python"
    _run(sys.executable, "-m", "pip", "--python", python, "install", "--no-deps", "--no-index",
         "--quiet", wheel[0], cwd=root)  # fmt: skip
    # Added after the install, so that pip never sees this environment's editable plugintrain.
    ours = [p for p in sys.path if Path(p).name in ("site-packages", "dist-packages")]
    site = _run(python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])", cwd=root)
    (Path(site.stdout.strip()) / "_borrowed_dependencies.pth").write_text("\n".join(ours) + "\n")
    return root


def test_the_wheel_holds_every_package_and_recipe_and_nothing_else(
    wheel: tuple[Path, str],
) -> None:
    path, log = wheel
    names = zipfile.ZipFile(path).namelist()
    packages = {
        n.removesuffix("/__init__.py").replace("/", ".")
        for n in names
        if n.endswith("/__init__.py")
    }
    assert packages == _source_packages() | {"plugintrain.recipes"}
    recipes = {n.removeprefix("plugintrain/recipes/") for n in names if n.endswith(".yaml")}
    assert recipes == {p.name for p in RECIPES.glob("*.yaml")}
    assert {n.split("/")[0] for n in names} == {
        "plugintrain",
        path.name.split("-py")[0] + ".dist-info",
    }
    assert not _BUILD_WARNING.findall(log), log  # e.g. a license in the pre-PEP 639 form


def test_the_installed_package_is_the_wheel_s(venv: Path, tmp_path: Path) -> None:
    site = next((venv / "lib").glob("python*/site-packages"))
    names = sorted(_source_packages() | {"plugintrain.recipes"})
    code = (
        "import importlib, json, sys;"
        " print(json.dumps({n: importlib.import_module(n).__file__ for n in sys.argv[1:]}))"
    )
    found = json.loads(_run(venv / "bin" / "python", "-c", code, *names, cwd=tmp_path).stdout)
    elsewhere = {n: f for n, f in found.items() if not Path(f).is_relative_to(site)}
    assert not elsewhere, f"imported from outside the wheel's install: {elsewhere}"


def test_recipes_lists_the_packaged_recipes(venv: Path, tmp_path: Path) -> None:
    out = _run(venv / "bin" / "plugintrain", "recipes", cwd=tmp_path).stdout
    listed = {line.split()[0] for line in out.splitlines() if line.startswith("  ")}
    assert listed == {p.stem for p in RECIPES.glob("*.yaml")}


def test_fit_and_convert_by_recipe_name_from_an_empty_folder(
    venv: Path, shakespeare_gpt2: Path, tmp_path: Path
) -> None:
    plugintrain = venv / "bin" / "plugintrain"
    _run(
        plugintrain, "fit", "--config", RECIPE, f"--data.init_args.data_dir={shakespeare_gpt2}",
        "--trainer.max_steps=3", "--data.init_args.seq_len=32", "--data.init_args.batch_size=2",
        "--trainer.limit_val_batches=1", "--trainer.enable_progress_bar=false",
        "--checkpoint.every_n_train_steps=3",
        cwd=tmp_path,
    )  # fmt: skip
    # The recipe's own logger name and model, with the overrides on top.
    saved = (tmp_path / "runs" / RECIPE / "version_0" / "config.yaml").read_text()
    assert "class_path: plugintrain.model_zoo.CausalLM" in saved and "max_steps: 3" in saved
    checkpoint = tmp_path / "runs" / RECIPE / "checkpoints" / "last.ckpt"
    assert checkpoint.is_file()
    _run(plugintrain, "convert", checkpoint, "hf", "--format", "hf", cwd=tmp_path)
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert config["model_type"] == "gpt2"
    assert list((tmp_path / "hf").glob("*.safetensors"))


def test_print_config_by_recipe_name_from_an_empty_folder(venv: Path, tmp_path: Path) -> None:
    out = _run(
        venv / "bin" / "plugintrain", "fit", "--config", RECIPE, "--print_config", cwd=tmp_path
    ).stdout
    assert f"name: {RECIPE}" in out and "class_path: plugintrain.model_zoo.CausalLM" in out
    assert not any(tmp_path.iterdir())  # printing the config writes nothing
