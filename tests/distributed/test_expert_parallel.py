"""Expert parallelism (with dp, tp (+SP), pp and ZeRO) on gloo, against one process.

A shrunk ``deepseek-v3-debug`` (a dense block, then two mixture-of-experts blocks with
MLA attention, a shared expert and a sequence-wise balance loss) trains on the same
global batches as one process with AdamW:

- ``parallelize`` and the gradient engine: ep=2 (world 2, ZeRO-0), dp4 x ep2 (ZeRO-0 and
  ZeRO-2: each expert held by two ranks), tp2 x ep2 (ZeRO-1) and tp2+SP x ep2 (world 4;
  each tp rank's balance loss is its sequence shard's part): the losses of every step, the whole
  first-step gradient of every parameter (expert shards gathered; at ZeRO-0) and the
  global gradient norm the precision plugins clip by.
- Lightning's ``HybridParallelStrategy``: ep2 x pp2 with ZeRO-1 (the pipeline adds each
  stage's balance loss) saves a sharded checkpoint, which one process reads back whole
  (weights, AdamW state, routing biases), dp4 with ep=1 resumes, and a dp4 x ep2 model
  built on the meta device loads as pretrained weights into its expert shards.

Processes start once per world size.
"""

from __future__ import annotations

import dataclasses
import functools
import tempfile
from collections.abc import Iterator
from contextlib import nullcontext
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from _dtensors import full_params
from torch import Tensor, nn
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import loss_parallel
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from plugintrain.checkpoints.dcp import read_full
from plugintrain.model_zoo import CausalLM, Transformer, TransformerConfig, deepseek_v3
from plugintrain.precision_plugins import FP32Precision
from plugintrain.strategies import (
    HybridParallelStrategy,
    ParallelDims,
    hybrid_gradient_layout,
    parallelize,
    vocab_parallel_loss,
)
from plugintrain.strategies.blocks import BlockOptions
from plugintrain.strategies.mesh import data_parallel_mesh

from _harness import run_distributed

STEPS = 3
GLOBAL_BATCH = 4
SEQ = 16
VOCAB = 64


def _config(aux_loss_coeff: float = 0.01) -> TransformerConfig:
    base = TransformerConfig.from_name("deepseek-v3-debug")
    mla = dataclasses.replace(base.mla, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16)
    moe = dataclasses.replace(base.moe, moe_intermediate_size=32, aux_loss_coeff=aux_loss_coeff)
    return dataclasses.replace(
        base, n_layer=3, vocab_size=VOCAB, block_size=SEQ, n_embd=64,
        intermediate_size=128, mla=mla, moe=moe, tokenizer=None,
    )  # fmt: skip


def _model(config: TransformerConfig) -> Transformer:
    torch.manual_seed(0)
    return Transformer(config)


def _batches() -> list[tuple[Tensor, Tensor]]:
    gen = torch.Generator().manual_seed(1)
    data = torch.randint(0, VOCAB, (2 * STEPS, GLOBAL_BATCH, SEQ + 1), generator=gen)
    return [(d[:, :-1], d[:, 1:]) for d in data]


def _loss(logits: Tensor, targets: Tensor) -> Tensor:
    return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())


def _adamw(params: list[Tensor]) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1, eps=1e-5)


def _reference(aux_loss_coeff: float) -> dict[str, Any]:
    """One process: the first step's gradients and their norm, then STEPS AdamW losses."""
    model = _model(_config(aux_loss_coeff))
    optimizer = _adamw(list(model.parameters()))
    losses, grads, norm = [], {}, 0.0
    for step, (x, y) in enumerate(_batches()[:STEPS]):
        loss = _loss(model(x), y)
        aux = model.take_aux_loss()
        loss = loss if aux is None else loss + aux
        loss.backward()
        if step == 0:
            grads = {n: p.grad.clone() for n, p in model.named_parameters()}
            norm = sum(g.double().square().sum() for g in grads.values()).sqrt()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return {"grads": grads, "norm": float(norm), "losses": losses}


@dataclasses.dataclass(frozen=True)
class Case:
    """One layout of ``parallelize`` + the gradient engine."""

    ep: int
    tp: int = 1
    sp: bool = False
    zero_stage: int = 0
    recompute: str = "none"

    aux_loss_coeff: float = 0.01


# Recomputation reruns the blocks' routing and, under `full`, their all-to-alls in backward.
WORLD2 = [Case(ep=2), Case(ep=2, recompute="full"), Case(ep=2, recompute="selective")]
# dp4 x ep2: each expert on two ranks (edp = 2), replicated (ZeRO-0) or sharded (ZeRO-2).
WORLD4 = [
    Case(ep=2),
    Case(ep=2, zero_stage=2),
    Case(ep=2, tp=2, zero_stage=1),
    Case(ep=2, tp=2, sp=True),
]


