"""Mixture-of-experts feed-forward layer: router, grouped experts, token dispatch.

DeepSeek-V3 (2024) and Qwen3-MoE in one layer, shaped by
:class:`~plugintrain.model_zoo.config.MoEConfig`:

- **Routing** (:class:`Router`): token-choice top-k over sigmoid (DeepSeek-V3) or softmax
  (Qwen3-MoE) scores, optionally group-limited; the chosen experts' scores are
  normalized and scaled into the combine weights. A per-expert ``expert_bias`` is added
  to the scores only to *choose* experts (DeepSeek-V3's auxiliary-loss-free balancing):
  the weights never see it. :meth:`MoE.update_bias` moves it after each optimizer step.
- **Experts** (:class:`GroupedExperts`): every expert's SwiGLU weights stacked into
  ``(E, ...)`` tensors and run as one batched matmul per projection over tokens sorted by
  expert (padded to the busiest expert), not a Python loop over experts.
- **Dispatch**: tokens are sorted into expert-major order; with expert parallelism
  (:attr:`MoE.ep_group`, set by the hybrid strategy) the per-expert counts are exchanged
  with an all-to-all first, then the tokens, which each rank permutes into the order of
  its local experts; outputs travel back the same way and are combined with the weights.
  An optional capacity factor drops each expert's overflow tokens (counted).
- **Observability**: each layer counts the tokens routed to each expert and the tokens
  dropped during training forwards (not in recomputation); DeepSeek-V3's sequence-wise
  balance loss is computed when its coefficient is set, for the training step to add.

Weights keep Hugging Face's ``(out, in)`` orientation per expert, so checkpoints map by
name. Under tensor or expert parallelism the strategy turns the parameters into DTensors;
the layer runs on their local shards (:func:`local`).
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn
from torch.distributed.tensor import DTensor, Partial
from typing_extensions import override

from plugintrain.core import profiling
from plugintrain.model_zoo.config import MoEConfig, TransformerConfig


def local(param: Tensor, partial_grad: bool = False) -> Tensor:
    """``param``'s local shard for computing (itself unless it is a DTensor).

    Args:
        param: A parameter, or a DTensor parameter on the strategy's mesh.
        partial_grad: The rank computes on its own tokens only (sequence parallelism), so
            the gradient it produces is one rank's part of the sum: marked ``Partial``, it
            is summed over the tensor-parallel ranks where the strategy reduces it.
    """
    if not isinstance(param, DTensor):
        return param
    if not partial_grad:
        return param.to_local()
    grads = [Partial() if p.is_replicate() else p for p in param.placements]
    return param.to_local(grad_placements=grads)


def _recomputing() -> bool:
    """Whether this forward runs inside a backward pass (activation recomputation)."""
    return torch._C._current_graph_task_id() != -1


class _FP32Buffers(nn.Module):
    """Keeps the buffers named in ``fp32_buffers`` in float32 through ``.to(dtype)`` and
    ``.half()`` (bf16-true converts the whole module): routing-bias steps of 1e-3 vanish
    in bf16, and so do token counts above 256 (Hugging Face keeps DeepSeek-V3's bias in
    fp32 too)."""

    fp32_buffers: tuple[str, ...] = ()

    @override
    def _apply(self, fn: Any, recurse: bool = True) -> _FP32Buffers:
        kept = {name: self._buffers[name] for name in self.fp32_buffers}
        super()._apply(fn, recurse)
        for name, old in kept.items():
            new = self._buffers[name]
            if new.dtype != old.dtype:  # a cast: keep the fp32 values, take the new device
                moved = torch.empty_like(old, device=new.device)
                self._buffers[name] = moved if old.is_meta else moved.copy_(old)
        return self


class Router(_FP32Buffers):
    """Token-choice top-k routing with a balancing bias that only picks experts.

    Args:
        dim: Model width.
        moe: The layer's routing settings.
    """

    def __init__(self, dim: int, moe: MoEConfig) -> None:
        super().__init__()
        self.moe = moe
        self.weight = nn.Parameter(torch.empty(moe.n_routed_experts, dim))
        # Persistent: resuming keeps the balance reached; Hugging Face's
        # `e_score_correction_bias`. Kept in fp32 whatever the model's dtype.
        self.fp32_buffers = ("expert_bias",)
        bias = torch.zeros(moe.n_routed_experts, dtype=torch.float32)
        self.register_buffer("expert_bias", bias)
        self.partial_grad = False

    def forward(self, x: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """Route tokens ``(N, C)``.

        Returns:
            ``(weights, indices, scores)``: the combine weights ``(N, top_k)`` (fp32), the
            chosen experts ``(N, top_k)`` and every expert's score ``(N, E)`` (fp32).
        """
        moe = self.moe
        with torch.autocast(x.device.type, enabled=False):  # fp32 under mixed precision too
            logits = F.linear(x.float(), local(self.weight, self.partial_grad).float())
        scores = logits.sigmoid() if moe.score_func == "sigmoid" else logits.softmax(dim=-1)
        choice = scores.detach() + self.expert_bias.float()
        if moe.n_group > 1:
            choice = self._limit_groups(choice)
        indices = choice.topk(moe.top_k, dim=-1, sorted=False).indices
        weights = scores.gather(1, indices)
        if moe.norm_topk_prob:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return weights * moe.routed_scaling_factor, indices, scores

    def _limit_groups(self, choice: Tensor) -> Tensor:
        """Keep only the ``topk_group`` groups whose two best scores sum highest."""
        moe = self.moe
        grouped = choice.view(choice.size(0), moe.n_group, -1)
        best = grouped.topk(min(2, grouped.size(-1)), dim=-1).values.sum(dim=-1)
        groups = best.topk(moe.topk_group, dim=-1, sorted=False).indices
        keep = torch.zeros_like(best, dtype=torch.bool).scatter_(1, groups, True)
        return grouped.masked_fill(~keep[..., None], float("-inf")).flatten(1)


class GroupedExperts(nn.Module):
    """``E`` SwiGLU experts as stacked weights: ``w1``/``w3`` ``(E, I, C)``, ``w2`` ``(E, C, I)``.

    Under expert parallelism each rank holds ``E / ep`` of them (DTensors sharded on dim
    0); :meth:`forward` runs the local ones.
    """

    def __init__(self, dim: int, hidden: int, experts: int) -> None:
        super().__init__()
        self.w1 = nn.Parameter(torch.empty(experts, hidden, dim))  # gate
        self.w3 = nn.Parameter(torch.empty(experts, hidden, dim))  # up
        self.w2 = nn.Parameter(torch.empty(experts, dim, hidden))  # down
        self.partial_grad = False

    def forward(self, x: Tensor, counts: Tensor) -> Tensor:
        """Tokens ``(M, C)`` sorted by local expert, ``counts[e]`` of them for expert ``e``
        -> outputs ``(M, C)``: one ``bmm`` per projection over every local expert, the
        tokens padded to the busiest expert's count."""
        w1, w3, w2 = (local(w, self.partial_grad) for w in (self.w1, self.w3, self.w2))
        experts = w1.size(0)
        # No token routed here: the matmuls run on (E, 0, C), and the weights get zeros.
        rows = torch.repeat_interleave(torch.arange(experts, device=x.device), counts)
        starts = torch.cumsum(counts, 0) - counts
        slot = torch.arange(x.size(0), device=x.device) - starts[rows]
        padded = x.new_zeros(experts, int(counts.max()), x.size(1))
        padded[rows, slot] = x
        h = F.silu(torch.bmm(padded, w1.transpose(1, 2))) * torch.bmm(padded, w3.transpose(1, 2))
        return torch.bmm(h, w2.transpose(1, 2))[rows, slot]


