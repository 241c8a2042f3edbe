"""The scaling calculator (``plugintrain estimate --time``, :mod:`plugintrain.estimate.timing`).

Its inputs from the model's shapes are checked against the real code path's traced step
(the dry run's FLOP counter and collective recorder); its arithmetic against formulas
written out here from their sources: nccl-tests' bus bandwidth, the pipeline bubble of
GPipe / 1F1B / interleaved 1F1B (Narayanan et al. 2021, section 2.2), and a one-GPU step
bound by its matmuls. Its figures against published runs are in the README
(``benchmarks/scaling_calculator.py``), not asserted here; what that benchmark adds for
Megatron-LM's run is checked against the paper's FLOP count.
"""

from __future__ import annotations

import dataclasses
import json

import pytest

from plugintrain.cli import main
from plugintrain.core.peak_flops import DENSE_PEAK_FLOPS
from plugintrain.estimate import Layout
from plugintrain.estimate.dry_run import dry_run, sample_ranks
from plugintrain.estimate.timing import (
    CLUSTERS,
    Collective,
    Link,
    collective_time,
    formula_costs,
    power_limited_clock,
    predict,
    tokens_per_step,
    traced_costs,
)
from plugintrain.model_zoo import TransformerConfig

# Blocks wide enough, and a vocabulary small enough, that the blocks' traffic dominates.
CONFIG = TransformerConfig.from_name(
    "llama3-debug", n_embd=256, n_head=4, n_kv_head=2, vocab_size=512, n_layer=4, block_size=256
)
TRACED = {
    "dp2 x tp2 (sp) x pp2, zero1": dict(dp=2, tp=2, sp=True, pp=2, microbatches=4, zero_stage=1),
    "dp2 x tp2, zero2": dict(dp=2, tp=2, zero_stage=2),
    "dp2 x pp2 x vpp2": dict(dp=2, pp=2, vpp=2, microbatches=4),
    "dp2 x tp2 (sp), full recomputation": dict(dp=2, tp=2, sp=True, zero_stage=1,
                                               recompute="full"),
    "dp2 x tp2 (sp), selective recomputation": dict(dp=2, tp=2, sp=True, zero_stage=1,
                                                    recompute="selective"),
    "dp2 x tp2, selective recomputation": dict(dp=2, tp=2, zero_stage=1, recompute="selective"),
}  # fmt: skip


def _layout(**degrees) -> Layout:
    # fp32: a traced step runs on meta tensors, where autocast does not run (the dtypes
    # under bf16-mixed are checked on real ranks, tests/distributed/test_traffic_distributed.py).
    return Layout.of("hybrid", precision="32-true", micro_batch=2, seq_len=128, **degrees)


@pytest.fixture(scope="module")
def traced() -> dict[str, tuple[Layout, list]]:
    """Each layout's costs from a traced dry run of one rank per stage."""
    out = {}
    for name, degrees in TRACED.items():
        layout = _layout(**degrees)
        report = dry_run(CONFIG, layout, sample_ranks(layout), trace=True)
        out[name] = (layout, traced_costs(report, CONFIG, layout))
    return out


@pytest.mark.parametrize("name", list(TRACED))
def test_costs_from_the_shapes_equal_the_traced_step(traced: dict, name: str) -> None:
    layout, from_trace = traced[name]
    from_shapes = formula_costs(CONFIG, layout)
    for t, f in zip(from_trace, from_shapes, strict=True):
        assert f.matmul_flops == pytest.approx(t.matmul_flops, rel=1e-9)
        assert f.attention_flops == pytest.approx(t.attention_flops, rel=1e-9)
        assert (f.p2p_bytes, f.p2p_messages) == (t.p2p_bytes, t.p2p_messages)
        assert f.state_bytes == t.state_bytes
        total = sum(c.bytes for c in t.collectives)
        shapes = {(c.op, c.dim): c for c in f.collectives}
        for c in t.collectives:  # every collective of weight, by its bytes (the traced
            if c.bytes < 0.05 * total:  # step also has the loss's few scalar reductions)
                continue
            assert shapes[(c.op, c.dim)].bytes == pytest.approx(c.bytes, rel=0.01), c
    cluster = CLUSTERS["h100-ib"]
    a = predict(from_trace, CONFIG, layout, cluster).step_time
    b = predict(from_shapes, CONFIG, layout, cluster).step_time
    assert b == pytest.approx(a, rel=0.05)


