"""The recipes for the scales users aim at (``recipes/scale/``), checked by dry run: rank 0,
a middle rank and the last rank of each built on the real code path (torch's fake process
group, meta tensors) hold what the estimate says, with no problem found. The same command
with ``--ranks all`` checks every rank (minutes; figures in the README)."""

from __future__ import annotations

from pathlib import Path

import pytest

from plugintrain.cli import main
from plugintrain.estimate.recipe import recipe_layout

SCALE = Path(__file__).resolve().parents[2] / "recipes" / "scale"


@pytest.mark.parametrize("recipe", sorted(SCALE.glob("*.yaml")), ids=lambda p: p.stem)
def test_scale_recipe_dry_runs_clean(recipe: Path, capsys) -> None:
    _, layout = recipe_layout(recipe)
    world = layout.world_size
    ranks = f"0,{world // 2},{world - 1}"
    code = main(["estimate", "--config", str(recipe), "--dry_run", "--ranks", ranks])
    out, err = capsys.readouterr()
    assert code == 0, err
    assert f"dry run of 3 of {world} ranks" in out, out
    assert "DIFFERS" not in out and "problems: none" in out, out


def test_the_scale_recipes_are_the_issue_s_layouts() -> None:
    worlds = {p.stem: recipe_layout(p)[1].world_size for p in SCALE.glob("*.yaml")}
    assert worlds == {
        "llama3_405b_1024gpu": 1024,
        "deepseek_v3_2048gpu": 2048,
        "llama3_8b_64gpu": 64,
        "qwen3_8b_8gpu": 8,
    }
