"""``plugintrain estimate``: the table, ``--json`` and ``--fit`` are well formed, bad input
is one line naming the value and a fix, and an 8B model on 64 devices allocates nothing.

That the bytes are right is measured in ``tests/distributed/test_estimate_distributed.py``.
"""

from __future__ import annotations

import dataclasses
import json
import resource

import pytest

from plugintrain.cli import main
from plugintrain.core.memory import LiveTensorMemory
from plugintrain.estimate import Layout, estimate, fitting_layouts, parse_bytes
from plugintrain.model_zoo import TransformerConfig
from plugintrain.tools import COMMANDS
from plugintrain.tools.estimate import estimate as estimate_command

ROWS = ("parameters", "gradients", "optimizer state (AdamW)", "activations (peak)", "total")


def _run(capsys: pytest.CaptureFixture, *argv: str) -> tuple[int, str, str]:
    code = main(["estimate", *argv])
    out, err = capsys.readouterr()
    return code, out, err


def test_registered_as_a_tool() -> None:
    assert COMMANDS["estimate"].load() is estimate_command


def test_table_has_a_column_per_pipeline_stage(capsys: pytest.CaptureFixture) -> None:
    code, out, _ = _run(capsys, "llama3-debug", "--tp", "2", "--pp", "2", "--seq_len", "64")
    assert code == 0
    lines = out.splitlines()
    assert lines[0].startswith("llama3-debug: hybrid dp=1 x tp=2 x pp=2")
    assert lines[2].split() == ["stage", "0", "stage", "1"]
    for row in ROWS:
        line = next(line for line in lines if line.startswith(row))
        assert len(line[len(row) :].split()) == 4, line  # two stages, "<value> <unit>"


def test_json_matches_the_estimate(capsys: pytest.CaptureFixture) -> None:
    code, out, _ = _run(capsys, "gpt2-debug", "--dp", "2", "--zero_stage", "2", "--json")
    assert code == 0
    record = json.loads(out)
    assert record["model"] == "gpt2-debug"
    assert record["layout"]["world_size"] == 2
    peak = record["peak"]
    parts = ("parameters", "gradients", "optimizer", "activations", "communication")
    assert peak["total"] == sum(peak[k] for k in parts)
    config = TransformerConfig.from_name("gpt2-debug")
    layout = Layout.of("hybrid", dp=2, zero_stage=2, precision="bf16-mixed", seq_len=256)
    expected = estimate(config, layout)
    assert peak["total"] == expected.peak.total


def test_fit_lists_layouts_that_fit_fastest_first(capsys: pytest.CaptureFixture) -> None:
    code, out, _ = _run(capsys, "qwen3-debug", "--fit", "300MiB", "--gpus", "4", "--json")
    assert code == 0
    record = json.loads(out)
    layouts = record["layouts"]
    assert layouts, "some layout of up to 4 devices fits"
    speeds = [r["prediction"]["tokens_per_second"] for r in layouts]
    assert speeds == sorted(speeds, reverse=True)
    assert all(r["peak"]["total"] <= 300 * 2**20 for r in layouts)
    assert max(r["layout"]["world_size"] for r in layouts) <= 4
    code, text, _ = _run(capsys, "qwen3-debug", "--fit", "300MiB", "--gpus", "4", "--top", "3")
    assert code == 0
    assert text.splitlines()[0].startswith(f"{len(layouts)} layouts of up to 4 devices fit")
    assert "fastest first on h100-ib" in text.splitlines()[0]
    assert len(text.splitlines()) == 2 + 3


def test_fit_says_when_nothing_fits(capsys: pytest.CaptureFixture) -> None:
    code, out, _ = _run(capsys, "llama3-debug", "--fit", "1MiB", "--gpus", "2")
    assert code == 0
    assert out.strip() == "No layout of up to 2 devices fits in 1 MiB per device."