def test_cluster_names_listed_without_torch_are_the_presets() -> None:
    from plugintrain.estimate.names import CLUSTER_NAMES

    assert tuple(CLUSTERS) == CLUSTER_NAMES


@pytest.mark.parametrize("op", ["all_reduce", "all_gather", "reduce_scatter"])
def test_collective_time_is_nccl_tests_bus_bandwidth(op: str) -> None:
    # nccl-tests (doc/PERFORMANCE.md): busbw = algbw x 2(n-1)/n for all-reduce and
    # algbw x (n-1)/n for all-gather and reduce-scatter, algbw = size / time.
    n, size, busbw = 8, 2**30, 100e9
    factor = 2 * (n - 1) / n if op == "all_reduce" else (n - 1) / n
    seconds = collective_time(Collective(op, "dp", n, 1, size), Link(busbw, 0.0))
    assert seconds == pytest.approx(size * factor / busbw)
    one_call_latency = collective_time(Collective(op, "dp", n, 3, 0), Link(busbw, 5e-6))
    assert one_call_latency == pytest.approx(3 * 5e-6)


def test_one_gpu_step_is_its_matmuls_at_the_sustained_rate() -> None:
    config, layout = CONFIG, Layout.of("single", precision="bf16-mixed", micro_batch=4,
                                       seq_len=256)  # fmt: skip
    cluster = CLUSTERS["h100-ib"]
    tokens = 4 * 256
    d, f, v, h, kv, hd = 256, config.ffn_dim, 512, 4, 2, 64
    per_block = d * h * hd + 2 * d * kv * hd + h * hd * d + 3 * d * f  # q, k, v, o, SwiGLU
    matmuls = 6 * tokens * (4 * per_block + v * d)  # 4 blocks and the head, 3 passes
    attention = 4 * 3 * (2 * tokens * 256 * h * 2 * hd) / 2  # causal: half of the scores
    peak = DENSE_PEAK_FLOPS["h100 sxm"]["bf16"]  # the layout is bf16-mixed
    compute = matmuls / (peak * 0.75) + attention / (peak * 0.35)
    # Memory-bound kernels, bytes a token of a block's forward: two RMSNorms (pow, mean,
    # two multiplies: 6 accesses of the fp32 width), five bf16 casts of their outputs for
    # the Linears (read fp32, write bf16), RoPE on q (256 wide) and k (128: half of the
    # K/V's 256) at 10 accesses, attention's output transposed (2), two residual adds
    # (3 accesses, fp32), SwiGLU (5 accesses of the bf16 FFN width); backward twice the
    # forward. The head: the final norm (three passes over fp32) and the cross-entropy,
    # 7 fp32 accesses a logit plus its casts to and from fp32.
    block = 2 * 6 * d * 4 + 5 * d * 6 + 10 * (h * hd + kv * hd) * 2 + 2 * h * hd * 2
    block += 2 * 3 * d * 4 + 5 * f * 2
    head = 3 * 6 * d * 4 + v * (7 * 4 + 2 * (2 + 4))
    memory = tokens * (3 * 4 * block + head) / 3.35e12
    prediction = predict(formula_costs(config, layout), config, layout, cluster)
    assert prediction.breakdown["compute"] == pytest.approx(compute, rel=1e-9)
    assert prediction.breakdown["memory-bound"] == pytest.approx(memory, rel=1e-9)
    step = compute + memory + prediction.breakdown["optimizer"]
    assert prediction.step_time == pytest.approx(step)
    assert prediction.tokens_per_second == pytest.approx(tokens / prediction.step_time)


