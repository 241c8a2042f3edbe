"""LoRA under every parallel layout (2 gloo ranks) against one plain process.

One spawn of two ranks fits the same Llama debug model with the same LoRA callback under
Lightning's ``ddp``, ``zero2`` (our gradient engine, stage 2), ``hybrid`` (tensor
parallel 2 with sequence parallelism), ``pipeline`` (2 stages, 1F1B) and ``hybrid`` with
ZeRO-3 (FSDP2, frozen and trained parameters in one unit). Each layout must
give the single process's per-step losses and final adapter weights, leave every frozen
base weight bitwise as initialized, and let only the adapters reach gradients, the
optimizer and the gradient engine. After training, ``plugintrain.model_zoo.lora.merge`` runs on
the tensor-parallel shards and the pipeline stages: it must communicate nothing, keep
each rank's shard shape, and give the single process's merged weights.

The same spawn then trains LoRA on a pretrained base (a random Hugging Face Llama
directory) under ``hybrid`` (tp 2 + sp), ``zero2`` and ``pipeline`` and saves adapter
checkpoints (DCP directories): they must hold only the adapters and their AdamW state,
plus the base's sha256. The ranks resume the tp checkpoint under ``zero2`` and the
pipeline one under tp, the test process the ``zero2`` one in one process, each for one
more step, against an uninterrupted one-process run; a resume on another base must
fail before training.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import functools
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
from _dtensors import full
from lightning.pytorch.callbacks import Callback
from torch import Tensor
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.debug import CommDebugMode
from torch.distributed.tensor.parallel import loss_parallel
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from plugintrain.callbacks import LoRA
from plugintrain.callbacks.lora import resume_base
from plugintrain.checkpoints.dcp import read_weights
from plugintrain.checkpoints.files import LIGHTNING_METADATA
from plugintrain.checkpoints.lightning_io import SafeCheckpointIO
from plugintrain.formats import lora_checkpoints
from plugintrain.model_zoo import CausalLM, TransformerConfig, lora
from plugintrain.model_zoo.lora import RECORD_KEY
from plugintrain.precision_plugins import FP32Precision
from plugintrain.strategies import HybridParallelStrategy, ZeroStrategy
from plugintrain.strategies.mesh import ParallelDims
from plugintrain.strategies.tensor_parallel import apply_tensor_parallel, vocab_parallel_loss

from _harness import run_distributed
from _hf_models import random_hf_llama

WORLD = 2
STEPS = 3
GLOBAL_BATCH = 8
SEQ = 16
VOCAB = 256
TARGETS = ["*.attention.wq", "*.attention.wo", "*.feed_forward.w1", "*.feed_forward.w2"]
RANK = 4

# name -> (strategy factory, data-parallel degree over the 2 ranks)
LAYOUTS: dict[str, tuple[Callable[[], Any], int]] = {
    "ddp": (lambda: "ddp", 2),
    "zero2": (lambda: ZeroStrategy(stage=2, bucket_size_mb=0.01), 2),
    "hybrid": (lambda: HybridParallelStrategy(tensor_parallel=2, sequence_parallel=True), 1),
    "pipeline": (lambda: HybridParallelStrategy(pipeline_parallel=2, microbatches=2), 1),
    "fsdp2": (lambda: HybridParallelStrategy(zero_stage=3), 2),
}
TIED = {"model.output.weight": "model.tok_embeddings.weight"}
ENGINE_LAYOUTS = ("zero2", "hybrid", "pipeline")
MERGE_LAYOUTS = ("hybrid", "pipeline", "fsdp2")


def _local(tensor: Tensor) -> Tensor:
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def _engine(strategy: Any) -> Any:
    """The strategy's gradient engine, or None (Lightning's ddp has none)."""
    binding = getattr(strategy, "_binding", None)
    return binding.engine if binding is not None and binding.bound else None


class _Probe(Callback):
    """Records losses, the frozen weights at the start, and who gets gradients."""

    def __init__(self) -> None:
        self.losses: list[float] = []
        self.initial: dict[str, Tensor] = {}
        self.stepped_with_grad: set[str] = set()
        self.frozen_with_grad: set[str] = set()

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.initial = {n: full(p) for n, p in pl_module.named_parameters() if not p.requires_grad}

    def on_before_optimizer_step(
        self, trainer: L.Trainer, pl_module: L.LightningModule, optimizer: Any
    ) -> None:
        named = dict(pl_module.named_parameters())
        names = {id(p): n for n, p in named.items()}
        engine = _engine(trainer.strategy)
        for group in optimizer.param_groups:
            for param in group["params"]:
                if param.grad is not None:
                    owner = engine.parameter_of(param) if engine is not None else param
                    self.stepped_with_grad.add(names[id(owner)])
        self.frozen_with_grad |= {
            n for n, p in named.items() if not p.requires_grad and p.grad is not None
        }

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, *args: Any) -> None:
        self.losses.append(outputs["loss"].detach().item())


def _data() -> TensorDataset:
    gen = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, VOCAB, (STEPS * GLOBAL_BATCH, SEQ + 1), generator=gen)
    return TensorDataset(tokens[:, :-1], tokens[:, 1:])


def _fit(layout: str | None, rank: int = 0) -> dict[str, Any]:
    """Fit STEPS steps with LoRA; ``layout=None`` is the single-process reference."""
    L.seed_everything(0, verbose=False)
    config = dataclasses.replace(
        TransformerConfig.from_name("llama3-debug"), n_layer=2, vocab_size=VOCAB, block_size=32
    )
    optimizer = functools.partial(torch.optim.AdamW, lr=1e-2)
    module = CausalLM(config, optimizer, warmup_steps=0, min_lr_ratio=1.0)
    if layout is None:
        strategy, dp = "auto", 1
    else:
        factory, dp = LAYOUTS[layout]
        strategy = factory()
    data = _data()
    sampler = DistributedSampler(data, num_replicas=dp, rank=rank % dp, shuffle=False)
    probe = _Probe()
    trainer = L.Trainer(
        accelerator="cpu", devices=1 if layout is None else WORLD, strategy=strategy,
        plugins=[FP32Precision()], max_steps=STEPS, use_distributed_sampler=False,
        logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[LoRA(r=RANK, alpha=8.0, dropout=0.0, target_modules=TARGETS), probe],
    )  # fmt: skip
    trainer.fit(module, DataLoader(data, batch_size=GLOBAL_BATCH // dp, sampler=sampler))

    named = dict(module.named_parameters())
    names = {id(p): n for n, p in named.items()}
    engine = _engine(trainer.strategy)
    opt = trainer.optimizers[0]
    owner = engine.parameter_of if engine is not None else (lambda p: p)
    out: dict[str, Any] = {
        "losses": probe.losses,
        "trainable": sorted(n for n, p in named.items() if p.requires_grad),
        "adapters": {n: full(p) for n, p in named.items() if lora.is_adapter_name(n)},
        "frozen": {n: full(p) for n, p in named.items() if not p.requires_grad},
        "initial_frozen": probe.initial,
        "stepped_with_grad": sorted(probe.stepped_with_grad),
        "frozen_with_grad": sorted(probe.frozen_with_grad),
        "optimizer_state": sorted(names[id(owner(p))] for p in opt.state),
        "optimizer_params": sorted(
            names[id(owner(p))] for group in opt.param_groups for p in group["params"]
        ),
        "engine": None,
    }
    if engine is not None:
        out["engine"] = {
            "managed": sorted(entry.name for entry in engine._layout.entries.values()),
            "steps": sorted(engine.shards.parameter_names(opt)),
        }
    if layout is None or layout in MERGE_LAYOUTS:
        out["merge"] = _merge(module)
    return out


def _merge(module: torch.nn.Module) -> dict[str, Any]:
    """Merge every adapter on this rank; what it communicated and the merged weights."""
    layers = dict(lora.adapted_layers(module))
    shapes = {path: tuple(_local(layer.weight).shape) for path, layer in layers.items()}
    with CommDebugMode() as comm:
        count = lora.merge(module)
    return {
        "count": count,
        "collectives": comm.get_total_counts(),
        "collective_names": sorted(str(op).split(".")[-1] for op in comm.get_comm_counts()),
        "shapes_before": shapes,
        "shapes_after": {p: tuple(_local(layer.weight).shape) for p, layer in layers.items()},
        "weights": {f"{p}.weight": full(layer.weight) for p, layer in layers.items()},
        "merged_flags": [layer.merged for layer in layers.values()],
    }


PROJECTIONS = ("*.attention.w?", "*.feed_forward.w?")


def _tp_collectives() -> dict[bool, dict[str, dict[str, int]]]:
    """Collectives of one forward and backward under tp=2 + SP: adapters on every
    projection (column- and row-wise), against the same projections' weights trained
    without adapters (everything else frozen in both)."""
    dims = ParallelDims(WORLD, tensor_parallel=2, sequence_parallel=True)
    mesh = dims.build_mesh()
    config = dataclasses.replace(
        TransformerConfig.from_name("llama3-debug"), n_layer=2, vocab_size=VOCAB, block_size=32
    )
    x, y = _data()[:2]
    counts = {}
    for adapted in (False, True):
        torch.manual_seed(0)
        module = CausalLM(config)
        module.configure_model()
        if adapted:
            lora.inject(module, lora.LoRASpec(r=RANK, target_modules=PROJECTIONS))
            lora.init_adapters(module, 0)
        else:  # the same layers train, without adapters: backward reaches the same places
            for name, param in module.named_parameters():
                param.requires_grad_(any(fnmatch.fnmatch(name, f"{p}.weight") for p in PROJECTIONS))
        apply_tensor_parallel(module, module.tp_plan(), mesh["tp"], sequence_parallel=True)
        with CommDebugMode() as forward:
            loss = vocab_parallel_loss(module.loss_fn)(module(x), y)
        with CommDebugMode() as backward, loss_parallel():
            loss.backward()
        counts[adapted] = {
            phase: {str(op).split(".")[-1]: n for op, n in mode.get_comm_counts().items()}
            for phase, mode in (("forward", forward), ("backward", backward))
        }
    return counts


def _run_layouts(rank: int, world_size: int, base: Path, ckpt_root: Path) -> dict[str, Any]:
    results: dict[str, Any] = {layout: _fit(layout, rank) for layout in LAYOUTS}
    results["tp_collectives"] = _tp_collectives()
    results["checkpoints"] = _checkpoint_cases(rank, base, ckpt_root)
    return results


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    base = _hf_llama(tmp_path_factory.mktemp("base"), seed=0)
    ckpt_root = tmp_path_factory.mktemp("lora_ckpts")
    # Forked before any fit here.
    ranks = run_distributed(_run_layouts, WORLD, base, ckpt_root, timeout=600)
    other = _hf_llama(tmp_path_factory.mktemp("other_base"), seed=1)
    return {
        "reference": _fit(None),
        "ranks": ranks,
        "checkpoints": _single_process_checkpoint_cases(base, other, ckpt_root),
    }


def _adapter_names(reference: dict[str, Any]) -> list[str]:
    return sorted(reference["adapters"])


def test_reference_trains_only_adapters(runs: dict[str, Any]) -> None:
    """The single process itself: trainable == adapter names, B moved off zero, base fixed."""
    ref = runs["reference"]
    names = _adapter_names(ref)
    assert len(names) == 2 * 4 * 2  # A and B x 4 targets x 2 layers
    assert ref["trainable"] == names
    assert ref["stepped_with_grad"] == names and ref["frozen_with_grad"] == []
    assert ref["optimizer_state"] == names and ref["optimizer_params"] == names
    assert any(ref["adapters"][n].abs().max() > 0 for n in names if n.endswith("lora_B"))
    for name, initial in ref["initial_frozen"].items():
        assert torch.equal(ref["frozen"][name], initial), name


@pytest.mark.parametrize("layout", LAYOUTS)
def test_losses_and_adapters_match_single_process(runs: dict[str, Any], layout: str) -> None:
    """Per-step losses and full adapter tensors against the single-process LoRA fit."""
    ref = runs["reference"]
    dp = LAYOUTS[layout][1]
    ranks = [r[layout] for r in runs["ranks"]]
    if dp > 1:  # each replica's loss is its half of the global batch: their mean is the loss
        losses = torch.tensor([r["losses"] for r in ranks]).mean(0).tolist()
        torch.testing.assert_close(losses, ref["losses"], rtol=1e-5, atol=1e-5)
    seen: set[str] = set()
    for got in ranks:
        if dp == 1:
            torch.testing.assert_close(got["losses"], ref["losses"], rtol=1e-5, atol=1e-5)
        for name, value in got["adapters"].items():
            torch.testing.assert_close(value, ref["adapters"][name], rtol=1e-4, atol=1e-5, msg=name)
        seen |= set(got["adapters"])
    assert seen == set(ref["adapters"]), "the ranks together hold every adapter"


@pytest.mark.parametrize("layout", LAYOUTS)
def test_frozen_base_weights_are_bitwise_unchanged(runs: dict[str, Any], layout: str) -> None:
    """Every frozen weight after training against its value at train start (bitwise), and
    the base against the single process's base (same seeded init)."""
    ref = runs["reference"]
    for got in (r[layout] for r in runs["ranks"]):
        assert got["frozen"].keys() == got["initial_frozen"].keys()
        for name, initial in got["initial_frozen"].items():
            assert torch.equal(got["frozen"][name], initial), name
            # The last pipeline stage holds its own copy of the tied head.
            same = TIED.get(name, name) if name not in ref["frozen"] else name
            assert torch.equal(got["frozen"][name], ref["frozen"][same]), name


