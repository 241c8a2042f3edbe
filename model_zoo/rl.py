"""Reinforcement learning with verifiable rewards: GRPO, Dr. GRPO and RLOO as a
:class:`~plugintrain.model_zoo.CausalLM` objective (:class:`GRPOLM`).

Each training step takes a batch of prompts (``PromptDataModule``), samples
``num_generations`` (G) completions of each with the model's own KV-cache generation in the
same process (:func:`~plugintrain.model_zoo.generation.sample_with_logps`, recording each
token's log-probability as it is drawn), scores them with the reward functions
(:mod:`plugintrain.core.rewards`), turns the rewards into advantages within each prompt's
group, and updates the policy on the clipped ratio of its log-probs to the sampled ones.
A group never leaves its rank: each data-parallel rank samples and scores its own prompts,
so the advantages are computed before anything is split.

Advantages (``advantage``), over a group's rewards ``r``:

- ``grpo``: ``(r - mean(r)) / (std(r) + 1e-4)`` (Shao et al., 2024; the std Bessel-corrected,
  as TRL computes it);
- ``dr_grpo``: ``r - mean(r)``, no division by the std (Liu et al., 2025);
- ``rloo``: ``r_i - mean of the others' r`` (Ahmadian et al., 2024), needs G >= 2.

Loss, with ``ratio = exp(logp - logp_sampled)`` per completion token and ``A`` its
completion's advantage: ``-min(ratio A, clip(ratio, 1 - epsilon, 1 + epsilon_high) A) +
beta KL``, where ``KL = exp(ref - logp) - (ref - logp) - 1`` (times the ratio with
``kl_ratio``, TRL's default) to the reference (the base
with its adapters off under LoRA/QLoRA; a frozen copy otherwise is not kept: ``beta`` > 0
needs adapters). Normalized (``loss_type``) as TRL 1.16's GRPOTrainer does:

- ``grpo``: each completion's mean over its tokens, then the mean over completions;
- ``bnpo``: the sum over the batch's completion tokens over their count;
- ``dr_grpo``: the sum over tokens over ``completions x max_new_tokens`` (no length bias);
- ``dapo``: the sum over tokens over the completion tokens of every data-parallel rank's
  batch (all-reduced), times the ranks, so the ranks' averaged gradient is the whole
  batch's token mean.

``mu`` > 1 reuses a rollout for ``mu`` optimizer steps (each a new batch of the data
loader's that is not sampled from: the sampled log-probs stay those of the rollout, so the
ratio moves away from 1 and clipping applies). Each equals TRL's loss and gradients on the
same completions (tests/e2e/test_grpo_trl.py).
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from lightning.pytorch.cli import OptimizerCallable
from torch import Tensor

from plugintrain.core.rewards import reward_name, score
from plugintrain.model_zoo.config import TransformerConfig
from plugintrain.model_zoo.generation import left_pad, sample_with_logps
from plugintrain.model_zoo.lm import CausalLM
from plugintrain.model_zoo.lora import lora_callback

ADVANTAGES = ("grpo", "dr_grpo", "rloo")
"""How :class:`GRPOLM` turns a group's rewards into advantages."""
LOSS_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo")
"""How :class:`GRPOLM` normalizes the per-token loss (TRL's ``loss_type`` names)."""
STD_EPSILON = 1e-4
"""Added to a group's reward std before dividing (TRL's)."""
_SEED_BASE = 1_000_003
"""Spaces the rollout seeds of successive steps (more examples than this per epoch would
share seeds across steps, harmlessly)."""


def group_advantages(rewards: Tensor, group_size: int, kind: str) -> Tensor:
    """Advantages of ``rewards`` ``(N,)``, consecutive groups of ``group_size`` completions
    of one prompt each, by ``kind`` (:data:`ADVANTAGES`)."""
    grouped = rewards.view(-1, group_size).double()
    if kind == "rloo":
        others = (grouped.sum(dim=1, keepdim=True) - grouped) / (group_size - 1)
        return (grouped - others).flatten().to(rewards.dtype)
    advantages = grouped - grouped.mean(dim=1, keepdim=True)
    if kind == "grpo":
        advantages = advantages / (grouped.std(dim=1, keepdim=True) + STD_EPSILON)
    return advantages.flatten().to(rewards.dtype)