def test_a_power_limit_slows_the_tensor_cores_not_the_mfu_denominator() -> None:
    # NVIDIA's two H100 boards: 989.4 dense bf16 TFLOP/s at 700 W (SXM), 835.5 at 400 W
    # (NVL); torchtitan's 500 W boards lie between them, a third of the way up.
    assert power_limited_clock(700) == pytest.approx(1.0)
    assert power_limited_clock(400) * 989.4 == pytest.approx(835.5)
    assert power_limited_clock(500) * 989.4 == pytest.approx(835.5 + (989.4 - 835.5) / 3)
    titan = CLUSTERS["h100-500w-roce"]
    assert (titan.hbm_bandwidth, titan.tensor_clock) == (2.4e12, power_limited_clock(500))
    with pytest.raises(ValueError, match="watts=300"):
        power_limited_clock(300)
    # Half the clock: twice the compute, half the MFU (still over the datasheet's peak).
    layout = Layout.of("single", precision="bf16-mixed", micro_batch=4, seq_len=256)
    free = dataclasses.replace(CLUSTERS["h100-ib"], hbm_bandwidth=1e30)
    costs = formula_costs(CONFIG, layout)
    rated = predict(costs, CONFIG, layout, free)
    capped = predict(costs, CONFIG, layout, dataclasses.replace(free, tensor_clock=0.5))
    assert capped.breakdown["compute"] == pytest.approx(2 * rated.breakdown["compute"])
    assert capped.mfu == pytest.approx(rated.mfu / 2, rel=1e-3)  # (the optimizer's step aside)


def test_fsdp2_copies_and_unhidden_edges_are_priced() -> None:
    # dp4 FSDP2 under bf16-mixed, CONFIG's P parameters (tied embedding 512 x 256, final
    # norm 256, four blocks of q 256x256, k and v 128x256, o 256x256, SwiGLU 3 x 384x256
    # and two norms). Per step: two gathers of bf16 weights, each copied out (read and
    # written, 2 x 2P bytes) and copied in from the fp32 shards (P/4 read at 4 bytes,
    # written at 2); one fp32 reduce-scatter of the gradients, chunk-concatenated from
    # bf16 (2P read, 4P written).
    block = 256 * 256 * 2 + 128 * 256 * 2 + 3 * 384 * 256 + 2 * 256
    outside = 512 * 256 + 256
    params = outside + 4 * block
    copies = 2 * (2 * 2 * params + params / 4 * (4 + 2)) + (2 + 4) * params
    fsdp = Layout.of("hybrid", precision="bf16-mixed", micro_batch=2, seq_len=128, dp=4,
                     zero_stage=3)  # fmt: skip
    zero2 = dataclasses.replace(fsdp, dims=dataclasses.replace(fsdp.dims, zero_stage=2))
    (three,), (two,) = formula_costs(CONFIG, fsdp), formula_costs(CONFIG, zero2)
    assert three.memory_bytes - two.memory_bytes == pytest.approx(copies)
    # The first two units (what is outside the blocks, then block 0) gather before the
    # first block runs and reduce-scatter after the last backward: exposed however long
    # the compute, the rest of FSDP2's traffic hidden under it.
    edge = outside + block
    assert {(c.op, c.count, c.bytes) for c in three.fsdp_edge} == {
        ("all_gather", 2, 2 * edge),  # bf16
        ("reduce_scatter", 2, 4 * edge),  # fp32
    }
    link = Link(1e12, 0.0)
    fast = dataclasses.replace(CLUSTERS["h100-ib"], intra=link)
    exposed = sum(collective_time(c, link) for c in three.fsdp_edge)
    assert predict([three], CONFIG, fsdp, fast).breakdown["dp exposed"] == pytest.approx(exposed)


@pytest.mark.parametrize(("schedule", "vpp"), [("gpipe", 1), ("1f1b", 1), ("interleaved", 2)])
def test_pipeline_bubble_is_the_textbook_one(schedule: str, vpp: int) -> None:
    # Equal stages (no head: a one-word vocabulary; no traffic: free links), p stages and
    # m micro-batches: the step is (m + (p - 1) / v) micro-batch times (Narayanan et al.).
    config = dataclasses.replace(CONFIG, n_layer=8, vocab_size=1, tie_embeddings=False)
    p, m = 4, 8
    layout = _layout(pp=p, vpp=vpp, microbatches=m, schedule=schedule)
    free = Link(1e30, 0.0)
    cluster = dataclasses.replace(CLUSTERS["h100-ib"], intra=free, inter=free,
                                  hbm_bandwidth=1e30)  # fmt: skip
    prediction = predict(formula_costs(config, layout), config, layout, cluster)
    compute = prediction.breakdown["compute"]
    # (The last stage's one-word head makes it 0.1% heavier than the others.)
    assert prediction.breakdown["bubble"] / compute == pytest.approx((p - 1) / (vpp * m), rel=5e-3)


