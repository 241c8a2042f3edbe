"""docs/extending.md's examples work as the page shows them: each ``python title="X.py"``
block is written to ``X.py`` in a temporary folder, imported, and used through plugintrain's
own entry points (a toy family and strategy and precision plugin train 2 steps, a toy data
source is read by ``prepare text``, a toy weight format round-trips bit for bit, a toy
command answers ``--help``, runs and refuses a typo in one line). Every registry the
examples add to is restored afterwards."""

from __future__ import annotations

import dataclasses
import json
import re
import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import lightning.pytorch as L
import numpy as np
import pytest
import torch
from lightning.pytorch.strategies import StrategyRegistry
from torch.utils.data import DataLoader, TensorDataset

from plugintrain.data import get_tokenizer, read_token_bin
from plugintrain.data.prepare import text_sources
from plugintrain.data.prepare.corpus import PrepareOptions, prepare_text
from plugintrain.formats import convert, open_weights
from plugintrain.formats.registry import FORMATS
from plugintrain.model_zoo import CausalLM, config
from plugintrain.model_zoo.families import FAMILIES
from plugintrain.precision_plugins import PRECISION_PLUGINS, precision_plugin_from_name
from plugintrain.strategies.registry import STRATEGIES
from plugintrain.tools import COMMANDS

PAGE = Path(__file__).resolve().parents[2] / "docs" / "extending.md"
_BLOCK = re.compile(r'^```python title="(\w+)\.py"\n(.*?)^```$', re.MULTILINE | re.DOTALL)
EXAMPLES = dict(_BLOCK.findall(PAGE.read_text()))
# What the examples register into; config._PRESETS is the preset registry behind
# register_preset (a preset name can be registered once per process).
REGISTRIES = (
    FAMILIES,
    config._PRESETS,
    STRATEGIES,
    StrategyRegistry,
    PRECISION_PLUGINS,
    text_sources.READERS,
    FORMATS,
    COMMANDS,
)


