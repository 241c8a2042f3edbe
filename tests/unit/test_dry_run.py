"""Dry runs (``plugintrain estimate --dry_run``, :mod:`plugintrain.estimate.dry_run`): one
process per rank on torch's fake process group, meta tensors.

The bytes each rank holds are checked against real gloo ranks in
``tests/distributed/test_estimate_distributed.py``. Here: the traced step against the same
model run for real in this process (FLOPs and the activation peak, measured on CPU
tensors by the same counters), the collectives found per mesh dimension, and one planted
problem of each kind, reported in one line naming the rank and the value.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from plugintrain.cli import main
from plugintrain.core.memory import LiveTensorMemory
from plugintrain.estimate import Layout
from plugintrain.estimate.dry_run import (
    DryRank,
    build_ranks,
    ownership_problems,
    p2p_problems,
    parse_ranks,
    sample_ranks,
    trainable_stages,
)
from plugintrain.model_zoo import CausalLM, TransformerConfig

SEQ = 32
CONFIG = TransformerConfig.from_name("llama3-debug", block_size=SEQ)


def _layout(**degrees) -> Layout:
    layout = Layout.of("hybrid", **degrees)
    return dataclasses.replace(layout, seq_len=SEQ, micro_batch=2, precision="32-true")


def _real_step() -> tuple[int, int]:
    """Matmul FLOPs and activation peak (beyond what outlives the step) of one fp32
    forward and backward of the whole model on real CPU tensors (torch's CPU flash
    attention has no FLOP formula: attention is not counted here)."""
    torch.manual_seed(0)
    module = CausalLM(CONFIG)
    module.configure_model()
    tokens = torch.zeros(2, SEQ, dtype=torch.long)
    with LiveTensorMemory() as memory, FlopCounterMode(display=False) as flops:
        memory.track(module.parameters(), module.buffers())
        module.loss_fn(module(tokens), tokens).backward()
        peak = memory.peak_bytes - memory.live_bytes
    return flops.get_flop_counts()["Global"][torch.ops.aten.mm], peak


@pytest.fixture(scope="module")
def traced() -> dict[str, list[DryRank]]:
    layouts = {"one": _layout(), "tp2": _layout(tp=2, sp=True), "dp2": _layout(dp=2, zero_stage=2),
               "pp2": _layout(pp=2, dp=2, zero_stage=1, microbatches=2)}  # fmt: skip
    return {
        name: build_ranks(CONFIG, layout, list(range(layout.world_size)), trace=True)
        for name, layout in layouts.items()
    }


def test_the_traced_step_computes_what_the_real_model_does(traced) -> None:
    matmuls, peak = _real_step()
    one = traced["one"][0].trace
    assert one.flops_by_op["aten.mm"] == matmuls
    # Attention (SDPA's math path on meta): QK^T and AV, 2 B H S^2 D each, in each of the
    # layers, forward and twice that backward.
    b, h, d, layers = 2, CONFIG.n_head, CONFIG.n_embd // CONFIG.n_head, CONFIG.n_layer
    assert one.flops_by_op["aten.bmm"] == 3 * layers * 2 * (2 * b * h * SEQ * SEQ * d)
    # The same tensors but for a scalar or two (the engine's world-1 reduction, SDPA's
    # math path instead of CPU flash attention): 0.1%.
    assert one.activations == pytest.approx(peak, rel=1e-3)
    # tp splits every matmul (heads, MLP, the vocabulary) over 2 ranks.
    assert [r.trace.flops for r in traced["tp2"]] == [one.flops // 2] * 2
    # Data parallelism: each rank the whole model on its own batch.
    assert [r.trace.flops for r in traced["dp2"]] == [one.flops] * 2


def test_collectives_are_found_on_their_mesh_dimension(traced) -> None:
    def ops(rank: DryRank) -> set[tuple[str, str, int]]:
        return {(t.op, t.dim, t.group_size) for t in rank.trace.traffic}

    assert ops(traced["one"][0]) == {("all_reduce", "dp", 1)}  # the engine, a world of one
    tp = ops(traced["tp2"][0])  # sequence parallelism: all-gather in, reduce-scatter out
    assert {("all_gather", "tp", 2), ("reduce_scatter", "tp", 2)} <= tp
    # The vocabulary-parallel loss's all-reduces run inside DTensor's operators: seen too
    # (a dispatch-mode recorder saw only the 2 issued from Python).
    losses = [t for t in traced["tp2"][0].trace.traffic if (t.op, t.dim) == ("all_reduce", "tp")]
    assert losses and losses[0].count > 2, traced["tp2"][0].trace.traffic
    dp = ops(traced["dp2"][0])  # ZeRO-2: gradients reduce-scattered, parameters gathered
    assert ("all_gather", "dp", 2) in dp and not any(dim == "tp" for _, dim, _ in dp)
    pp = traced["pp2"]  # stage 0 (ranks 0, 1) sends activations to stage 1 (ranks 2, 3)
    assert [(k, peer) for k, peer, _ in pp[0].trace.p2p if k == "send"] == [("send", 2)] * 2
    assert p2p_problems(pp) == []


def test_the_engine_s_traffic_is_its_whole_buffers(traced) -> None:
    """ZeRO-2 reduce-scatters every gradient bucket once and all-gathers every parameter
    bucket once per step: each is the padded flat buffer whose storage the rank holds."""
    for rank in traced["dp2"]:
        dp = {t.op: t.bytes for t in rank.trace.traffic if t.dim == "dp"}
        assert dp["reduce_scatter"] == dp["all_gather"] == rank.parameters, rank.trace.traffic


def test_an_unpaired_send_is_reported_with_both_ranks(traced) -> None:
    ranks = list(traced["pp2"])
    trace = ranks[2].trace
    dropped = dataclasses.replace(trace, p2p=trace.p2p[1:])  # rank 2 misses a receive
    ranks[2] = dataclasses.replace(ranks[2], trace=dropped)
    problems = p2p_problems(ranks)
    assert len(problems) == 1 and problems[0].startswith("rank 0 -> rank 2: 2 sends"), problems


def test_every_parameter_is_stepped_once_and_a_lost_shard_is_named(traced) -> None:
    layout = _layout(pp=2, dp=2, zero_stage=1, microbatches=2)
    ranks = list(traced["pp2"])
    assert ownership_problems(ranks, layout, trainable_stages(CONFIG, layout)) == []
    owned = dict(ranks[1].owned)
    name = "layers.0.attention.wq.weight"
    owned[name] -= 1  # rank 1's optimizer misses one element of its shard
    ranks[1] = dataclasses.replace(ranks[1], owned=owned)
    problems = ownership_problems(ranks, layout, trainable_stages(CONFIG, layout))
    assert len(problems) == 1 and problems[0].startswith(f"parameter {name}: "), problems


def test_a_weight_no_rank_steps_or_holds_is_named(traced) -> None:
    layout = _layout(pp=2, dp=2, zero_stage=1, microbatches=2)
    expected = trainable_stages(CONFIG, layout)
    assert expected["tok_embeddings.weight"] == 2  # tied: the first and the last stage
    ranks = list(traced["pp2"])
    assert ownership_problems(ranks, layout, expected) == []
    # The last stage's optimizer leaves the tied head out (on both of its dp ranks).
    for i in (2, 3):
        owned = {**ranks[i].owned, "tok_embeddings.weight": 0}
        ranks[i] = dataclasses.replace(ranks[i], owned=owned)
    problems = ownership_problems(ranks, layout, expected)
    assert [p.split(":")[0] for p in problems] == ["parameter tok_embeddings.weight"], problems
    # A weight that no rank holds at all.
    lost = "layers.3.ffn_norm.weight"
    ranks = [dataclasses.replace(r, owned={k: v for k, v in r.owned.items() if k != lost})
             for r in traced["pp2"]]  # fmt: skip
    assert ownership_problems(ranks, layout, expected) == [
        f"parameter {lost}: held by no rank (nothing would train it)"
    ]


def test_sample_ranks_cover_every_stage_and_edge() -> None:
    layout = _layout(dp=4, tp=2, pp=2, microbatches=2)
    # (pp, dp, tp) -> rank = (pp * dp + dp_i) * tp + tp_i
    assert sample_ranks(layout) == [0, 1, 6, 7, 8, 9, 14, 15]
    assert parse_ranks("all", layout) == list(range(16))
    with pytest.raises(ValueError, match=r"rank 16 is not in 0\.\.15"):
        parse_ranks("3,16", layout)


def _dry_run_error(capsys, *args: str) -> str:
    code = main(["estimate", *args, "--dry_run"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and err, err
    assert "Traceback" not in "\n".join(err)
    return err[-1]


def test_a_layout_the_model_cannot_split_names_the_rank_and_value(capsys) -> None:
    line = _dry_run_error(capsys, "llama3-debug", "--tp", "3", "--ranks", "2")
    assert line.startswith("plugintrain estimate: error: rank 2: "), line
    assert "not divisible by tensor_parallel=3" in line, line


def test_a_rank_over_memory_is_named(capsys) -> None:
    line = _dry_run_error(capsys, "llama3-debug", "--dp", "2", "--zero_stage", "1",
                          "--memory", "50MiB")  # fmt: skip
    assert line.startswith("plugintrain estimate: rank 1 (pp 0, dp 1, tp 0) needs "), line
    assert "> --memory 52428800; list layouts that fit with --fit 52428800" in line, line


def test_an_unbalanced_pipeline_names_the_heavy_stage(capsys, tmp_path) -> None:
    config = tmp_path / "eight.yaml"  # small vocabulary: the head is next to nothing
    fields = dataclasses.asdict(TransformerConfig.from_name("llama3-debug", n_layer=8,
                                                            vocab_size=512))  # fmt: skip
    import yaml

    config.write_text(yaml.safe_dump({k: v for k, v in fields.items() if v is not None}))
    line = _dry_run_error(capsys, str(config), "--pp", "2", "--layers_per_stage", "7,1",
                          "--microbatches", "2")  # fmt: skip
    # 7 blocks against 1 block and a 512-word head: 5.6x.
    assert line.startswith("plugintrain estimate: pipeline stage 0 computes 5.60x the FLOPs"
                           " per token of stage 1"), line  # fmt: skip
    assert "move blocks off it with --layers_per_stage" in line, line


def test_dry_run_options_without_dry_run_are_refused(capsys) -> None:
    code = main(["estimate", "llama3-debug", "--trace"])
    assert code == 2
    assert capsys.readouterr().err.strip().endswith("--trace, --memory and --ranks go with"
                                                    " --dry_run; add it")  # fmt: skip


# ---- context parallelism -----------------------------------------------------------------


@pytest.mark.parametrize(
    "degrees",
    [dict(cp=2, dp=2, zero_stage=2), dict(cp=2, tp=2, sp=True, zero_stage=1)],
    ids=["cp2 x dp2, zero2", "cp2 x tp2 (sp), zero1"],
)
def test_a_cp_layout_s_ranks_hold_what_the_estimate_says(degrees: dict) -> None:
    """Every rank of a cp layout built on the real code path (the mesh's cp dimension,
    ZeRO sharding over dp x cp): its bytes equal the estimate's at its (pp, dp, cp)
    position, and every trainable element is stepped once over the dp x cp ranks."""
    from plugintrain.estimate.dry_run import dry_run

    layout = _layout(**degrees)
    report = dry_run(CONFIG, layout, list(range(layout.world_size)))
    assert report.problems == []
    assert {r.cp_rank for r in report.ranks} == {0, 1}
    for r in report.ranks:
        assert r.training_state == report.estimated[r.rank].training_state
        assert report.estimated[r.rank].cp_rank == r.cp_rank


def test_sample_ranks_cover_the_cp_edges() -> None:
    layout = _layout(cp=4, tp=2)  # mesh (dp, cp, tp): rank = cp x 2 + tp
    assert sample_ranks(layout) == [0, 1, 6, 7]


def test_the_cp_exchange_is_traced_on_the_cp_dimension() -> None:
    """The K/V all-gather and reduce-scatter a traced cp step issues, by the recorder's
    names of the mesh's groups: ``cp`` for the exchange, ``dp,cp`` for the gradients."""
    from plugintrain.estimate.dry_run.trace import _mesh_groups
    from plugintrain.estimate.dry_run.world import fake_world

    layout = _layout(cp=2, dp=2, tp=2)
    with fake_world(0, layout.world_size):
        mesh = layout.dims.build_mesh("cpu")
        names = _mesh_groups(mesh, 0)
    # Mesh (dp, cp, tp) of 2 x 2 x 2: rank = (dp x 2 + cp) x 2 + tp.
    assert names[frozenset({0, 2})] == "cp"
    assert names[frozenset({0, 2, 4, 6})] == "dp,cp"
    assert names[frozenset({0, 1})] == "tp"