@dataclass
class ClippedPolicyLoss:
    """The clipped policy-ratio loss of GRPO and its family (see the module docstring).

    Args:
        loss_type: One of :data:`LOSS_TYPES`.
        epsilon: The ratio's lower clip, ``1 - epsilon``.
        epsilon_high: The upper clip, ``1 + epsilon_high`` (DAPO's clip-higher); None:
            ``epsilon``.
        beta: The KL term's weight.
        max_new_tokens: ``dr_grpo``'s constant length.
        kl_ratio: Weigh each token's KL by its ratio (DeepSeek-V3.2's unbiased reverse-KL
            gradient; TRL's ``use_bias_correction_kl``, on by default there too).
    """

    loss_type: str = "grpo"
    epsilon: float = 0.2
    epsilon_high: float | None = None
    beta: float = 0.0
    max_new_tokens: int = 64
    kl_ratio: bool = True

    def per_token(
        self, logps: Tensor, old_logps: Tensor, advantages: Tensor, ref_logps: Tensor | None
    ) -> tuple[Tensor, dict[str, Tensor]]:
        """The loss of each completion token ``(N, n)`` and its parts (``ratio``, ``kl``,
        the clipped regions), before masking and normalization."""
        ratio = torch.exp(logps - old_logps)
        high = self.epsilon if self.epsilon_high is None else self.epsilon_high
        clipped = torch.clamp(ratio, 1 - self.epsilon, 1 + high)
        a = advantages[:, None]
        loss = -torch.min(ratio * a, clipped * a)
        parts = {
            "low": (ratio < 1 - self.epsilon) & (a < 0),
            "high": (ratio > 1 + high) & (a > 0),
        }
        if self.beta != 0.0:
            assert ref_logps is not None
            delta = ref_logps - logps
            kl = torch.exp(delta) - delta - 1
            loss = loss + self.beta * (kl * ratio if self.kl_ratio else kl)
            parts["kl"] = kl
        return loss, parts

    def numerator(self, per_token: Tensor, mask: Tensor) -> Tensor:
        """A group's share of the loss before the step's normalizer (:meth:`denominator`)."""
        masked = per_token * mask
        if self.loss_type == "grpo":
            return (masked.sum(dim=-1) / mask.sum(dim=-1).clamp(min=1.0)).sum()
        return masked.sum()

    def denominator(self, completions: int, tokens: Tensor, all_ranks_tokens: Tensor) -> Tensor:
        """What the step's summed :meth:`numerator` is divided by: ``completions`` of this
        rank, their completion ``tokens``, and ``all_ranks_tokens / ranks`` (``dapo``)."""
        if self.loss_type == "grpo":
            return torch.tensor(float(completions))
        if self.loss_type == "dr_grpo":
            return torch.tensor(float(completions * self.max_new_tokens))
        if self.loss_type == "bnpo":
            return tokens.clamp(min=1.0)
        return all_ranks_tokens.clamp(min=1.0)


@dataclass
class Group:
    """One prompt's sampled completions, as the update needs them."""

    prompt: Tensor  # (T,)
    tokens: Tensor  # (G, n) the drawn tokens
    logps: Tensor  # (G, n) their log-probs when drawn
    mask: Tensor  # (G, n) float: 1 up to and including each completion's stop
    advantages: Tensor  # (G,)
    rewards: Tensor  # (G, R) each reward function's
    texts: list[str] = field(default_factory=list)

    def widened(self, width: int) -> Group:
        """The group with its completions padded to ``width`` tokens (the last token
        repeated, as the rollout pads; log-prob 0 and mask 0 there)."""
        extra = width - self.tokens.size(1)
        if extra == 0:
            return self
        tokens = torch.cat([self.tokens, self.tokens[:, -1:].expand(-1, extra)], dim=1)
        logps, mask = (torch.nn.functional.pad(t, (0, extra)) for t in (self.logps, self.mask))
        return Group(self.prompt, tokens, logps, mask, self.advantages, self.rewards, self.texts)


