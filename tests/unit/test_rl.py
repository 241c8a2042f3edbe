"""Reinforcement learning's parts (issue 48), each against an independent reference:
group advantages against per-group arithmetic in Python; the log-probs a rollout records
against the training forward's; the shipped rewards on hand-checked cases; bad options,
bad rewards and long prompts refused in one line naming the value and a fix that works.
"""

from __future__ import annotations

import math
import statistics
from pathlib import Path

import pytest
import torch

from plugintrain.core.rewards import (
    Contains,
    ExactMatch,
    F1Match,
    LengthPenalty,
    NumericMatch,
    RegexFormat,
    RewardError,
    score,
)
from plugintrain.model_zoo.generation import sample_with_logps
from plugintrain.model_zoo.rl import GRPOLM, group_advantages, launch_problem

REWARDS = torch.tensor([1.0, 0.0, 0.5, 0.5, 2.0, 2.0, 2.0, -1.0])


def _python_advantages(kind: str) -> list[float]:
    out = []
    for start in range(0, len(REWARDS), 4):
        group = REWARDS[start : start + 4].tolist()
        mean = sum(group) / len(group)
        if kind == "grpo":
            out += [(r - mean) / (statistics.stdev(group) + 1e-4) for r in group]
        elif kind == "dr_grpo":
            out += [r - mean for r in group]
        else:  # rloo: each against the mean of the others
            out += [r - (sum(group) - r) / (len(group) - 1) for r in group]
    return out


@pytest.mark.parametrize("kind", ["grpo", "dr_grpo", "rloo"])
def test_group_advantages_equal_the_arithmetic(kind: str) -> None:
    got = group_advantages(REWARDS, 4, kind).tolist()
    assert got == pytest.approx(_python_advantages(kind), rel=1e-6, abs=1e-7)


@pytest.fixture(scope="module")
def module() -> GRPOLM:
    torch.manual_seed(0)
    lm = GRPOLM(config="llama3-debug", rewards=[ExactMatch()], temperature=0.8)
    lm.configure_model()
    lm.init_weights()
    return lm


def test_the_log_probs_training_computes_are_the_ones_recorded_while_sampling(
    module: GRPOLM,
) -> None:
    """The ratio starts at 1: the training forward over prompt + completion gives each
    drawn token the log-prob the KV-cache decode recorded (top-p truncation aside)."""
    prompt = torch.randint(
        0, module.config.vocab_size, (12,), generator=torch.Generator().manual_seed(1)
    )
    generator = torch.Generator().manual_seed(2)
    tokens, recorded, lengths = sample_with_logps(
        module.model, prompt[None].expand(6, -1), 20, 0.8, None, 0.9, (), None, generator
    )
    with torch.no_grad():
        trained = module.completion_logps(prompt, tokens)[0]
    assert (trained - recorded).abs().max() <= 1e-3
    assert lengths.tolist() == [20] * 6  # no stop id given


def test_a_stop_token_ends_a_row_and_later_steps_repeat_it(module: GRPOLM) -> None:
    prompt = torch.arange(5)
    generator = torch.Generator().manual_seed(3)
    stops = set(range(module.config.vocab_size // 2))  # half the vocabulary: rows end soon
    tokens, _, lengths = sample_with_logps(
        module.model, prompt[None].expand(4, -1), 16, 1.0, None, 1.0, stops, None, generator
    )
    for row, n in zip(tokens.tolist(), lengths.tolist(), strict=True):
        assert row[n - 1] in stops and all(t not in stops for t in row[: n - 1])
        assert set(row[n - 1 :]) == {row[n - 1]}


def test_shipped_rewards() -> None:
    answer = {"answer": "2038-04-01"}
    assert ExactMatch()("p", " 2038-04-01 ", **answer) == 1.0
    assert ExactMatch()("p", "2038-04-01.", **answer) == 0.0
    assert Contains()("p", "It is 2038-04-01.", **answer) == 1.0
    assert F1Match()("p", "2022-04-01", **answer) == pytest.approx(2 / 3)
    assert NumericMatch()("p", "so the total is 1,024", answer="#### 1024") == 1.0
    assert NumericMatch()("p", "no number", answer="3") == 0.0
    assert RegexFormat(r"\d{4}-\d{2}-\d{2}")("p", "2038-04-01", **answer) == 1.0
    assert RegexFormat(r"\d{4}-\d{2}-\d{2}")("p", "on 2038-04-01", **answer) == 0.0
    assert RegexFormat(r"\d{4}-\d{2}-\d{2}", full_match=False)("p", "on 2038-04-01") == 1.0
    assert LengthPenalty(budget=4, per_char=0.5)("p", "123456") == -1.0


def test_a_reward_that_raises_or_is_not_finite_is_one_line_naming_it_and_the_prompt() -> None:
    with pytest.raises(RewardError) as error:
        score([NumericMatch(field="solution")], "What is 2 + 2?", ["4"], {"answer": "4"})
    message = str(error.value)
    assert "\n" not in message and "reward NumericMatch raised KeyError" in message
    assert "'What is 2 + 2?'" in message

    def nan_reward(prompt: str, completion: str, **fields: object) -> float:
        return math.nan

    with pytest.raises(RewardError, match=r"reward nan_reward gave nan, not a finite number"):
        score([nan_reward], "What is 2 + 2?", ["4"], {})


@pytest.mark.parametrize(
    "options,expected",
    [
        ({"num_generations": 1}, "num_generations=1 with advantage='grpo': a group baseline"),
        ({"advantage": "ppo"}, "advantage='ppo': use one of grpo, dr_grpo, rloo"),
        ({"loss_type": "sapo"}, "loss_type='sapo': use one of grpo, bnpo, dr_grpo, dapo"),
        ({"temperature": 0.0}, "temperature=0.0: sampling needs a temperature above 0"),
        ({"rewards": []}, "GRPOLM needs at least one reward"),
    ],
)
def test_bad_options_are_one_line(options: dict, expected: str) -> None:
    arguments = {"config": "llama3-debug", "rewards": [ExactMatch()], **options}
    with pytest.raises(ValueError) as error:
        GRPOLM(**arguments)
    assert expected in str(error.value) and "\n" not in str(error.value)


class _Prompts:
    rl_prompts = True
    data_dir = Path("data/prompts")

    def longest_prompt(self) -> tuple[int, int]:
        return 200, 7


def test_a_prompt_longer_than_the_context_less_max_new_tokens_is_one_line_with_a_fix(
    module: GRPOLM,
) -> None:
    module.max_new_tokens = module.config.block_size  # prompt + this overflows
    problem = launch_problem(module, None, _Prompts())
    assert problem is not None and "prompt 7 of data/prompts is 200 tokens" in problem
    fix = int(problem.split("set max_new_tokens: ")[1].split(" ")[0])
    module.max_new_tokens = fix  # the fix works
    assert launch_problem(module, None, _Prompts()) is None
