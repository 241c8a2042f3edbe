"""DPO through the command line under every parallel layout, against one process (issue 45).

One recipe: ``PreferenceLM`` with DPO's sigmoid objective (beta 0.1) on a small random
Hugging Face Llama, LoRA r 4 on every attention and MLP projection, fp32, a fixed seed and
fixed random pairs (a shared prompt of 4-8 tokens, answers of 2-6), 4 pairs a step for 4
steps. The pairs are written as ``plugintrain prepare preference`` writes them, with the
reference log-probs of every sequence computed by ``transformers`` on the same weights
(independent of the code under test), and every run reads the reference from there
(``reference: data``), since a pipeline's stages cannot run the reference forward. It runs
in one process (the reference run) and on 2 gloo ranks under ``ddp_bucketed``, ``zero2``,
``hybrid`` with ``zero_stage: 3`` (FSDP2; also with ``activation_checkpointing: full``),
``hybrid`` with ``tensor_parallel: 2`` (vocabulary-parallel
log-probs), the same with ``sequence_parallel``, and ``pipeline`` (2 stages of 2 pairs a
micro-batch). Every layout's loss of the global batch (the mean of the data-parallel ranks'
halves: each holds as many pairs) must be the one process's at every step within 1e-5
relative.

Two more paths run against their own one process: the reference as the same model with
its adapters switched off (``reference: adapters_off``, a no-grad forward inside the step)
on a folder without reference log-probs, under ``zero2``, FSDP2 with full recomputation
(the recomputed forward is the policy's, the adapters on) and tp2; and ORPO
(reference-free, its NLL term scoring the prompt too) under ``zero2`` and the pipeline, on
the same pairs of varied lengths: its NLL term is the mean over the whole step's chosen
tokens however the step is split (the step totals in every batch; with each part's own
token mean instead, the pipeline's ORPO losses were 6e-5 off at step 0 and 4e-4 by step
3). The pipeline refuses ``reference: adapters_off`` in one line.

Full fine-tuning with the reference from ``fit``'s own first pass over the pairs (no
reference in the folder, no LoRA) runs in one process and under ``zero2``, FSDP2 and tp2:
each layout's losses equal the one process's (whose first is log 2), and the log-probs
each cached equal ``transformers``' on the same weights.

Each command runs forked from the fork server (``_cli.run_cli``), the 2-rank fits as
torchrun starts its ranks; each rank's losses come from files a small callback of this
module writes (TensorBoard holds rank 0's only).
"""

from __future__ import annotations

import json
import math
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import numpy as np
import pytest
import torch
import yaml
from lightning.pytorch.callbacks import Callback

from _cli import REPO, logged_losses, run_cli
from _hf_models import random_hf_llama

VOCAB = 256
STEPS = 4
PAIRS = 4  # the global batch
SEQ_LEN = 16  # every row padded to it (pad_multiple), so every layout sees one shape
NAME = "dpo"
TARGETS = ["*.attention.w?", "*.feed_forward.w?"]
HYBRID = "plugintrain.strategies.HybridParallelStrategy"

# name -> (strategy, data-parallel degree over the 2 ranks)
LAYOUTS: dict[str, tuple[Any, int]] = {
    "ddp_bucketed": ("ddp_bucketed", 2),
    "zero2": ("zero2", 2),
    "fsdp2": ({"class_path": HYBRID, "init_args": {"zero_stage": 3}}, 2),
    "fsdp2_recompute": (
        {"class_path": HYBRID, "init_args": {"zero_stage": 3, "activation_checkpointing": "full"}},
        2,
    ),
    "tp2": ({"class_path": HYBRID, "init_args": {"tensor_parallel": 2}}, 1),
    "tp2_sp": (
        {"class_path": HYBRID, "init_args": {"tensor_parallel": 2, "sequence_parallel": True}},
        1,
    ),
    "pipeline": ("pipeline", 1),
}


@dataclass(frozen=True)
class Case:
    """One objective and where its reference comes from, run on one folder."""

    objective: str
    reference: str  # PreferenceLM's: data, adapters_off, first_pass, auto (reference-free)
    folder: str  # the setup fixture's: "ref" (with reference log-probs) or "plain"
    lora: bool = True  # False: full fine-tuning