@dataclass
class GroupScorer:
    """Scores one prompt's sampled completions: their texts as the rewards read them, the
    rewards' weighted sum and the group's advantages (:class:`GRPOLM`'s settings)."""

    rewards: list[Callable[..., float]]
    weights: list[float]
    advantage: str
    stop_ids: set[int]
    decode: Callable[[list[int]], str]
    stop_strings: list[str]

    def group(
        self, prompt: Tensor, fields: dict[str, Any], tokens: Tensor, logps: Tensor, lengths: Tensor
    ) -> Group:
        """The :class:`Group` of ``prompt``'s completions ``tokens`` ``(G, n)``, drawn at
        ``logps``, each ``lengths`` long (through its stop), for the row's ``fields``."""
        steps = torch.arange(tokens.size(1), device=tokens.device)
        mask = (steps[None] < lengths[:, None]).float()
        texts = [
            self.text(row[:n].tolist()) for row, n in zip(tokens, lengths.tolist(), strict=True)
        ]
        table = torch.tensor(score(self.rewards, fields["prompt"], texts, fields))  # (G, R)
        total = (table * torch.tensor(self.weights, dtype=table.dtype)).sum(dim=1)
        advantages = group_advantages(total, tokens.size(0), self.advantage)
        return Group(
            prompt, tokens, logps, mask, advantages.to(tokens.device).float(), table, texts
        )

    def text(self, ids: list[int]) -> str:
        """A completion as the rewards read it: up to its stop token or stop string."""
        text = self.decode([t for t in ids if t not in self.stop_ids])
        for stop in self.stop_strings:
            text = text.split(stop, 1)[0]
        return text

    def stop_string_rows(self, tokens: Tensor) -> Tensor:
        """Which rows of new tokens ``(B, n)`` hold a stop string."""
        found = [any(s in self.decode(row.tolist()) for s in self.stop_strings) for row in tokens]
        return torch.tensor(found, device=tokens.device)


class RolloutSampling:
    """:class:`GRPOLM`'s rollouts: a step's prompts decoded together in one KV-cache batch,
    then scored (its settings and scorer are the module's)."""

    def rollout(self, batch: list[tuple[Tensor, dict[str, Any]]]) -> list[Group]:
        """Sample ``num_generations`` completions of each prompt of ``batch``, score them and
        compute their advantages (no gradients; dropout off). The groups of up to
        ``rollout_batch_size`` prompts decode together, their prompts left-padded."""
        training = self.model.training
        self.model.eval()
        per_call = self.rollout_batch_size or len(batch)
        try:
            groups = []
            for start in range(0, len(batch), per_call):
                groups += self._sample_groups(batch[start : start + per_call])
            # Calls end when their own rows have: one width for the step's update (under
            # FSDP2 each call's width is every rank's, so the ranks' widths agree too).
            width = max(g.tokens.size(1) for g in groups)
            return [g.widened(width) for g in groups]
        finally:
            self.model.train(training)

    def _sample_groups(self, batch: list[tuple[Tensor, dict[str, Any]]]) -> list[Group]:
        G = self.num_generations
        prompts = [ids.to(self.device) for ids, _ in batch]
        idx, pads = left_pad(prompts)  # each prefilled once, then decoded as G rows
        tokens, logps, lengths = sample_with_logps(
            self.model,
            idx,
            self.max_new_tokens,
            self.temperature,
            self.top_k,
            self.top_p,
            self.scorer.stop_ids,
            self.scorer.stop_string_rows if self.stop_strings else None,
            [group_generator(self._seed, self.global_step, f, self.device) for _, f in batch],
            pads,
            copies=G,
            all_done=self._all_ranks_done if self._gathers_weights() else None,
            forward=self,  # through the LightningModule: a strategy's hooks (FSDP2) run
        )
        return [
            self.scorer.group(
                prompt, fields, *(t[i * G : (i + 1) * G] for t in (tokens, logps, lengths))
            )
            for i, (prompt, (_, fields)) in enumerate(zip(prompts, batch, strict=True))
        ]

    def _gathers_weights(self) -> bool:
        """Whether every forward gathers weight shards from the other ranks (FSDP2), so
        that every rank must run as many decode steps as the others."""
        dims = getattr(self._trainer and self.trainer.strategy, "parallel_dims", None)
        return dims is not None and dims.fsdp_enabled and self.trainer.world_size > 1

    def _all_ranks_done(self, done: Tensor) -> bool:
        """Whether every rank's rollout rows have ended (one all-reduce of a flag)."""
        import torch.distributed as dist

        flag = done.to(torch.int32).reshape(1)
        dist.all_reduce(flag, op=dist.ReduceOp.MIN)
        return bool(flag.item())


