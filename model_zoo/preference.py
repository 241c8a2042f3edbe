"""Preference tuning: DPO and its family as a :class:`~plugintrain.model_zoo.CausalLM`
objective (:class:`PreferenceLM`).

A batch holds pairs: row ``2i`` is pair ``i``'s prompt and chosen answer, row ``2i + 1``
the same prompt and its rejected answer (``PreferenceDataModule``; the layout is
:mod:`plugintrain.core.preference_batch`'s), so a pair never splits across data-parallel
ranks, micro-batches or pipeline micro-batches. Only answer
tokens are scored: each row's log-probability is the sum of its answer tokens'
(:func:`sequence_logps`).

The objectives (``objective``), with ``h`` the policy's log-ratio margin over the
reference, ``(pi_c - ref_c) - (pi_r - ref_r)``:

- ``sigmoid``: DPO (Rafailov et al., 2023), ``-log sigmoid(beta h)``; with
  ``label_smoothing`` e, conservative DPO (Mitchell, 2023): ``-(1 - e) log sigmoid(beta
  h) - e log sigmoid(-beta h)``.
- ``ipo``: IPO (Azar et al., 2023), ``(h' - 1 / (2 beta))^2`` over the answers'
  per-token log-ratios ``h'`` (TRL's length-normalized form).
- ``simpo``: SimPO (Meng et al., 2024), reference-free: ``-log sigmoid(beta (a_c - a_r)
  - gamma)`` over the answers' mean token log-probs ``a``.
- ``orpo``: ORPO (Hong et al., 2024), reference-free: the chosen rows' NLL minus
  ``beta log sigmoid(log odds(a_c) - log odds(a_r))``, ``odds(a) = e^a / (1 - e^a)``. Its
  NLL is over the whole chosen row, prompt and answer (each token but the first), as the
  authors' code and TRL compute it.

``sft_weight`` adds the chosen answers' mean token NLL to the DPO family's loss (the
"RPO" term). Each equals TRL 1.16's loss on the same batch (tests/e2e/test_preference_trl.py).

The reference log-probs come from the data when the folder holds them (``plugintrain
prepare preference --reference WEIGHTS``), else, under the LoRA callback, from the same
model with its adapters switched off (:func:`plugintrain.model_zoo.lora.adapters_disabled`),
else from a first pass of ``fit`` over the pairs before the first step, cached beside the
data (:mod:`~plugintrain.model_zoo.reference_pass`): one copy of the weights every way.

Loss weighting: the preference loss is the mean over the micro-batch's pairs (every
micro-batch holds the same number), so gradient accumulation, data parallelism and a
pipeline's micro-batches give the mean over the optimizer step's pairs. The NLL terms are
token-weighted over the whole step, as the chat loss is: a micro-batch of ``P`` pairs adds
its chosen tokens' summed NLL times ``N / (P * S)``, with ``N`` the step's pairs and ``S``
its chosen tokens (the totals ``PreferenceDataModule`` puts in every batch), which the
strategies' mean over micro-batches turns into the step's sum over ``S``. On one batch
that is the mean over its chosen tokens, TRL's.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from lightning.pytorch.cli import OptimizerCallable
from torch import Tensor
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import loss_parallel

from plugintrain.core.preference_batch import (
    row_targets,
    step_totals,
    unpack_reference,
    with_reference,
)
from plugintrain.model_zoo.config import TransformerConfig
from plugintrain.model_zoo.cross_entropy import CHUNK_ELEMENTS, IGNORE_INDEX
from plugintrain.model_zoo.lm import CausalLM
from plugintrain.model_zoo.lora import lora_callback

OBJECTIVES = ("sigmoid", "ipo", "simpo", "orpo")
"""The preference objectives :class:`PreferenceLM` trains on."""
REFERENCE_FREE = frozenset({"simpo", "orpo"})
"""Objectives that need no reference model."""
REFERENCES = ("auto", "data", "adapters_off", "first_pass")
"""Where :class:`PreferenceLM` takes the reference log-probs from."""


# ---------------------------------------------------------------------------------------
# Log-probs of the scored tokens


def sequence_logps(logits: Tensor, targets: Tensor) -> Tensor:
    """Each row's summed log-probability of its scored targets: ``(N,)`` fp32.

    ``logits`` ``(N, T, V)``; ``targets`` ``(N, T)`` token ids, :data:`IGNORE_INDEX` where
    not scored. Plain logits go through a chunked function that keeps no fp32 copy of the
    logits (a fp32 chunk of :data:`CHUNK_ELEMENTS` at a time, only at scored positions;
    backward recomputes the chunk's softmax). Vocabulary-sharded DTensor logits (tensor
    parallelism) take torch's cross-entropy, called under the caller's ``loss_parallel``
    (which reduces over the shards): the strategy runs ``loss_fn`` and the backward in one,
    :meth:`PreferenceLM.with_reference` its reference forward. ``loss_parallel`` cannot
    nest: the inner one's exit unregisters torch's loss ops and the outer one's raises.
    """
    if isinstance(logits, DTensor):
        per_token = -F.cross_entropy(
            logits.float().flatten(0, -2),
            targets.flatten(),
            ignore_index=IGNORE_INDEX,
            reduction="none",
        )
        if isinstance(per_token, DTensor):
            per_token = per_token.full_tensor()
        return per_token.view(targets.shape).sum(dim=-1)
    return _SequenceLogps.apply(logits, targets)


class _SequenceLogps(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, logits: Tensor, targets: Tensor) -> Tensor:
        n_rows, vocab = targets.size(0), logits.size(-1)
        flat = logits.reshape(-1, vocab)
        flat_targets = targets.reshape(-1)
        scored = (flat_targets != IGNORE_INDEX).nonzero().squeeze(1)  # (S,)
        rows = torch.div(scored, targets.size(1), rounding_mode="floor")
        chunk = max(1, CHUNK_ELEMENTS // vocab)
        logps = torch.empty(scored.numel(), dtype=torch.float32, device=logits.device)
        for start in range(0, scored.numel(), chunk):
            at = scored[start : start + chunk]
            part = flat.index_select(0, at).float()
            picked = part.gather(1, flat_targets[at][:, None]).squeeze(1)
            logps[start : start + chunk] = picked - torch.logsumexp(part, dim=-1)
        sums = torch.zeros(n_rows, dtype=torch.float32, device=logits.device)
        sums.index_add_(0, rows, logps)
        ctx.save_for_backward(logits, flat_targets, scored, rows)
        return sums

    @staticmethod
    def backward(ctx: Any, grad_sums: Tensor) -> tuple[Tensor, None]:
        logits, flat_targets, scored, rows = ctx.saved_tensors
        vocab = logits.size(-1)
        flat = logits.reshape(-1, vocab)
        grad = torch.zeros_like(flat)
        chunk = max(1, CHUNK_ELEMENTS // vocab)
        weights = grad_sums.float().index_select(0, rows)  # (S,) d(loss)/d(token log-prob)
        for start in range(0, scored.numel(), chunk):
            at = scored[start : start + chunk]
            w = weights[start : start + chunk, None]
            # d log p(t) / d logits = one_hot(t) - softmax
            part = torch.softmax(flat.index_select(0, at).float(), dim=-1).mul_(-w)
            part.scatter_add_(1, flat_targets[at][:, None], w)
            grad.index_copy_(0, at, part.to(grad.dtype))
        return grad.view(logits.shape), None


# ---------------------------------------------------------------------------------------
# The objectives


@dataclass(frozen=True)
class PreferenceLoss:
    """One preference objective and its settings.

    Attributes:
        objective: One of :data:`OBJECTIVES`.
        beta: The inverse temperature (DPO's beta; ORPO's lambda, the odds-ratio weight).
        label_smoothing: ``sigmoid`` only: the assumed share of flipped labels (cDPO).
        simpo_gamma: ``simpo`` only: the target reward margin gamma.
        sft_weight: DPO family only: the weight of the chosen answers' NLL added.
    """

    objective: str = "sigmoid"
    beta: float = 0.1
    label_smoothing: float = 0.0
    simpo_gamma: float = 0.5
    sft_weight: float = 0.0

    def problem(self) -> str | None:
        """What is wrong with these settings, in one line, or None."""
        if self.objective not in OBJECTIVES:
            return f"objective={self.objective!r}: use one of {', '.join(OBJECTIVES)}"
        if not (math.isfinite(self.beta) and self.beta > 0):
            return f"beta={self.beta}: must be > 0 (0.1 is DPO's usual value)"
        if not 0 <= self.label_smoothing < 0.5:
            return f"label_smoothing={self.label_smoothing}: must be in [0, 0.5)"
        if self.label_smoothing and self.objective != "sigmoid":
            return (
                f"label_smoothing={self.label_smoothing} is conservative DPO's; use it with"
                f" objective: sigmoid, or set it to 0 for {self.objective}"
            )
        if self.sft_weight < 0:
            return f"sft_weight={self.sft_weight}: must be >= 0"
        if self.sft_weight and self.objective == "orpo":
            return "sft_weight: ORPO has its own NLL term; set sft_weight: 0 with objective: orpo"
        return None

    @property
    def needs_reference(self) -> bool:
        """Whether the objective compares against a reference model."""
        return self.objective not in REFERENCE_FREE

    def __call__(
        self,
        logps: Tensor,
        counts: Tensor,
        reference: Tensor | None,
        row_nll: tuple[Tensor, Tensor] | None = None,
        nll_denominator: Tensor | None = None,
    ) -> tuple[Tensor, dict[str, Tensor]]:
        """The mean loss over the pairs, and its detached statistics.

        Args:
            logps: ``(2P,)`` each row's summed answer log-prob, rows alternating chosen and
                rejected.
            counts: ``(2P,)`` each row's answer tokens.
            reference: ``(2P,)`` the reference's, alike; None for reference-free objectives.
            row_nll: ``orpo``: the summed log-prob of the chosen rows' every token (prompt
                and answer) and their number; None: their answers'.
            nll_denominator: What the NLL term's summed token NLL is divided by (the
                module docstring's ``P * S / N``; 0 where unknown); None or 0: the chosen
                tokens counted here, the mean over them.

        Returns:
            The loss and the statistics: per pair ``reward_chosen``/``reward_rejected``
            (``beta`` times the log-ratio; SimPO and ORPO: times the mean token log-prob,
            as TRL defines them), ``logp_chosen``/``logp_rejected`` (the answers' summed
            log-probs; SimPO and ORPO: their mean token log-probs, as TRL's), and the
            scalar loss parts ``loss_pref`` and ``loss_nll`` (the mean token NLL of these
            pairs' chosen rows, whatever ``nll_denominator``).
        """
        chosen, rejected = logps[0::2], logps[1::2]
        sizes = counts[0::2].clamp(min=1), counts[1::2].clamp(min=1)
        nll, weight = None, 1.0
        if self.objective in REFERENCE_FREE:
            scores = chosen / sizes[0], rejected / sizes[1]  # the mean token log-probs
            pref = self._reference_free(*scores)
            if self.objective == "orpo":
                nll = row_nll if row_nll is not None else (chosen.sum(), counts[0::2].sum())
            logs = scores  # TRL's log-probs of these objectives are the mean token ones
        else:
            assert reference is not None
            scores = (
                chosen - reference[0::2].to(chosen.dtype),
                rejected - reference[1::2].to(chosen.dtype),
            )  # the log-ratios over the reference
            pref = self._against_reference(*scores, *sizes)
            if self.sft_weight:
                nll, weight = (chosen.sum(), counts[0::2].sum()), self.sft_weight
            logs = chosen, rejected
        total = pref.mean()
        if nll is not None:
            denominator = nll[1].clamp(min=1).to(nll[0].dtype)
            if nll_denominator is not None:  # the step's, where the data knew it
                step = nll_denominator.to(denominator.dtype)
                denominator = torch.where(step > 0, step, denominator)
            total = total - weight * nll[0] / denominator
        return total, self._statistics(scores, logs, pref, nll)

    def _statistics(
        self,
        scores: tuple[Tensor, Tensor],
        logs: tuple[Tensor, Tensor],
        pref: Tensor,
        nll: tuple[Tensor, Tensor] | None,
    ) -> dict[str, Tensor]:
        """:meth:`__call__`'s statistics, detached."""
        stats = {
            "reward_chosen": self.beta * scores[0].detach(),
            "reward_rejected": self.beta * scores[1].detach(),
            "logp_chosen": logs[0].detach(),
            "logp_rejected": logs[1].detach(),
            "loss_pref": pref.detach().mean(),
        }
        if nll is not None:
            stats["loss_nll"] = -nll[0].detach() / nll[1].clamp(min=1)
        return stats

    def _reference_free(self, mean_c: Tensor, mean_r: Tensor) -> Tensor:
        """SimPO's or ORPO's preference term per pair, from the mean token log-probs."""
        if self.objective == "simpo":
            return -F.logsigmoid(self.beta * (mean_c - mean_r) - self.simpo_gamma)
        # A mean log-prob of exactly 0 (p = 1 in fp32) has no finite odds: held below it.
        mean_c, mean_r = mean_c.clamp(max=-1e-7), mean_r.clamp(max=-1e-7)
        log_odds = (mean_c - mean_r) - (_log1mexp(mean_c) - _log1mexp(mean_r))
        return -self.beta * F.logsigmoid(log_odds)

    def _against_reference(
        self, ratio_c: Tensor, ratio_r: Tensor, size_c: Tensor, size_r: Tensor
    ) -> Tensor:
        """DPO's (conservative with label smoothing) or IPO's loss per pair, from the
        answers' log-ratios over the reference and their sizes."""
        if self.objective == "ipo":
            return (ratio_c / size_c - ratio_r / size_r - 1 / (2 * self.beta)) ** 2
        h = self.beta * (ratio_c - ratio_r)
        e = self.label_smoothing
        return -(1 - e) * F.logsigmoid(h) - (e * F.logsigmoid(-h) if e else 0)


def _nll_denominator(totals: Tensor, pairs: int, preference: PreferenceLoss) -> Tensor:
    """``P * S / N`` (the module docstring) for a micro-batch of ``pairs`` pairs of a step
    with ``totals`` (:func:`~plugintrain.core.preference_batch.step_totals`); 0 where the
    totals are unknown. A tensor: no host sync."""
    tokens = totals[2 if preference.objective == "orpo" else 1].double().clamp(min=1)
    step_pairs = totals[0].double()
    return torch.where(step_pairs > 0, pairs * tokens / step_pairs.clamp(min=1), 0.0)


def _log1mexp(x: Tensor) -> Tensor:
    """``log(1 - exp(x))`` for ``x < 0``, accurate at both ends (Maechler, 2012)."""
    return torch.where(x > -math.log(2), torch.log(-torch.expm1(x)), torch.log1p(-torch.exp(x)))


# ---------------------------------------------------------------------------------------
# The LightningModule


def _context_parallel_problem(module: Any, strategy: Any) -> str | None:
    """Why ``module`` cannot train under ``strategy``'s context parallelism, or None."""
    dims = getattr(strategy, "parallel_dims", None)
    if getattr(dims, "context_parallel", 1) == 1:
        return None
    return (
        f"{type(module).__name__} scores each answer over its whole row, and"
        f" context_parallel={dims.context_parallel} splits rows over ranks; use"
        " context_parallel: 1 (preference rows are short: data or tensor parallelism fits"
        " them)"
    )


class PreferenceLM(CausalLM):
    """A :class:`~plugintrain.model_zoo.CausalLM` trained on preference pairs.

    Reads ``PreferenceDataModule`` batches; trains any model of the zoo under any
    strategy; LoRA (and QLoRA) attach as for supervised fine-tuning.

    Args:
        objective: ``sigmoid`` (DPO), ``ipo``, ``simpo`` or ``orpo`` (see the module
            docstring).
        beta: DPO's beta (SimPO's beta, ORPO's lambda).
        label_smoothing: ``sigmoid``: conservative DPO's share of flipped labels.
        simpo_gamma: ``simpo``: the target margin.
        sft_weight: DPO family: the weight of an NLL term on the chosen answers.
        reference: Where the reference log-probs come from: ``data`` (the folder's, from
            ``plugintrain prepare preference --reference``), ``adapters_off`` (this model
            with its LoRA adapters switched off: LoRA runs only), ``first_pass`` (this
            model scores every pair before the first step, cached beside the data:
            :mod:`~plugintrain.model_zoo.reference_pass`), ``auto`` (the data's when it
            holds them, else the adapters switched off, else a first pass).

    The other arguments are :class:`~plugintrain.model_zoo.CausalLM`'s (``weights``,
    ``optimizer``, the schedule), with no weight decay and 10 warmup steps by default, as
    fine-tuning runs start.
    """

    def __init__(
        self,
        config: str | TransformerConfig | None = None,
        optimizer: OptimizerCallable = torch.optim.AdamW,
        weight_decay: float = 0.0,
        warmup_steps: int = 10,
        lr_decay_steps: int | None = None,
        min_lr_ratio: float = 0.1,
        weights: str | None = None,
        objective: str = "sigmoid",
        beta: float = 0.1,
        label_smoothing: float = 0.0,
        simpo_gamma: float = 0.5,
        sft_weight: float = 0.0,
        reference: str = "auto",
    ) -> None:
        super().__init__(
            config, optimizer, weight_decay, warmup_steps, lr_decay_steps, min_lr_ratio, weights
        )
        self.preference = PreferenceLoss(objective, beta, label_smoothing, simpo_gamma, sft_weight)
        problem = self.preference.problem()
        if problem is None and reference not in REFERENCES:
            problem = f"reference={reference!r}: use one of {', '.join(REFERENCES)}"
        if problem is not None:
            raise ValueError(problem)
        self.reference = reference
        self._stats: dict[str, list[Tensor]] = {}
        self._received: dict[str, Tensor] | None = None
        self._reference_forward = False

    # -- setup ---------------------------------------------------------------------------

    def check_launch(self, trainer: Any, datamodule: Any) -> None:
        """What :meth:`on_fit_start` would raise, from the recipe alone (the LoRA callback
        among ``trainer``'s callbacks stands for adapters): ``plugintrain fit`` calls it
        before any process is launched."""
        callback = lora_callback(trainer)
        problem = self.launch_problem(trainer.strategy, datamodule, callback is not None)
        problem = problem or _base_reference_problem(self, callback, datamodule)
        if problem is not None:
            raise ValueError(problem)

    def on_fit_start(self) -> None:
        """Before the first step (the model built, adapters in): the checks of
        :meth:`launch_problem` (the Python API runs no others); a first pass's scores."""
        trainer, lora = self.trainer, _has_adapters(self.model)
        problem = self.launch_problem(trainer.strategy, trainer.datamodule, lora)
        problem = problem or _base_reference_problem(
            self, lora_callback(trainer), trainer.datamodule
        )
        if problem is not None:
            raise ValueError(problem)
        _first_pass_if_needed(self, trainer.datamodule, lora)

    def launch_problem(self, strategy: Any, datamodule: Any, lora: bool) -> str | None:
        """What keeps this run from starting, in one line, or None: data without pairs, no
        reference where the objective needs one, context parallelism, or, under a pipeline,
        a reference not in the data (no second forward) or micro-batches parting a pair."""
        if datamodule is not None and not getattr(datamodule, "preference", False):
            return (
                f"{type(self).__name__} trains on preference pairs, and"
                f" {type(datamodule).__name__} holds none; prepare them with `plugintrain"
                " prepare preference` and use `data: class_path: plugintrain.data."
                "PreferenceDataModule`"
            )
        in_data = bool(getattr(datamodule, "has_reference", False))
        try:
            source = self._reference_source(in_data, lora)
        except ValueError as error:
            return str(error)
        if source == "first_pass" and not hasattr(datamodule, "use_reference"):
            return (
                f"reference={self.reference!r} scores the pairs in a first pass, which needs"
                " plugintrain.data.PreferenceDataModule; or prepare the pairs with"
                " `plugintrain prepare preference ... --reference WEIGHTS`"
            )
        layout = _context_parallel_problem(self, strategy)
        return layout or _pipeline_problem(strategy, datamodule, source)

    def reference_source(self, batch: tuple[Tensor, ...] | None = None) -> str | None:
        """Where this run's reference log-probs come from: ``data``, ``adapters_off``,
        ``first_pass`` (before its pass has run), or None for a reference-free objective.
        Whether the data holds them: the datamodule's ``has_reference``, else (no trainer)
        whether ``batch`` carries them. Raises a one-line ValueError when there is none."""
        datamodule = self.trainer.datamodule if self._trainer is not None else None
        if datamodule is not None or batch is None:
            in_data = bool(getattr(datamodule, "has_reference", False))
        else:
            in_data = not bool(torch.isnan(unpack_reference(batch[1])[1]).any())
        return self._reference_source(in_data, _has_adapters(self.model))

    def _reference_source(self, in_data: bool, lora: bool) -> str | None:
        if not self.preference.needs_reference:
            return None
        auto = self.reference == "auto"
        if self.reference == "data" or (auto and in_data):
            if not in_data:
                raise ValueError(_NO_REFERENCE)
            return "data"
        if self.reference == "adapters_off" or (auto and lora):
            if not lora:
                raise ValueError(_NO_REFERENCE)
            return "adapters_off"
        return "first_pass"

    # -- steps ---------------------------------------------------------------------------

    def training_step(self, batch: tuple[Tensor, ...], batch_idx: int) -> Tensor:
        """The preference loss of a batch of pairs; logs it and its statistics."""
        batch = self.with_reference(batch)
        loss = self.loss_fn(self(batch[0]), batch[1])
        self.record_loss("train", loss, batch)
        aux = self.model.take_aux_loss()  # MoE balance losses
        return loss if aux is None else loss + aux

    def validation_step(self, batch: tuple[Tensor, ...], batch_idx: int) -> None:
        """Logs ``val_loss`` and the preference statistics of held-out pairs."""
        batch = self.with_reference(batch)
        self.record_loss("val", self.loss_fn(self(batch[0]), batch[1]), batch)

    def test_step(self, batch: tuple[Tensor, ...], batch_idx: int) -> None:
        """As :meth:`validation_step`, for ``test``."""
        batch = self.with_reference(batch)
        self.record_loss("test", self.loss_fn(self(batch[0]), batch[1]), batch)

    def with_reference(self, batch: tuple[Tensor, ...]) -> tuple[Tensor, Tensor]:
        """``batch`` with the reference log-probs filled in where they come from this model
        with its adapters off (one no-grad forward, before the policy's)."""
        x, packed = batch[0], batch[1]
        self._reference_forward = self.reference_source(batch) == "adapters_off"
        if not self._reference_forward:
            return x, packed
        from plugintrain.model_zoo.lora import adapters_disabled

        targets, _ = unpack_reference(packed)
        training = self.model.training
        with torch.no_grad(), adapters_disabled(self.model):
            self.model.eval()  # the reference without dropout, as TRL's
            try:
                reference = self.answer_logps(x, targets)
            finally:
                self.model.train(training)
        return x, with_reference(packed, reference.double())

    def answer_logps(self, x: Tensor, targets: Tensor) -> Tensor:
        """Each row's summed log-prob of its answer ``targets`` ``(N, T)`` given ``x``,
        outside :meth:`loss_fn` (tp: under a ``loss_parallel`` of its own)."""
        logits = self(x)
        with loss_parallel() if isinstance(logits, DTensor) else contextlib.nullcontext():
            return sequence_logps(logits, targets)

    def loss_fn(self, logits: Tensor, targets: Tensor) -> Tensor:
        """The preference loss of ``logits`` ``(2P, T, V)`` against packed targets
        ``(2P, T + 4)`` (:mod:`plugintrain.core.preference_batch`); keeps the statistics for
        :meth:`record_loss` (a pipeline calls this on its last stage, micro-batch by
        micro-batch)."""
        scored, reference = unpack_reference(targets)
        logps = sequence_logps(logits, scored)
        counts = (scored != IGNORE_INDEX).sum(dim=-1)
        if self.preference.needs_reference:
            if torch.isnan(reference).any():
                raise ValueError(_NO_REFERENCE)
        else:
            reference = None
        row_nll = None
        if self.preference.objective == "orpo":
            chosen_rows = row_targets(targets)
            chosen_rows[1::2] = IGNORE_INDEX
            row_nll = (sequence_logps(logits, chosen_rows).sum(), (chosen_rows >= 0).sum())
        denominator = None  # only an objective with an NLL term reads the step's totals
        if self.preference.objective == "orpo" or self.preference.sft_weight:
            denominator = _nll_denominator(step_totals(targets), len(logps) // 2, self.preference)
        loss, stats = self.preference(logps, counts, reference, row_nll, denominator)
        for name, value in stats.items():
            self._stats.setdefault(name, []).append(value)
        return loss

    def record_loss(self, stage: str, loss: Tensor, batch: tuple[Tensor, ...]) -> None:
        """Log ``{stage}_loss`` and the statistics :meth:`loss_fn` kept: ``{stage}_reward_
        chosen``/``_rejected``/``_margin``/``_accuracy`` (the share of pairs whose chosen
        reward is higher), ``{stage}_logp_chosen``/``_rejected``, ``{stage}_loss_pref`` and
        ``{stage}_loss_nll``; count the step's FLOPs (with the reference's forward)."""
        stats, self._stats = self._stats, {}
        sync = stage != "train"
        if stage == "train":
            self.count_flops(batch[0], extra_forwards=int(self._reference_forward))
        self.log(f"{stage}_loss", loss, prog_bar=True, sync_dist=sync)
        if self._received is None and not stats:
            return
        values, self._received = self._received or _summary(stats), None
        for name, value in values.items():
            self.log(f"{stage}_{name}", value.float(), sync_dist=sync)

    rows_per_sample = 2
    """Rows a sample spans (a pair: its chosen and rejected rows), which a pipeline's
    micro-batches never part."""

    def statistics_vector(self, device: torch.device) -> Tensor:
        """The statistics :meth:`loss_fn` kept, as one vector in :data:`STATISTICS`'s order
        (NaN for a part the objective has not; zeros on a pipeline stage without the
        head), for the pipeline to hand to every rank (:meth:`receive_statistics`)."""
        if not self._stats:
            return torch.zeros(len(STATISTICS), device=device)
        summary = _summary(self._stats)
        return torch.stack(
            [summary.get(n, torch.tensor(float("nan"))).float().to(device) for n in STATISTICS]
        )

    def receive_statistics(self, vector: Tensor) -> None:
        """Log the pipeline's last stage's statistics (:meth:`statistics_vector`) at the
        next :meth:`record_loss`, on every rank alike."""
        self._stats = {}
        has_nll = self.preference.objective == "orpo" or self.preference.sft_weight > 0
        names = STATISTICS if has_nll else STATISTICS[:-1]  # the same keys on every rank
        self._received = dict(zip(names, vector.unbind(), strict=False))


STATISTICS = (
    "reward_chosen", "reward_rejected", "reward_margin", "reward_accuracy", "logp_chosen",
    "logp_rejected", "loss_pref", "loss_nll",
)  # fmt: skip
"""The statistics of a step's pairs that :class:`PreferenceLM` logs, ``{stage}_{name}``."""


def _summary(stats: dict[str, list[Tensor]]) -> dict[str, Tensor]:
    """The means of a step's kept statistics (each micro-batch's, concatenated)."""
    chosen = torch.cat(stats["reward_chosen"])
    rejected = torch.cat(stats["reward_rejected"])
    values = {
        "reward_chosen": chosen.mean(),
        "reward_rejected": rejected.mean(),
        "reward_margin": (chosen - rejected).mean(),
        "reward_accuracy": (chosen > rejected).float().mean(),
        "logp_chosen": torch.cat(stats["logp_chosen"]).mean(),
        "logp_rejected": torch.cat(stats["logp_rejected"]).mean(),
        "loss_pref": torch.stack(stats["loss_pref"]).mean(),
    }
    if "loss_nll" in stats:
        values["loss_nll"] = torch.stack(stats["loss_nll"]).mean()
    return values


_NO_REFERENCE = (
    "this objective needs reference log-probs, and the run has none: set reference: auto"
    " (the adapters switched off under the LoRA callback, else a first pass that scores the"
    " pairs before training), or prepare the pairs with `plugintrain prepare preference"
    " ... --reference WEIGHTS`, or use a reference-free objective (simpo, orpo)"
)


def _pipeline_problem(strategy: Any, datamodule: Any, source: str | None) -> str | None:
    """Under a pipeline: a reference that is not in the data (the schedule runs no second
    forward), or micro-batches that would part a pair."""
    options = getattr(strategy, "pipeline_options", None)
    dims = getattr(strategy, "parallel_dims", None)
    if options is None or dims is None or dims.pipeline_parallel <= 1:
        return None
    if source in ("adapters_off", "first_pass"):
        return (
            "under pipeline parallelism the reference log-probs come from the data:"
            " prepare the pairs with `plugintrain prepare preference ... --reference"
            " WEIGHTS` (the base's weights), or use a reference-free objective (simpo, orpo)"
        )
    pairs = getattr(datamodule, "batch_size", None)
    if pairs is not None and pairs % options.microbatches:
        return (
            f"batch_size={pairs} pairs do not split into microbatches={options.microbatches}"
            " of whole pairs; set --data.init_args.batch_size to a multiple of"
            f" {options.microbatches}"
        )
    return None


def _base_reference_problem(module: PreferenceLM, callback: Any, datamodule: Any) -> str | None:
    """Where the adapters switched off would not leave the reference: LoRA that also
    trains other weights (``trainable``, ``bias``), which stay on, or that starts from
    an adapter (``adapter``: the reference would be the base without it)."""
    if callback is None or not module.preference.needs_reference:
        return None
    in_data = bool(getattr(datamodule, "has_reference", False))
    if module._reference_source(in_data, lora=True) != "adapters_off":
        return None
    spec, start = callback.spec, getattr(callback, "adapter", None)
    if spec.trainable:
        what = f"LoRA trainable: {list(spec.trainable)}"
    elif spec.bias != "none":
        what = f"LoRA bias: {spec.bias}"
    elif start is not None:
        what = f"LoRA adapter: {start}"
    else:
        return None
    return (
        f"{what} leaves trained weights in the model with its adapters off, so it is not"
        " the reference: prepare the pairs with `plugintrain prepare preference ..."
        " --reference WEIGHTS` (the starting model's weights, an adapter merged with"
        " `plugintrain export`) and set reference: data, or drop it"
    )


def _first_pass_if_needed(module: PreferenceLM, datamodule: Any, lora: bool) -> None:
    """Score the pairs with the model before the first step, where the reference comes
    from a first pass (:mod:`~plugintrain.model_zoo.reference_pass`)."""
    in_data = bool(getattr(datamodule, "has_reference", False))
    if module._reference_source(in_data, lora) == "first_pass":
        from plugintrain.model_zoo.reference_pass import first_pass

        datamodule.use_reference(first_pass(module, module.trainer, datamodule))


def _has_adapters(module: torch.nn.Module | None) -> bool:
    from plugintrain.model_zoo.lora import adapted_layers

    return module is not None and next(adapted_layers(module), None) is not None


# ---------------------------------------------------------------------------------------
# Reference log-probs ahead of training


class ReferenceScorer:
    """The reference model of ``plugintrain prepare preference --reference``: the
    log-probability it gives each sequence's scored tokens (:func:`scored_logps`). Loaded
    at the first call and kept for every shard after; on the GPU where there is one.

    Args:
        weights: What ``CausalLM(weights=...)`` takes (a pretrained name, a Hugging Face
            directory, a GGUF or llm.c file, a checkpoint).
        batch_size: Sequences per forward.
    """

    def __init__(self, weights: str, batch_size: int = 8) -> None:
        self.weights, self.batch_size = weights, batch_size
        self.model: torch.nn.Module | None = None

    def __call__(self, sequences: list[tuple[np.ndarray, np.ndarray]]) -> np.ndarray:
        if self.model is None:
            from plugintrain.model_zoo.generation import PretrainedLM

            device = "cuda" if torch.cuda.is_available() else "cpu"
            self.model = PretrainedLM(weights=self.weights).eval().to(device)
        return scored_logps(self.model, sequences, self.batch_size)


@torch.no_grad()
def scored_logps(
    model: torch.nn.Module, sequences: Iterable[tuple[np.ndarray, np.ndarray]], batch_size: int = 8
) -> np.ndarray:
    """The log-probability ``model`` gives each sequence's scored tokens: ``(n,)`` float64.

    Args:
        model: Token ids ``(B, T)`` in, logits ``(B, T, V)`` out, on the device it runs on.
        sequences: ``(ids, mask)`` pairs: token ids and, per token, whether it is scored
            (the answer tokens); a token's log-prob is ``log p(ids[t] | ids[:t])``.
        batch_size: Sequences per forward (sorted by length first: little padding).
    """
    sequences = list(sequences)
    device = next(model.parameters()).device
    out = np.zeros(len(sequences), dtype=np.float64)
    order = np.argsort([len(ids) for ids, _ in sequences], kind="stable")
    for start in range(0, len(order), batch_size):
        chosen = order[start : start + batch_size]
        width = max(1, max(len(sequences[i][0]) for i in chosen) - 1)
        x = torch.zeros(len(chosen), width, dtype=torch.int64)
        y = torch.full_like(x, IGNORE_INDEX)
        for row, i in enumerate(chosen):
            ids = torch.as_tensor(np.asarray(sequences[i][0]).astype(np.int64))
            mask = torch.as_tensor(np.asarray(sequences[i][1], dtype=bool))
            n = len(ids) - 1
            x[row, :n] = ids[:-1]
            y[row, :n] = torch.where(mask[1:], ids[1:], IGNORE_INDEX)
        logits = model(x.to(device))
        out[chosen] = sequence_logps(logits, y.to(device)).double().cpu().numpy()
    return out