def test_gradient_reduction_hides_under_the_backward_until_it_outlasts_it() -> None:
    layout = _layout(dp=16, zero_stage=0)  # two nodes: the reduction crosses the network
    costs = formula_costs(CONFIG, layout)
    fast_net = dataclasses.replace(CLUSTERS["h100-ib"], inter=Link(1e15, 0.0))
    fast = predict(costs, CONFIG, layout, fast_net)
    assert fast.breakdown["dp exposed"] == 0
    slow_net = dataclasses.replace(CLUSTERS["h100-ib"], inter=Link(1e6, 0.0))
    slow = predict(costs, CONFIG, layout, slow_net)
    (reduce,) = [c for c in costs[0].collectives if c.dim == "dp"]
    backward = (slow.breakdown["compute"] + slow.breakdown["memory-bound"]) * 2 / 3
    seconds = collective_time(reduce, Link(1e6, 0.0), nodes=2)
    assert slow.breakdown["dp exposed"] == pytest.approx(seconds - backward)


@pytest.mark.parametrize(("recompute", "gathers"), [("none", 1), ("full", 2), ("selective", 2)])
def test_cp_exchanges_whole_rows_of_keys_and_values_every_block(
    recompute: str, gathers: int
) -> None:
    # cp4 x tp2 (sp), 4 blocks, 2 rows of 128 tokens in fp32: per block and micro-batch
    # one all-gather of K and V together, whole rows of this tp rank's one K/V head
    # (2 x 128 tokens x 64 channels x 4 bytes each), again in a rerun forward; backward
    # reduce-scatters their gradient. Gradients reduce over the 4 dp x cp ranks.
    layout = _layout(cp=4, tp=2, sp=True, recompute=recompute)
    (cost,) = formula_costs(CONFIG, layout)
    found = {(c.op, c.dim): c for c in cost.collectives}
    one = 2 * 128 * 64 * 4
    gather, scatter = found[("all_gather", "cp")], found[("reduce_scatter", "cp")]
    assert (gather.group_size, gather.count, gather.bytes) == (
        4,
        4 * gathers,
        2 * 4 * gathers * one,
    )
    assert (scatter.count, scatter.bytes) == (4, 2 * 4 * one)
    assert found[("all_reduce", "dp")].group_size == 4


def test_cp_splits_every_rank_s_work_and_prices_the_exchange_exposed() -> None:
    # Each cp rank computes a quarter of the rows' tokens, its queries over whole rows:
    # a quarter of the matmuls and of the causal attention (Megatron's head-tail balance).
    one, four = (formula_costs(CONFIG, _layout(cp=cp))[0] for cp in (1, 4))
    assert four.matmul_flops == pytest.approx(one.matmul_flops / 4, rel=1e-12)
    assert four.attention_flops == pytest.approx(one.attention_flops / 4, rel=1e-12)
    assert four.memory_bytes < one.memory_bytes / 2  # beside the gathered keys' reordering
    layout = _layout(cp=4)
    costs = formula_costs(CONFIG, layout)
    slow = dataclasses.replace(CLUSTERS["h100-ib"], intra=Link(1e9, 0.0))
    fast = dataclasses.replace(CLUSTERS["h100-ib"], intra=Link(1e30, 0.0))
    exposed = sum(collective_time(c, Link(1e9, 0.0)) for c in costs[0].collectives if c.dim == "cp")
    gap = predict(costs, CONFIG, layout, slow).step_time
    gap -= predict(costs, CONFIG, layout, fast).step_time
    assert predict(costs, CONFIG, layout, slow).breakdown["tp/ep/cp exposed"] == pytest.approx(
        exposed
    )
    assert gap >= exposed


def test_estimate_time_prints_the_prediction(capsys: pytest.CaptureFixture) -> None:
    argv = ["estimate", "llama3.1-8b", "--dp", "8", "--zero_stage", "1", "--seq_len", "8192",
            "--time", "--cluster", "a100-ib"]  # fmt: skip
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "predicted on a100-ib (from the shapes): a100" in out
    assert "MFU" in out and "modelled:" in out
    assert main([*argv, "--json"]) == 0
    record = json.loads(capsys.readouterr().out)
    assert 0 < record["prediction"]["mfu"] < 1