class GRPOLM(RolloutSampling, CausalLM):
    """A :class:`~plugintrain.model_zoo.CausalLM` trained by reinforcement learning on its
    own samples, scored by reward functions (GRPO, Dr. GRPO, RLOO; module docstring).

    Reads ``PromptDataModule`` batches; LoRA/QLoRA attach as for supervised fine-tuning
    (then ``beta`` > 0 takes the reference from the base, adapters off).

    Args:
        rewards: Reward functions (:mod:`plugintrain.core.rewards`; any callable
            ``(prompt, completion, **fields) -> float``), by ``class_path`` in a recipe.
        reward_weights: Each reward's weight in the sum; None: 1 each.
        num_generations: Completions sampled per prompt (G).
        max_new_tokens: Most tokens per completion.
        temperature: Sampling temperature (> 0); the log-probs are at this temperature.
        top_p: Nucleus sampling's mass (1: off).
        top_k: Sample among the k most likely tokens; None: all.
        stop_strings: Text that ends a completion (left out of the text scored), beside the
            data's stop tokens.
        advantage: One of :data:`ADVANTAGES`.
        loss_type: One of :data:`LOSS_TYPES`.
        epsilon: Lower clip of the ratio (``1 - epsilon``).
        epsilon_high: Upper clip (``1 + epsilon_high``); None: ``epsilon``.
        beta: Weight of the KL term to the reference (0: none, and no reference pass).
        kl_ratio: Weigh each token's KL term by its policy ratio (see
            :class:`ClippedPolicyLoss`).
        mu: Optimizer steps per rollout.
        rollout_batch_size: Most prompts whose groups decode together (``G`` rows each,
            the KV cache's batch); None: the step's whole batch.
        share_prompts: Run each prompt once in the update's forward (its keys and values
            repeated for its group's rows, as the rollout does) instead of once a row:
            about ``G`` times fewer prompt tokens. Off, or where dropout, recomputed blocks
            or compilation apply, each row runs its prompt.

    The other arguments are :class:`~plugintrain.model_zoo.CausalLM`'s, with no weight
    decay and no warmup by default.
    """

    def __init__(
        self,
        config: str | TransformerConfig | None = None,
        optimizer: OptimizerCallable = torch.optim.AdamW,
        weight_decay: float = 0.0,
        warmup_steps: int = 0,
        lr_decay_steps: int | None = None,
        min_lr_ratio: float = 1.0,
        weights: str | None = None,
        rewards: list[Callable[..., float]] | None = None,
        reward_weights: list[float] | None = None,
        num_generations: int = 8,
        max_new_tokens: int = 64,
        temperature: float = 1.0,
        top_p: float = 1.0,
        top_k: int | None = None,
        stop_strings: list[str] | None = None,
        advantage: str = "grpo",
        loss_type: str = "grpo",
        epsilon: float = 0.2,
        epsilon_high: float | None = None,
        beta: float = 0.0,
        kl_ratio: bool = True,
        mu: int = 1,
        rollout_batch_size: int | None = None,
        share_prompts: bool = True,
    ) -> None:
        super().__init__(
            config, optimizer, weight_decay, warmup_steps, lr_decay_steps, min_lr_ratio, weights
        )
        # CausalLM saved every init argument; a checkpoint keeps the rewards by name only
        # (objects would need unpickling to read back).
        self.hparams["rewards"] = [_qualified_name(r) for r in rewards or []]
        self.rewards = list(rewards or [])
        self.reward_weights = list(reward_weights or [1.0] * len(self.rewards))
        self.num_generations, self.max_new_tokens = num_generations, max_new_tokens
        self.temperature, self.top_p, self.top_k = temperature, top_p, top_k
        self.stop_strings = list(stop_strings or [])
        self.advantage, self.mu = advantage, mu
        self.rollout_batch_size, self.share_prompts = rollout_batch_size, share_prompts
        self.policy = ClippedPolicyLoss(
            loss_type, epsilon, epsilon_high, beta, max_new_tokens, kl_ratio
        )
        problem = option_problem(self)
        if problem is not None:
            raise ValueError(problem)
        self._rollout: list[Group] | None = None
        self._uses, self._seed = 0, 0
        self.scorer: GroupScorer | None = None

    # -- setup ---------------------------------------------------------------------------

    def check_launch(self, trainer: Any, datamodule: Any) -> None:
        """What keeps this run from starting, raised in one line before any process is
        launched (``plugintrain fit``) and again at setup: data that holds no prompts, a
        layout whose ranks do not each hold whole weights, a prompt longer than the context
        less ``max_new_tokens``, ``beta`` > 0 without adapters to switch off."""
        problem = launch_problem(self, trainer, datamodule)
        if problem is not None:
            raise ValueError(problem)

    def setup(self, stage: str) -> None:
        """The launch checks (the Python API runs no others); :meth:`use_data`."""
        datamodule = self.trainer.datamodule
        self.check_launch(self.trainer, datamodule)
        self.use_data(datamodule)
        self._seed = int(os.environ.get("PL_GLOBAL_SEED", 0)) * 7919
        super().setup(stage)
        self.loss_mask = False

    def use_data(self, datamodule: Any) -> None:
        """Score completions with the prompts' stop tokens and decoder (a
        ``PromptDataModule``'s ``stop_ids`` and ``decode``)."""
        stops, decode = set(datamodule.stop_ids), datamodule.decode
        self.scorer = GroupScorer(
            self.rewards, self.reward_weights, self.advantage, stops, decode, self.stop_strings
        )

    # -- steps ---------------------------------------------------------------------------

    def training_step(self, batch: list[tuple[Tensor, dict[str, Any]]], batch_idx: int) -> Tensor:
        """Sample and score (every ``mu`` steps), then the clipped policy loss of the
        rollout; logs rewards, accuracy, KL, clipping, lengths, entropy and times."""
        start = time.perf_counter()
        if self._rollout is None or self._uses >= self.mu:
            self._rollout, self._uses = self.rollout(batch), 0
            self.log("train_rollout_seconds", time.perf_counter() - start)
            log_rewards(self, self._rollout)
        self._uses += 1
        update = time.perf_counter()
        loss, batch.samples, batch.tokens = self.policy_loss(self._rollout)
        # The mean over data-parallel ranks (each a share of the step's completions): the
        # loss the whole batch has, as one process computes it.
        self.log("train_loss", loss.detach(), prog_bar=True, sync_dist=True)
        self.log("train_update_forward_seconds", time.perf_counter() - update)
        aux = self.model.take_aux_loss()  # MoE balance losses of the update's forwards
        return loss if aux is None else loss + aux

    def validation_step(self, batch: list[tuple[Tensor, dict[str, Any]]], batch_idx: int) -> None:
        """Logs ``val_reward`` and ``val_accuracy`` of sampled completions of held-out
        prompts (no update)."""
        groups = self.rollout(batch)
        log_rewards(self, groups, stage="val")

    def policy_loss(self, groups: list[Group]) -> tuple[Tensor, int, int]:
        """The step's loss over ``groups`` (normalized by ``loss_type``), the completions it
        trained on and the tokens of their rows (prompt and completion). Every completion
        is scored in one forward (and the reference's in one more)."""
        prompts = [g.prompt for g in groups]
        tokens, old, mask = (
            torch.cat([getattr(g, k) for g in groups]) for k in ("tokens", "logps", "mask")
        )
        advantages = torch.cat([g.advantages for g in groups])
        logps, entropy = self.completion_logps(prompts, tokens, entropy=True)
        ref = self.reference_logps(prompts, tokens) if self.policy.beta != 0.0 else None
        per_token, parts = self.policy.per_token(logps, old, advantages, ref)
        numerator = self.policy.numerator(per_token, mask)
        count = mask.sum()
        completions = tokens.size(0)
        denominator = self.policy.denominator(completions, count, self._all_ranks_tokens(count))
        loss = numerator / denominator.to(numerator.device)
        stats = {
            name: (value.float() * mask).sum().detach() / count.clamp(min=1.0)
            for name, value in {**parts, "entropy": entropy}.items()
        }
        for name, value in stats.items():
            label = {"low": "clip_ratio/low", "high": "clip_ratio/high"}.get(name, name)
            self.log(f"train_{label}", value)
        self.log("train_clip_ratio/region", stats["low"] + stats["high"])
        length = max(p.numel() for p in prompts) + tokens.size(1)
        self.count_flops(torch.empty(completions, length, device="meta"))  # not the rollouts'
        if self._shares_prompts():  # the prompts' tokens run once, the completions' less one
            run = len(prompts) * (length - tokens.size(1)) + completions * (tokens.size(1) - 1)
            self.flops_per_batch *= run / (completions * length)
        return loss, completions, completions * length

    def completion_logps(
        self, prompts: Tensor | list[Tensor], tokens: Tensor, entropy: bool = False
    ) -> tuple[Tensor, Tensor | None]:
        """The policy's log-probs of completion ``tokens`` ``(N, n)`` at the sampling
        temperature ``(N, n)``, and each position's entropy.

        ``prompts``: one ``(T,)`` for all rows, or a list of ``k`` prompts ``(T_i,)``, each
        followed by ``N / k`` consecutive rows (a group each, or one a row). With
        ``share_prompts`` each prompt runs once: the unique prompts, left-padded, fill a KV
        cache that is repeated for their rows, and the completions attend to it
        (:func:`shared_prompt_logits`); otherwise every row runs its prompt, right-padded
        (a causal model reads past the pads; :func:`completion_rows`).
        """
        prompts = [prompts] if isinstance(prompts, Tensor) else list(prompts)
        copies = tokens.size(0) // len(prompts)
        assert copies * len(prompts) == tokens.size(0), "each prompt followed by equal blocks"
        if self._shares_prompts():
            logits = shared_prompt_logits(self, prompts, tokens, copies)
        else:
            x, at = completion_rows([p for p in prompts for _ in range(copies)], tokens)
            logits = self(x)
            logits = logits.gather(1, at[..., None].expand(-1, -1, logits.size(-1)))
        log_probs = torch.log_softmax(logits.float() / self.temperature, dim=-1)  # (N, n, V)
        logps = log_probs.gather(-1, tokens[..., None]).squeeze(-1)
        if not entropy:
            return logps, None
        return logps, -(log_probs.exp() * log_probs).sum(dim=-1).detach()

    def _shares_prompts(self) -> bool:
        """Whether the update runs each prompt once: asked for, and nothing that the KV
        cache's attention would change (dropout, recomputed blocks, a compiled model)."""
        plain = all(
            not hasattr(layer, "_recompute") and getattr(layer, "_compiled_call_impl", None) is None
            for layer in self.model.layers.values()
        )
        return self.share_prompts and plain and (not self.training or self.config.dropout == 0)

    def reference_logps(self, prompts: list[Tensor], tokens: Tensor) -> Tensor:
        """The reference's log-probs of completions (as :meth:`completion_logps`): the
        base, adapters off."""
        from plugintrain.model_zoo.lora import adapters_disabled

        training = self.model.training
        with torch.no_grad(), adapters_disabled(self.model):
            self.model.eval()
            try:
                return self.completion_logps(prompts, tokens)[0]
            finally:
                self.model.train(training)

    def _all_ranks_tokens(self, tokens: Tensor) -> Tensor:
        """``dapo``'s normalizer: the completion tokens of every data-parallel rank's batch
        over the ranks (their mean)."""
        if self.policy.loss_type != "dapo" or self._trainer is None or self.trainer.world_size == 1:
            return tokens
        return self.trainer.strategy.reduce(tokens.float(), reduce_op="mean")