@pytest.mark.parametrize(
    ("argv", "names"),
    [
        (["gpt2-debug", "--ep", "2"], ["expert_parallel=2", "use expert_parallel=1"]),
        (["deepseek-v3-debug", "--dp", "6", "--ep", "3"], ["n_routed_experts=8", "[1, 2]"]),
        (["llama3-debug", "--tp", "3"], ["tensor_parallel=3"]),
        (["llama3-debug", "--pp", "3"], ["pipeline_parallel=3", "[1, 2, 4]"]),
        (["gpt2-debug", "--sp"], ["sequence_parallel=True", "tensor_parallel > 1"]),
        (["gpt2-debug", "--seq_len", "4096"], ["seq_len=4096", "block_size=256"]),
        (["gpt2-debug", "--pp", "2", "--zero_stage", "3"], ["zero_stage=3"]),
        (["gpt2-debug", "--strategy", "zero2", "--tp", "2"], ["'zero2'", "hybrid"]),
        (["gpt2-debug", "--fit", "80 parsecs"], ["'80 parsecs'", "80GiB"]),
        (["gpt-2", "--dp", "2"], ["'gpt-2'", "gpt2-debug"]),
        (["missing.yaml"], ["'missing.yaml'"]),
        (["gpt2-debug", "--recompute", "all"], ["--recompute all:", "full"]),
    ],
)
def test_bad_input_is_one_line_naming_the_value(
    capsys: pytest.CaptureFixture, argv: list[str], names: list[str]
) -> None:
    code = main(["estimate", *argv])
    out, err = capsys.readouterr()
    assert code == 2
    assert out == ""
    assert len(err.strip().splitlines()) == 1, err
    for name in names:
        assert name in err, (name, err)


def test_config_file(tmp_path, capsys: pytest.CaptureFixture) -> None:
    config = TransformerConfig.from_name("gpt2-debug", n_layer=2)
    path = tmp_path / "tiny.json"
    path.write_text(json.dumps(dataclasses.asdict(config)))
    code, out, _ = _run(capsys, str(path), "--json")
    assert code == 0
    assert json.loads(out)["peak"]["parameters"] == config.num_params() * 4


def test_parse_bytes() -> None:
    assert parse_bytes("80GiB") == 80 * 2**30
    assert parse_bytes("141 GB") == 141 * 10**9
    assert parse_bytes(1024) == 1024
    with pytest.raises(ValueError, match="80GiB"):
        parse_bytes("-1GiB")


def test_8b_on_64_devices_allocates_nothing() -> None:
    """An 8B model on 64 devices, and every layout of up to 16 that fits 80 GiB, estimated
    without allocating a tensor (the model is only built on the meta device)."""
    config = TransformerConfig.from_name("llama3.1-8b")
    base = Layout.of("hybrid", precision="bf16-mixed", seq_len=8192, recompute="selective")
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    with LiveTensorMemory() as memory:
        one = estimate(config, Layout.of("hybrid", dp=8, tp=4, sp=True, pp=2, zero_stage=1))
        assert one.layout.world_size == 64
        fits = fitting_layouts(config, 16, parse_bytes("80GiB"), base)
    assert memory.peak_bytes < 2**20, memory.peak_bytes
    grown_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - rss
    assert grown_kib < 2**20, grown_kib  # < 1 GiB; the weights alone would be 32 GB
    assert len(one.ranks) == 16  # one per (pp, dp) position
    assert fits and fits[0].layout.world_size < 16
    # The weights alone (bf16-mixed keeps fp32 master weights) need a few devices.
    assert fits[0].layout.world_size * 80 * 2**30 > 4 * config.num_params()