@pytest.mark.parametrize("layout", LAYOUTS)
def test_only_adapters_get_gradients_and_optimizer_state(runs: dict[str, Any], layout: str) -> None:
    """Names requiring grad / getting gradients / holding optimizer state against the
    reference's adapter names (this rank's stage's under pipeline parallelism)."""
    adapters = set(_adapter_names(runs["reference"]))
    dp = LAYOUTS[layout][1]
    with_state: dict[str, set[str]] = {}
    for got in (r[layout] for r in runs["ranks"]):
        local = set(got["adapters"])
        assert local <= adapters
        assert set(got["trainable"]) == local
        assert got["frozen_with_grad"] == []
        for key in ("optimizer_params", "optimizer_state", "stepped_with_grad"):
            assert set(got[key]) <= local, key
            if dp == 1:  # every rank steps its whole (tp-sharded or staged) part
                assert set(got[key]) == local, key
            with_state[key] = with_state.get(key, set()) | set(got[key])
        assert len(got["optimizer_state"]) <= len(local)
    # ZeRO-2 steps each rank's slices of the flat buckets, a pipeline each rank's stage:
    # together the ranks step every adapter.
    for key, names in with_state.items():
        assert names == adapters, key
    if layout == "pipeline":
        assert 0 < len(runs["ranks"][0][layout]["adapters"]) < len(adapters)


