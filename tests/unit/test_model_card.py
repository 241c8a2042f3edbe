"""The model card ``plugintrain export`` writes, read by ``huggingface_hub`` itself: its
``ModelCard`` parser, ``ModelCardData`` (which turns ``model-index`` into ``EvalResult``
objects and refuses a malformed one), ``metadata_load`` and ``validate_repo_id`` (the Hub's
own ``card.validate()`` posts to the Hub, which is not reachable here). Cards of a whole
run record, of none and of partial ones; where a GGUF file's card goes; and a real export
of a checkpoint that carries a record (Hugging Face directory and GGUF file)."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml
from huggingface_hub import EvalResult, ModelCard, ModelCardData, metadata_load
from huggingface_hub.utils import validate_repo_id

from plugintrain.cli import main
from plugintrain.formats.model_card import (
    RUN_RECORD_KEY,
    CardFacts,
    export_marker,
    gguf_card_path,
    model_card,
)
from plugintrain.model_zoo import TransformerConfig
from plugintrain.model_zoo.transformer import Transformer

RECIPE = "trainer:\n  max_steps: 20\n  # ```not a fence```\nmodel:\n  init_args:\n    lr: 0.001\n"
RECORD: dict[str, Any] = {
    "plugintrain_version": "0.1.0",
    "git_commit": "0123abc",
    "recipe": RECIPE,
    "model": {"class_path": "plugintrain.model_zoo.CausalLM", "weights": "smollm2-135m",
              "config": "smollm2-135m"},
    "data": [{"path": "/runs/data/dates_chat", "name": "dates_chat", "meta_sha256": "ab" * 32,
              "meta": {"kind": "chat", "tokenizer": "smollm2-135m",
                       "splits": {"train": {"tokens": 12345}, "val": {"tokens": 678}}}}],
    "hardware": {"accelerator": "cuda", "device_name": "NVIDIA H100", "devices": 8,
                 "num_nodes": 2},
    "strategy": "zero2",
    "precision": "bf16-mixed",
    "step": 20,
    "epoch": 1,
    "metrics": {"train_loss": 1.25, "val_loss": 1.5},
    "evaluation": {
        "step": 20,
        "data": "/runs/data/dates_chat",
        "results": {"weights": "w", "adapter": None, "data": "/runs/data/dates_chat",
                    "split": "val", "examples": 10, "tokens": 100, "loss": 0.5,
                    "perplexity": 1.6487, "bits_per_byte": None, "exact_match": 0.7,
                    "contains": 0.8, "preference_accuracy": None, "reward_margin": None,
                    "reference_accuracy": None},
        "tasks": {"arc_easy": {"alias": "arc_easy", "acc,none": 0.25,
                               "acc_stderr,none": 0.01, "acc_norm,none": 0.3}},
    },
    "adapter": {"r": 8, "alpha": 16.0, "target_modules": ["*.attention.wq"]},
}  # fmt: skip


def _card(tmp_path: Path, record: dict[str, Any] | None, facts: CardFacts) -> ModelCard:
    """The card written to a file and read back by ``huggingface_hub``."""
    path = tmp_path / "README.md"
    path.write_text(model_card(record, facts))
    card = ModelCard.load(path)
    assert metadata_load(path) == card.data.to_dict()
    again = ModelCardData(**copy.deepcopy(card.data.to_dict()))  # the model-index round trip
    assert again.to_dict() == card.data.to_dict()
    return card


def _scores(results: list[EvalResult]) -> dict[tuple[str, str], Any]:
    return {(r.dataset_name, r.metric_type): r.metric_value for r in results}


def test_a_whole_record_fills_the_metadata_and_the_results(tmp_path: Path) -> None:
    card = _card(tmp_path, RECORD, CardFacts("peft", name="dates-adapter"))
    data = card.data
    validate_repo_id(data.base_model)
    assert data.base_model == "HuggingFaceTB/SmolLM2-135M-Instruct"
    assert (data.library_name, data.license, data.pipeline_tag) == (
        "peft", "apache-2.0", "text-generation"
    )  # fmt: skip
    assert data.datasets == ["dates_chat"]
    assert {"plugintrain", "lora", "peft"} <= set(data.tags)
    assert f"base_model:adapter:{data.base_model}" in data.tags
    assert data.model_name == "dates-adapter"
    assert {r.task_type for r in data.eval_results} == {"text-generation"}
    assert _scores(data.eval_results) == {
        ("dates_chat", "loss"): 0.5, ("dates_chat", "perplexity"): 1.6487,
        ("dates_chat", "exact_match"): 0.7, ("dates_chat", "contains"): 0.8,
        ("arc_easy", "acc"): 0.25, ("arc_easy", "acc_norm"): 0.3,
    }  # fmt: skip
    assert {r.dataset_split for r in data.eval_results if r.dataset_name == "dates_chat"} == {"val"}
    body = card.text
    assert f"````yaml\n{RECIPE}````" in body  # fenced longer than the recipe's backticks
    assert "ab" * 32 in body and "train 12,345, val 678" in body
    assert "8 x NVIDIA H100 (cuda) on 2 nodes" in body and "zero2" in body
    assert "bf16-mixed" in body and "**Steps**: 20" in body
    assert "plugintrain 0.1.0 (git commit `0123abc`)" in body
    assert "| val_loss | 1.5 |" in body and "| arc_easy | acc_norm | 0.3 |" in body
    assert "LoRA (r=8, alpha=16.0" in body
    assert 'PeftModel.from_pretrained(base, "dates-adapter")' in body
    assert body.rstrip().endswith(export_marker(CardFacts("peft", name="dates-adapter")))


@pytest.mark.parametrize(
    ("kind", "library", "tag"), [("hf", "transformers", None), ("peft", "peft", "peft"),
                                 ("gguf", None, "gguf")],
)  # fmt: skip
def test_no_record_gives_what_export_knows(
    tmp_path: Path, kind: str, library: str | None, tag: str | None
) -> None:
    facts = CardFacts(kind, name="out", base="smollm2-135m", dtype="bfloat16")
    data = _card(tmp_path, None, facts).data
    assert data.library_name == library  # GGUF: a file format, not a Hub library
    assert data.base_model == "HuggingFaceTB/SmolLM2-135M-Instruct"
    assert data.license == "apache-2.0"
    assert data.eval_results is None and data.datasets is None
    assert tag is None or tag in data.tags
    bare = _card(tmp_path, None, CardFacts(kind)).data  # nothing known at all
    assert bare.base_model is None and bare.license is None
    assert bare.pipeline_tag == "text-generation"


@pytest.mark.parametrize(
    "record",
    [
        {},
        {"data": None, "hardware": None, "metrics": None, "evaluation": None, "model": None},
        {"data": [{"name": "x"}, "not a dict", {"path": "/a/b", "meta": {"splits": None}}]},
        {"hardware": {"devices": 2}, "step": 0},
        {"evaluation": {"results": {"loss": None, "exact_match": True}, "tasks": None}},
        {"evaluation": {"results": {"loss": float("nan"), "split": None}, "step": None}},
        {"evaluation": {"tasks": {"t": {"acc,none": "n/a", "alias": "t"}, "u": None}}},
        {"recipe": None, "adapter": None, "metrics": {"loss": 1}},
    ],
)
def test_a_partial_record_still_makes_a_valid_card(tmp_path: Path, record: dict) -> None:
    card = _card(tmp_path, record, CardFacts("hf"))
    assert card.data.library_name == "transformers"
    assert card.data.eval_results is None  # nothing numeric was measured


def test_a_hub_cache_snapshot_names_its_repo(tmp_path: Path) -> None:
    weights = "/home/u/.cache/huggingface/hub/models--Qwen--Qwen3-0.6B/snapshots/abc123"
    record = {"model": {"weights": weights}}
    data = _card(tmp_path, record, CardFacts("hf")).data
    assert data.base_model == "Qwen/Qwen3-0.6B" and data.license is None
    local = _card(tmp_path, {"model": {"weights": "/data/my_llama"}}, CardFacts("hf"))
    assert local.data.base_model is None and "`my_llama` (local weights)" in local.text


def test_a_gguf_card_never_replaces_a_readme_export_did_not_write(tmp_path: Path) -> None:
    out = tmp_path / "m.gguf"
    assert gguf_card_path(out) == tmp_path / "README.md"
    (tmp_path / "README.md").write_text(model_card(None, CardFacts("gguf", name="m.gguf")))
    assert gguf_card_path(out) == tmp_path / "README.md"  # the card of this same file
    assert gguf_card_path(tmp_path / "q8.gguf") == tmp_path / "q8.README.md"
    (tmp_path / "README.md").write_text("# my project\n")
    assert gguf_card_path(out) == tmp_path / "m.README.md"
    (tmp_path / "m.README.md").write_text("notes\n")
    with pytest.raises(ValueError, match="move one of them away"):
        gguf_card_path(out)


def _checkpoint(path: Path, record: dict[str, Any]) -> Path:
    """A checkpoint as ``fit`` saves it (the CausalLM's weights and hyperparameters) with
    the run's record, written directly: a trained model adds nothing the card reads."""
    model = Transformer(TransformerConfig.from_name("gpt2-debug"))
    state = {f"model.{k}": v for k, v in model.state_dict().items()}
    hparams = {"config": "gpt2-debug", "weights": None}
    torch.save({"state_dict": state, "hyper_parameters": hparams, RUN_RECORD_KEY: record}, path)
    return path


def test_export_writes_the_card_beside_the_weights(tmp_path: Path, capsys) -> None:
    record = {k: v for k, v in RECORD.items() if k not in ("model", "adapter")}
    ckpt = str(_checkpoint(tmp_path / "last.ckpt", record))
    assert main(["export", ckpt, str(tmp_path / "hf"), "--format", "hf"]) == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert summary["card"] == str(tmp_path / "hf" / "README.md")
    card = ModelCard.load(tmp_path / "hf" / "README.md")
    assert card.data.library_name == "transformers" and card.data.base_model is None
    assert card.data.datasets == ["dates_chat"] and card.data.model_name == "hf"
    assert _scores(card.data.eval_results)[("dates_chat", "exact_match")] == 0.7
    assert "**Method**: training from scratch" in card.text and "(float32)" in card.text
    assert "`gpt2-debug`" in card.text

    folder = tmp_path / "gguf"
    folder.mkdir()
    (folder / "README.md").write_text("# mine\n")
    for _ in range(2):  # the second run replaces its own card, never the user's README
        argv = ["export", ckpt, str(folder / "m.gguf"), "--format", "gguf", "--overwrite"]
        assert main(argv) == 0
        assert (folder / "README.md").read_text() == "# mine\n"
        card = ModelCard.load(folder / "m.README.md")
        assert "gguf" in card.data.tags and card.data.library_name is None
    (folder / "m.README.md").write_text("notes\n")  # now the user's too: refused, untouched
    written = (folder / "m.gguf").stat().st_mtime_ns
    capsys.readouterr()
    assert main(["export", ckpt, str(folder / "m.gguf"), "--format", "gguf", "--overwrite"]) == 2
    assert "move one of them away" in capsys.readouterr().err
    assert (folder / "m.README.md").read_text() == "notes\n"
    assert (folder / "m.gguf").stat().st_mtime_ns == written


def test_the_front_matter_is_plain_yaml() -> None:
    """No anchors or aliases (one task block reused by every result is written out)."""
    text = model_card(RECORD, CardFacts("hf"))
    front = text.split("---\n")[1]
    assert "&id" not in front and "*id" not in front
    assert yaml.safe_load(front)["model-index"][0]["results"][1]["task"]["type"] == (
        "text-generation"
    )
