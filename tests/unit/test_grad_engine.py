"""Single-process logic of the gradient engine: bucketing, padding, shard ranges, errors."""

from __future__ import annotations

import re

import pytest
import torch
import torch.distributed as dist
from torch import nn

from plugintrain.strategies import (
    GradientEngine,
    ParameterServerStrategy,
    ZeroStrategy,
    check_shardable,
    optimizer_state_bytes,
    register_elementwise_optimizer,
)
from plugintrain.strategies.buckets import assign_buckets, padded_numel, shard_range
from plugintrain.strategies.optimizer_shards import ELEMENTWISE_OPTIMIZERS


@pytest.fixture
def world_of_one(tmp_path) -> None:
    """A gloo group of one process, for engine tests that need a process group."""
    assert not dist.is_initialized(), "another test left a process group initialized"
    dist.init_process_group(
        "gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1
    )
    yield
    dist.destroy_process_group()


def _mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 3))


def test_buckets_follow_backward_order_and_close_at_the_size() -> None:
    params = [torch.zeros(100), torch.zeros(100), torch.zeros(300), torch.zeros(50)]
    # 1 KiB buckets hold 256 fp32 elements: a bucket closes before a parameter that would
    # take it past the size (the 300-element one then fills its own) or once it is full.
    assert assign_buckets(params, 1 / 1024) == [[3], [2], [1, 0]]


def test_buckets_are_single_dtype() -> None:
    params = [torch.zeros(4), torch.zeros(4, dtype=torch.bfloat16), torch.zeros(4)]
    assert assign_buckets(params, 1.0) == [[2, 0], [1]]


def test_buckets_never_mix_reduction_groups() -> None:
    params = [torch.zeros(4) for _ in range(4)]
    assert assign_buckets(params, 1.0, ["dp", "edp", "dp", "edp"]) == [[3, 1], [2, 0]]


def test_large_parameter_gets_its_own_bucket() -> None:
    params = [torch.zeros(10), torch.zeros(10_000), torch.zeros(10)]
    assert assign_buckets(params, 1 / 1024) == [[2], [1], [0]]


@pytest.mark.parametrize(
    ("numel", "world", "padded"), [(10, 1, 10), (10, 4, 12), (12, 4, 12), (1, 3, 3)]
)
def test_padding_to_a_multiple_of_the_group(numel: int, world: int, padded: int) -> None:
    assert padded_numel(numel, world) == padded


def test_shard_ranges_tile_the_padded_buffer() -> None:
    ranges = [shard_range(10, rank, 4) for rank in range(4)]
    assert ranges == [(0, 3), (3, 6), (6, 9), (9, 12)]


@pytest.mark.parametrize("stage", [3, -1, "zero2", True])
def test_unknown_stage_is_refused(stage: object) -> None:
    with pytest.raises(
        ValueError, match=re.escape(f"ZeroStrategy(stage={stage!r}) is not supported")
    ):
        ZeroStrategy(stage=stage)  # type: ignore[arg-type]


@pytest.mark.parametrize("size", [0, -1.5])
def test_non_positive_bucket_size_is_refused(size: float) -> None:
    with pytest.raises(ValueError, match=rf"`bucket_size_mb` must be > 0, got {size}"):
        ZeroStrategy(stage=2, bucket_size_mb=size)
    with pytest.raises(ValueError, match="bucket_size_mb"):
        ParameterServerStrategy(bucket_size_mb=size)


def test_unknown_strategy_argument_is_refused() -> None:
    with pytest.raises(TypeError, match="find_unused_parameters"):
        ZeroStrategy(stage=1, find_unused_parameters=True)


def test_non_elementwise_optimizer_is_refused() -> None:
    optimizer = torch.optim.LBFGS(_mlp().parameters())
    with pytest.raises(TypeError, match=r"LBFGS cannot be used .* AdamW"):
        check_shardable(optimizer)


def test_registering_an_elementwise_optimizer() -> None:
    @register_elementwise_optimizer
    class Signum(torch.optim.SGD):
        pass

    try:
        check_shardable(Signum(_mlp().parameters(), lr=0.1))
    finally:
        ELEMENTWISE_OPTIMIZERS.discard(Signum)


@pytest.mark.usefixtures("world_of_one")
def test_engine_refuses_lbfgs_before_training() -> None:
    model = _mlp()
    engine = GradientEngine(model.named_parameters(), stage=2, bucket_size_mb=1.0)
    with pytest.raises(TypeError, match="LBFGS"):
        engine.attach(torch.optim.LBFGS(model.parameters()))