@pytest.mark.parametrize("layout", ENGINE_LAYOUTS)
def test_gradient_engine_manages_only_adapters(runs: dict[str, Any], layout: str) -> None:
    """The engine's managed and stepped parameter names against the adapter names."""
    for got in (r[layout] for r in runs["ranks"]):
        assert got["engine"] is not None
        local = sorted(got["adapters"])
        assert got["engine"]["managed"] == local
        assert got["engine"]["steps"] == local


@pytest.mark.parametrize("layout", MERGE_LAYOUTS)
def test_merge_on_shards_matches_single_process(runs: dict[str, Any], layout: str) -> None:
    """Merged base weights (gathered after the merge) against the single process's merged
    weights; the merge keeps each local shard shape and communicates nothing under tp and
    pp. FSDP2 shards ``A`` over its rank dimension too: each layer gathers that factor
    (``r x in_features``, once), never a weight."""
    ref = runs["reference"]["merge"]
    merged: dict[str, Tensor] = {}
    for got in (r[layout]["merge"] for r in runs["ranks"]):
        assert got["count"] == len(got["shapes_before"]) > 0
        if layout == "fsdp2":
            assert got["collective_names"] == ["all_gather_into_tensor"]
            assert got["collectives"] == got["count"]
        else:
            assert got["collectives"] == 0, "merge gathered or reduced something"
        assert got["shapes_after"] == got["shapes_before"]
        assert all(got["merged_flags"])
        for name, weight in got["weights"].items():
            torch.testing.assert_close(weight, ref["weights"][name], rtol=1e-4, atol=1e-5, msg=name)
        merged.update(got["weights"])
    assert merged.keys() == ref["weights"].keys()
    if layout == "hybrid":  # each rank holds half of every adapted weight
        for rank_results in runs["ranks"]:
            got = rank_results[layout]["merge"]
            for path, shape in got["shapes_after"].items():
                full = ref["weights"][f"{path}.weight"].shape
                assert sum(a != b for a, b in zip(shape, full, strict=True)) == 1, path
                assert math.prod(shape) * WORLD == full.numel(), path


