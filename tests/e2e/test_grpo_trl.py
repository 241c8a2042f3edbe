"""plugintrain's GRPO loss equals TRL 1.16's GRPOTrainer loss, on SmolLM2-135M.

TRL (driven by ``tests/reference/trl_grpo.py``) loads plugintrain's Hugging Face export of
SmolLM2-135M-Instruct with ``transformers``; :class:`~plugintrain.model_zoo.GRPOLM` reads the
same folder. Both score the same completions of two prompts (4 each, of lengths 1 to 8,
some ending at the stop token) with the same advantages and the same sampling log-probs,
set apart from the policy's so the ratio is not 1 and both clips act. For each loss type
TRL has of the family (``grpo``, ``bnpo``, ``dr_grpo``, ``dapo``), with and without the KL
term, the loss and the gradient of every weight equal TRL's within 1e-4 relative (the
gradient as one vector; each weight's within 3e-4).

Both sides run in float64. Advantages of both signs make the loss a small difference of
larger terms (0.024 here, from terms near 1), which float32 rounding moves by more than
1e-4 relative on either side: against the float64 loss, plugintrain's float32 one is off
by 7.8e-5 relative and TRL's by 2.4e-5 (TRL's log-probs come from a chunked log-sum-exp
in float32 even in a float64 model, ``trl/kernels/chunked_logprob.py``).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from reference.trl_grpo import grpo_trainer, trl_grpo_step

from plugintrain.core.rewards import ExactMatch
from plugintrain.model_zoo.llama3 import hf_names
from plugintrain.model_zoo.rl import GRPOLM, Group

RTOL = 1e-4
GROUP, LENGTH = 4, 8
TEMPERATURE, EPSILON, EPSILON_HIGH = 0.7, 0.2, 0.28
PROMPTS = ["Write 5 March 2021 as an ISO 8601 date:", "What is the capital of France? Say"]


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from plugintrain.cli import main

    out = tmp_path_factory.mktemp("smollm2") / "hf"
    assert main(["convert", "smollm2-135m", str(out), "--format", "hf"]) == 0
    return out


def _module(hf_dir: Path, loss_type: str, beta: float) -> GRPOLM:
    module = GRPOLM(
        weights=str(hf_dir), rewards=[ExactMatch()], num_generations=GROUP,
        max_new_tokens=LENGTH, temperature=TEMPERATURE, loss_type=loss_type,
        epsilon=EPSILON, epsilon_high=EPSILON_HIGH, beta=beta,
    )  # fmt: skip
    module.configure_model()
    module.init_weights()
    return module.double().train()


@pytest.fixture(scope="module")
def groups(module: GRPOLM) -> list[dict[str, torch.Tensor]]:
    """Two prompts of one length, 4 completions each: random ids, lengths 1-8 (the shorter
    ones ending at the stop token, 2), sampling log-probs the policy's plus noise, the
    reference's the policy's plus other noise, advantages of both signs."""
    from plugintrain.data import get_tokenizer

    tokenizer = get_tokenizer("smollm2-135m")
    encoded = [tokenizer.encode(p) for p in PROMPTS]
    length = min(len(e) for e in encoded)
    generator = torch.Generator().manual_seed(0)
    made = []
    for ids in encoded:
        prompt = torch.tensor(ids[:length])
        completions = torch.randint(3, 40000, (GROUP, LENGTH), generator=generator)
        lengths = torch.tensor([LENGTH, 5, 3, 1])
        mask = (torch.arange(LENGTH)[None] < lengths[:, None]).double()
        for row, n in enumerate(lengths.tolist()):
            if n < LENGTH:
                completions[row, n - 1] = 2  # ends at <|im_end|>
                completions[row, n:] = 2  # then padding, as the rollout repeats it
        with torch.no_grad():
            logps = module.completion_logps(prompt, completions)[0]
        noise = torch.randn(GROUP, LENGTH, generator=generator, dtype=torch.float64)
        made.append(
            {
                "prompt": prompt, "completions": completions, "mask": mask,
                "old_logps": logps + 0.3 * noise,
                "ref_logps": logps + 0.5 * torch.randn(noise.shape, generator=generator).double(),
                "advantages": torch.tensor([1.2, -0.7, 0.4, -0.9], dtype=torch.float64),
            }
        )  # fmt: skip
    return made


@pytest.fixture(scope="module")
def trainer(hf_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> object:
    """TRL's trainer, built once (loss type and beta set at each step)."""
    return grpo_trainer(
        str(hf_dir), str(tmp_path_factory.mktemp("trl")), GROUP, GROUP * len(PROMPTS),
        epsilon=EPSILON, epsilon_high=EPSILON_HIGH, temperature=TEMPERATURE,
        max_completion_length=LENGTH, dtype=torch.float64,
    )  # fmt: skip


@pytest.fixture(scope="module")
def module(hf_dir: Path) -> GRPOLM:
    """Ours, built once (loss type and beta set at each step)."""
    return _module(hf_dir, "grpo", 0.0)


def _ours(module: GRPOLM, groups: list[dict[str, torch.Tensor]]) -> float:
    rollout = [
        Group(
            g["prompt"],
            g["completions"],
            g["old_logps"],
            g["mask"],
            g["advantages"],
            torch.zeros(GROUP, 1),
        )
        for g in groups
    ]
    references = torch.cat([g["ref_logps"] for g in groups])
    module.reference_logps = lambda prompts, tokens: references  # the data's, as TRL's input
    module.zero_grad(set_to_none=True)
    loss, _, _ = module.policy_loss(rollout)
    loss.backward()
    return loss.item()


def _close(ours: torch.Tensor, theirs: torch.Tensor, what: str, rtol: float = RTOL) -> None:
    ours, theirs = ours.double(), theirs.double()
    error = (ours - theirs).norm() / theirs.norm().clamp(min=1e-30)
    assert error <= rtol, f"{what}: relative error {error:.2e}"


@pytest.mark.parametrize("beta", [0.0, 0.04])
@pytest.mark.parametrize("loss_type", ["grpo", "bnpo", "dr_grpo", "dapo"])
def test_loss_and_gradients_equal_trl(
    module: GRPOLM,
    trainer: object,
    groups: list[dict[str, torch.Tensor]],
    loss_type: str,
    beta: float,
) -> None:
    module.policy.loss_type, module.policy.beta = loss_type, beta
    ours = _ours(module, groups)
    theirs = trl_grpo_step(trainer, groups, loss_type, beta)
    assert ours == pytest.approx(theirs["loss"], rel=RTOL)
    hf = hf_names(module.config)
    grads = {
        n: (p.grad, hf[n.removeprefix("model.")])
        for n, p in module.named_parameters()
        if p.requires_grad
    }
    assert set(theirs["grads"]) == {name for _, name in grads.values()}
    pairs = [(grad, theirs["grads"][name]) for grad, name in grads.values()]
    _close(
        *[torch.cat([g.flatten() for g in side]) for side in zip(*pairs, strict=True)],
        "the gradient",
    )
    for ours_name, (grad, theirs_name) in grads.items():
        _close(grad, theirs["grads"][theirs_name], ours_name, rtol=3 * RTOL)