class SharedExperts(nn.Module):
    """The always-on experts: one SwiGLU ``n_shared_experts x moe_intermediate_size`` wide."""

    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.w1 = nn.Linear(dim, hidden, bias=False)
        self.w3 = nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)
        self.partial_grad = False

    def forward(self, x: Tensor) -> Tensor:
        """Map ``(N, C)`` to ``(N, C)``."""
        w1, w3, w2 = (local(m.weight, self.partial_grad) for m in (self.w1, self.w3, self.w2))
        return F.linear(F.silu(F.linear(x, w1)) * F.linear(x, w3), w2)


class MoE(_FP32Buffers):
    """A mixture-of-experts feed-forward layer (see the module documentation).

    Args:
        config: Model architecture with ``moe`` set.
    """

    def __init__(self, config: TransformerConfig) -> None:
        super().__init__()
        moe = config.moe
        assert moe is not None
        self.moe = moe
        d = config.n_embd
        self.router = Router(d, moe)
        self.experts = GroupedExperts(d, moe.moe_intermediate_size, moe.n_routed_experts)
        shared = moe.n_shared_experts * moe.moe_intermediate_size
        self.shared_experts = SharedExperts(d, shared) if shared else None
        self.dropout = nn.Dropout(config.dropout)
        self.ep_group: dist.ProcessGroup | None = None
        """The expert-parallel group the hybrid strategy set (None: every expert here)."""
        self.context_group: dist.ProcessGroup | None = None
        """Under context parallelism, the cp group holding the other chunks of this rank's
        sequences (set by :meth:`~plugintrain.model_zoo.CausalLM.split_sequences`)."""
        self.sequence_group: dist.ProcessGroup | None = None
        """Under sequence parallelism, the tensor-parallel group holding the other shards
        of this rank's sequences (for the balance loss); None: whole sequences here."""
        self.fp32_buffers = ("tokens_per_expert", "dropped_tokens", "aux_loss_sum", "forwards")
        for name in self.fp32_buffers:  # this step's routing, summed over its forwards
            shape = (moe.n_routed_experts,) if name == "tokens_per_expert" else ()
            self.register_buffer(name, torch.zeros(shape, dtype=torch.float32), persistent=False)
        self.aux_loss: Tensor | None = None
        """The sequence-wise balance loss of this step's training forwards, not yet taken."""

    def forward(self, x: Tensor) -> Tensor:
        """Map hidden states ``(B, T, C)`` to ``(B, T, C)``."""
        B, T, C = x.shape
        flat = x.reshape(-1, C)
        weights, indices, scores = self.router(flat)
        training = self.training and torch.is_grad_enabled()
        # A recomputed forward (in backward) must run the same operators as the first one,
        # but counts nothing: its tokens were counted, its loss taken, the first time.
        counting = training and not _recomputing()
        if counting:
            self.forwards += 1
        if training and self.moe.aux_loss_coeff > 0:
            loss = self._balance_loss(scores, indices, B)
            if counting:
                self.aux_loss = loss if self.aux_loss is None else self.aux_loss + loss
                # Under SP each rank holds a part of the loss: x tp makes the mean over
                # the ranks holding this layer (routing_stats) the whole loss.
                shards = (
                    1 if self.sequence_group is None else dist.get_world_size(self.sequence_group)
                )
                self.aux_loss_sum += loss.detach() * shards
        y = self._routed(flat, weights, indices, counting)
        if self.shared_experts is not None:
            y = y + self.shared_experts(flat)
        return self.dropout(y.view(B, T, C))

    def _routed(self, flat: Tensor, weights: Tensor, indices: Tensor, counting: bool) -> Tensor:
        """The routed experts' weighted sum for each token ``(N, C)``."""
        n, k = indices.shape
        experts = self.moe.n_routed_experts
        expert_ids = indices.reshape(-1)
        order = torch.argsort(expert_ids, stable=True)  # expert-major, tokens in order
        counts = torch.bincount(expert_ids, minlength=experts)
        if counting:
            self.tokens_per_expert += counts.to(self.tokens_per_expert.dtype)
        if self.moe.capacity_factor is not None:
            order, counts = self._drop_overflow(order, counts, expert_ids, n * k, counting)
        tokens = order // k
        out = self._run_experts(flat[tokens], counts)
        combined = out * weights.reshape(-1)[order, None]
        return torch.zeros_like(flat).index_add_(0, tokens, combined.to(flat.dtype))

    def _drop_overflow(
        self, order: Tensor, counts: Tensor, expert_ids: Tensor, assignments: int, counting: bool
    ) -> tuple[Tensor, Tensor]:
        """Keep each expert's first ``capacity`` tokens (in token order); count the rest."""
        capacity = math.ceil(self.moe.capacity_factor * assignments / self.moe.n_routed_experts)
        starts = torch.cumsum(counts, 0) - counts
        position = torch.arange(order.numel(), device=order.device) - starts[expert_ids[order]]
        keep = position < capacity
        if counting:
            self.dropped_tokens += (~keep).sum().to(self.dropped_tokens.dtype)
        return order[keep], counts.clamp(max=capacity)

    def _run_experts(self, x: Tensor, counts: Tensor) -> Tensor:
        """Expert outputs for tokens ``x`` sorted by (global) expert, ``counts`` per expert;
        with expert parallelism through two all-to-alls."""
        if self.ep_group is None:
            return self.experts(x, counts)
        return dispatch_and_combine(self.experts, x, counts, self.ep_group)

    def _balance_loss(self, scores: Tensor, indices: Tensor, batch: int) -> Tensor:
        """DeepSeek-V3's sequence-wise balance loss ``alpha * sum_i f_i P_i``, averaged over
        the sequences: ``f_i`` is expert i's share of the sequence's ``T x top_k`` picks
        times ``E``, ``P_i`` its mean normalized score over the sequence.

        Under sequence parallelism (:attr:`sequence_group` set) this rank holds ``T / tp``
        of each sequence: the picks are summed over the group (``f`` is the whole
        sequence's) and ``P`` is this rank's part of the whole sequence's mean, so the
        ranks' losses add up to the sequence's loss, and so do their gradients (the
        layer's gradients are summed over the group). Under context parallelism
        (:attr:`context_group` set) the picks are summed over the cp group as well, and the
        part is scaled by cp, since the cp ranks' gradients are averaged."""
        moe = self.moe
        experts = moe.n_routed_experts
        normalized = scores / scores.sum(dim=-1, keepdim=True)
        picks = indices.view(batch, -1)  # (B, T_local * k)
        hits = torch.zeros(batch, experts, dtype=normalized.dtype, device=normalized.device)
        hits.scatter_add_(1, picks, torch.ones_like(picks, dtype=hits.dtype))
        shards = cp = 1
        if self.sequence_group is not None:
            dist.all_reduce(hits, group=self.sequence_group)
            shards = dist.get_world_size(self.sequence_group)
        if self.context_group is not None:  # the other chunks' picks too
            dist.all_reduce(hits, group=self.context_group)
            cp = dist.get_world_size(self.context_group)
        picks_per_sequence = picks.size(1) * shards * cp  # T x top_k
        f = hits * experts / picks_per_sequence  # (B, E)
        p = normalized.view(batch, -1, experts).sum(dim=1) * moe.top_k / picks_per_sequence
        # x cp: the strategy averages gradients over the cp ranks, whose parts add up.
        return moe.aux_loss_coeff * (f * p).sum(dim=-1).mean() * cp

    @torch.no_grad()
    def update_bias(self, load: Tensor) -> None:
        """One step of auxiliary-loss-free balancing from each expert's token count ``load``
        (global, or any multiple of it): ``bias += rate * sign(mean - load)``, then the
        biases are re-centred to zero mean."""
        rate = self.moe.bias_update_rate
        bias = self.router.expert_bias
        load = load.to(bias.device, torch.float32)
        bias += rate * torch.sign(load.mean() - load)
        bias -= bias.mean()

    def take_aux_loss(self) -> Tensor | None:
        """The balance loss accumulated since the last call (None if there is none)."""
        loss, self.aux_loss = self.aux_loss, None
        return loss

    def reset_counts(self) -> None:
        """Zero the step's counters (after its statistics were read)."""
        for counter in (
            self.tokens_per_expert,
            self.dropped_tokens,
            self.aux_loss_sum,
            self.forwards,
        ):
            counter.zero_()