def test_merge_changes_the_base(runs: dict[str, Any]) -> None:
    """Single-process merged weights against base + scaling * B @ A computed here."""
    ref = runs["reference"]
    scaling = 8.0 / RANK
    for name, weight in ref["merge"]["weights"].items():
        path = name.removesuffix(".weight")
        adapter_a, adapter_b = ref["adapters"][f"{path}.lora_A"], ref["adapters"][f"{path}.lora_B"]
        expected = ref["frozen"][name].double() + scaling * adapter_b.double() @ adapter_a.double()
        torch.testing.assert_close(weight.double(), expected, rtol=1e-5, atol=1e-6, msg=name)
        assert not torch.equal(weight, ref["frozen"][name]), name


# --- Adapter checkpoints of a pretrained base --------------------------------------------

CKPT_STEPS = 2  # fits that save stop here; resumed ones run to STEPS
SAVE_LAYOUTS = ("hybrid", "zero2", "pipeline")
# layout that saved the checkpoint -> layout resuming it on the 2 ranks
RESUMES = {"hybrid": "zero2", "pipeline": "hybrid"}
SINGLE_RESUMES = ("zero2",)  # resumed in one process (the test process)
ADAPTED = sorted(f"model.layers.{i}.{t.removeprefix('*.')}" for i in range(2) for t in TARGETS)