def _train(case: Case, world_size: int) -> dict[str, Any]:
    """STEPS steps of ``case`` on its dp replica's rows of each global batch."""
    dims = ParallelDims(
        world_size, tensor_parallel=case.tp, sequence_parallel=case.sp,
        expert_parallel=case.ep, zero_stage=case.zero_stage,
    )  # fmt: skip
    mesh = dims.build_mesh()
    config = _config(case.aux_loss_coeff)
    model = _model(config)
    plan = deepseek_v3.tp_plan(config) if case.tp > 1 else None
    blocks = BlockOptions(case.recompute)
    engine = parallelize(model, plan, dims, mesh, bucket_size_mb=0.01, blocks=blocks)
    optimizer = _adamw(list(model.parameters()))
    engine.attach(optimizer)
    dp_mesh = data_parallel_mesh(mesh)
    rows = GLOBAL_BATCH // dims.dp
    rows = slice(dp_mesh.get_local_rank() * rows, (dp_mesh.get_local_rank() + 1) * rows)
    loss_fn = vocab_parallel_loss(_loss) if case.tp > 1 else _loss
    losses, grads, norm = [], {}, 0.0
    for step, (x, y) in enumerate(_batches()[:STEPS]):
        cross_entropy = loss_fn(model(x[rows]), y[rows])
        aux = model.take_aux_loss()
        loss = cross_entropy if aux is None else cross_entropy + aux
        with loss_parallel() if case.tp > 1 else nullcontext():
            loss.backward()
        if step == 0:
            stepped = [p for group in optimizer.param_groups for p in group["params"]]
            norm = hybrid_gradient_layout(stepped, engine, case.tp).global_norm().item()
            grads = _whole_grads(model, engine, stepped) if case.zero_stage == 0 else {}
        optimizer.step()
        optimizer.zero_grad()
        mean = loss.detach().clone()
        if case.sp and aux is not None:  # each tp rank holds its sequence shard's part
            whole = aux.detach().clone()
            dist.all_reduce(whole, group=mesh["tp"].get_group())
            mean = cross_entropy.detach() + whole
        dist.all_reduce(mean, group=dp_mesh.get_group())
        losses.append(mean.item() / dims.dp)
    return {"losses": losses, "grads": grads, "norm": norm, "placements": _placements(model)}


def _whole_grads(model: nn.Module, engine: Any, stepped: list[Tensor]) -> dict[str, Tensor]:
    """Each parameter's reduced gradient, whole: at ZeRO-0 the optimizer's parameter of a
    model parameter covers its whole local tensor; expert shards are gathered over ep."""
    by_param = {id(engine.parameter_of(shard)): shard for shard in stepped}
    grads = {}
    for name, param in model.named_parameters():
        local = param.to_local() if isinstance(param, DTensor) else param
        grad = by_param[id(param)].grad.view_as(local)
        if isinstance(param, DTensor):
            grad = DTensor.from_local(grad, param.device_mesh, param.placements).full_tensor()
        grads[name] = grad.clone()
    return grads


def _placements(model: nn.Module) -> dict[str, tuple]:
    """The DTensor placements of the first MoE layer's parameters."""
    moe = model.layers["1"].feed_forward
    return {
        name: tuple(p.placements) if isinstance(p, DTensor) else None
        for name, p in moe.named_parameters()
    }


# ---- through Lightning: ep2 x pp2, its checkpoint read whole and resumed by dp4 ------------


class _Record(L.Callback):
    """The logged (cross-entropy) loss of every step, averaged over the world; after the
    first epoch (with ``snapshot``), every weight and buffer and the optimizer's state by
    parameter name: what a checkpoint written then holds (the routing biases are updated
    by the module's own ``on_train_batch_end``, after the callbacks')."""

    def __init__(self, snapshot: bool = False) -> None:
        self.losses: list[float] = []
        self.snapshot = {} if snapshot else None

    def on_train_batch_end(self, trainer: Any, pl_module: Any, *args: Any) -> None:
        loss = trainer.callback_metrics["train_loss"].detach().clone()
        self.losses.append(trainer.strategy.reduce(loss, reduce_op="mean").item())

    def on_train_epoch_end(self, trainer: Any, pl_module: Any) -> None:
        if self.snapshot == {}:
            self.snapshot = _snapshot(pl_module, trainer.optimizers[0])