def dispatch_and_combine(
    experts: GroupedExperts, x: Tensor, counts: Tensor, group: dist.ProcessGroup
) -> Tensor:
    """Run tokens ``x`` (sorted by global expert id, ``counts`` ``(E,)`` per expert) on the
    experts spread over ``group``, whose rank r holds experts ``[r E/ep, (r+1) E/ep)``.

    The counts are exchanged first (an all-to-all of ``E`` integers), then the tokens
    (uneven all-to-all); the received tokens, source-major, are permuted into the order
    of the local experts, run, permuted back and returned by the reverse all-to-all.
    Both token all-to-alls are differentiable (their backward is the opposite exchange).
    """
    ep = dist.get_world_size(group)
    local_experts = counts.numel() // ep
    send = counts.view(ep, local_experts)
    with profiling.record(profiling.EXPERT_ALL_TO_ALL):
        received = torch.empty_like(send)
        dist.all_to_all_single(received, send, group=group)
        send_splits = send.sum(dim=1).tolist()
        recv_splits = received.sum(dim=1).tolist()
    inbound = _Exchange.apply(x, recv_splits, send_splits, group)
    # Rows arrive grouped by (source rank, local expert); sort them by (expert, source).
    segment = torch.arange(ep * local_experts, device=x.device)
    key = (segment % local_experts) * ep + segment // local_experts
    order = torch.argsort(torch.repeat_interleave(key, received.reshape(-1)), stable=True)
    out = experts(inbound[order], received.sum(dim=0))
    out = out[torch.argsort(order)]
    return _Exchange.apply(out, send_splits, recv_splits, group)


class _Exchange(torch.autograd.Function):
    """An uneven all-to-all whose backward is the opposite exchange, both recorded as the
    ``expert_all_to_all`` phase. Through torch's functional collectives, so selective
    recomputation keeps the forward's output instead of exchanging again."""

    @staticmethod
    def forward(
        ctx: Any, x: Tensor, out_splits: list[int], in_splits: list[int], group: Any
    ) -> Tensor:
        ctx.splits, ctx.group = (out_splits, in_splits), group
        return _all_to_all(x, out_splits, in_splits, group)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, ...]:
        out_splits, in_splits = ctx.splits
        return _all_to_all(grad, in_splits, out_splits, ctx.group), None, None, None


def _all_to_all(x: Tensor, out_splits: list[int], in_splits: list[int], group: Any) -> Tensor:
    import torch.distributed._functional_collectives as funcol

    with profiling.record(profiling.EXPERT_ALL_TO_ALL):
        out = funcol.all_to_all_single(x.contiguous(), out_splits, in_splits, group)
        return funcol.wait_tensor(out)