def _hf_llama(root: Path, seed: int) -> Path:
    """A random Hugging Face Llama (GQA, untied head) saved by transformers."""
    return random_hf_llama(root, VOCAB, seed, hidden=128, intermediate=256)


def _repeated_data() -> TensorDataset:
    """STEPS copies of one global batch: whichever batch a resumed epoch starts from, each
    step sees the tokens the uninterrupted run's step saw."""
    gen = torch.Generator().manual_seed(2)
    tokens = torch.randint(0, VOCAB, (GLOBAL_BATCH, SEQ + 1), generator=gen).repeat(STEPS, 1)
    return TensorDataset(tokens[:, :-1], tokens[:, 1:])


def _adapters(module: torch.nn.Module) -> dict[str, Tensor]:
    return {n: full(p) for n, p in module.named_parameters() if lora.is_adapter_name(n)}


class _Snapshots(Callback):
    """Adapters at train start (after a resume restored them) and after each step, the
    batches this fit trained on and their losses."""

    def __init__(self) -> None:
        self.start: dict[str, Tensor] = {}
        self.after: dict[int, dict[str, Tensor]] = {}
        self.batches = 0
        self.losses: list[float] = []

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.start = _adapters(pl_module)

    def on_train_batch_start(self, *args: Any) -> None:
        self.batches += 1

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, *args: Any) -> None:
        self.after[trainer.global_step] = _adapters(pl_module)
        self.losses.append(outputs["loss"].detach().item())