def _snapshot(module: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    names = {id(p): n for n, p in module.named_parameters()}
    state = {names[id(p)]: {k: v.clone() for k, v in s.items()} for p, s in optimizer.state.items()}
    weights = {n: t.detach().clone() for n, t in module.state_dict().items()}
    return {"weights": weights, "optimizer": state}


def _fit(
    strategy: Any = "auto",
    dp: int = 1,
    dp_rank: int = 0,
    steps: int = STEPS,
    save: Path | None = None,
    resume: Path | None = None,
    snapshot: bool = False,
) -> dict[str, Any]:
    """Fit CausalLM (clipping on) for ``steps`` steps of GLOBAL_BATCH sequences, each dp
    replica reading its rows, validating after each epoch of STEPS steps."""
    L.seed_everything(0, verbose=False)
    optimizer = functools.partial(torch.optim.AdamW, lr=1e-2, eps=1e-5)
    module = CausalLM(_config(), optimizer, warmup_steps=0, min_lr_ratio=1.0)
    data = TensorDataset(*(torch.cat(parts) for parts in zip(*_batches()[:STEPS], strict=True)))
    sampler = DistributedSampler(data, num_replicas=dp, rank=dp_rank, shuffle=False)
    val_sampler = DistributedSampler(data, num_replicas=dp, rank=dp_rank, shuffle=False)
    record = _Record(snapshot)
    trainer = L.Trainer(
        accelerator="cpu", devices=1 if strategy == "auto" else 4, strategy=strategy,
        plugins=[FP32Precision()], max_steps=steps, gradient_clip_val=0.5,
        use_distributed_sampler=False, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, callbacks=[record],
        limit_val_batches=1, num_sanity_val_steps=0,
    )  # fmt: skip
    batch = GLOBAL_BATCH // dp
    trainer.fit(
        module,
        DataLoader(data, batch_size=batch, sampler=sampler),
        DataLoader(data, batch_size=batch, sampler=val_sampler),
        ckpt_path=resume,
    )
    if save is not None:
        trainer.save_checkpoint(save)
    return {"losses": record.losses, "params": full_params(module), "snapshot": record.snapshot}


def _lightning_runs(root: Path, rank: int) -> dict[str, Any]:
    pipeline = _pipeline()
    # Mesh (pp, edp, ep): the two dp replicas of a stage are its two expert ranks.
    ep_pp = _fit(pipeline, dp=2, dp_rank=rank % 2, save=root / "ep2xpp2")
    dp4 = HybridParallelStrategy(zero_stage=2)  # ep = 1
    resumed = _fit(dp4, dp=4, dp_rank=rank, steps=2 * STEPS, resume=root / "ep2xpp2")
    return {
        "ep2xpp2": ep_pp,
        "dp4_from_ep2xpp2": resumed,
        "pretrained_ep2": _pretrained(root / "ep2xpp2", HybridParallelStrategy(expert_parallel=2)),
        "pretrained_ep2_pp2": _pretrained(root / "ep2xpp2", _pipeline()),
    }


def _pipeline() -> HybridParallelStrategy:
    return HybridParallelStrategy(
        pipeline_parallel=2, expert_parallel=2, zero_stage=1, microbatches=2,
        layers_per_stage=[2, 1],
    )  # fmt: skip


def _pretrained(path: Path, strategy: HybridParallelStrategy) -> dict[str, Any]:
    """The ep2 x pp2 checkpoint as the pretrained weights of a model built on the meta
    device, its experts sharded, then loaded box by box: each rank reads only the tensors
    its stage holds, on its own (stages read different tensors, so no collective)."""
    module = CausalLM(_config(), weights=str(path))
    trainer = L.Trainer(
        accelerator="cpu", devices=4, strategy=strategy,
        plugins=[FP32Precision()], logger=False, enable_progress_bar=False,
        enable_model_summary=False, use_distributed_sampler=False,
    )  # fmt: skip
    x, y = _batches()[0]
    trainer.validate(module, DataLoader(TensorDataset(x, y), batch_size=1), verbose=False)
    experts = next(p for n, p in module.named_parameters() if n.endswith("experts.w1"))
    biases = {n: b.clone() for n, b in module.named_buffers() if n.endswith("expert_bias")}
    return {"params": full_params(module), "biases": biases, "local": experts.to_local().shape}


def _world4(rank: int, world_size: int, root: str) -> dict[str, Any]:
    results: dict[str, Any] = {case: _train(case, world_size) for case in WORLD4}
    return results | _lightning_runs(Path(root), rank)


def _world2(rank: int, world_size: int) -> dict[str, Any]:
    return {case: _train(case, world_size) for case in WORLD2}


@pytest.fixture(scope="module")
def checkpoints() -> Iterator[Path]:
    with tempfile.TemporaryDirectory() as root:
        yield Path(root)


@pytest.fixture(scope="module")
def ranks(checkpoints: Path) -> dict[int, list[dict[Any, Any]]]:
    return {
        2: run_distributed(_world2, 2),
        4: run_distributed(_world4, 4, str(checkpoints), timeout=600),
    }


@functools.cache
def _cached_reference(aux_loss_coeff: float) -> dict[str, Any]:
    return _reference(aux_loss_coeff)


TOL = {"rtol": 1e-4, "atol": 1e-5}


@pytest.mark.parametrize("case", WORLD2 + WORLD4, ids=str)
def test_matches_single_process(ranks: dict, case: Case) -> None:
    reference = _cached_reference(case.aux_loss_coeff)
    for got in (rank[case] for rank in ranks[2 if case in WORLD2 else 4]):
        torch.testing.assert_close(got["losses"], reference["losses"], **TOL)
        assert got["norm"] == pytest.approx(reference["norm"], rel=1e-5)
        for name, grad in got["grads"].items():
            torch.testing.assert_close(grad, reference["grads"][name], **TOL, msg=name)
        assert set(got["grads"]) in (set(), set(reference["grads"]))


def test_experts_are_sharded_and_the_rest_replicated(ranks: dict) -> None:
    from torch.distributed.tensor import Replicate, Shard

    ep = ranks[2][0][WORLD2[0]]["placements"]
    assert ep["experts.w1"] == (Shard(0),) and ep["router.weight"] is None
    tp_sp = ranks[4][0][WORLD4[3]]["placements"]
    assert tp_sp["experts.w2"] == (Shard(0), Replicate())
    assert tp_sp["router.weight"] == tp_sp["shared_experts.w1.weight"] == (Replicate(),)


def _reference_fit() -> dict[str, Any]:
    return _fit(steps=2 * STEPS, snapshot=True)


@pytest.fixture(scope="module")
def reference_fit() -> dict[str, Any]:
    return _reference_fit()


def test_pipeline_with_expert_parallelism_matches_single_process(
    ranks: dict, reference_fit: dict
) -> None:
    snapshot = reference_fit["snapshot"]["weights"]
    seen = set()
    for rank in ranks[4]:
        got = rank["ep2xpp2"]
        torch.testing.assert_close(got["losses"], reference_fit["losses"][:STEPS], **TOL)
        for name, param in got["params"].items():
            torch.testing.assert_close(param, snapshot[name], **TOL, msg=name)
        seen |= set(got["params"])
    assert seen == {n for n, _ in _named_parameters()}, "the stages hold the whole model"


def _named_parameters() -> list[tuple[str, Tensor]]:
    with torch.device("meta"):
        module = CausalLM(_config())
        module.configure_model()
    return list(module.named_parameters())


def test_sharded_checkpoint_reads_whole_in_one_process(
    ranks: dict, reference_fit: dict, checkpoints: Path
) -> None:
    """Weights, routing biases and AdamW state, saved shard by shard by ep2 x pp2."""
    saved = read_full(checkpoints / "ep2xpp2")
    expected = reference_fit["snapshot"]
    weights = saved["state_dict"]
    assert set(weights) == set(expected["weights"])
    biases = [n for n in weights if n.endswith("router.expert_bias")]
    assert len(biases) == 2 and any(weights[n].abs().sum() > 0 for n in biases)
    for name, value in expected["weights"].items():
        torch.testing.assert_close(weights[name], value, **TOL, msg=name)
    state = saved["optimizer_states"][0]["state"]
    assert set(state) == set(expected["optimizer"])
    for name, values in expected["optimizer"].items():
        for key in ("exp_avg", "exp_avg_sq"):
            torch.testing.assert_close(state[name][key], values[key], rtol=1e-4, atol=1e-7)


@pytest.mark.parametrize("layout", ["pretrained_ep2", "pretrained_ep2_pp2"])
def test_pretrained_weights_load_into_expert_shards(
    ranks: dict, reference_fit: dict, layout: str
) -> None:
    expected = reference_fit["snapshot"]["weights"]
    loaded = set()
    for rank in ranks[4]:
        got = rank[layout]
        assert got["local"][0] == _config().moe.n_routed_experts // 2  # its own experts only
        for name, value in {**got["params"], **got["biases"]}.items():
            torch.testing.assert_close(value, expected[name], **TOL, msg=name)
        loaded |= set(got["params"])
    assert loaded == set(reference_fit["params"])  # the stages hold the whole model


def test_dp_resumes_the_expert_parallel_checkpoint(ranks: dict, reference_fit: dict) -> None:
    for rank in ranks[4]:
        got = rank["dp4_from_ep2xpp2"]
        torch.testing.assert_close(got["losses"], reference_fit["losses"][STEPS:], **TOL)
        for name, param in got["params"].items():
            torch.testing.assert_close(param, reference_fit["params"][name], rtol=1e-4, atol=1e-4)