def test_expert_parallelism_splits_the_experts_only() -> None:
    """ep=2 holds half of each MoE layer's stacked experts (everything else whole) and
    steps their AdamW state over the dp / ep ranks that hold them; activations are alike."""
    config = TransformerConfig.from_name("deepseek-v3-debug")
    base = Layout.of("hybrid", dp=2, zero_stage=0, seq_len=64, bucket_size_mb=1000)
    whole = estimate(config, base).ranks[0]
    split = estimate(config, base.replace(ep=2)).ranks[0]
    moe = config.moe
    sparse = sum(moe.is_moe_layer(i) for i in range(config.n_layer))
    experts = sparse * 3 * moe.n_routed_experts * moe.moe_intermediate_size * config.n_embd * 4
    assert whole.parameters - split.parameters == pytest.approx(experts / 2, abs=8)
    assert whole.optimizer - split.optimizer == pytest.approx(experts, abs=8)
    assert whole.activations == split.activations


def test_config_takes_a_fit_recipe_or_a_file_of_the_options(tmp_path, capsys) -> None:
    """``--config`` keeps meaning a fit recipe (its model and layout, as ``--recipe``), and
    also reads what ``--print_config`` wrote, as every command's ``--config`` does."""
    recipe = "recipes/scale/qwen3_8b_8gpu.yaml"
    from_config = _run(capsys, "--config", recipe, "--json")
    from_recipe = _run(capsys, "--recipe", recipe, "--json")
    assert from_config[0] == 0 and from_config == from_recipe
    assert json.loads(from_config[1])["model"] == "qwen3-8b"
    code, printed, _ = _run(capsys, "gpt2-debug", "--dp", "2", "--print_config")
    assert code == 0
    options = tmp_path / "options.yaml"
    options.write_text(printed)
    assert _run(capsys, "--config", str(options), "--json") == _run(
        capsys, "gpt2-debug", "--dp", "2", "--json"
    )


def test_precisions_listed_without_torch_are_the_precision_plugins() -> None:
    from plugintrain.estimate.names import PRECISIONS
    from plugintrain.precision_plugins import PRECISION_PLUGINS

    assert sorted(PRECISIONS) == sorted(PRECISION_PLUGINS)


# ---- context parallelism -----------------------------------------------------------------


def test_cp_shards_zero_state_over_dp_x_cp() -> None:
    """ZeRO-1 over cp4 holds what ZeRO-1 over dp4 does: the cp ranks of a replica average
    their gradients and shard the optimizer state between them (torchtitan's dp_shard_cp)."""
    config = TransformerConfig.from_name("llama3-debug")
    by_cp = estimate(config, Layout.of("hybrid", cp=4, zero_stage=1, seq_len=64))
    by_dp = estimate(config, Layout.of("hybrid", dp=4, zero_stage=1, seq_len=64))
    assert [r.training_state for r in by_cp.ranks] == [r.training_state for r in by_dp.ranks]
    assert [(r.dp_rank, r.cp_rank) for r in by_cp.ranks] == [(0, c) for c in range(4)]


def test_cp_activations_are_a_rank_s_share_plus_the_gathered_keys() -> None:
    """At 16,384 tokens (the issue's debug case) cp4 holds at most 0.3x cp1's activation
    peak: a quarter of every activation, plus whole rows of keys and values per block."""
    from plugintrain.estimate.dry_run import activation_peak

    config = TransformerConfig.from_name("llama3-debug", vocab_size=8192, block_size=16384)
    peaks = {
        cp: activation_peak(config, Layout.of("hybrid", cp=cp, seq_len=16384, precision="32-true"))
        for cp in (1, 4)
    }
    # Whole rows of keys and values, each block's: 16,384 tokens x 2 x 2 heads x 32 x 4 B.
    gathered = 4 * 16384 * 2 * 2 * 32 * 4
    assert peaks[4] - peaks[1] / 4 >= gathered * 3 / 4  # beyond a quarter of cp1's
    assert peaks[4] / peaks[1] <= 0.3


def test_a_sequence_cp_cannot_split_is_one_line() -> None:
    config = TransformerConfig.from_name("llama3-debug")
    with pytest.raises(ValueError, match="not divisible by 2 x context_parallel=8"):
        Layout.of("hybrid", cp=4, seq_len=100).check(config)