def group_generator(
    seed: int, step: int, fields: dict[str, Any], device: torch.device
) -> torch.Generator:
    """The random numbers of one prompt's group at training ``step``, seeded by the run's
    ``seed``, the example (``fields["index"]``) and the step: the same completions whatever
    rank samples the prompt and whatever else is in its batch (up to floating-point
    rounding, which batched kernels of other shapes may change on a GPU)."""
    generator = torch.Generator(device)
    generator.manual_seed(_SEED_BASE * (step + 1) + int(fields.get("index", 0)) + seed)
    return generator


def shared_prompt_logits(
    module: GRPOLM, prompts: list[Tensor], tokens: Tensor, copies: int
) -> Tensor:
    """The logits ``(N, n, V)`` that predict completion ``tokens`` ``(N, n)``, each prompt
    of ``prompts`` run once for its ``copies`` consecutive rows: the prompts left-padded into
    a KV cache (gradients flow through it), the cache repeated for the rows, then the
    completions (less their last token) run after it. The prompt's last position predicts
    each row's first token."""
    model, n = module.model, tokens.size(1)
    idx, pads = left_pad(prompts)
    width = idx.size(1)
    try:
        model.setup_kv_cache(len(prompts), width + n - 1, pads=pads)
        first = module(idx, torch.arange(width, device=idx.device))[:, -1:]  # (k, 1, V)
        model.repeat_kv_cache(copies)
        first = first.repeat_interleave(copies, dim=0)  # (N, 1, V)
        if n == 1:
            return first
        at = torch.arange(width, width + n - 1, device=idx.device)
        return torch.cat([first, module(tokens[:, :-1], at)], dim=1)
    finally:
        model.clear_kv_cache()


