"""GRPO through the command line (issue 48): the demo recipe on a debug model over real
prompts from ``prepare chat``; ZeRO-2 and FSDP2 (with and without recomputed blocks) over
two ranks equal to one process; a reward that raises refused in one line.

The prompts are the dates data's, through ``prepare chat`` (GPT-2's tokenizer, the plain
template). The model is ``gpt2-debug`` with random weights, so the rewards are a length
penalty and a format check, which vary from one completion to the next (no answer would
ever match), and the loss is ``dapo``'s token mean over every rank's completions (GRPO's
on-policy loss is 0 by construction: a group's advantages sum to 0) over completions a
stop string (the letter ``e``) ends at varied lengths. Completions are drawn from
generators seeded by the run's seed, the example and the step, so every layout samples
the same ones. Four prompts a step, decoded two at a time (left-padded together; one
process makes two decode calls of their own lengths, each of two ranks one).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from plugintrain.cli import main

from _cli import RECIPES, run_cli
from _hf_models import random_hf_llama

STEPS = 3
REWARDS = [
    {
        "class_path": "plugintrain.core.rewards.LengthPenalty",
        "init_args": {"budget": 4, "per_char": 0.05},
    },
    {"class_path": "plugintrain.core.rewards.RegexFormat", "init_args": {"pattern": ".*[0-9].*"}},
]


@pytest.fixture(scope="module")
def prompts(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("grpo")
    assert main(["prepare", "dates", "--count", "40", "--out", str(root / "dates.jsonl")]) == 0
    folder = root / "dates_chat"
    prepare = ["prepare", "chat", str(root / "dates.jsonl"), "--tokenizer", "gpt2"]
    assert main([*prepare, "--template", "plain", "--seq_len", "64", "--val_examples", "6",
                 "--out", str(folder)]) == 0  # fmt: skip
    return folder


HYBRID = "plugintrain.strategies.HybridParallelStrategy"
LAYOUTS = {
    "zero2": "zero2",
    # FSDP2: every rank decodes until every rank's rows have ended (weights gathered per
    # block at each step); the update runs each prompt once through the KV cache
    "fsdp2": json.dumps({"class_path": HYBRID, "init_args": {"zero_stage": 3}}),
    # recomputed blocks: the update runs each row's prompt instead
    "fsdp2_recompute": json.dumps(
        {"class_path": HYBRID, "init_args": {"zero_stage": 3, "activation_checkpointing": "full"}}
    ),
}


def _fit(
    work: Path, prompts: Path, ranks: int, *extra: str, exit_code: int = 0, layout: str = "zero2"
) -> Any:
    rewards = work / "rewards.yaml"
    settings = {"rewards": REWARDS, "reward_weights": [1.0, 1.0]}
    rewards.write_text(json.dumps({"model": {"init_args": settings}}))
    return run_cli(
        "fit", "--config", str(RECIPES / "smollm2_grpo_cpu.yaml"), "--config", str(rewards),
        "--model.init_args.weights=null", "--model.init_args.config=gpt2-debug",
        "--model.init_args.max_new_tokens=8", "--model.init_args.num_generations=4",
        "--model.init_args.loss_type=dapo", '--model.init_args.stop_strings=["e"]',
        f"--data.init_args.data_dir={prompts}", f"--data.init_args.batch_size={4 // ranks}",
        "--model.init_args.rollout_batch_size=2",
        f"--trainer.max_steps={STEPS}", f"--trainer.devices={ranks}",
        f"--trainer.strategy={LAYOUTS[layout]}" if ranks > 1 else "--trainer.devices=1",
        "--trainer.callbacks=[]", *extra,
        cwd=work, exit_code=exit_code, fresh_interpreter=False, ranks=ranks,
    )  # fmt: skip


def _scalars(work: Path) -> dict[str, list[float]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    (run,) = (work / "runs" / "smollm2_grpo_cpu").glob("version_*")
    events = EventAccumulator(str(run))
    events.Reload()
    return {tag: [e.value for e in events.Scalars(tag)] for tag in events.Tags()["scalars"]}


def test_prompts_are_the_chat_examples_up_to_the_answer(prompts: Path) -> None:
    from plugintrain.data import PromptDataModule

    data = PromptDataModule(str(prompts), batch_size=2)
    data.setup("fit")
    held_out = [json.loads(line)["messages"] for line in (prompts / "val.messages.jsonl").open()]
    assert len(data.val_set) == len(held_out)
    for index, messages in enumerate(held_out):
        ids, fields = data.val_set[index]
        assert fields["answer"] == messages[-1]["content"].strip()
        assert messages[0]["content"] in fields["prompt"]
        assert messages[-1]["content"] not in fields["prompt"][-len(messages[-1]["content"]) :]
        assert data.decode(ids.tolist()) == fields["prompt"]


@pytest.fixture(scope="module")
def alone(prompts: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[float]]:
    """The one-process run's scalars."""
    work = tmp_path_factory.mktemp("one")
    _fit(work, prompts, 1)
    assert (work / "runs/smollm2_grpo_cpu/checkpoints/last.ckpt").is_file()
    return _scalars(work)


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_two_ranks_give_the_one_process_losses(
    layout: str, alone: dict[str, list[float]], prompts: Path, tmp_path: Path
) -> None:
    _fit(tmp_path, prompts, 2, layout=layout)
    two = _scalars(tmp_path)
    assert len(alone["train_loss"]) == STEPS
    # dapo (a token mean over every rank's tokens): longer completions weigh more, so the
    # on-policy loss is not 0
    assert all(abs(loss) > 1e-4 for loss in alone["train_loss"]), [
        alone[k] for k in ("train_loss", "train_reward_std", "train_completion_length")
    ]
    assert two["train_loss"] == pytest.approx(alone["train_loss"], rel=1e-5, abs=1e-7)
    # the steps after the first sample from the updated weights: the updates were equal
    assert two["grad_norm"] == pytest.approx(alone["grad_norm"], rel=1e-5)
    for tag in ("train_rollout_seconds", "train_completion_length", "train_entropy"):
        assert tag in alone, tag