@pytest.mark.usefixtures("world_of_one")
def test_engine_refuses_foreign_parameters() -> None:
    model = _mlp()
    engine = GradientEngine(model.named_parameters(), stage=1, bucket_size_mb=1.0)
    with pytest.raises(ValueError, match=r"shape \(2,\) that the gradient engine does not"):
        engine.attach(torch.optim.SGD([nn.Parameter(torch.zeros(2))], lr=0.1))


@pytest.mark.usefixtures("world_of_one")
@pytest.mark.parametrize("stage", [0, 1, 2, "parameter_server"])
def test_params_become_views_of_padded_buckets(stage: int | str) -> None:
    model = _mlp()
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    engine = GradientEngine(model.named_parameters(), stage=stage, bucket_size_mb=1 / 16384)
    assert engine.num_buckets > 1
    for name, param in model.named_parameters():
        torch.testing.assert_close(param, before[name])
    storages = {p.untyped_storage().data_ptr() for p in model.parameters()}
    assert len(storages) == engine.num_buckets


@pytest.mark.usefixtures("world_of_one")
@pytest.mark.parametrize("stage", [0, 1, 2, "parameter_server"])
def test_one_rank_engine_trains_like_plain_pytorch(stage: int | str) -> None:
    x, y = torch.randn(8, 5), torch.randn(8, 3)
    reference, model = _mlp(), _mlp()
    engine = GradientEngine(model.named_parameters(), stage=stage, bucket_size_mb=1 / 16384)
    optimizers = [torch.optim.AdamW(m.parameters(), lr=0.1) for m in (reference, model)]
    engine.attach(optimizers[1])
    for _ in range(3):
        for net, optimizer in zip((reference, model), optimizers, strict=True):
            optimizer.zero_grad()
            nn.functional.mse_loss(net(x), y).backward()
            optimizer.step()
    for (name, expected), got in zip(reference.named_parameters(), model.parameters(), strict=True):
        torch.testing.assert_close(got, expected, msg=name)
    assert all(p.grad is None for p in model.parameters())
    assert optimizer_state_bytes(optimizers[1]) == optimizer_state_bytes(optimizers[0])


@pytest.mark.usefixtures("world_of_one")
@pytest.mark.parametrize("stage", [0, 1, 2])
def test_parameters_reduced_over_a_group_of_their_own(stage: int) -> None:
    """Expert weights are reduced over their own group (here a group of one as well): in
    buckets apart from the rest, and the whole state cannot be gathered onto one rank."""
    x, y = torch.randn(8, 5), torch.randn(8, 3)
    reference, model = _mlp(), _mlp()
    group = dist.new_group([0])
    own = {"2.weight": group, "2.bias": group}
    engine = GradientEngine(model.named_parameters(), stage=stage, reduce_groups=own)
    assert engine.num_buckets == 2
    optimizers = [torch.optim.AdamW(m.parameters(), lr=0.1) for m in (reference, model)]
    engine.attach(optimizers[1])
    for net, optimizer in zip((reference, model), optimizers, strict=True):
        nn.functional.mse_loss(net(x), y).backward()
        optimizer.step()
    for (name, expected), got in zip(reference.named_parameters(), model.parameters(), strict=True):
        torch.testing.assert_close(got, expected, msg=name)
    with pytest.raises(ValueError, match=r"groups of their own .* sharded checkpoint"):
        engine.optimizer_state_dict(optimizers[1])


@pytest.mark.usefixtures("world_of_one")
def test_a_group_for_a_name_the_model_lacks_is_refused() -> None:
    """A name spelled with another prefix would otherwise reduce over the whole dp group."""
    own = {"model.2.weight": dist.new_group([0])}
    with pytest.raises(ValueError, match=r"1 tensors .* \(model\.2\.weight\)"):
        GradientEngine(_mlp().named_parameters(), stage=1, reduce_groups=own)


@pytest.mark.usefixtures("world_of_one")
def test_state_created_before_attach_is_kept() -> None:
    # Adagrad creates its state eagerly, keyed by the original parameters.
    model = _mlp()
    engine = GradientEngine(model.named_parameters(), stage=2, bucket_size_mb=1 / 16384)
    optimizer = torch.optim.Adagrad(model.parameters(), lr=0.1, initial_accumulator_value=0.5)
    engine.attach(optimizer)
    state = engine.optimizer_state_dict(optimizer)
    assert set(state["state"]) == {name for name, _ in model.named_parameters()}
    torch.testing.assert_close(state["state"]["0.weight"]["sum"], torch.full((7, 5), 0.5))


