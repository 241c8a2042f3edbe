"""The chat fine-tuning path from the command line, as the README runs it: `prepare dates`,
`prepare chat`, `fit` with the chat LoRA recipe (on a debug model) evaluating the held-out
answers as it trains (`plugintrain.callbacks.Evaluate`), then `evaluate`, `generate --chat`
and `export` (with its model card) on what it trained."""

from __future__ import annotations

import json
import math
from typing import Any

import pytest

from plugintrain.cli import main

from _cli import RECIPES, run_cli

RECIPE = RECIPES / "smollm2_lora_chat_cpu.yaml"
EVALUATED = ("eval/loss", "eval/exact_match", "eval/contains")


@pytest.fixture(scope="module")
def chat_run(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    root = tmp_path_factory.mktemp("chat")
    assert main(["prepare", "dates", "--count", "40", "--out", str(root / "dates.jsonl")]) == 0
    folder = root / "dates_chat"
    prepare = ["prepare", "chat", str(root / "dates.jsonl"), "--tokenizer", "gpt2"]
    assert main([*prepare, "--template", "plain", "--seq_len", "64", "--val_examples", "6",
                 "--out", str(folder)]) == 0  # fmt: skip
    run_cli(
        "fit", "--config", str(RECIPE),
        "--model.init_args.weights=null", "--model.init_args.config=gpt2-debug",
        f"--data.init_args.data_dir={folder}", "--data.init_args.batch_size=2",
        "--trainer.max_steps=3", "--trainer.val_check_interval=3",
        "--trainer.limit_val_batches=1", "--trainer.enable_progress_bar=false",
        "--checkpoint.every_n_train_steps=3",
        "--trainer.callbacks+=plugintrain.callbacks.Evaluate",
        f"--trainer.callbacks.data={folder}", "--trainer.callbacks.every_n_steps=2",
        "--trainer.callbacks.max_new_tokens=8",
        cwd=root, fresh_interpreter=False,
    )  # fmt: skip
    return {
        "root": root,
        "folder": folder,
        "checkpoints": root / "runs/smollm2_lora_chat_cpu/checkpoints",
    }


def test_the_recipe_trains_on_packed_masked_rows(chat_run: dict[str, Any]) -> None:
    meta = json.loads((chat_run["folder"] / "meta.json").read_text())
    assert meta["pack"] is True and meta["splits"]["val"]["examples"] == 6
    assert (chat_run["checkpoints"] / "last.ckpt").exists()


def test_evaluate_scores_the_held_out_answers(chat_run: dict[str, Any]) -> None:
    """``evaluate`` on the last checkpoint scores what the Evaluate callback logged at the
    last step, from the live model (LoRA unmerged), to TensorBoard."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    out = chat_run["root"] / "eval.json"
    args = ["evaluate", "--weights", str(chat_run["checkpoints"]), "--data",
            str(chat_run["folder"]), "--max_new_tokens", "8", "--json", str(out)]  # fmt: skip
    assert main(args) == 0
    result = json.loads(out.read_text())
    assert result["examples"] == 6
    assert math.isfinite(result["loss"]) and result["loss"] > 0
    assert 0.0 <= result["exact_match"] <= result["contains"] <= 1.0
    events = EventAccumulator(str(chat_run["root"] / "runs/smollm2_lora_chat_cpu/version_0"))
    events.Reload()
    logged = {tag: {e.step: e.value for e in events.Scalars(tag)} for tag in EVALUATED}
    for tag in EVALUATED:
        assert set(logged[tag]) == {2, 3}, tag  # every 2 steps, and at the last
        measure = tag.removeprefix("eval/")
        assert logged[tag][3] == pytest.approx(result[measure], rel=1e-5, abs=1e-6), tag
    assert events.Scalars("eval/seconds")[-1].value > 0


def test_the_model_card_of_the_export_holds_the_evaluation(
    chat_run: dict[str, Any], tmp_path
) -> None:
    """``export --format hf --merge-lora`` writes a README.md that ``huggingface_hub``
    reads, with the in-training evaluation's scores as model-index results."""
    from huggingface_hub import ModelCard

    out = tmp_path / "hf"
    export = ["export", str(chat_run["checkpoints"]), str(out), "--format", "hf", "--merge-lora"]
    assert main(export) == 0
    card = ModelCard.load(out / "README.md")
    assert card.data.library_name == "transformers" and "plugintrain" in card.data.tags
    scores = {(r.dataset_name, r.metric_type): r.metric_value for r in card.data.eval_results}
    assert set(scores) >= {("dates_chat", "exact_match"), ("dates_chat", "loss")}


def test_generate_answers_each_conversation(chat_run: dict[str, Any], capsys) -> None:
    conversations = chat_run["root"] / "ask.jsonl"
    ask = [{"messages": [{"role": "user", "content": "Write 1 May 2020 as ISO 8601."}]}] * 3
    conversations.write_text("".join(json.dumps(row) + "\n" for row in ask))
    capsys.readouterr()
    args = ["generate", "--weights", str(chat_run["checkpoints"]), "--chat", str(conversations),
            "--template", "plain", "--max_new_tokens", "4", "--temperature", "0"]  # fmt: skip
    assert main(args) == 0
    rows = [
        json.loads(line) for line in capsys.readouterr().out.splitlines() if line.startswith("{")
    ]
    assert len(rows) == 3
    for row in rows:
        assert row["messages"][:1] == ask[0]["messages"]
        assert row["messages"][-1]["role"] == "assistant"
    assert len({row["messages"][-1]["content"] for row in rows}) == 1  # greedy: the same answer