def test_a_reward_that_raises_is_one_line_naming_it_and_the_prompt(
    prompts: Path, tmp_path: Path
) -> None:
    bad = '[{"class_path": "plugintrain.core.rewards.NumericMatch", "init_args": {"field": "x"}}]'
    weights = "--model.init_args.reward_weights=[1.0]"
    proc = _fit(tmp_path, prompts, 1, f"--model.init_args.rewards={bad}", weights, exit_code=2)
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("plugintrain fit: error: reward NumericMatch raised KeyError: 'x'")
    assert "on the prompt '" in last and "Traceback" not in proc.stderr


def test_qlora_with_a_kl_term_takes_the_reference_from_the_base(tmp_path: Path) -> None:
    """QLoRA (an nf4 base: a small random Llama, the prompts in Llama 3's tokens) with
    ``beta`` > 0: the reference is the quantized base with its adapters off. Adapters start
    with ``B = 0``, so at the first step the policy is the reference and the KL is 0; after
    updates it is not."""
    lora = {
        "class_path": "plugintrain.callbacks.LoRA",
        "init_args": {"r": 8, "alpha": 16, "quantize": "nf4", "target_modules": ["*.attention.*"]},
    }
    assert main(["prepare", "dates", "--count", "12", "--out", str(tmp_path / "d.jsonl")]) == 0
    prompts = tmp_path / "llama_chat"
    assert main(["prepare", "chat", str(tmp_path / "d.jsonl"), "--tokenizer", "llama3",
                 "--template", "plain", "--seq_len", "48", "--val_examples", "2",
                 "--out", str(prompts)]) == 0  # fmt: skip
    base = random_hf_llama(tmp_path / "base", vocab=128256)
    _fit(
        tmp_path, prompts, 1, f"--trainer.callbacks=[{json.dumps(lora)}]",
        f"--model.init_args.weights={base}", "--model.init_args.config=null",
        "--model.init_args.beta=0.04", "--model.init_args.optimizer.init_args.lr=0.05",
    )  # fmt: skip
    kl = _scalars(tmp_path)["train_kl"]
    assert len(kl) == STEPS
    assert abs(kl[0]) <= 1e-6 and kl[-1] > 1e-6, kl