@pytest.fixture
def examples(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """The page's examples as modules in a temporary folder on ``sys.path``; every registry
    and ``sys.modules`` as they were afterwards."""
    folder = tmp_path / "examples"
    folder.mkdir()
    for name, code in EXAMPLES.items():
        (folder / f"{name}.py").write_text(code)
    monkeypatch.syspath_prepend(str(folder))
    saved = [dict(registry) for registry in REGISTRIES]
    yield folder
    for registry, before in zip(REGISTRIES, saved, strict=True):
        registry.clear()
        registry.update(before)
    for name in EXAMPLES:
        sys.modules.pop(name, None)


def _load(name: str) -> ModuleType:
    import importlib

    return importlib.import_module(name)


def _fit(module: L.LightningModule, root: Path, steps: int = 2, **trainer: object) -> L.Trainer:
    """``module`` trained ``steps`` steps on random tokens, on the CPU."""
    L.seed_everything(0, verbose=False)
    tokens = torch.randint(0, 256, (8, 17), generator=torch.Generator().manual_seed(0))
    run = L.Trainer(
        accelerator="cpu", max_steps=steps, logger=False, enable_progress_bar=False,
        enable_model_summary=False, enable_checkpointing=False, default_root_dir=root,
        **trainer,
    )  # fmt: skip
    run.fit(module, DataLoader(TensorDataset(tokens[:, :-1], tokens[:, 1:]), batch_size=2))
    return run


def test_the_page_shows_each_kind_of_example_briefly() -> None:
    kinds = ("family", "strategy", "precision", "source", "format", "command")
    assert sorted(EXAMPLES) == sorted(f"toy_{kind}" for kind in kinds)
    assert all(len(code.splitlines()) <= 55 for code in EXAMPLES.values())


def test_a_toy_family_trains(examples: Path, tmp_path: Path) -> None:
    _load("toy_family")
    module = CausalLM("toy-debug", warmup_steps=0)
    run = _fit(module, tmp_path)
    assert run.global_step == 2 and module.config.family == "toy"
    assert torch.isfinite(run.callback_metrics["train_loss"])


def test_a_toy_strategy_trains(examples: Path, tmp_path: Path) -> None:
    _load("toy_family")
    strategy = _load("toy_strategy")
    run = _fit(CausalLM("toy-debug", warmup_steps=0), tmp_path, strategy="counting")
    assert isinstance(run.strategy, strategy.CountingStrategy)
    assert run.strategy.steps == 2 == run.global_step


def test_a_toy_precision_plugin_trains(examples: Path, tmp_path: Path) -> None:
    _load("toy_family")
    _load("toy_precision")
    module = CausalLM("toy-debug", warmup_steps=0)
    run = _fit(module, tmp_path, plugins=[precision_plugin_from_name("64-true")])
    assert run.global_step == 2
    assert {p.dtype for p in module.parameters()} == {torch.float64}


def test_a_toy_data_source_is_read_by_prepare_text(examples: Path, tmp_path: Path) -> None:
    _load("toy_source")
    docs = ["The first row.", "A second, with a comma.", 'And "quotes".']
    rows = "\n".join(
        ["id,text", *(f'{i},"{d.replace(chr(34), chr(34) * 2)}"' for i, d in enumerate(docs))]
    )
    (tmp_path / "in").mkdir()
    (tmp_path / "in" / "rows.csv").write_text(rows + "\n")
    options = PrepareOptions(tokenizer="gpt2", val_fraction=0.0)
    prepare_text([str(tmp_path / "in")], tmp_path / "out", options, progress=False, num_proc=1)
    meta = json.loads((tmp_path / "out" / "meta.json").read_text())
    shards = meta["splits"]["train"]["shards"]
    tokens = np.concatenate([read_token_bin(tmp_path / "out" / s["file"]) for s in shards])
    gpt2 = get_tokenizer("gpt2")
    eot = gpt2.encoding.encode_single_token("<|endoftext|>")
    assert tokens.tolist() == [t for d in docs for t in [*gpt2.encode(d), eot]]


def test_a_toy_format_round_trips(examples: Path, tmp_path: Path) -> None:
    _load("toy_family")
    _load("toy_format")
    run = _fit(CausalLM("toy-debug", warmup_steps=0), tmp_path, steps=1)
    run.save_checkpoint(tmp_path / "toy.ckpt")
    convert(tmp_path / "toy.ckpt", tmp_path / "toy.npz", "npz")
    convert(tmp_path / "toy.npz", tmp_path / "again.npz", "npz")
    ours, back, again = (open_weights(tmp_path / n) for n in ("toy.ckpt", "toy.npz", "again.npz"))
    for read_back in (back, again):  # the architecture too, under the file's name
        assert dataclasses.replace(read_back.config, name=ours.config.name) == ours.config
    assert sorted(back.names()) == sorted(again.names()) == sorted(ours.names())
    for name in ours.names():
        assert torch.equal(back.read(name), ours.read(name)), name
        assert torch.equal(again.read(name), ours.read(name)), name


def test_a_toy_command_answers(
    examples: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from plugintrain.cli import main

    _load("toy_command")
    assert main(["count-tokens", "--help"]) == 0
    assert "Count the tokens of a text file." in capsys.readouterr().out
    (tmp_path / "notes.txt").write_text("hello world")
    assert main(["count-tokens", str(tmp_path / "notes.txt")]) == 0
    assert capsys.readouterr().out.strip() == str(len(get_tokenizer("gpt2").encode("hello world")))
    assert main(["count-tokens", str(tmp_path / "notes.txt"), "--tokenizr", "gpt2"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--tokenizer" in err[0], err
    assert main(["count-tokens", str(tmp_path / "missing.txt")]) == 2
    assert capsys.readouterr().err.strip().endswith("missing.txt: no such file; name a text file")