def _fit_pretrained(
    layout: str | None,
    rank: int,
    base: Path,
    steps: int,
    resume: Path | None = None,
    save: Path | None = None,
    snapshots: _Snapshots | None = None,
) -> dict[str, Any]:
    """LoRA on the pretrained ``base`` up to global step ``steps`` (from ``resume`` if
    given), then ``trainer.save_checkpoint(save)`` if given; ``layout=None``: one process."""
    L.seed_everything(0, verbose=False)
    optimizer = functools.partial(torch.optim.AdamW, lr=1e-2)
    module = CausalLM(weights=str(base), optimizer=optimizer, warmup_steps=0, min_lr_ratio=1.0)
    if layout is None:
        strategy, dp, devices = "auto", 1, 1
        plugins: list[Any] = [FP32Precision(), SafeCheckpointIO()]
    else:
        factory, dp = LAYOUTS[layout]
        strategy, devices, plugins = factory(), WORLD, [FP32Precision()]
    data = _repeated_data()
    sampler = DistributedSampler(data, num_replicas=dp, rank=rank % dp, shuffle=False)
    snapshots = snapshots if snapshots is not None else _Snapshots()
    trainer = L.Trainer(
        accelerator="cpu", devices=devices, strategy=strategy, plugins=plugins,
        max_steps=steps, use_distributed_sampler=False, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        callbacks=[LoRA(r=RANK, alpha=8.0, dropout=0.0, target_modules=TARGETS), snapshots],
    )  # fmt: skip
    loader = DataLoader(data, batch_size=GLOBAL_BATCH // dp, sampler=sampler)
    trainer.fit(module, loader, ckpt_path=None if resume is None else str(resume))
    if save is not None:
        trainer.save_checkpoint(save)  # every rank
    return {
        "start": snapshots.start,
        "after": snapshots.after,
        "batches": snapshots.batches,
        "losses": snapshots.losses,
        "global_step": trainer.global_step,
    }


def _checkpoint_cases(rank: int, base: Path, ckpt_root: Path) -> dict[str, Any]:
    """On each rank: save after CKPT_STEPS under every SAVE_LAYOUT, then resume some of
    those checkpoints under another layout up to STEPS."""
    saved = {
        layout: _fit_pretrained(layout, rank, base, CKPT_STEPS, save=ckpt_root / layout)
        for layout in SAVE_LAYOUTS
    }
    resumed = {
        source: _fit_pretrained(target, rank, base, STEPS, resume=ckpt_root / source)
        for source, target in RESUMES.items()
    }
    return {"saved": saved, "resumed": resumed}


def _single_process_checkpoint_cases(base: Path, other: Path, ckpt_root: Path) -> dict[str, Any]:
    """The uninterrupted single-process run, and the SINGLE_RESUMES resumed in one process."""
    return {
        "base": base,
        "other": other,
        "root": ckpt_root,
        "reference": _fit_pretrained(None, 0, base, STEPS),
        "resumed": {
            source: _fit_pretrained(None, 0, base, STEPS, resume=ckpt_root / source)
            for source in SINGLE_RESUMES
        },
    }


def _tree_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def _payload(metadata: dict[str, Any], prefix: str) -> int:
    """Bytes of the tensors under ``prefix`` in DCP ``metadata`` (whole sizes)."""
    return sum(
        math.prod(meta.size) * meta.properties.dtype.itemsize
        for key, meta in metadata.items()
        if key.startswith(prefix) and isinstance(meta, TensorStorageMetadata)
    )


def _assert_adapters_close(got: dict[str, Tensor], expected: dict[str, Tensor]) -> None:
    assert got.keys() == expected.keys()
    for name, value in got.items():
        torch.testing.assert_close(value, expected[name], rtol=1e-4, atol=1e-5, msg=name)


def test_pretrained_reference_trains_adapters(runs: dict[str, Any]) -> None:
    """The uninterrupted one-process run on the Hugging Face base: STEPS steps, adapters
    that move at every step (so a wrong restore shows in the resumed step)."""
    ref = runs["checkpoints"]["reference"]
    assert ref["batches"] == STEPS and sorted(ref["after"]) == list(range(1, STEPS + 1))
    assert len(ref["start"]) == 2 * len(ADAPTED)
    for step in range(1, STEPS + 1):
        before = ref["start"] if step == 1 else ref["after"][step - 1]
        moved = max((ref["after"][step][n] - before[n]).abs().max() for n in before)
        assert moved > 1e-3, step


@pytest.mark.parametrize("layout", SAVE_LAYOUTS)
def test_sharded_adapter_checkpoint_holds_only_adapters(runs: dict[str, Any], layout: str) -> None:
    """DCP metadata keys against the adapter names (weights and their AdamW state only),
    meta.pt's LoRA record against the base's sha256, the saved adapters against the
    single process's after CKPT_STEPS, and the directory's bytes against the base's."""
    cases = runs["checkpoints"]
    path = cases["root"] / layout
    expected = cases["reference"]["after"][CKPT_STEPS]
    names = set(expected)
    metadata = FileSystemReader(str(path)).read_metadata().state_dict_metadata
    keys = set(metadata)
    assert all(k.startswith(("state_dict.", "optimizer_0.")) for k in keys), sorted(keys)
    assert {k.removeprefix("state_dict.") for k in keys if k.startswith("state_dict.")} == names
    state: dict[str, set[str]] = {}
    for key in keys:
        if key.startswith("optimizer_0.state."):
            name, _, entry = key.removeprefix("optimizer_0.state.").rpartition(".")
            state.setdefault(name, set()).add(entry)
    assert state.keys() == names
    assert all(entries == {"step", "exp_avg", "exp_avg_sq"} for entries in state.values()), state

    meta = torch.load(path / LIGHTNING_METADATA, weights_only=True)
    record = meta[RECORD_KEY]
    assert record["sha256"] == lora_checkpoints.weights_sha256(cases["base"])
    assert record["base"] == str(cases["base"])
    assert sorted(record["adapted"]) == ADAPTED
    assert record["spec"]["r"] == RANK and list(record["spec"]["target_modules"]) == TARGETS
    assert meta["global_step"] == CKPT_STEPS

    _assert_adapters_close(read_weights(path), expected)
    saving = [rank["checkpoints"]["saved"][layout] for rank in runs["ranks"]]
    assert all(got["global_step"] == CKPT_STEPS for got in saving)
    losses = torch.tensor([got["losses"] for got in saving]).mean(0).tolist()  # dp: halves
    assert losses == pytest.approx(cases["reference"]["losses"][:CKPT_STEPS], rel=1e-5)
    # Tensor bytes: the adapters once as weights and twice as AdamW moments, plus the
    # scalar steps; nothing else. On disk DCP adds ~1 KB per tensor item (and the metadata),
    # which dominates at this size: the directory still is a fraction of the base's bytes.
    adapter_bytes = sum(v.numel() * v.element_size() for v in expected.values())
    assert _payload(metadata, "state_dict.") == adapter_bytes
    steps_bytes = len(names) * torch.tensor(1.0).element_size()
    assert _payload(metadata, "optimizer_0.state.") == 2 * adapter_bytes + steps_bytes
    assert _tree_bytes(path) * 3 < _tree_bytes(cases["base"]), (
        _tree_bytes(path),
        _tree_bytes(cases["base"]),
    )


RESUMED_CASES = [*RESUMES.items(), *((source, "single") for source in SINGLE_RESUMES)]


@pytest.mark.parametrize(
    ("source", "target"), RESUMED_CASES, ids=[f"{a}->{b}" for a, b in RESUMED_CASES]
)
def test_resume_in_another_layout_matches_uninterrupted(
    runs: dict[str, Any], source: str, target: str
) -> None:
    """The adapters at train start against the checkpoint's (bitwise); the one step taken
    after the resume (it depends on the restored AdamW moments and step count: a fresh
    optimizer's is ~2e-2 off) against the uninterrupted run's third step; and the final
    adapters against the uninterrupted run's. The checkpoint itself carries the saving
    layout's rounding (up to ~1e-5 off the single process, see the saved-adapter test),
    hence the looser bound on the final weights than on the step."""
    cases = runs["checkpoints"]
    ref = cases["reference"]
    saved = read_weights(cases["root"] / source)
    if target == "single":
        results = [cases["resumed"][source]]
    else:
        results = [rank["checkpoints"]["resumed"][source] for rank in runs["ranks"]]
    for got in results:
        assert got["global_step"] == STEPS
        assert got["batches"] == STEPS - CKPT_STEPS
        assert got["start"].keys() == saved.keys()
        for name, value in got["start"].items():
            assert torch.equal(value, saved[name]), name
        final = got["after"][STEPS]
        _assert_adapters_close(final, ref["after"][STEPS])
        for name, value in final.items():
            update = value - got["start"][name]
            expected = ref["after"][STEPS][name] - ref["after"][CKPT_STEPS][name]
            torch.testing.assert_close(update, expected, rtol=0, atol=1e-5, msg=name)
    if LAYOUTS.get(target, (None, 1))[1] == 1:  # each rank's loss is the whole batch's
        for got in results:
            assert got["losses"] == pytest.approx(ref["losses"][CKPT_STEPS:], rel=1e-5)


def test_resume_on_another_base_fails_before_training(runs: dict[str, Any]) -> None:
    """A one-process resume whose module has another base (same architecture, other seed)
    raises the callback's sha256 ValueError before any batch; so does the CLI's check."""
    cases = runs["checkpoints"]
    path = cases["root"] / "zero2"
    snapshots = _Snapshots()
    with pytest.raises(ValueError, match="sha256"):
        _fit_pretrained(None, 0, cases["other"], STEPS, resume=path, snapshots=snapshots)
    assert snapshots.batches == 0 and snapshots.start == {}

    record = torch.load(path / LIGHTNING_METADATA, weights_only=True)[RECORD_KEY]
    callbacks = [LoRA(r=RANK, alpha=8.0, target_modules=TARGETS)]
    with pytest.raises(ValueError, match="sha256"):
        resume_base(str(path), record, str(cases["other"]), callbacks, verify=True)
    assert resume_base(str(path), record, None, callbacks, verify=True) == str(cases["base"])
    other_rank = [LoRA(r=2 * RANK, alpha=8.0, target_modules=TARGETS)]
    with pytest.raises(ValueError, match=r"trained with LoRA r: 4 \(this run: 8\)"):
        resume_base(str(path), record, None, other_rank, verify=False)


def test_adapters_add_no_collective_under_tensor_parallelism(runs: dict[str, Any]) -> None:
    """Megatron's collectives, against the same layers trained without adapters: each
    adapter's partial output joins its layer's before the layer's one all-gather /
    reduce-scatter, forward and backward (reducing adapter outputs apart is what makes
    LoRA + TP diverge)."""
    for rank in runs["ranks"]:
        plain, adapted = rank["tp_collectives"][False], rank["tp_collectives"][True]
        assert plain["forward"] and plain["backward"]
        assert adapted == plain
