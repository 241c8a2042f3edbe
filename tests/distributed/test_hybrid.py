"""Tensor/sequence x data parallelism (ZeRO 0-3) on gloo, against a single process.

One spawn at world size 4 runs every case: for GPT-2 and Llama debug models, tp=4 (dp=1)
and dp=2 x tp=2, with and without sequence parallelism, with ZeRO stage 0/1/2 (our
gradient engine) and 3 (FSDP2). Each case checks, against one process on the same
weights and global batch: the first step's gradient of every parameter (gathered),
the losses of several AdamW steps, and the final parameters. A second group of checks
counts collectives per transformer layer with torch's ``CommDebugMode``.
"""

from __future__ import annotations

import dataclasses
import functools
from pathlib import Path
from typing import Any

import lightning as L
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from _dtensors import full_grads, full_params
from torch import Tensor, nn
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.debug import CommDebugMode
from torch.distributed.tensor.parallel import loss_parallel
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from plugintrain.data import TokenDataModule, write_token_bin
from plugintrain.model_zoo import CausalLM, Transformer, TransformerConfig, gpt2, llama3
from plugintrain.precision_plugins import FP32Precision
from plugintrain.strategies import (
    HybridParallelStrategy,
    ParallelDims,
    apply_tensor_parallel,
    hybrid_gradient_layout,
    parallelize,
    vocab_parallel_loss,
)

from _harness import run_distributed
from _hf_models import random_hf_llama

WORLD = 4
STEPS = 3
GLOBAL_BATCH = 4
SEQ = 16
VOCAB = 64
PLANS = {"gpt2-debug": gpt2.tp_plan(), "llama3-debug": llama3.tp_plan()}


@dataclasses.dataclass(frozen=True)
class Case:
    """One layout, trained single-process and on the 4 ranks."""

    preset: str
    tp: int
    sp: bool
    zero_stage: int = 0


CASES = [
    case
    for preset in PLANS
    for case in (
        Case(preset, tp=4, sp=False),
        Case(preset, tp=4, sp=True),
        Case(preset, tp=2, sp=False, zero_stage=0),
        Case(preset, tp=2, sp=True, zero_stage=1),
        Case(preset, tp=2, sp=True, zero_stage=2),
        Case(preset, tp=2, sp=False, zero_stage=3),
        Case(preset, tp=2, sp=True, zero_stage=3),
    )
]


def _config(preset: str, n_layer: int = 2) -> TransformerConfig:
    # n_kv_head=4: Llama debug's 2 kv heads cannot be split 4 ways (GPT-2 has 4 anyway).
    return TransformerConfig.from_name(
        preset, n_layer=n_layer, vocab_size=VOCAB, n_embd=32, block_size=SEQ, n_kv_head=4
    )


def _model(preset: str, n_layer: int = 2) -> Transformer:
    torch.manual_seed(0)
    return Transformer(_config(preset, n_layer))


def _batches() -> list[tuple[Tensor, Tensor]]:
    gen = torch.Generator().manual_seed(1)
    data = torch.randint(0, VOCAB, (STEPS, GLOBAL_BATCH, SEQ + 1), generator=gen)
    return [(d[:, :-1], d[:, 1:]) for d in data]


def _loss(logits: Tensor, targets: Tensor) -> Tensor:
    return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())


def _adamw(params: list[Tensor]) -> torch.optim.Optimizer:
    # GPT-2's key bias gets an exactly-zero gradient (softmax ignores a shift shared by all
    # keys); a large eps keeps Adam from blowing its rounding noise up to full-size steps.
    return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1, eps=1e-5)


def _reference(preset: str) -> dict[str, Any]:
    model = _model(preset)
    batches = _batches()
    _loss(model(batches[0][0]), batches[0][1]).backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    optimizer = _adamw(list(model.parameters()))
    losses = []
    for x, y in batches:
        loss = _loss(model(x), y)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return {"grads": grads, "losses": losses, "params": full_params(model)}


