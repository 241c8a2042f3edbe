"""Reinforcement learning's parts (issue 48), each against an independent reference:
group advantages against per-group arithmetic in Python; the log-probs a rollout records
against the training forward's; the shipped rewards on hand-checked cases; bad options,
bad rewards and long prompts refused in one line naming the value and a fix that works.
"""

from __future__ import annotations

import json
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
from plugintrain.model_zoo.generation import left_pad, sample_with_logps
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


@pytest.mark.parametrize(
    "config", ["llama3-debug", "gpt2-debug", "qwen3-debug", "deepseek-v3-debug"]
)
def test_prompts_of_several_lengths_sample_together_what_each_samples_alone(config: str) -> None:
    """Left-padded prompts in one KV-cache batch, each prefilled once and decoded as its
    group's rows (RoPE, learned positions, qk-norm, latent attention and MoE), draw each
    group's tokens as that prompt alone, repeated and with its generator, does, at its
    log-probs; the training forward over right-padded rows of mixed prompt
    lengths gives each row its log-probs alone."""
    torch.manual_seed(0)
    lm = GRPOLM(config=config, rewards=[ExactMatch()], temperature=0.9).eval()
    lm.configure_model()
    lm.init_weights()
    lm.eval()
    vocab, group = lm.config.vocab_size, 3
    draw = torch.Generator().manual_seed(4)
    prompts = [torch.randint(0, vocab, (n,), generator=draw) for n in (5, 12, 9)]
    seeds = [11, 12, 13]
    idx, pads = left_pad(prompts)
    assert pads.tolist() == [7, 0, 3]
    together = sample_with_logps(
        lm.model, idx, 10, 0.9, None, 0.95, (), None,
        [torch.Generator().manual_seed(s) for s in seeds], pads, copies=group,
    )  # fmt: skip
    for i, (prompt, seed) in enumerate(zip(prompts, seeds, strict=True)):
        alone = sample_with_logps(
            lm.model, prompt[None].expand(group, -1), 10, 0.9, None, 0.95, (), None,
            torch.Generator().manual_seed(seed),
        )  # fmt: skip
        rows = slice(i * group, (i + 1) * group)
        assert torch.equal(together[0][rows], alone[0])
        torch.testing.assert_close(together[1][rows], alone[1], rtol=0, atol=1e-5)
    with torch.no_grad():
        rows_prompts = [p for p in prompts for _ in range(group)]
        batched = lm.completion_logps(rows_prompts, together[0])[0]
        for i, prompt in enumerate(prompts):
            rows = slice(i * group, (i + 1) * group)
            alone = lm.completion_logps(prompt, together[0][rows])[0]
            torch.testing.assert_close(batched[rows], alone, rtol=0, atol=1e-5)
    torch.testing.assert_close(batched, together[1], rtol=0, atol=1e-3)


@pytest.mark.parametrize("config", ["llama3-debug", "gpt2-debug", "deepseek-v3-debug"])
def test_prompts_run_once_in_the_update_give_every_row_s_own_run(config: str) -> None:
    """The update's forward with each prompt run once (a KV cache repeated for its group)
    gives the log-probs and every weight's gradient of the plain forward in which each row
    runs its own prompt (prompts of three lengths, left-padded in the cache), within float32
    rounding: 1e-5 of the whole gradient's norm, 1e-4 of each weight's."""
    torch.manual_seed(0)
    lm = GRPOLM(config=config, rewards=[ExactMatch()], temperature=0.9)
    lm.configure_model()
    lm.init_weights()
    lm.train()
    vocab, group = lm.config.vocab_size, 3
    draw = torch.Generator().manual_seed(6)
    prompts = [torch.randint(0, vocab, (n,), generator=draw) for n in (5, 12, 9)]
    tokens = torch.randint(0, vocab, (3 * group, 7), generator=draw)
    weights = torch.randn(tokens.shape, generator=draw)
    results = []
    for share in (True, False):
        lm.share_prompts = share
        lm.zero_grad(set_to_none=True)
        logps = lm.completion_logps(prompts, tokens)[0]
        (logps * weights).sum().backward()
        grads = {n: p.grad.clone() for n, p in lm.named_parameters() if p.grad is not None}
        results.append((logps.detach(), grads))
    (shared, shared_grads), (plain, plain_grads) = results
    torch.testing.assert_close(shared, plain, rtol=0, atol=1e-5)
    assert shared_grads.keys() == plain_grads.keys() and len(plain_grads) > 0
    whole = torch.cat([g.flatten() for g in plain_grads.values()]).norm()
    error = torch.cat([(shared_grads[n] - g).flatten() for n, g in plain_grads.items()]).norm()
    assert error <= 1e-5 * whole, f"whole gradient: relative error {error / whole:.1e}"
    for name, grad in plain_grads.items():  # a bias whose gradient is 0 but for rounding
        error = (shared_grads[name] - grad).norm()
        assert error <= 1e-4 * grad.norm() + 1e-7 * whole, f"{name}: error {error:.1e}"


