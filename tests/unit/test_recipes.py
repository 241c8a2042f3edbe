"""Recipes by name: ``--config NAME`` reads the packaged recipe, ``plugintrain recipes``
lists them, and a name that matches none is one line naming the close ones.

The packaged recipes are ``recipes/*.yaml`` of this checkout (the editable install maps
``plugintrain.recipes`` onto that folder); ``tests/e2e/test_wheel.py`` checks the same
from an installed wheel.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from plugintrain.cli import main as cli_main
from plugintrain.cli_messages import ConfigError
from plugintrain.tools import COMMANDS
from plugintrain.tools.recipes import (
    description,
    recipe_names,
    resolve_config,
    resolve_config_args,
)

REPO = Path(__file__).resolve().parents[2]


def main(argv: list[str]) -> int:
    return cli_main(["recipes", *argv])


RECIPES = REPO / "recipes"
NAME = "gpt2_debug_shakespeare_cpu"


@pytest.fixture
def empty_cwd(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """An empty working directory, as after a pip install (no recipes/ beside it)."""
    monkeypatch.chdir(tmp_path)
    return tmp_path


def _reads(resolved: str, name: str) -> bool:
    """Whether ``resolved`` is a file holding the checkout's recipe ``name``."""
    return Path(resolved).read_text() == (RECIPES / f"{name}.yaml").read_text()


def test_every_recipe_of_the_checkout_is_packaged() -> None:
    assert recipe_names() == sorted(p.stem for p in RECIPES.glob("*.yaml"))


@pytest.mark.parametrize("value", [NAME, f"{NAME}.yaml", f"recipes/{NAME}.yaml"])
def test_a_name_reads_the_packaged_recipe(empty_cwd: Path, value: str) -> None:
    assert _reads(resolve_config(value), NAME)


def test_a_file_wins_over_the_name(empty_cwd: Path) -> None:
    for value in (NAME, f"{NAME}.yaml", f"recipes/{NAME}.yaml"):
        (empty_cwd / value).parent.mkdir(exist_ok=True)
        (empty_cwd / value).write_text("trainer: {max_steps: 1}\n")
        assert resolve_config(value) == value