def completion_rows(prompts: Tensor | list[Tensor], tokens: Tensor) -> tuple[Tensor, Tensor]:
    """The model's input for scoring completion ``tokens`` ``(N, n)``, each after its prompt
    (``prompts``: one ``(T_i,)`` a row, or one ``(T,)`` for all): each row's prompt and
    completion less its last token, right-padded (a causal model reads past the pads),
    ``(N, max T_i + n - 1)``; and where each row's predictions of its ``n`` tokens are,
    ``(N, n)``."""
    rows, n = tokens.shape
    if isinstance(prompts, Tensor):
        prompts = [prompts] * rows
    starts = [p.numel() - 1 for p in prompts]  # where each row's first prediction is
    x = tokens.new_zeros(rows, max(starts) + n)
    for row, prompt, completion in zip(x, prompts, tokens, strict=True):
        row[: prompt.numel() + n - 1] = torch.cat([prompt, completion[:-1]])
    at = torch.tensor(starts, device=x.device)[:, None] + torch.arange(n, device=x.device)
    return x, at


def option_problem(module: GRPOLM) -> str | None:
    """The first of ``module``'s options that cannot work, in one line, or None."""
    if not module.rewards:
        return "GRPOLM needs at least one reward: model.init_args.rewards (class_path ...)"
    if len(module.reward_weights) != len(module.rewards):
        return (
            f"reward_weights has {len(module.reward_weights)} weights for"
            f" {len(module.rewards)} rewards; give one weight per reward"
        )
    choices = ", ".join
    g = module.num_generations
    checks = [
        (
            module.advantage in ADVANTAGES,
            f"advantage={module.advantage!r}: use one of {choices(ADVANTAGES)}",
        ),
        (
            module.policy.loss_type in LOSS_TYPES,
            f"loss_type={module.policy.loss_type!r}: use one of {choices(LOSS_TYPES)}",
        ),
        (
            g >= 2,
            f"num_generations={g} with advantage={module.advantage!r}: a group baseline"
            " needs 2 or more completions per prompt; set num_generations: 2 or more",
        ),
        (
            module.temperature > 0,
            f"temperature={module.temperature}: sampling needs a temperature above 0;"
            " e.g. temperature: 1.0",
        ),
        (0 < module.top_p <= 1, f"top_p={module.top_p}: must be in (0, 1]; e.g. top_p: 1.0"),
        (module.max_new_tokens >= 1, f"max_new_tokens={module.max_new_tokens}: must be >= 1"),
        (module.mu >= 1, f"mu={module.mu}: one optimizer step per rollout or more; e.g. mu: 1"),
        (
            module.rollout_batch_size is None or module.rollout_batch_size >= 1,
            f"rollout_batch_size={module.rollout_batch_size}: at least 1 prompt, or null for"
            " the whole batch",
        ),
        (
            module.policy.epsilon >= 0,
            f"epsilon={module.policy.epsilon}: must be 0 or more; e.g. epsilon: 0.2",
        ),
    ]
    return next((message for ok, message in checks if not ok), None)