@pytest.mark.usefixtures("world_of_one")
def test_positional_state_dict_of_a_plain_optimizer_loads_by_name() -> None:
    x, y = torch.randn(8, 5), torch.randn(8, 3)
    plain = _mlp()
    plain_optimizer = torch.optim.AdamW(plain.parameters(), lr=0.1)
    nn.functional.mse_loss(plain(x), y).backward()
    plain_optimizer.step()
    model = _mlp()
    engine = GradientEngine(model.named_parameters(), stage=1, bucket_size_mb=1 / 16384)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    engine.attach(optimizer)
    engine.load_optimizer_state_dict(optimizer, plain_optimizer.state_dict())
    full = engine.optimizer_state_dict(optimizer)
    for name, param in plain.named_parameters():
        expected = plain_optimizer.state[param]["exp_avg"]
        torch.testing.assert_close(full["state"][name]["exp_avg"], expected)


@pytest.mark.usefixtures("world_of_one")
def test_mismatched_param_groups_are_refused() -> None:
    model = _mlp()
    engine = GradientEngine(model.named_parameters(), stage=2, bucket_size_mb=1.0)
    optimizer = torch.optim.AdamW(model.parameters())
    engine.attach(optimizer)
    saved = {"state": {}, "param_groups": [optimizer.param_groups[0]] * 2}
    with pytest.raises(ValueError, match="checkpoint has 2 optimizer param groups, the"):
        engine.load_optimizer_state_dict(optimizer, saved)


@pytest.mark.usefixtures("world_of_one")
@pytest.mark.parametrize("overlap", [True, False])
def test_overlap_launches_buckets_from_the_gradient_hooks(overlap: bool) -> None:
    model = _mlp()
    engine = GradientEngine(
        model.named_parameters(), stage=2, bucket_size_mb=1 / 16384, overlap_comm=overlap
    )
    events: list[str] = []
    reduce, finish = engine._layout.scheme.reduce, engine.finish_grad_sync
    engine._layout.scheme.reduce = lambda bucket: events.append("reduce") or reduce(bucket)
    engine.finish_grad_sync = lambda: events.append("finish") or finish()
    model(torch.randn(4, 5)).sum().backward()
    # Overlapped: every bucket is launched by the hook of its last gradient, in backward;
    # otherwise all of them at the end.
    launched_in_backward = engine.num_buckets if overlap else 0
    assert engine.num_buckets > 1
    assert events.index("finish") == launched_in_backward
    assert events.count("reduce") == engine.num_buckets


@pytest.mark.usefixtures("world_of_one")
def test_block_backward_sync_accumulates_without_communicating() -> None:
    model = _mlp()
    strategy = ZeroStrategy(stage=2, bucket_size_mb=1 / 16384)
    strategy._binding.install(
        GradientEngine(model.named_parameters(), stage=2, bucket_size_mb=1 / 16384)
    )
    with strategy.block_backward_sync():
        model(torch.randn(4, 5)).sum().backward()
    assert strategy.engine.grad_bytes() > strategy.engine._layout.buckets[0].shard_grads.numel() * 4
    assert all(bucket.work is None for bucket in strategy.engine._layout.buckets)


@pytest.mark.usefixtures("world_of_one")
def test_sharded_save_refuses_a_remote_path_before_writing(tmp_path) -> None:
    from plugintrain.strategies.engine_binding import EngineBinding

    model = _mlp()
    binding = EngineBinding("ZeroStrategy")
    binding.install(GradientEngine(model.named_parameters(), stage=1))
    with pytest.raises(ValueError, match="save to a local or mounted filesystem"):
        binding.save({"state_dict": model.state_dict()}, "s3://bucket/last.ckpt", None, True)
    with pytest.raises(TypeError, match="does not take `storage_options`"):
        binding.save({"state_dict": model.state_dict()}, tmp_path / "c", {"x": 1}, True)
    # The hint's fix works: a local directory is written.
    binding.save({"state_dict": model.state_dict()}, tmp_path / "c", None, True)
    assert (tmp_path / "c" / ".metadata").is_file()