CASES = {
    "dpo": Case("sigmoid", "data", "ref"),
    "dpo_adapters_off": Case("sigmoid", "adapters_off", "plain"),
    "orpo": Case("orpo", "auto", "plain"),
    "dpo_first_pass": Case("sigmoid", "first_pass", "plain", lora=False),
}
FIRST_PASS_LAYOUTS = ["zero2", "fsdp2", "tp2"]
RUNS = [
    *(("dpo", layout) for layout in LAYOUTS),
    ("dpo_adapters_off", "zero2"),
    ("dpo_adapters_off", "fsdp2_recompute"),
    ("dpo_adapters_off", "tp2"),
    ("orpo", "zero2"),
    ("orpo", "pipeline"),
    *(("dpo_first_pass", layout) for layout in FIRST_PASS_LAYOUTS),
]


class LossProbe(Callback):
    """Writes ``<dirpath>/rank_<rank>.json``: this rank's loss at each step.

    Args:
        dirpath: Where the files go.
    """

    def __init__(self, dirpath: str) -> None:
        self.dirpath = dirpath
        self.losses: dict[int, float] = {}

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, *args: Any
    ) -> None:
        self.losses[trainer.global_step - 1] = float(outputs["loss"])

    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        path = Path(self.dirpath, f"rank_{trainer.global_rank}.json")
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(self.losses))


# ---------------------------------------------------------------------------------------
# The preference folder, as `plugintrain prepare preference` writes it


def _random_pairs(rng: np.random.Generator, count: int) -> list[tuple[np.ndarray, ...]]:
    """``count`` pairs ``(prompt, chosen, rejected)`` of random ids (0 is the pad/eos): a
    prompt of 4-8 tokens, answers of 2-6."""
    pairs = []
    for _ in range(count):
        prompt = rng.integers(1, VOCAB, rng.integers(4, 9))
        lengths = rng.integers(2, 7), rng.integers(2, 7)
        chosen, rejected = (rng.integers(1, VOCAB, n) for n in lengths)
        pairs.append((prompt, chosen, rejected))
    return pairs


def _sequences(pairs: list[tuple[np.ndarray, ...]]) -> list[tuple[np.ndarray, np.ndarray]]:
    """``(ids, answer mask)`` of each pair's prompt + chosen, then prompt + rejected."""
    out = []
    for prompt, *answers in pairs:
        for answer in answers:
            mask = np.r_[np.zeros(len(prompt), bool), np.ones(len(answer), bool)]
            out.append((np.r_[prompt, answer], mask))
    return out


@torch.no_grad()
def _transformers_logps(base: Path, sequences: list[tuple[np.ndarray, np.ndarray]]) -> np.ndarray:
    """Each sequence's summed log-prob of its answer tokens under the Hugging Face model at
    ``base``, computed by ``transformers`` one sequence at a time: ``(n,)`` float64."""
    import transformers

    model = transformers.LlamaForCausalLM.from_pretrained(base, torch_dtype=torch.float32).eval()
    out = []
    for ids, mask in sequences:
        tokens = torch.as_tensor(ids, dtype=torch.int64)[None]
        logps = torch.log_softmax(model(tokens).logits[0, :-1].double(), dim=-1)
        picked = logps.gather(1, tokens[0, 1:, None]).squeeze(1)  # log p(ids[t] | ids[:t])
        out.append(float(picked[torch.as_tensor(mask[1:])].sum()))
    return np.asarray(out, dtype=np.float64)


