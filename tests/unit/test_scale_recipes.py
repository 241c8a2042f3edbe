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
    ranks = sorted({0, world // 2, world - 1})
    listed = ",".join(map(str, ranks))
    code = main(["estimate", "--config", str(recipe), "--dry_run", "--ranks", listed])
    out, err = capsys.readouterr()
    assert code == 0, err
    assert f"dry run of {len(ranks)} of {world} ranks" in out, out
    assert "DIFFERS" not in out and "problems: none" in out, out


def test_the_scale_recipes_are_the_issue_s_layouts() -> None:
    """World, model, degrees (cp last), ZeRO stage, micro-batch size and count, as the
    strategy the recipe names reads them."""

    def shape(path: Path) -> tuple:
        config, layout = recipe_layout(path)
        d, p = layout.dims, layout.pipeline
        count = p.microbatches if d.pp > 1 else None
        return (layout.world_size, config.name, d.dp, d.tp, d.sequence_parallel, d.pp, d.vpp,
                d.ep, layout.stage, layout.micro_batch, count, d.cp)  # fmt: skip

    assert {p.stem: shape(p) for p in SCALE.glob("*.yaml")} == {
        "llama3_405b_1024gpu": (1024, "llama3.1-405b", 8, 8, True, 16, 2, 1, 1, 1, 32, 1),
        "deepseek_v3_2048gpu": (2048, "deepseek-v3", 128, 1, False, 16, 1, 64, 1, 1, 32, 1),
        "llama3_8b_64gpu": (64, "llama3.1-8b", 64, 1, False, 1, 1, 1, 3, 1, None, 1),
        "llama3_8b_128k": (64, "llama3.1-8b", 1, 8, True, 1, 1, 1, 3, 1, None, 8),
        "qwen3_8b_8gpu": (8, "qwen3-8b", 4, 2, True, 1, 1, 1, 2, 2, None, 1),
        "llama3_70b_qlora_2gpu": (2, "llama3.1-70b", 1, 1, False, 2, 1, 1, 0, 1, 2, 1),
    }


def test_a_recipe_the_strategy_would_refuse_is_one_line(tmp_path, capsys) -> None:
    text = (SCALE / "qwen3_8b_8gpu.yaml").read_text()
    bad = tmp_path / "bad.yaml"
    bad.write_text(text.replace("tensor_parallel: 2", "tensor_parallel: 3"))
    assert main(["estimate", "--config", str(bad)]) == 2
    line = capsys.readouterr().err.strip().splitlines()[-1]
    assert line.startswith(f"plugintrain estimate: error: {bad}: world_size=8 is not divisible"
                           " by tensor_parallel=3"), line  # fmt: skip