def log_rewards(module: GRPOLM, groups: list[Group], stage: str = "train") -> None:
    """Log the rewards of ``groups``: their weighted sum's mean and within-group std, each
    function's mean and std, the accuracy (the share of completions every verifying reward
    passes) and the completion lengths."""
    table = torch.cat([g.rewards for g in groups])  # (N, R)
    weights = torch.tensor(module.reward_weights, dtype=table.dtype)
    total = (table * weights).sum(dim=1)
    sync = stage != "train"
    module.log(f"{stage}_reward", total.mean().float(), prog_bar=True, sync_dist=sync)
    std = torch.stack([(g.rewards * weights).sum(1).std() for g in groups])
    module.log(f"{stage}_reward_std", std.mean().float(), sync_dist=sync)
    for i, reward in enumerate(module.rewards):
        name = f"{stage}_rewards/{reward_name(reward)}"
        module.log(f"{name}/mean", table[:, i].mean().float(), sync_dist=sync)
        module.log(f"{name}/std", table[:, i].std().float(), sync_dist=sync)
    verifiers = [i for i, r in enumerate(module.rewards) if getattr(r, "verifies", False)]
    if verifiers:
        accuracy = (table[:, verifiers] > 0).all(dim=1).float().mean()
        module.log(f"{stage}_accuracy", accuracy, prog_bar=True, sync_dist=sync)
    lengths = torch.cat([g.mask.sum(dim=1) for g in groups])
    module.log(f"{stage}_completion_length", lengths.mean(), sync_dist=sync)