def _write_folder(
    folder: Path, splits: dict[str, list[tuple[np.ndarray, ...]]], base: Path | None
) -> None:
    """A preference folder of ``splits``' pairs; with ``base``, reference log-probs of every
    sequence under it (``S.ref_logps.npy``, and ``meta.json``'s ``reference``)."""
    folder.mkdir(parents=True)
    for split, pairs in splits.items():
        sequences = _sequences(pairs)
        lengths = [len(ids) for ids, _ in sequences]
        np.save(
            folder / f"{split}.ids.npy", np.concatenate([s[0] for s in sequences]).astype(np.uint32)
        )
        np.save(
            folder / f"{split}.mask.npy", np.concatenate([s[1] for s in sequences]).astype(np.uint8)
        )
        np.save(folder / f"{split}.offsets.npy", np.r_[0, np.cumsum(lengths)].astype(np.int64))
        if base is not None:
            np.save(folder / f"{split}.ref_logps.npy", _transformers_logps(base, sequences))
    meta = {
        "kind": "preference", "version": 1, "vocab_size": VOCAB, "eos_id": 0, "pad_id": 0,
        "settings": {"seq_len": SEQ_LEN},
        "splits": {split: {"pairs": len(pairs)} for split, pairs in splits.items()},
        "reference": None if base is None else {"weights": str(base)},
    }  # fmt: skip
    (folder / "meta.json").write_text(json.dumps(meta, indent=2))


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The random base; one set of pairs written with (``ref``) and without (``plain``)
    reference log-probs."""
    root = tmp_path_factory.mktemp("preference_layouts")
    base = random_hf_llama(root / "base", VOCAB, seed=0)
    rng = np.random.default_rng(0)
    # 3 held-out pairs: a batch of 4 pairs leaves a last validation batch of 3, which the
    # pipeline's 2 micro-batches must not split inside a pair.
    splits = {"train": _random_pairs(rng, STEPS * PAIRS), "val": _random_pairs(rng, 3)}
    _write_folder(root / "ref", splits, base)
    _write_folder(root / "plain", splits, None)
    return {"base": base, "root": root, **{name: root / name for name in ("ref", "plain")}}


# ---------------------------------------------------------------------------------------
# The runs


def _recipe(base: Path, data: Path, case: Case) -> dict[str, Any]:
    lora = {"r": 4, "alpha": 8, "target_modules": TARGETS}
    callbacks = [{"class_path": "plugintrain.callbacks.LoRA", "init_args": lora}]
    return {
        "seed_everything": 7,
        "trainer": {
            "accelerator": "cpu", "devices": 1, "precision": "32-true", "max_steps": STEPS,
            "limit_val_batches": 0, "log_every_n_steps": 1, "enable_progress_bar": False,
            "callbacks": callbacks if case.lora else [],
            "logger": {
                "class_path": "lightning.pytorch.loggers.TensorBoardLogger",
                "init_args": {"save_dir": "runs", "name": NAME},
            },
        },
        "model": {
            "class_path": "plugintrain.model_zoo.PreferenceLM",
            "init_args": {
                "weights": str(base), "objective": case.objective, "beta": 0.1,
                "reference": case.reference, "warmup_steps": 0, "min_lr_ratio": 1.0,
                "optimizer": {"class_path": "torch.optim.AdamW", "init_args": {"lr": 0.01}},
            },
        },
        "data": {
            "class_path": "plugintrain.data.PreferenceDataModule",
            "init_args": {
                "data_dir": str(data), "batch_size": PAIRS, "pad_multiple": SEQ_LEN, "seed": 3,
            },
        },
        "checkpoint": {"every_n_train_steps": STEPS},
    }  # fmt: skip


def _layout_options(layout: str) -> tuple[list[str], int]:
    """The command-line options of ``layout`` on 2 ranks (each rank's batch: the global one
    over the data-parallel degree), and its data-parallel degree."""
    strategy, dp = LAYOUTS[layout]
    strategy = strategy if isinstance(strategy, str) else json.dumps(strategy)
    options = [f"--trainer.strategy={strategy}", "--trainer.devices=2"]
    return [*options, f"--data.init_args.batch_size={PAIRS // dp}"], dp


class Runs:
    """Each (case, layout) fitted once per module, on demand; layout None: one process.

    Args:
        setup: The ``setup`` fixture's paths.
        tmp_path_factory: Where each run's folder goes.
    """

    def __init__(self, setup: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> None:
        self.setup, self.tmp = setup, tmp_path_factory
        self.done: dict[tuple[str, str | None], dict[str, Any]] = {}

    def __call__(self, case: str, layout: str | None = None) -> dict[str, Any]:
        if (case, layout) not in self.done:
            self.done[case, layout] = self._fit(case, layout)
        return self.done[case, layout]

    def recipe(self, case: str) -> Path:
        """The recipe file of ``case``."""
        spec = CASES[case]
        recipe = self.setup["root"] / f"{case}.yaml"
        if not recipe.is_file():
            data = self.setup[spec.folder]
            recipe.write_text(yaml.safe_dump(_recipe(self.setup["base"], data, spec)))
        return recipe

    def _fit(self, case: str, layout: str | None) -> dict[str, Any]:
        """Every rank's losses, and rank 0's TensorBoard ones."""
        out = self.tmp.mktemp(f"{case}_{layout or 'single'}")
        extra, ranks, dp = [], 1, 1
        if layout is not None:
            extra, dp = _layout_options(layout)
            ranks = 2
        if CASES[case].reference == "first_pass":  # a cache of the run's own
            extra.append(f"--data.init_args.reference_cache={out / 'cache'}")
        probe = {"class_path": f"{__name__}.LossProbe", "init_args": {"dirpath": str(out / "p")}}
        run_cli(
            "fit", "--config", str(self.recipe(case)), f"--trainer.logger.init_args.save_dir={out}",
            f"--trainer.default_root_dir={out}", f"--trainer.callbacks+={json.dumps(probe)}",
            *extra, cwd=REPO, fresh_interpreter=False, ranks=ranks,
        )  # fmt: skip
        per_rank = [json.loads((out / "p" / f"rank_{r}.json").read_text()) for r in range(ranks)]
        per_rank = [{int(step): loss for step, loss in losses.items()} for losses in per_rank]
        logged = logged_losses(out / NAME / "version_0")
        shutil.rmtree(out / NAME / "checkpoints", ignore_errors=True)
        return {"ranks": per_rank, "logged": logged, "dp": dp, "cache": out / "cache"}


@pytest.fixture(scope="module")
def runs(setup: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> Runs:
    return Runs(setup, tmp_path_factory)


# ---------------------------------------------------------------------------------------
# The checks


@pytest.mark.parametrize("case", ["dpo", "dpo_adapters_off", "dpo_first_pass"])
def test_one_process_starts_at_log_2_and_moves(runs: Runs, case: str) -> None:
    """Step 0 (adapters at B = 0, the policy is the reference): DPO's loss is log 2 within
    1e-6 relative, with the reference from transformers (measured: 3e-9, fp32's rounding
    of log 2) as with the adapters switched off; by step 3 the loss has moved by more than
    1e-3 relative, so agreeing within 1e-5 tells layouts apart."""
    single = runs(case)
    (losses,) = single["ranks"]
    assert sorted(losses) == list(range(STEPS)) and losses == single["logged"]
    assert losses[0] == pytest.approx(math.log(2), rel=1e-6)
    assert abs(losses[STEPS - 1] - losses[0]) > 1e-3 * losses[0]


@pytest.mark.parametrize(("case", "layout"), RUNS, ids=[f"{c}-{lay}" for c, lay in RUNS])
def test_layout_gives_the_one_process_losses(runs: Runs, case: str, layout: str) -> None:
    """The global batch's loss at each step against the one process's (rel 1e-5): the mean
    of the data-parallel ranks' halves; under tp and the pipeline every rank's (the last
    stage's, broadcast) and rank 0's logged one."""
    expected = runs(case)["logged"]
    run = runs(case, layout)
    assert all(sorted(losses) == sorted(expected) for losses in run["ranks"])
    for step, loss in expected.items():
        mean = sum(losses[step] for losses in run["ranks"]) / len(run["ranks"])
        assert mean == pytest.approx(loss, rel=1e-5), step
    if run["dp"] == 1:
        assert run["logged"] == pytest.approx(expected, rel=1e-5)
        assert all(losses == pytest.approx(expected, rel=1e-5) for losses in run["ranks"])


@pytest.mark.parametrize("layout", [None, *FIRST_PASS_LAYOUTS])
def test_a_first_pass_caches_the_transformers_reference(runs: Runs, layout: str | None) -> None:
    """Full fine-tuning with no reference in the data: the first pass (its chunks shared
    by the data-parallel ranks, or scored by tensor-parallel peers together, or through
    FSDP2's gathers) caches each sequence's log-prob as ``transformers`` computes it on the
    same weights (the ``ref`` folder's) within 1e-5 relative."""
    (cache,) = runs("dpo_first_pass", layout)["cache"].iterdir()
    for split in ("train", "val"):
        chunks = sorted(cache.glob(f"{split}.*.npy"))
        got = np.concatenate([np.load(path) for path in chunks])
        expected = np.load(runs.setup["ref"] / f"{split}.ref_logps.npy")
        np.testing.assert_allclose(got, expected, rtol=1e-5)


def test_pipeline_refuses_the_adapters_off_reference(runs: Runs, tmp_path: Path) -> None:
    """``reference: adapters_off`` under the pipeline (no stage holds the whole model for
    the reference forward): refused in one line, the last, exit 2, naming the ways out
    (the data's reference, a reference-free objective), before any rank is launched."""
    out = tmp_path / "runs"
    proc = run_cli(
        "fit", "--config", str(runs.recipe("dpo_adapters_off")),
        f"--trainer.logger.init_args.save_dir={out}", f"--trainer.default_root_dir={out}",
        *_layout_options("pipeline")[0], cwd=REPO, fresh_interpreter=False, exit_code=2,
    )  # fmt: skip
    last = proc.stderr.strip().splitlines()[-1]
    assert (
        "under pipeline parallelism the reference log-probs come from the data: prepare the"
        " pairs with `plugintrain prepare preference ... --reference WEIGHTS`"
    ) in last
    assert "use a reference-free objective (simpo, orpo)" in last
    assert not out.exists() or not any(out.rglob("events.out.tfevents*"))
    assert not list(out.rglob("*.ckpt")) and not list(out.rglob("*.distcp"))


def _validated(runs: Runs, layout: str | None) -> dict[str, dict[int, float]]:
    """DPO (reference from the data) fitted with validation after the last step, under
    ``layout`` (None: one process): rank 0's TensorBoard scalars by tag."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    out = runs.tmp.mktemp(f"validated_{layout or 'single'}")
    extra = [] if layout is None else _layout_options(layout)[0]
    run_cli(
        "fit", "--config", str(runs.recipe("dpo")), f"--trainer.logger.init_args.save_dir={out}",
        f"--trainer.default_root_dir={out}", "--trainer.limit_val_batches=null",
        f"--trainer.val_check_interval={STEPS}", *extra, cwd=REPO, fresh_interpreter=False,
        ranks=1 if layout is None else 2,
    )  # fmt: skip
    events = EventAccumulator(str(out / NAME / "version_0"))
    events.Reload()
    return {tag: {e.step: e.value for e in events.Scalars(tag)} for tag in events.Tags()["scalars"]}


def test_pipeline_validates_and_logs_as_one_process(runs: Runs) -> None:
    """Under the pipeline, with a last validation batch of 3 pairs over 2 micro-batches:
    the validation loss and statistics equal one process's (rel 1e-5), and rank 0 (the
    first stage, which holds no head) logs every statistic the last stage computes, train
    and val (the last stage's, handed to every rank: a synchronized log is a collective)."""
    single, piped = _validated(runs, None), _validated(runs, "pipeline")
    names = ["loss", "reward_chosen", "reward_rejected", "reward_margin", "reward_accuracy"]
    names += ["logp_chosen", "logp_rejected", "loss_pref"]
    for stage in ("train", "val"):
        for name in names:
            tag = f"{stage}_{name}"
            assert tag in piped, tag
            assert sorted(piped[tag]) == sorted(single[tag]), tag
            for step, value in single[tag].items():
                assert piped[tag][step] == pytest.approx(value, rel=1e-5, abs=1e-7), (tag, step)