def test_the_rollout_sampler_draws_the_truncated_distribution() -> None:
    """Inverse-CDF draws after top-k and top-p truncation, counted over many rows, against
    the truncated distribution computed here in plain Python (4.5 standard errors)."""
    from plugintrain.model_zoo.generation import _draw

    logits = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0, -3.0])
    probs = [math.exp(x) for x in logits.tolist()]
    for top_k, top_p in [(None, 1.0), (4, 1.0), (None, 0.8), (5, 0.9)]:
        kept = list(range(len(probs) if top_k is None else top_k))
        mass, nucleus = sum(probs[i] for i in kept), []
        for i in kept:  # most likely first, while the mass above is below top_p
            if sum(probs[j] for j in nucleus) / mass < top_p:
                nucleus.append(i)
        expected = [probs[i] / sum(probs[j] for j in nucleus) if i in nucleus else 0.0
                    for i in range(len(probs))]  # fmt: skip
        rows = 200_000
        drawn = _draw(logits.expand(rows, -1), top_k, top_p, torch.Generator().manual_seed(5))
        counts = torch.bincount(drawn.flatten(), minlength=len(probs)).tolist()
        for count, p in zip(counts, expected, strict=True):
            assert abs(count / rows - p) <= 4.5 * math.sqrt(p * (1 - p) / rows), (top_k, top_p)
    for bad in (float("nan"), float("-inf")):  # an error, not an id past the vocabulary
        with pytest.raises(FloatingPointError, match="NaN or all zero"):
            _draw(torch.full((2, 6), bad), 1, 1.0, None)


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


def test_the_year_task_asks_the_iso_task_s_dates_for_their_year(tmp_path: Path, capsys) -> None:
    """``prepare dates --task year`` (the RL demo's data) asks about the same dates, written
    the same ways, as the ISO task, and answers each with the ISO date's year; a task it
    does not know, or one with ``--preference``, is one line."""
    from plugintrain.cli import main

    iso, year = tmp_path / "iso.jsonl", tmp_path / "year.jsonl"
    assert main(["prepare", "dates", "--count", "50", "--out", str(iso)]) == 0
    assert main(["prepare", "dates", "--count", "50", "--task", "year", "--out", str(year)]) == 0
    iso_rows = [json.loads(line)["messages"] for line in iso.open()]
    year_rows = [json.loads(line)["messages"] for line in year.open()]
    prefix = "Write this date in ISO 8601 format (YYYY-MM-DD), and nothing else: "
    for (iso_q, iso_a), (year_q, year_a) in zip(iso_rows, year_rows, strict=True):
        written = iso_q["content"].removeprefix(prefix)
        assert (
            year_q["content"]
            == f"Which year is this date in: {written}? Answer with the year only."
        )
        assert year_a["content"] == iso_a["content"][:4]
    capsys.readouterr()
    assert main(["prepare", "dates", "--task", "month", "--out", str(year)]) == 2
    assert (
        capsys.readouterr()
        .err.strip()
        .splitlines()[-1]
        .endswith("--task month: choose iso (the date in ISO 8601) or year")
    )
    assert main(["prepare", "dates", "--task", "year", "--preference"]) == 2
    assert len(year.read_text().splitlines()) == 50  # nothing written over
