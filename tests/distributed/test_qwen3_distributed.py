"""Qwen3 under tensor (+sequence) x data parallelism and under a pipeline, against one process.

One group of 4 gloo ranks runs every case on a shrunk ``qwen3-debug`` (heads of 16 over a
width of 32, so the query width is twice ``n_embd``): dp=2 x tp=2 with and without
sequence parallelism (``parallelize`` and the gradient engine), and pp=2 x tp=2 with SP
through Lightning's ``HybridParallelStrategy``. Each compares with one process on the same
weights and global batches. The point is the ``head_norm`` style of the query/key norms:
their weights' gradients, which each tp rank computes on its own heads only, must sum to
the single-process ones, and the norms must add no collective to a layer.
"""

from __future__ import annotations

import functools
from typing import Any

import lightning as L
import pytest
import torch
import torch.nn.functional as F
from _dtensors import full_grads, full_params
from torch import Tensor
from torch.distributed.tensor import DTensor, Replicate
from torch.distributed.tensor.debug import CommDebugMode
from torch.distributed.tensor.parallel import loss_parallel
from torch.utils.data import DataLoader, TensorDataset

from plugintrain.model_zoo import CausalLM, Transformer, TransformerConfig, qwen3
from plugintrain.precision_plugins import FP32Precision
from plugintrain.strategies import (
    HybridParallelStrategy,
    ParallelDims,
    apply_tensor_parallel,
    parallelize,
    vocab_parallel_loss,
)

from _harness import run_distributed

WORLD = 4
STEPS = 3
GLOBAL_BATCH = 4
SEQ = 16
VOCAB = 64
PLAN = qwen3.tp_plan()
HEAD_NORMS = ("attention.q_norm.weight", "attention.k_norm.weight")


def _config(n_layer: int = 2) -> TransformerConfig:
    return TransformerConfig.from_name(
        "qwen3-debug", n_layer=n_layer, vocab_size=VOCAB, block_size=SEQ, n_embd=32,
        head_size=16, intermediate_size=64, tokenizer=None,
    )  # fmt: skip


def _model(n_layer: int = 2) -> Transformer:
    torch.manual_seed(0)
    model = Transformer(_config(n_layer))
    with torch.no_grad():  # norms off one, so a gradient summed wrongly shows
        gen = torch.Generator().manual_seed(1)
        for name, param in model.named_parameters():
            if "norm" in name:
                param.copy_(torch.rand(param.shape, generator=gen) + 0.5)
    return model


def _batches() -> list[tuple[Tensor, Tensor]]:
    gen = torch.Generator().manual_seed(2)
    data = torch.randint(0, VOCAB, (STEPS, GLOBAL_BATCH, SEQ + 1), generator=gen)
    return [(d[:, :-1], d[:, 1:]) for d in data]


def _loss(logits: Tensor, targets: Tensor) -> Tensor:
    return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())


def _adamw(params: list[Tensor]) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1, eps=1e-5)


def _reference() -> dict[str, Any]:
    """One process: the first step's gradients, then the losses of STEPS AdamW steps."""
    model = _model()
    x, y = _batches()[0]
    _loss(model(x), y).backward()
    grads = full_grads(model)
    model.zero_grad()
    optimizer = _adamw(list(model.parameters()))
    losses = []
    for x, y in _batches():
        loss = _loss(model(x), y)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return {"grads": grads, "losses": losses}


def _tp_grads(sp: bool, mesh: Any) -> dict[str, Any]:
    """First-step gradients of the tensor-parallel model on the whole batch, and the
    placements the head norms' weights got."""
    model = _model()
    apply_tensor_parallel(model, PLAN, mesh["tp"], sp)
    x, y = _batches()[0]
    loss = vocab_parallel_loss(_loss)(model(x), y)
    with loss_parallel():
        loss.backward()
    norm = model.layers["0"].attention.q_norm.weight
    placements = tuple(norm.placements) if isinstance(norm, DTensor) else None
    return {"grads": full_grads(model), "placements": placements}


def _train(dims: ParallelDims, mesh: Any) -> list[float]:
    """Losses of STEPS steps of dp x tp, each replica on its rows of the global batch."""
    model = _model()
    engine = parallelize(model, PLAN, dims, mesh, bucket_size_mb=0.01)
    optimizer = _adamw(list(model.parameters()))
    engine.attach(optimizer)
    dp_rank, dp = mesh["dp"].get_local_rank(), dims.dp
    rows = slice(dp_rank * GLOBAL_BATCH // dp, (dp_rank + 1) * GLOBAL_BATCH // dp)
    losses = []
    for x, y in _batches():
        loss = vocab_parallel_loss(_loss)(model(x[rows]), y[rows])
        with loss_parallel():
            loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        mean = loss.detach().clone()
        torch.distributed.all_reduce(mean, group=mesh["dp"].get_group())
        losses.append(mean.item() / dp)
    return losses


def _layer_collectives(sp: bool, mesh: Any) -> dict[str, dict[str, int]]:
    """Collectives of one forward and one backward, per layer (2 layers minus 1)."""
    per_depth = []
    for n_layer in (1, 2):
        model = _model(n_layer)
        apply_tensor_parallel(model, PLAN, mesh["tp"], sp)
        x, y = _batches()[0]
        with CommDebugMode() as forward:
            loss = vocab_parallel_loss(_loss)(model(x), y)
        with CommDebugMode() as backward, loss_parallel():
            loss.backward()
        per_depth.append({"forward": _counts(forward), "backward": _counts(backward)})
    return {
        phase: {
            op: n - per_depth[0][phase].get(op, 0)
            for op, n in per_depth[1][phase].items()
            if n != per_depth[0][phase].get(op, 0)
        }
        for phase in ("forward", "backward")
    }


def _counts(mode: CommDebugMode) -> dict[str, int]:
    return {str(op).split(".")[-1]: n for op, n in mode.get_comm_counts().items()}


def _lightning_fit(strategy: Any = "auto") -> dict[str, Any]:
    """Fit CausalLM for STEPS steps of GLOBAL_BATCH sequences; losses and full weights."""
    L.seed_everything(0, verbose=False)
    optimizer = functools.partial(torch.optim.AdamW, lr=1e-2, eps=1e-5)
    module = CausalLM(_config(), optimizer, warmup_steps=0, min_lr_ratio=1.0)
    data = TensorDataset(*(torch.cat(parts) for parts in zip(*_batches(), strict=True)))
    losses: list[float] = []

    class _Losses(L.Callback):
        def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, *_: Any) -> None:
            losses.append(
                trainer.strategy.reduce(outputs["loss"].detach(), reduce_op="mean").item()
            )

    trainer = L.Trainer(
        accelerator="cpu", devices=1 if strategy == "auto" else WORLD, strategy=strategy,
        plugins=[FP32Precision()], max_steps=STEPS, use_distributed_sampler=False,
        logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, callbacks=[_Losses()],
    )  # fmt: skip
    trainer.fit(module, DataLoader(data, batch_size=GLOBAL_BATCH))
    params = full_params(module)
    return {"losses": losses, "params": params}


