"""The TRL reference harness (``tests/reference/trl_preference.py``) against plain PyTorch.

On a tiny random Llama and four hand-made pairs, each objective's loss, per-pair rewards
and log-probs and every gradient the harness reads from TRL equal the paper formulas
computed here from ``transformers`` logits, one unpadded sequence at a time (so TRL adds no
BOS/EOS to the given ids and its padding changes nothing); under LoRA the reference is the
base with peft's adapters disabled; and ``trl_train``'s losses equal a plain AdamW loop at
the optimizer settings the harness states.
"""

from __future__ import annotations

from pathlib import Path

import peft
import pytest
import torch
import torch.nn.functional as F
import transformers
from reference.trl_preference import trl_step, trl_train

from _hf_models import random_hf_llama

BETA = 0.1
PAIRS = [
    {"prompt_ids": [5, 6, 7], "chosen_ids": [8, 9, 3], "rejected_ids": [10]},
    {"prompt_ids": [11, 12], "chosen_ids": [13], "rejected_ids": [14, 15, 16, 17]},
    {"prompt_ids": [20, 21, 22, 23], "chosen_ids": [24, 25], "rejected_ids": [26, 27]},
    {"prompt_ids": [30], "chosen_ids": [31, 32, 33, 34, 35], "rejected_ids": [36, 37, 38]},
]
REF = ([-9.0, -5.0, -7.5, -24.0], [-4.0, -21.0, -6.0, -15.0])
LORA = {"r": 4, "alpha": 8, "dropout": 0.0, "target_modules": ["q_proj", "v_proj", "down_proj"]}


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return random_hf_llama(tmp_path_factory.mktemp("tiny"), vocab=128, hidden=32, intermediate=64)


def _fresh(hf_dir: Path) -> transformers.PreTrainedModel:
    return transformers.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)


def _token_logps(model: torch.nn.Module, prompt: list[int], answer: list[int]) -> torch.Tensor:
    """log p of each token of ``prompt + answer`` after the first, from one unpadded row."""
    ids = torch.tensor([prompt + answer])
    return model(ids).logits[0, :-1].log_softmax(-1).gather(-1, ids[0, 1:, None])[:, 0]


def _answers(model: torch.nn.Module, side: str, pairs: list[dict] = PAIRS) -> list[torch.Tensor]:
    """Per pair, log p of each token of the ``side`` answer."""
    return [
        _token_logps(model, p["prompt_ids"], p[f"{side}_ids"])[len(p["prompt_ids"]) - 1 :]
        for p in pairs
    ]


def _dpo_family(model, ref, *, ipo=False, smoothing=0.0, sft=0.0) -> dict[str, torch.Tensor]:
    """DPO (Rafailov et al. 2023) on answer sums; conservative DPO's smoothing; IPO (Azar et
    al. 2023, eq. 17) on per-token averages, as TRL normalizes it; and the SFT term: the
    mean over every chosen answer token of the batch."""
    chosen, rejected = _answers(model, "chosen"), _answers(model, "rejected")
    logp_c, logp_r = (
        torch.stack([x.sum() for x in chosen]),
        torch.stack([x.sum() for x in rejected]),
    )
    ratio_c, ratio_r = logp_c - torch.tensor(ref[0]), logp_r - torch.tensor(ref[1])
    if ipo:
        n_c, n_r = torch.tensor([len(x) for x in chosen]), torch.tensor([len(x) for x in rejected])
        losses = (ratio_c / n_c - ratio_r / n_r - 1 / (2 * BETA)) ** 2
    else:
        h = BETA * (ratio_c - ratio_r)
        losses = -(1 - smoothing) * F.logsigmoid(h) - smoothing * F.logsigmoid(-h)
    loss = losses.mean() - sft * torch.cat(chosen).mean()
    return {"loss": loss, "chosen_rewards": BETA * ratio_c, "rejected_rewards": BETA * ratio_r,
            "chosen_logps": logp_c, "rejected_logps": logp_r}  # fmt: skip


def _average_logps(model: torch.nn.Module) -> tuple[torch.Tensor, torch.Tensor]:
    chosen, rejected = _answers(model, "chosen"), _answers(model, "rejected")
    return torch.stack([x.mean() for x in chosen]), torch.stack([x.mean() for x in rejected])


def _simpo(model: torch.nn.Module, gamma: float) -> dict[str, torch.Tensor]:
    """SimPO (Meng et al. 2024, eq. 6): per-token average log-probs, margin gamma."""
    avg_c, avg_r = _average_logps(model)
    loss = -F.logsigmoid(BETA * (avg_c - avg_r) - gamma).mean()
    return {"loss": loss, "chosen_rewards": BETA * avg_c, "rejected_rewards": BETA * avg_r,
            "chosen_logps": avg_c, "rejected_logps": avg_r}  # fmt: skip


