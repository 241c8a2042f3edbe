"""TRL 1.16's GRPO loss, the independent reference of plugintrain's (issue 48).

:func:`trl_grpo_step` runs given completions through ``GRPOTrainer._compute_loss`` (the
loss of a training step once the completions are sampled and scored) on CPU in float32,
then ``loss.backward()``. The completions, their advantages and the log-probs they were
sampled with (``old_per_token_logps``) go in as TRL's own ``_generate_and_score_completions``
hands them to the loss, so no generation, reward function or tokenizer plays a part (the
tokenizer the trainer requires is the word-level stand-in of
``tests/reference/trl_preference.py``). Prompts are of one length: TRL left-pads prompts,
and a Hugging Face Llama numbers positions from the first pad, not the first token.
"""

from __future__ import annotations

from typing import Any

import torch

from reference.trl_preference import _COMMON_ARGS, _id_tokenizer


def grpo_trainer(
    hf_dir: str,
    out: str,
    group_size: int,
    rows: int,
    *,
    epsilon: float,
    epsilon_high: float | None,
    temperature: float,
    max_completion_length: int,
    dtype: torch.dtype = torch.float32,
) -> Any:
    """A ``GRPOTrainer`` on the model in ``hf_dir`` (read in ``dtype``), built once for
    several :func:`trl_grpo_step` calls (its loss type and beta are set at each).

    Args:
        hf_dir: A folder ``transformers`` loads.
        out: The trainer's output folder (nothing is written there).
        group_size: ``num_generations``.
        rows: Completions a step (the per-device batch).
        epsilon, epsilon_high, temperature, max_completion_length: ``GRPOConfig``'s.
        dtype: The dtype the model is loaded in.
    """
    import transformers
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer

    model = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=dtype)
    common = {**_COMMON_ARGS, "per_device_train_batch_size": rows}
    args = GRPOConfig(
        **common, output_dir=out, loss_type="grpo", beta=0.0, epsilon=epsilon,
        epsilon_high=epsilon_high, temperature=temperature, num_generations=group_size,
        max_completion_length=max_completion_length,
    )  # fmt: skip
    trainer = GRPOTrainer(
        model=model,
        reward_funcs=[_no_reward],
        args=args,
        train_dataset=Dataset.from_list([{"prompt": "t1 t2"}] * rows),
        processing_class=_id_tokenizer(model.config),
    )
    trainer.current_gradient_accumulation_steps = 1
    return trainer


def trl_grpo_step(
    trainer: Any, groups: list[dict[str, torch.Tensor]], loss_type: str, beta: float
) -> dict[str, Any]:
    """One step's loss of ``groups`` through ``trainer`` (:func:`grpo_trainer`) with
    ``loss_type`` and ``beta``, and the gradient of every weight.

    Args:
        trainer: The trainer.
        groups: Each ``{"prompt": (P,), "completions": (G, C), "mask": (G, C),
            "old_logps": (G, C), "advantages": (G,), "ref_logps": (G, C)}``; every prompt of
            one length ``P``.
        loss_type: TRL's ``loss_type`` (``grpo``, ``bnpo``, ``dr_grpo``, ``dapo``).
        beta: The KL term's weight (the reference's log-probs are the groups' ``ref_logps``).

    Returns:
        ``loss`` (float) and ``grads`` (Hugging Face parameter name -> gradient).
    """
    trainer.loss_type, trainer.beta = loss_type, beta
    model = trainer.model.train()
    model.zero_grad(set_to_none=True)
    loss = trainer._compute_loss(model, _inputs(groups, beta))
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return {"loss": loss.item(), "grads": grads}


def _no_reward(prompts: list, completions: list, **kwargs: Any) -> list[float]:
    return [0.0] * len(completions)


def _inputs(groups: list[dict[str, torch.Tensor]], beta: float) -> dict[str, torch.Tensor]:
    """What ``_generate_and_score_completions`` gives ``_compute_loss``."""
    prompts = torch.cat([g["prompt"][None].expand(len(g["completions"]), -1) for g in groups])
    mask = torch.cat([g["mask"] for g in groups]).long()
    inputs = {
        "prompt_ids": prompts,
        "prompt_mask": torch.ones_like(prompts),
        "completion_ids": torch.cat([g["completions"] for g in groups]),
        "completion_mask": mask,
        "advantages": torch.cat([g["advantages"] for g in groups]),
        "old_per_token_logps": torch.cat([g["old_logps"] for g in groups]),
        "num_items_in_batch": mask.sum(),
    }
    if beta != 0.0:
        inputs["ref_per_token_logps"] = torch.cat([g["ref_logps"] for g in groups])
    return inputs
