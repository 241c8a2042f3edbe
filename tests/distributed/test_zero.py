"""The gradient engine and ZeRO strategies on gloo, checked against a single process.

Processes are spawned once per world size (module fixtures); every case runs inside. For
the same seed, model and global batch, stages 0/1/2 and the parameter server must give the
single-process losses and parameters to fp32 tolerance, hold 1/N of the optimizer state
(stage 1/2) and gradients (stage 2), and resume a checkpoint under another rank count.
"""

from __future__ import annotations

import dataclasses
import json
import sys
from contextlib import nullcontext
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from _processes import run_command
from torch import Tensor, nn

from plugintrain.model_zoo import Transformer, TransformerConfig
from plugintrain.precision_plugins import clip_grads_by_global_norm_
from plugintrain.strategies import GradientEngine, optimizer_state_bytes

from _harness import run_distributed

STEPS = 3
RESUME_AT = 3
GLOBAL_BATCH = 8
SEQ = 16
VOCAB = 97
BUCKET_MB = 0.02  # ~5k fp32 elements: several buckets, parameters straddle shard borders


@dataclasses.dataclass(frozen=True)
class Case:
    """One training configuration run single-process and on every world size."""

    stage: int | str
    preset: str = "gpt2-debug"
    accumulate: int = 1
    clip: float | None = None
    optimizer: str = "adamw"
    overlap_comm: bool = True


CASES = [
    case
    for stage in (0, 1, 2, "parameter_server")
    for case in (
        Case(stage),
        Case(stage, preset="llama3-debug", accumulate=2, clip=0.05),
        Case(stage, optimizer="sgd", overlap_comm=False, clip=0.05),
    )
]


def _model(preset: str) -> nn.Module:
    """The preset's architecture, shrunk so a CPU step takes milliseconds."""
    base = TransformerConfig.from_name(preset)
    extra = {"intermediate_size": 48} if preset.startswith("llama") else {}
    config = dataclasses.replace(
        base, vocab_size=VOCAB, n_layer=2, n_embd=32, block_size=SEQ, **extra
    )
    torch.manual_seed(0)
    return Transformer(config)