def _tp_grads(case: Case, mesh: Any) -> dict[str, Tensor]:
    """First-step gradients of the tensor-parallel model on the whole batch."""
    model = _model(case.preset)
    apply_tensor_parallel(model, PLANS[case.preset], mesh["tp"], case.sp)
    x, y = _batches()[0]
    loss = vocab_parallel_loss(_loss)(model(x), y)
    with loss_parallel():
        loss.backward()
    return full_grads(model)


def _train(case: Case, dims: ParallelDims, mesh: Any) -> dict[str, Any]:
    model = _model(case.preset)
    engine = parallelize(model, PLANS[case.preset], dims, mesh, bucket_size_mb=0.01)
    optimizer = _adamw(list(model.parameters()))
    if engine is not None:
        engine.attach(optimizer)
    dp_rank, dp = mesh["dp"].get_local_rank(), dims.dp
    loss_fn = vocab_parallel_loss(_loss)
    losses, state_bytes, norms = [], 0, []
    for x, y in _batches():
        rows = slice(dp_rank * GLOBAL_BATCH // dp, (dp_rank + 1) * GLOBAL_BATCH // dp)
        loss = loss_fn(model(x[rows]), y[rows])
        with loss_parallel():
            loss.backward()
        stepped = [p for group in optimizer.param_groups for p in group["params"]]
        norms.append(hybrid_gradient_layout(stepped, engine, dims.tensor_parallel).global_norm())
        optimizer.step()
        state_bytes = _training_state_bytes(model, optimizer, engine)
        optimizer.zero_grad()
        mean = loss.detach().clone()
        torch.distributed.all_reduce(mean, group=mesh["dp"].get_group())
        losses.append(mean.item() / dp)
    return {
        "losses": losses,
        "params": full_params(model),
        "state_bytes": state_bytes,
        "first_grad_norm": norms[0].item(),
    }


def _bytes(tensor: Tensor) -> int:
    local = tensor.to_local() if isinstance(tensor, DTensor) else tensor
    return local.numel() * local.element_size()


def _training_state_bytes(model: nn.Module, optimizer: Any, engine: Any) -> int:
    """This rank's parameter + gradient + optimizer-state bytes, right after a step."""
    params = sum(_bytes(p) for p in model.parameters())
    if engine is not None:  # the engine keeps gradients in its buckets
        grads = engine.grad_bytes()
    else:
        grads = sum(_bytes(p.grad) for p in model.parameters() if p.grad is not None)
    states = optimizer.state.values()
    return params + grads + sum(_bytes(v) for s in states for v in s.values() if v.dim() > 0)


def _parity_cases(rank: int, world_size: int, cases: list[Case]) -> dict[Case, dict]:
    results = {}
    for case in cases:
        dims = ParallelDims(
            world_size,
            tensor_parallel=case.tp,
            sequence_parallel=case.sp,
            zero_stage=case.zero_stage,
        )
        mesh = dims.build_mesh()
        results[case] = {"grads": _tp_grads(case, mesh), **_train(case, dims, mesh)}
    return results


# Through Lightning: the strategy's own setup, optimizer hooks, sampler and clipping.
LIGHTNING_CASES = [
    Case("llama3-debug", tp=2, sp=True, zero_stage=2),
    Case("gpt2-debug", tp=2, sp=False, zero_stage=3),
]


def _lightning_fit(case: Case, strategy: Any = "auto", dp_rank: int = 0) -> dict[str, Tensor]:
    """Fit CausalLM for STEPS steps of GLOBAL_BATCH sequences; return the full weights.

    Each of the ``dp = 4 / tp`` replicas reads rows ``dp_rank::dp`` (no shuffling), so one
    step of all replicas covers the single process's batch.
    """
    L.seed_everything(0, verbose=False)
    optimizer = functools.partial(torch.optim.AdamW, lr=1e-2, eps=1e-5)
    module = CausalLM(_config(case.preset), optimizer, warmup_steps=0, min_lr_ratio=1.0)
    data = TensorDataset(*(torch.cat(parts) for parts in zip(*_batches(), strict=True)))
    dp = 1 if strategy == "auto" else WORLD // case.tp
    sampler = DistributedSampler(data, num_replicas=dp, rank=dp_rank, shuffle=False)
    trainer = L.Trainer(
        accelerator="cpu", devices=1 if strategy == "auto" else WORLD, strategy=strategy,
        plugins=[FP32Precision()], max_steps=STEPS, gradient_clip_val=0.5,
        use_distributed_sampler=False, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False,
    )  # fmt: skip
    trainer.fit(module, DataLoader(data, batch_size=GLOBAL_BATCH // dp, sampler=sampler))
    return full_params(module)


def _lightning_cases(rank: int, world_size: int, cases: list[Case]) -> dict[Case, dict]:
    results = {}
    for case in cases:
        strategy = HybridParallelStrategy(
            tensor_parallel=case.tp, sequence_parallel=case.sp, zero_stage=case.zero_stage
        )
        results[case] = _lightning_fit(case, strategy, dp_rank=rank // case.tp)  # tp innermost
    return results


def _count_layer_collectives(rank: int, world_size: int) -> dict[tuple, dict[str, int]]:
    """Collectives of one forward + backward, per extra layer (2-layer minus 1-layer model)."""
    counts = {}
    for preset in PLANS:
        for sp in (False, True):
            dims = ParallelDims(world_size, tensor_parallel=world_size, sequence_parallel=sp)
            mesh = dims.build_mesh()
            per_depth = [_comm_counts(preset, n, dims, mesh) for n in (1, 2)]
            counts[(preset, sp)] = {
                phase: {
                    k: per_depth[1][phase].get(k, 0) - per_depth[0][phase].get(k, 0)
                    for k in per_depth[1][phase] | per_depth[0][phase]
                }
                for phase in ("forward", "backward")
            }
    return counts


def _comm_counts(preset: str, n_layer: int, dims: ParallelDims, mesh: Any) -> dict[str, dict]:
    model = _model(preset, n_layer)
    apply_tensor_parallel(model, PLANS[preset], mesh["tp"], dims.sequence_parallel)
    x, y = _batches()[0]
    with CommDebugMode() as fwd:
        loss = vocab_parallel_loss(_loss)(model(x), y)
    with CommDebugMode() as bwd, loss_parallel():
        loss.backward()
    return {"forward": _names(fwd), "backward": _names(bwd)}


def _names(mode: CommDebugMode) -> dict[str, int]:
    return {str(op).split(".")[-1]: n for op, n in mode.get_comm_counts().items()}


# The data each rank trains on under dp=2 x tp=2, from TokenDataModule (shuffled).
WINDOW = 4  # tokens per training window
WINDOWS = 16


def _token_dir(root: Path) -> Path:
    # Token value == position (< VOCAB), so a window's first token / WINDOW is its index.
    tokens = np.arange(WINDOWS * WINDOW + 1) % VOCAB
    for name in ("train.bin", "val.bin"):
        write_token_bin(root / name, tokens)
    return root


class _SeenWindows(L.Callback):
    """The window indices of every training batch this rank receives."""

    def __init__(self) -> None:
        self.batches: list[list[int]] = []

    def on_train_batch_start(
        self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        self.batches.append((batch[0][:, 0] // WINDOW).tolist())


def _seen_windows(data_dir: Path) -> dict[str, Any]:
    """One epoch under HybridParallelStrategy(tp=2) on 4 ranks: what this rank trained on."""
    L.seed_everything(0, verbose=False)
    seen = _SeenWindows()
    strategy = HybridParallelStrategy(tensor_parallel=2)
    trainer = L.Trainer(
        accelerator="cpu", devices=WORLD, strategy=strategy, max_epochs=1,
        limit_val_batches=0, callbacks=[seen], logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False,
    )  # fmt: skip
    data = TokenDataModule(str(data_dir), seq_len=WINDOW, batch_size=2, vocab_size=VOCAB)
    trainer.fit(CausalLM(_config("llama3-debug"), warmup_steps=0), datamodule=data)
    mesh = strategy.device_mesh
    ranks = {"dp": mesh["dp"].get_local_rank(), "tp": mesh["tp"].get_local_rank()}
    return {**ranks, "batches": seen.batches}


# Pretrained weights (a Hugging Face Llama saved by transformers) loaded into sharded layouts.
PRETRAINED_LAYOUTS = {  # name -> (HybridParallelStrategy options, head tied to the embedding)
    "tp2 x pp2": ({"tensor_parallel": 2, "pipeline_parallel": 2}, False),
    "dp2 x tp2 +SP": ({"tensor_parallel": 2, "sequence_parallel": True}, False),
    "dp4 FSDP2": ({"zero_stage": 3}, False),
    "dp2 x pp2, tied head": ({"pipeline_parallel": 2}, True),
}


def _hf_llama(root: Path, tied: bool) -> Path:
    """A random Hugging Face Llama (GQA) saved by transformers."""
    return random_hf_llama(root, VOCAB, tied=tied)


def _hf_val_loss(hf_dir: Path) -> float:
    """transformers' own mean next-token loss on the validation windows."""
    import transformers

    model = transformers.LlamaForCausalLM.from_pretrained(hf_dir).eval()
    x, y = (torch.cat(parts) for parts in zip(*_batches(), strict=True))
    with torch.no_grad():
        return float(F.cross_entropy(model(x).logits.flatten(0, 1), y.flatten()))


def _pretrained_val_loss(layout: dict[str, Any], hf_dir: Path) -> float:
    """``val_loss`` of ``CausalLM(weights=hf_dir)`` validated under ``layout``."""
    module = CausalLM(weights=str(hf_dir))
    trainer = L.Trainer(
        accelerator="cpu", devices=WORLD, strategy=HybridParallelStrategy(**layout),
        logger=False, enable_progress_bar=False, enable_model_summary=False,
    )  # fmt: skip
    data = TensorDataset(*(torch.cat(parts) for parts in zip(*_batches(), strict=True)))
    (metrics,) = trainer.validate(module, DataLoader(data, batch_size=1), verbose=False)
    return metrics["val_loss"]


def _lightning_runs(
    rank: int, world_size: int, cases: list[Case], data_dir: Path, hf_dirs: dict[bool, Path]
) -> dict:
    pretrained = {
        name: _pretrained_val_loss(layout, hf_dirs[tied])
        for name, (layout, tied) in PRETRAINED_LAYOUTS.items()
    }
    return {
        "cases": _lightning_cases(rank, world_size, cases),
        "data": _seen_windows(data_dir),
        "pretrained": pretrained,
    }


@pytest.fixture(scope="module")
def world4(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    references = {preset: _reference(preset) for preset in PLANS}
    parity = run_distributed(_parity_cases, WORLD, CASES)
    counts = run_distributed(_count_layer_collectives, WORLD)
    data_dir = _token_dir(tmp_path_factory.mktemp("tokens"))
    hf_dirs = {tied: _hf_llama(tmp_path_factory.mktemp("hf_llama"), tied) for tied in (False, True)}
    lightning = run_distributed(_lightning_runs, WORLD, LIGHTNING_CASES, data_dir, hf_dirs)
    return {
        "references": references,
        "parity": parity,
        "counts": counts,
        "lightning": lightning,
        "hf_val_loss": {tied: _hf_val_loss(path) for tied, path in hf_dirs.items()},
    }


@pytest.mark.parametrize("layout", PRETRAINED_LAYOUTS)
def test_pretrained_weights_load_into_every_layout(world4: dict[str, Any], layout: str) -> None:
    """Each rank reads the Hugging Face file and keeps its shard (tp, FSDP2) or stage (pp):
    validation on 4 ranks gives transformers' loss on the same windows."""
    tied = PRETRAINED_LAYOUTS[layout][1]
    for rank in world4["lightning"]:
        assert rank["pretrained"][layout] == pytest.approx(world4["hf_val_loss"][tied], rel=1e-5)


@pytest.mark.parametrize("case", CASES, ids=str)
def test_matches_single_process(world4: dict[str, Any], case: Case) -> None:
    reference = world4["references"][case.preset]
    for rank_results in world4["parity"]:
        got = rank_results[case]
        for name, grad in reference["grads"].items():
            torch.testing.assert_close(got["grads"][name], grad, rtol=1e-4, atol=1e-5, msg=name)
        torch.testing.assert_close(got["losses"], reference["losses"], rtol=1e-5, atol=1e-5)
        # What a precision plugin clips by: every parameter counted once over tp x dp.
        norm = torch.linalg.vector_norm(
            torch.stack([g.norm() for g in reference["grads"].values()])
        )
        assert got["first_grad_norm"] == pytest.approx(norm.item(), rel=1e-5)
        for name, param in reference["params"].items():
            torch.testing.assert_close(got["params"][name], param, rtol=1e-4, atol=1e-5, msg=name)


# Megatron-LM's analysis (Korthikanti et al. 2022, §4.2.2): per layer, TP does two
# all-reduces forward and two backward; SP replaces each by an all-gather plus a
# reduce-scatter (same volume), with nothing extra.
EXPECTED_PER_LAYER = {
    False: {"forward": {"all_reduce": 2}, "backward": {"all_reduce": 2}},
    True: {
        "forward": {"all_gather_into_tensor": 2, "reduce_scatter_tensor": 2},
        "backward": {"all_gather_into_tensor": 2, "reduce_scatter_tensor": 2},
    },
}


@pytest.mark.parametrize("sp", [False, True], ids=["tp", "tp+sp"])
@pytest.mark.parametrize("preset", list(PLANS))
def test_collectives_per_layer_match_megatron(
    world4: dict[str, Any], preset: str, sp: bool
) -> None:
    for counts in world4["counts"]:
        got = {
            phase: {op: n for op, n in ops.items() if n}
            for phase, ops in counts[(preset, sp)].items()
        }
        assert got == EXPECTED_PER_LAYER[sp]


@pytest.mark.parametrize("preset", list(PLANS))
def test_fsdp_holds_one_dp_th_of_ddp_state(world4: dict[str, Any], preset: str) -> None:
    ddp, fsdp = (
        Case(preset, tp=2, sp=False, zero_stage=0),
        Case(preset, tp=2, sp=False, zero_stage=3),
    )
    for rank_results in world4["parity"]:
        ratio = rank_results[fsdp]["state_bytes"] / rank_results[ddp]["state_bytes"]
        assert ratio == pytest.approx(1 / 2, rel=0.05)  # dp = 2; FSDP2 pads uneven dims


@pytest.mark.parametrize("case", LIGHTNING_CASES, ids=str)
def test_lightning_strategy_matches_single_process(world4: dict[str, Any], case: Case) -> None:
    reference = _lightning_fit(case)
    for rank_results in world4["lightning"]:
        for name, param in reference.items():
            got = rank_results["cases"][case][name]
            torch.testing.assert_close(got, param, rtol=1e-4, atol=1e-5, msg=name)


def test_tensor_parallel_peers_see_the_same_batches(world4: dict[str, Any]) -> None:
    """Under dp=2 x tp=2 the ranks of one tp group are one data-parallel replica: they
    must train on identical batches, while the two replicas split the epoch."""
    seen = [rank["data"] for rank in world4["lightning"]]
    assert sorted((r["dp"], r["tp"]) for r in seen) == [(0, 0), (0, 1), (1, 0), (1, 1)]
    replicas = {}
    for rank in seen:
        assert len(rank["batches"]) == WINDOWS // 4  # 2 windows per replica per step
        replicas.setdefault(rank["dp"], rank["batches"])
        assert rank["batches"] == replicas[rank["dp"]], rank  # the same as its tp peer
    windows = [{w for batch in replicas[dp] for w in batch} for dp in (0, 1)]
    assert not windows[0] & windows[1]
    assert windows[0] | windows[1] == set(range(WINDOWS))