def test_readme_paths_still_read_the_checkout_file(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(REPO)
    assert resolve_config(f"recipes/{NAME}.yaml") == f"recipes/{NAME}.yaml"


@pytest.mark.parametrize(
    "value", ["/no/such/dir/recipe.yaml", "{trainer: {max_steps: 3}}", "trainer:\n  max_steps: 3"]
)
def test_paths_elsewhere_and_inline_yaml_are_left_to_jsonargparse(
    empty_cwd: Path, value: str
) -> None:
    assert resolve_config(value) == value


def test_an_unknown_name_is_one_line_naming_the_close_recipes(empty_cwd: Path, capsys) -> None:
    with pytest.raises(ConfigError) as error:
        resolve_config("gpt2_debug")
    message = str(error.value)
    assert message == (
        "--config: File does not exist: 'gpt2_debug', and no recipe is named 'gpt2_debug'; did"
        " you mean gpt2_debug_pipeline_cpu or gpt2_debug_shakespeare_cpu? (`plugintrain"
        " recipes` lists the recipes)"
    )
    # The hint works: each name it offers resolves, and `plugintrain recipes` lists it.
    assert main([]) == 0
    listing = capsys.readouterr().out
    for name in ("gpt2_debug_pipeline_cpu", "gpt2_debug_shakespeare_cpu"):
        assert _reads(resolve_config(name), name)
        assert f"\n  {name} " in listing


def test_a_misspelt_name_gets_its_closest_recipe(empty_cwd: Path) -> None:
    with pytest.raises(ConfigError, match=r"did you mean mnist\?"):
        resolve_config("mnits.yaml")
    with pytest.raises(ConfigError, match=r"no recipe is named 'zzz' \(`plugintrain recipes`"):
        resolve_config("recipes/zzz.yaml")


def test_every_form_of_the_config_option_is_rewritten(empty_cwd: Path) -> None:
    args = resolve_config_args(
        [
            "fit", "--config", "mnist", f"--config={NAME}.yaml", "-c", f"recipes/{NAME}.yaml",
            "--model.init_args.config=gpt2-debug", "--trainer.max_steps", "3",
        ]
    )  # fmt: skip
    assert args[0:2] == ["fit", "--config"] and _reads(args[2], "mnist")
    flag, value = args[3].split("=", 1)
    assert flag == "--config" and _reads(value, NAME)
    assert args[4] == "-c" and _reads(args[5], NAME)
    assert args[6:] == ["--model.init_args.config=gpt2-debug", "--trainer.max_steps", "3"]


def test_a_config_option_without_a_value_is_left_to_the_parser(empty_cwd: Path) -> None:
    for args in (["fit", "--config"], ["fit", "--config", "--help"]):
        assert resolve_config_args(args) == args


def test_fit_by_name_from_an_empty_folder(empty_cwd: Path, capsys) -> None:
    with pytest.raises(SystemExit) as exit_info:
        cli_main(["fit", "--config", "mnist", "--print_config"])
    assert exit_info.value.code in (0, None)
    assert "class_path: plugintrain.model_zoo.MNISTClassifier" in capsys.readouterr().out


def test_the_console_script_rewrites_sys_argv(
    empty_cwd: Path, monkeypatch: pytest.MonkeyPatch, capsys
) -> None:
    # Without argv, LightningCLI parses sys.argv itself: the recipe's path must be there.
    monkeypatch.setattr(sys, "argv", ["plugintrain", "fit", "-c", "mnist.yaml", "--print_config"])
    with pytest.raises(SystemExit):
        cli_main()
    assert _reads(sys.argv[3], "mnist")
    assert "class_path: plugintrain.model_zoo.MNISTClassifier" in capsys.readouterr().out


def test_fit_with_an_unknown_recipe_exits_2_with_one_line(empty_cwd: Path, capfd) -> None:
    assert cli_main(["fit", "--config", "llama3_debug", "--trainer.max_steps=1"]) == 2
    err = capfd.readouterr().err
    assert "Traceback" not in err and "usage:" not in err
    assert err.strip().splitlines()[-1] == (
        "plugintrain fit: error: --config: File does not exist: 'llama3_debug', and no recipe"
        " is named 'llama3_debug'; did you mean llama3_debug_4d_cpu, llama3_debug_hybrid_cpu or"
        " llama3_debug_shakespeare_cpu? (`plugintrain recipes` lists the recipes)"
    )
    assert not (empty_cwd / "runs").exists()


def test_recipes_lists_every_recipe_with_its_description(capsys) -> None:
    assert COMMANDS["recipes"].target == "plugintrain.tools.recipes:recipes"
    assert cli_main(["recipes"]) == 0
    out = capsys.readouterr().out
    for path in sorted(RECIPES.glob("*.yaml")):
        line = next(line for line in out.splitlines() if line.split()[:1] == [path.stem])
        assert line.split(maxsplit=1)[1] == description(path.read_text())
    assert "mnist" in out and "MNIST classifier (MLP; set model.init_args.arch" in out


def test_descriptions_mark_where_the_first_line_is_cut() -> None:
    assert description("# One line.\nseed: 1\n") == "One line."
    assert description("# On two CPU processes:\n# details\n") == "On two CPU processes…"
    assert description("seed_everything: 1\n") == ""


def test_recipes_name_prints_the_yaml_to_copy(capsys) -> None:
    assert main([f"{NAME}.yaml"]) == 0
    assert capsys.readouterr().out == (RECIPES / f"{NAME}.yaml").read_text()


def test_recipes_of_an_unknown_name_is_one_line(capsys) -> None:
    assert main(["mnits"]) == 2
    out, err = capsys.readouterr()
    assert out == ""
    assert err == (
        "plugintrain recipes: error: no recipe is named 'mnits'; did you mean mnist?"
        " (`plugintrain recipes` lists the recipes)\n"
    )


def test_the_overview_and_help_name_the_command(capsys) -> None:
    assert cli_main(["--help"]) == 0
    assert "\n  recipes    List the recipes" in capsys.readouterr().out
    assert main(["--help"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: plugintrain recipes ") and "[NAME]" in out.splitlines()[0]


def test_resolving_imports_neither_torch_nor_lightning() -> None:
    # It runs before LightningCLI is built, on every `plugintrain fit`.
    code = (
        "import sys; from plugintrain.tools.recipes import resolve_config_args;"
        f" resolve_config_args(['fit', '--config', '{NAME}']);"
        " print(sorted(m for m in ('torch', 'lightning') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