@pytest.mark.usefixtures("world_of_one")
def test_sharded_checkpoint_keeps_hyperparameters_as_json(tmp_path) -> None:
    """Tools rebuild the model from JSON beside the shards, never from the pickled meta.pt."""
    from plugintrain.checkpoints.dcp import read_hparams, save_directory
    from plugintrain.model_zoo import TransformerConfig

    config = TransformerConfig.from_name("llama3-debug", n_layer=2)  # with rope scaling
    model = _mlp()
    hparams = {"config": config, "warmup_steps": 3, "optimizer": torch.optim.AdamW}
    save_directory({"state_dict": model.state_dict(), "hyper_parameters": hparams}, tmp_path, True)
    saved = read_hparams(tmp_path)
    assert saved["warmup_steps"] == 3 and "optimizer" not in saved  # code is left out
    assert TransformerConfig.from_dict(saved["config"]) == config
    with pytest.raises(FileNotFoundError, match=r"no hyper_parameters\.json"):
        read_hparams(tmp_path / "elsewhere")


@pytest.mark.usefixtures("world_of_one")
def test_buckets_launch_in_bucket_order_behind_an_incomplete_one() -> None:
    """A bucket whose parameter got no gradient holds back every bucket after it until the
    end of backward, so every rank starts the same collectives in the same order; the
    unused parameter's gradient counts as zero."""
    model = _mlp()
    engine = GradientEngine(model.named_parameters(), stage=0, bucket_size_mb=1 / 16384)
    buckets = engine._layout.buckets
    assert [entry.name for entry in buckets[0].entries] == ["2.bias"]
    launched: list[int] = []
    reduce = engine._layout.scheme.reduce
    engine._layout.scheme.reduce = lambda b: launched.append(buckets.index(b)) or reduce(b)
    model[2].bias.requires_grad_(False)  # no gradient for it in this backward
    model(torch.randn(4, 5)).sum().backward()
    # The other buckets completed first, in backward; they launched at the end, in order.
    assert launched == list(range(engine.num_buckets))
    bias = next(e for e in buckets[0].entries if e.name == "2.bias")
    assert bias.shard is not None and bias.shard.grad is not None
    assert not bias.shard.grad.any()


@pytest.mark.usefixtures("world_of_one")
def test_launch_starts_a_partitions_buckets_early() -> None:
    model = _mlp()
    partition = {"0.weight": "first", "0.bias": "first", "2.weight": "last", "2.bias": "last"}
    engine = GradientEngine(
        model.named_parameters(), stage=2, bucket_size_mb=1.0, partition=partition
    )
    assert engine.num_buckets == 2  # one per key, though everything fits in one
    launched = []
    reduce = engine._layout.scheme.reduce
    engine._layout.scheme.reduce = lambda b: launched.append(b.entries[0].name) or reduce(b)
    with engine.defer_reduction():
        model(torch.randn(4, 5)).sum().backward()
        assert launched == []
        engine.launch(list(model[2].parameters()))
        assert launched == ["2.bias"]
        with pytest.raises(ValueError, match=r"also holds '0\.bias'"):
            engine.launch([model[0].weight])
        with engine.no_sync():
            engine.launch(list(model[0].parameters()))  # accumulating: nothing yet
    assert launched == ["2.bias"]
    engine.finish_grad_sync()
    assert launched == ["2.bias", "0.bias"]


@pytest.mark.usefixtures("world_of_one")
def test_gathered_optimizer_state_is_on_the_host(monkeypatch: pytest.MonkeyPatch) -> None:
    """Fused AdamW keeps ``step`` as a tensor on the parameters' device: what goes through
    the object collective, and the gathered state, are CPU copies."""
    model = _mlp()
    engine = GradientEngine(model.named_parameters(), stage=1, bucket_size_mb=1 / 16384)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1, fused=True)
    engine.attach(optimizer)
    model(torch.randn(4, 5)).sum().backward()
    optimizer.step()
    sent: list = []
    gather = dist.all_gather_object

    def recording(out: list, obj: object, **kwargs: object) -> None:
        sent.append(obj)
        gather(out, obj, **kwargs)

    monkeypatch.setattr(dist, "all_gather_object", recording)
    state = engine.optimizer_state_dict(optimizer)
    scalars = [v for meta in sent[0].values() for v in meta.scalars.values()]
    assert len(scalars) == 4 and all(v.device.type == "cpu" for v in scalars)
    live = {s["step"].data_ptr() for s in optimizer.state.values()}
    for values in state["state"].values():
        assert {key: v.device.type for key, v in values.items()} == dict.fromkeys(values, "cpu")
        assert values["step"].data_ptr() not in live  # a copy: later steps leave it alone
        assert float(values["step"]) == 1.0