def _optimizer(model: nn.Module, name: str) -> torch.optim.Optimizer:
    params = [p for p in model.parameters() if p.requires_grad]
    groups = [
        {"params": [p for p in params if p.dim() >= 2], "weight_decay": 0.1},
        {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
    ]
    if name == "sgd":
        return torch.optim.SGD(groups, lr=0.05, momentum=0.9)
    return torch.optim.AdamW(groups, lr=3e-3)


def _batches(steps: int) -> Tensor:
    generator = torch.Generator().manual_seed(1234)
    return torch.randint(0, VOCAB, (steps, GLOBAL_BATCH, SEQ + 1), generator=generator)


def _micro_batches(batch: Tensor, accumulate: int, rank: int, world: int) -> list[Tensor]:
    """This rank's rows of each micro-batch of a global batch."""
    return [micro.chunk(world)[rank] for micro in batch.chunk(accumulate)]


def _loss(model: nn.Module, rows: Tensor) -> Tensor:
    logits = model(rows[:, :-1])  # (B, T, V)
    return nn.functional.cross_entropy(logits.flatten(0, 1), rows[:, 1:].flatten())


# ---- single-process reference ----------------------------------------------------------


def _reference_step(
    model: nn.Module, optimizer: torch.optim.Optimizer, batch: Tensor, case: Case
) -> float:
    optimizer.zero_grad()
    total = 0.0
    for rows in _micro_batches(batch, case.accumulate, 0, 1):
        loss = _loss(model, rows) / case.accumulate
        loss.backward()
        total += loss.item()
    if case.clip is not None:
        torch.nn.utils.clip_grad_norm_(model.parameters(), case.clip)
    optimizer.step()
    return total


def _reference(case: Case, steps: int = STEPS) -> dict[str, Any]:
    model = _model(case.preset)
    optimizer = _optimizer(model, case.optimizer)
    losses = [_reference_step(model, optimizer, batch, case) for batch in _batches(steps)]
    return {
        "losses": losses,
        "params": {name: p.detach().clone() for name, p in model.named_parameters()},
        "state_bytes": optimizer_state_bytes(optimizer),
        "grad_bytes": sum(p.numel() * p.element_size() for p in model.parameters()),
    }


# ---- per-rank engine runs --------------------------------------------------------------


def _engine_step(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    engine: GradientEngine,
    batch: Tensor,
    case: Case,
) -> float:
    rank, world = dist.get_rank(), dist.get_world_size()
    optimizer.zero_grad()
    total = torch.zeros(())
    micro_batches = _micro_batches(batch, case.accumulate, rank, world)
    for index, rows in enumerate(micro_batches):
        last = index == len(micro_batches) - 1
        with nullcontext() if last else engine.no_sync():
            loss = _loss(model, rows) / case.accumulate
            loss.backward()
        total += loss.detach()
    if case.clip is not None:
        shards = [p for group in optimizer.param_groups for p in group["params"]]
        clip_grads_by_global_norm_(engine.gradient_layout(shards), case.clip)
    optimizer.step()
    dist.all_reduce(total)
    return total.item() / world


def _train(
    case: Case, steps: range
) -> tuple[nn.Module, torch.optim.Optimizer, GradientEngine, list[float]]:
    model = _model(case.preset)
    engine = GradientEngine(
        model.named_parameters(), None, case.stage, BUCKET_MB, case.overlap_comm
    )
    optimizer = _optimizer(model, case.optimizer)
    engine.attach(optimizer)
    batches = _batches(steps.stop)
    losses = [_engine_step(model, optimizer, engine, batches[i], case) for i in steps]
    return model, optimizer, engine, losses


def _run_case(case: Case) -> dict[str, Any]:
    model, optimizer, engine, losses = _train(case, range(STEPS))
    return {
        "losses": losses,
        "params": {name: p.detach().clone() for name, p in model.named_parameters()},
        "state_bytes": optimizer_state_bytes(optimizer),
        "grad_bytes": engine.grad_bytes(),
        "bucket_numels": engine.bucket_numels,
    }


RESUME_CASE = Case(2, preset="llama3-debug", accumulate=2, clip=0.05)
RESUME_STAGE = {2: 1, 1: "parameter_server"}


def _save(case: Case) -> dict[str, Any]:
    model, optimizer, engine, _ = _train(case, range(RESUME_AT))
    state = engine.optimizer_state_dict(optimizer)
    params = {name: p.detach().clone() for name, p in model.state_dict().items()}
    return {"model": params, "optimizer": state}


def _resume(case: Case, checkpoint: dict[str, Any]) -> list[float]:
    model = _model(case.preset)
    model.load_state_dict(checkpoint["model"])
    engine = GradientEngine(model.named_parameters(), None, case.stage, BUCKET_MB)
    optimizer = _optimizer(model, case.optimizer)
    engine.attach(optimizer)
    engine.load_optimizer_state_dict(optimizer, checkpoint["optimizer"])
    batches = _batches(RESUME_AT + 2)
    return [
        _engine_step(model, optimizer, engine, batches[i], case)
        for i in range(RESUME_AT, RESUME_AT + 2)
    ]


def _suite(rank: int, world: int, cases: list[Case], checkpoint: dict | None) -> dict[str, Any]:
    """Every case on this rank; then save a checkpoint (none given) or resume the given one."""
    results: dict[str, Any] = {"cases": [_run_case(case) for case in cases]}
    if checkpoint is None:
        results["checkpoint"] = _save(RESUME_CASE)
    else:
        # Resume under another stage too: the checkpoint does not depend on the layout.
        stage = RESUME_STAGE[world]
        results["resumed"] = _resume(dataclasses.replace(RESUME_CASE, stage=stage), checkpoint)
    return results


@pytest.fixture(scope="module")
def world4() -> list[dict[str, Any]]:
    return run_distributed(_suite, 4, CASES, None)


@pytest.fixture(scope="module")
def world2(world4: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return run_distributed(_suite, 2, CASES, world4[0]["checkpoint"])


@pytest.fixture(scope="module")
def world1(world4: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return run_distributed(_suite, 1, [], world4[0]["checkpoint"])


@pytest.fixture(scope="module")
def references() -> dict[Case, dict[str, Any]]:
    return {case: _reference(case) for case in [*CASES, RESUME_CASE]}


def _worlds(request: pytest.FixtureRequest, world: int) -> list[dict[str, Any]]:
    return request.getfixturevalue(f"world{world}")


# ---- parity ----------------------------------------------------------------------------


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("index", range(len(CASES)), ids=[str(c) for c in CASES])
def test_matches_single_process(
    request: pytest.FixtureRequest, references: dict, world: int, index: int
) -> None:
    expected = references[CASES[index]]
    for rank, result in enumerate(_worlds(request, world)):
        got = result["cases"][index]
        torch.testing.assert_close(
            got["losses"],
            expected["losses"],
            rtol=1e-5,
            atol=1e-6,
            msg=lambda m, r=rank: f"rank {r} losses: {m}",
        )
        for name, param in expected["params"].items():
            # atol 1e-5: an attention key bias gets only rounding noise as gradient (softmax
            # ignores a per-query shift), which Adam's normalisation lifts to ~1e-6 moves.
            torch.testing.assert_close(
                got["params"][name],
                param,
                rtol=1e-5,
                atol=1e-5,
                msg=lambda m, n=name, r=rank: f"rank {r} {n}: {m}",
            )


# ---- memory ----------------------------------------------------------------------------


def _padding_slack(result: dict[str, Any], world: int, keys: int) -> int:
    """Bytes a rank may differ from an exact 1/N: < N padding elements per bucket per key."""
    return len(result["bucket_numels"]) * world * 4 * keys


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("stage", [1, 2])
def test_optimizer_state_is_one_nth(
    request: pytest.FixtureRequest, references: dict, world: int, stage: int
) -> None:
    index = CASES.index(Case(stage))
    full = references[CASES[index]]["state_bytes"]
    results = [r["cases"][index] for r in _worlds(request, world)]
    # AdamW: exp_avg and exp_avg_sq are sharded; each shard parameter also has a 4-byte step.
    n_params = len(references[CASES[index]]["params"])
    for rank, result in enumerate(results):
        slack = _padding_slack(result, world, keys=2) + 4 * (n_params + 8)
        assert abs(result["state_bytes"] - full / world) <= slack, (
            rank,
            result["state_bytes"],
            full,
            world,
        )


@pytest.mark.parametrize("world", [2, 4])
def test_stage2_gradients_are_one_nth(
    request: pytest.FixtureRequest, references: dict, world: int
) -> None:
    index = CASES.index(Case(2))
    full = references[CASES[index]]["grad_bytes"]
    for rank, result in enumerate(r["cases"][index] for r in _worlds(request, world)):
        slack = _padding_slack(result, world, keys=1)
        assert abs(result["grad_bytes"] - full / world) <= slack, (
            rank,
            result["grad_bytes"],
            full,
            world,
        )


@pytest.mark.parametrize("world", [2, 4])
def test_parameter_server_state_only_on_rank0(
    request: pytest.FixtureRequest, references: dict, world: int
) -> None:
    index = CASES.index(Case("parameter_server"))
    state_bytes = [r["cases"][index]["state_bytes"] for r in _worlds(request, world)]
    assert state_bytes == [references[CASES[index]]["state_bytes"]] + [0] * (world - 1)


# ---- checkpoints -----------------------------------------------------------------------


@pytest.fixture(scope="module")
def uninterrupted() -> list[float]:
    return _reference(RESUME_CASE, steps=RESUME_AT + 2)["losses"][RESUME_AT:]


@pytest.mark.parametrize("world", [2, 1])
def test_resume_from_four_ranks(
    request: pytest.FixtureRequest, uninterrupted: list[float], world: int
) -> None:
    for result in _worlds(request, world):
        torch.testing.assert_close(result["resumed"], uninterrupted, rtol=1e-5, atol=1e-6)


def test_plain_optimizer_loads_the_checkpoint(
    world4: list[dict[str, Any]], uninterrupted: list[float]
) -> None:
    checkpoint = world4[0]["checkpoint"]
    assert all(isinstance(name, str) for name in checkpoint["optimizer"]["state"])
    model = _model(RESUME_CASE.preset)
    model.load_state_dict(checkpoint["model"])
    optimizer = _optimizer(model, RESUME_CASE.optimizer)
    optimizer.load_state_dict(checkpoint["optimizer"])
    batches = _batches(RESUME_AT + 2)
    losses = [
        _reference_step(model, optimizer, batches[i], RESUME_CASE)
        for i in range(RESUME_AT, RESUME_AT + 2)
    ]
    torch.testing.assert_close(losses, uninterrupted, rtol=1e-5, atol=1e-6)


# ---- Lightning: processes launched by the Trainer, checkpoint resumed on fewer ranks ------

SCRIPT = Path(__file__).with_name("_lightning_zero.py")


def _lightning(tmp: Path, tag: str, *args: str) -> list[float]:
    out = tmp / f"{tag}.json"
    command = [sys.executable, str(SCRIPT), "--root", str(tmp), "--out", str(out), *args]
    proc = run_command(command, cwd=tmp, timeout=300)  # killed with its ranks on a timeout
    assert proc.returncode == 0, f"{tag} exited {proc.returncode}:\n{proc.stdout}\n{proc.stderr}"
    return json.loads(out.read_text())


def test_lightning_save_on_four_resume_on_two_and_one(tmp_path: Path) -> None:
    ckpt = str(tmp_path / "ckpt" / "step=2.ckpt")
    full = _lightning(
        tmp_path, "zero2x4", "--strategy", "zero2", "--devices", "4", "--validate", ckpt
    )
    assert (tmp_path / "ckpt" / "step=2.ckpt" / ".metadata").is_file()  # a DCP directory
    on_two = _lightning(
        tmp_path, "zero1x2", "--strategy", "zero1", "--devices", "2", "--resume", ckpt
    )
    on_one = _lightning(
        tmp_path, "zero2x1", "--strategy", "zero2", "--devices", "1", "--resume", ckpt
    )
    assert len(full["losses"]) == 4 and full["logged"]
    # Every resumed step continues the uninterrupted run: the first checks the restored
    # weights, the second the restored optimizer state and the data order (the script
    # stops by epochs to avoid Lightning's `max_steps` end-of-epoch resume, see there).
    for resumed in (on_two, on_one):
        torch.testing.assert_close(resumed["losses"], full["losses"][2:], rtol=1e-5, atol=1e-6)
    # Validating the step-2 checkpoint after fit evaluates its weights (as the validation
    # at the end of epoch 0, step 2, did), not the final ones (epoch 1, step 4).
    epoch0, epoch1 = full["val_epochs"]
    assert full["val_ckpt"] == pytest.approx(epoch0, rel=1e-5)
    assert epoch0 != pytest.approx(epoch1, rel=1e-3)


# ---- process exit (issue 12): collectives after fit, then leave the group -----------------

EXIT_CHECK = Path(__file__).parents[2] / "benchmarks" / "exit_check.py"


def test_ranks_exit_with_0_after_collectives_after_fit(tmp_path: Path) -> None:
    """Two zero2 process groups run the ZeRO benchmark's collectives after ``fit``, leave
    the group and exit; the check starts every rank itself and reads each exit code. Its
    exit handler holds the GIL into interpreter finalization, so gloo work still to be
    released at exit aborts a rank every time rather than by chance."""
    command = [sys.executable, str(EXIT_CHECK), "--strategies", "zero2", "--runs", "2"]
    proc = run_command([*command, "--hold-gil-at-exit"], cwd=tmp_path, timeout=600)
    assert proc.returncode == 0, f"{proc.stdout}\n{proc.stderr[-3000:]}"