PIPELINE = {"pipeline_parallel": 2, "tensor_parallel": 2, "sequence_parallel": True,
            "microbatches": 2}  # fmt: skip


def _all_cases(rank: int, world_size: int) -> dict[str, Any]:
    results: dict[str, Any] = {}
    for sp in (False, True):
        dims = ParallelDims(world_size, tensor_parallel=2, sequence_parallel=sp)
        mesh = dims.build_mesh()
        results[f"tp_grads_sp{sp}"] = _tp_grads(sp, mesh)
        results[f"losses_sp{sp}"] = _train(dims, mesh)
        results[f"collectives_sp{sp}"] = _layer_collectives(sp, mesh)
    results["pipeline"] = _lightning_fit(HybridParallelStrategy(**PIPELINE))
    return results


@pytest.fixture(scope="module")
def world4() -> dict[str, Any]:
    return {"reference": _reference(), "ranks": run_distributed(_all_cases, WORLD)}


@pytest.mark.parametrize("sp", [False, True], ids=["dp2xtp2", "dp2xtp2+sp"])
def test_tensor_parallel_gradients_equal_single_process(world4: dict, sp: bool) -> None:
    reference = world4["reference"]["grads"]
    names = [n for n in reference if n.endswith(HEAD_NORMS)]
    assert len(names) == 4  # two layers, a query and a key norm each
    for rank in world4["ranks"]:
        got = rank[f"tp_grads_sp{sp}"]
        assert got["placements"] == (Replicate(),)  # the head_norm style was applied
        for name, grad in reference.items():
            torch.testing.assert_close(got["grads"][name], grad, rtol=1e-4, atol=1e-6, msg=name)


@pytest.mark.parametrize("sp", [False, True], ids=["dp2xtp2", "dp2xtp2+sp"])
def test_dp_tp_training_losses_equal_single_process(world4: dict, sp: bool) -> None:
    for rank in world4["ranks"]:
        torch.testing.assert_close(
            rank[f"losses_sp{sp}"], world4["reference"]["losses"], rtol=1e-5, atol=1e-5
        )


# Megatron-LM's per-layer count (Korthikanti et al. 2022, §4.2.2): the head norms add none.
EXPECTED_PER_LAYER = {
    False: {"forward": {"all_reduce": 2}, "backward": {"all_reduce": 2}},
    True: {
        "forward": {"all_gather_into_tensor": 2, "reduce_scatter_tensor": 2},
        "backward": {"all_gather_into_tensor": 2, "reduce_scatter_tensor": 2},
    },
}


@pytest.mark.parametrize("sp", [False, True], ids=["tp2", "tp2+sp"])
def test_head_norms_add_no_collective(world4: dict, sp: bool) -> None:
    for rank in world4["ranks"]:
        assert rank[f"collectives_sp{sp}"] == EXPECTED_PER_LAYER[sp]


# The tied head is the embedding in one process, a copy of it on the last stage.
TIED = {"model.output.weight": "model.tok_embeddings.weight"}


def test_pipeline_with_tensor_parallel_stages_equals_single_process(world4: dict) -> None:
    reference = _lightning_fit()
    seen: set[str] = set()
    for rank in world4["ranks"]:
        got = rank["pipeline"]
        torch.testing.assert_close(got["losses"], reference["losses"], rtol=1e-5, atol=1e-5)
        for name, param in got["params"].items():
            expected = reference["params"][TIED.get(name, name)]
            torch.testing.assert_close(param, expected, rtol=1e-4, atol=1e-5, msg=name)
        seen |= {TIED.get(name, name) for name in got["params"]}
    assert seen == set(reference["params"])  # the two stages hold the whole model
    assert {n for n in seen if n.endswith(HEAD_NORMS)}, "the stages train the head norms"


def test_head_norm_applies_without_sequence_parallelism() -> None:
    from plugintrain.strategies.tensor_parallel import SP_ONLY_STYLES, expand_plan

    assert "head_norm" not in SP_ONLY_STYLES
    resolved = expand_plan(_model(), PLAN, sequence_parallel=False)
    assert {p for p, s in resolved.items() if s == "head_norm"} == {
        f"layers.{i}.attention.{kind}_norm" for i in range(2) for kind in ("q", "k")
    }