def _orpo(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """ORPO (Hong et al. 2024, eqs. 4-7) with beta as lambda: the log odds ratio of the
    average answer log-probs; TRL's NLL is the mean over every token of prompt + chosen
    after the first, across the batch."""
    avg_c, avg_r = _average_logps(model)
    log_odds = (avg_c - avg_r) - (torch.log1p(-avg_c.exp()) - torch.log1p(-avg_r.exp()))
    nll = -torch.cat([_token_logps(model, p["prompt_ids"], p["chosen_ids"]) for p in PAIRS]).mean()
    loss = nll - BETA * F.logsigmoid(log_odds).mean()
    return {"loss": loss, "chosen_rewards": BETA * avg_c, "rejected_rewards": BETA * avg_r,
            "chosen_logps": avg_c, "rejected_logps": avg_r}  # fmt: skip


CASES = {
    "sigmoid": (("sigmoid", {"ref_logps": REF}), lambda m: _dpo_family(m, REF)),
    "cdpo": (("sigmoid", {"ref_logps": REF, "label_smoothing": 0.2}),
             lambda m: _dpo_family(m, REF, smoothing=0.2)),
    "ipo": (("ipo", {"ref_logps": REF}), lambda m: _dpo_family(m, REF, ipo=True)),
    "sigmoid_sft": (("sigmoid_sft", {"ref_logps": REF, "sft_weight": 0.5}),
                    lambda m: _dpo_family(m, REF, sft=0.5)),
    "simpo": (("simpo", {"simpo_gamma": 0.7}), lambda m: _simpo(m, 0.7)),
    "orpo": (("orpo", {}), _orpo),
}  # fmt: skip


def _assert_equal(theirs: dict, expected: dict[str, torch.Tensor], grads: dict) -> None:
    assert theirs["loss"] == pytest.approx(expected["loss"].item(), rel=1e-6, abs=1e-6)
    for key in ("chosen_rewards", "rejected_rewards", "chosen_logps", "rejected_logps"):
        torch.testing.assert_close(theirs[key], expected[key].detach(), rtol=1e-6, atol=1e-6)
    assert theirs["grads"].keys() == grads.keys()
    for name, grad in grads.items():
        # float32 sums in another order: within 1e-6 of the tensor's largest entry
        scale = grad.abs().max().item()
        torch.testing.assert_close(theirs["grads"][name], grad, rtol=1e-5, atol=1e-6 * scale)


@pytest.mark.parametrize("case", CASES)
def test_full_fine_tuning_step_equals_the_formulas(hf_dir: Path, case: str) -> None:
    (objective, options), formula = CASES[case]
    theirs = trl_step(str(hf_dir), PAIRS, objective, BETA, **options)
    model = _fresh(hf_dir)
    expected = formula(model)
    expected["loss"].backward()
    _assert_equal(theirs, expected, {n: p.grad for n, p in model.named_parameters()})


def _lora_model(hf_dir: Path) -> tuple[peft.PeftModel, dict[str, torch.Tensor]]:
    """A peft LoRA model of ``LORA`` with random nonzero A and B, and those weights."""
    config = peft.LoraConfig(
        r=LORA["r"], lora_alpha=LORA["alpha"], target_modules=LORA["target_modules"],
        task_type="CAUSAL_LM",
    )  # fmt: skip
    model = peft.get_peft_model(_fresh(hf_dir), config)
    gen = torch.Generator().manual_seed(3)
    state = {k: torch.randn(v.shape, generator=gen) * 0.3
             for k, v in peft.get_peft_model_state_dict(model).items()}  # fmt: skip
    peft.set_peft_model_state_dict(model, state)
    return model, state


def _disabled_adapter_sums(model: peft.PeftModel, pairs: list[dict]) -> tuple[list, list]:
    """Per pair, the answers' log-probs under the base: the reference under LoRA."""
    with torch.no_grad(), model.disable_adapter():
        return tuple(
            [x.sum().item() for x in _answers(model, s, pairs)] for s in ("chosen", "rejected")
        )


def test_lora_step_uses_the_base_with_adapters_disabled(hf_dir: Path) -> None:
    theirs = trl_step(
        str(hf_dir), PAIRS, "sigmoid", BETA, lora=LORA, lora_state=_lora_model(hf_dir)[1]
    )
    model, state = _lora_model(hf_dir)
    expected = _dpo_family(model, _disabled_adapter_sums(model, PAIRS))
    expected["loss"].backward()
    grads = {n.replace(".default.", "."): p.grad for n, p in model.named_parameters()
             if p.requires_grad}  # fmt: skip
    assert grads.keys() == state.keys()
    _assert_equal(theirs, expected, grads)


def test_lora_training_equals_a_plain_adamw_loop(hf_dir: Path) -> None:
    steps, lr, batch = 5, 2e-2, 2
    theirs = trl_train(
        str(hf_dir), PAIRS, "sigmoid", BETA, steps, lr, LORA, _lora_model(hf_dir)[1], batch
    )
    model, _ = _lora_model(hf_dir)
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=lr, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0)
    losses = []
    for step in range(steps):
        start = step * batch % len(PAIRS)  # the pairs in order, cycled
        pairs = PAIRS[start : start + batch]
        ref = _disabled_adapter_sums(model, pairs)
        chosen = torch.stack([x.sum() for x in _answers(model, "chosen", pairs)])
        rejected = torch.stack([x.sum() for x in _answers(model, "rejected", pairs)])
        h = BETA * ((chosen - torch.tensor(ref[0])) - (rejected - torch.tensor(ref[1])))
        loss = -F.logsigmoid(h).mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    assert losses[-1] < losses[0]  # it learns, so equal losses say the updates are equal
    assert theirs == pytest.approx(losses, rel=1e-5)