def launch_problem(module: GRPOLM, trainer: Any, datamodule: Any) -> str | None:
    """What keeps a :class:`GRPOLM` run from starting, in one line, or None."""
    if datamodule is not None and not getattr(datamodule, "rl_prompts", False):
        return (
            f"GRPOLM samples from prompts, and {type(datamodule).__name__} holds none; use"
            " `data: class_path: plugintrain.data.PromptDataModule` on a `plugintrain prepare"
            " chat` folder"
        )
    strategy = trainer.strategy if trainer is not None else None
    layout = _layout_problem(strategy)
    if layout is not None:
        return layout
    if module.policy.beta != 0.0 and lora_callback(trainer) is None:
        return (
            f"beta={module.policy.beta} needs a reference: GRPOLM takes it from the base with"
            " its LoRA adapters off; add the LoRA callback, or set beta: 0"
        )
    if datamodule is not None and hasattr(datamodule, "longest_prompt"):
        longest, index = datamodule.longest_prompt()
        if longest + module.max_new_tokens > module.config.block_size:
            return (
                f"prompt {index} of {datamodule.data_dir} is {longest} tokens, and with"
                f" max_new_tokens={module.max_new_tokens} exceeds the model's context of"
                f" {module.config.block_size}; set max_new_tokens:"
                f" {module.config.block_size - longest} or less, or drop the longer prompts"
            )
    return None


def _layout_problem(strategy: Any) -> str | None:
    """Rollouts run each rank's whole model (FSDP2 gathers each block's weights as it runs
    it, as in training), which tensor, pipeline, expert and context parallelism split, and
    which Lightning's ``fsdp``/``deepspeed`` strategies are not built to run step by step."""
    if strategy is None:
        return None
    sharded = []
    dims = getattr(strategy, "parallel_dims", None)
    if dims is not None:
        degrees = {
            "tensor_parallel": dims.tensor_parallel,
            "pipeline_parallel": dims.pipeline_parallel,
            "expert_parallel": dims.expert_parallel,
            "context_parallel": dims.context_parallel,
        }
        sharded = [f"{name}={degree}" for name, degree in degrees.items() if degree > 1]
    if type(strategy).__name__ in ("FSDPStrategy", "DeepSpeedStrategy", "ModelParallelStrategy"):
        sharded.append(f"Lightning's {type(strategy).__name__}")
    if not sharded:
        return None
    return (
        f"GRPOLM samples rollouts from each rank's whole weights, which {', '.join(sharded)}"
        " shards; train it on one device, ddp_bucketed, zero1, zero2 or FSDP2 (zero_stage: 3)"
    )


def _qualified_name(reward: Callable[..., Any]) -> str:
    named = reward if hasattr(reward, "__qualname__") else type(reward)
    return f"{named.__module__}.{named.__qualname__}"