def test_dry_run_prices_the_traced_step_next_to_the_shapes(capsys: pytest.CaptureFixture) -> None:
    argv = ["estimate", "llama3-debug", "--dp", "2", "--tp", "2", "--seq_len", "32",
            "--dry_run", "--trace", "--time"]  # fmt: skip
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "(from the traced step)" in out and "(from the shapes)" in out


@pytest.mark.parametrize(
    ("argv", "names"),
    [
        (["--time", "--matmul_efficiency", "1.5"], ["--matmul_efficiency=1.5", "(0, 1]"]),
        (["--time", "--inter_bw", "0"], ["--inter_bw=0.0", "> 0"]),
        (["--time", "--gpus_per_node", "0"], ["--gpus_per_node=0", ">= 1"]),
        (["--dry_run", "--time"], ["--time with --dry_run", "add --trace"]),
    ],
)
def test_bad_calculator_options_are_one_line(
    capsys: pytest.CaptureFixture, argv: list[str], names: list[str]
) -> None:
    assert main(["estimate", "llama3-debug", "--dp", "2", *argv]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("plugintrain estimate: error:")
    for name in names:
        assert name in err[0]


def _benchmark() -> object:
    import importlib.util
    import sys
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "benchmarks" / "scaling_calculator.py"
    spec = importlib.util.spec_from_file_location("scaling_calculator", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def test_megatron_row_prices_the_flops_megatron_counts() -> None:
    """The benchmark's GPT 1T row, with what Megatron-LM executed beyond plugintrain added
    (whole-layer recomputation, unfused attention over the whole square), runs exactly the
    FLOPs per token of the paper's equation 3, ``96 l h^2 (1 + s/6h + V/16lh)``, written
    out here (biases and norms, which the equation leaves out, aside), and reissues the
    all-reduce after each block's last matmul in its rerun."""
    bench = _benchmark()
    run = next(r for r in bench.RUNS if r.name.startswith("GPT 1T"))
    config = TransformerConfig.from_name(run.model, **run.overrides)
    layout = Layout.of("hybrid", precision=run.precision, **run.layout)
    plain = formula_costs(config, layout)
    costs = run.rerun(plain, config, layout)
    dims, m = layout.dims, layout.pipeline.microbatches
    tokens = tokens_per_step(layout)
    per_token = sum(c.matmul_flops + c.attention_flops for c in costs) * dims.tp * dims.dp / tokens
    layers, h, s, v = config.n_layer, config.n_embd, layout.seq_len, config.vocab_size
    paper = 96 * layers * h**2 * (1 + s / (6 * h) + v / (16 * layers * h))
    assert per_token == pytest.approx(paper, rel=1e-4)
    # Without the additions plugintrain itself runs less: a third of a forward less.
    ran = sum(c.matmul_flops + c.attention_flops for c in plain) * dims.tp * dims.dp / tokens
    assert ran < 0.95 * paper
    # Rank 1 holds 2 blocks: 2 more all-reduces a micro-batch, of a half-precision output.
    blocks, micro_tokens = layers // dims.pp, layout.micro_batch * s

    def tp_all_reduce(cost: object) -> tuple[int, int]:
        found = [c for c in cost.collectives if (c.op, c.dim) == ("all_reduce", "tp")]
        return sum(c.count for c in found), sum(c.bytes for c in found)

    (count, size), (count0, size0) = tp_all_reduce(costs[1]), tp_all_reduce(plain[1])
    assert (count - count0, size - size0) == (blocks * m, blocks * m * micro_tokens * h * 2)


def test_titan_op_policy_reruns_three_of_seven_matmuls() -> None:
    """torchtitan's op policy recomputes every second matmul of a block: wk (4096 x 1024),
    wo (4096 x 4096) and w3 (4096 x 14336) of Llama 3 8B, written out here."""
    bench = _benchmark()
    config = TransformerConfig.from_name("llama3.1-8b")
    layout = Layout.of("hybrid", precision="bf16-mixed", dp=8, zero_stage=3, seq_len=64)
    plain = formula_costs(config, layout)
    costs = bench.titan_op_policy(plain, config, layout)
    rerun = 4096 * 1024 + 4096 * 4096 + 4096 * 14336
    added = costs[0].matmul_flops - plain[0].matmul_flops
    assert added == pytest.approx(2 * 64 * rerun * 32)
