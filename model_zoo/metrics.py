"""What a language model reports of held-out text: perplexity and bits per byte, summed
over every batch and rank (token-weighted, not a mean of per-batch means), during training
(:class:`EvalMetrics`) and after it (:func:`target_nll`, :class:`Totals` and the totals of
text windows and chat examples that ``plugintrain evaluate`` reports).

:func:`bits_per_byte` is the one formula (``plugintrain.core.bits_per_byte``, where data
preparation reads it too)."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from torchmetrics import Metric

from plugintrain.core.bits_per_byte import bits_per_byte
from plugintrain.model_zoo.cross_entropy import IGNORE_INDEX

if TYPE_CHECKING:
    import numpy as np

    from plugintrain.model_zoo.generation import PretrainedLM

__all__ = [
    "BitsPerByte",
    "EvalMetrics",
    "Perplexity",
    "Totals",
    "bits_per_byte",
    "chat_totals",
    "target_nll",
    "window_totals",
]


class _SummedNLL(Metric):
    """Total NLL (nats) and a total to divide it by, synced across ranks by summing both."""

    full_state_update = False
    higher_is_better = False

    def __init__(self) -> None:
        super().__init__()
        self.add_state(
            "nll_sum", default=torch.tensor(0.0, dtype=torch.float64), dist_reduce_fx="sum"
        )
        self.add_state("total", default=torch.tensor(0, dtype=torch.int64), dist_reduce_fx="sum")

    def _add(self, loss: torch.Tensor, num_tokens: int, total: int | torch.Tensor) -> None:
        self.nll_sum += loss.detach().double() * num_tokens
        self.total += total


class Perplexity(_SummedNLL):
    """Token-level perplexity from mean losses.

    Takes the loss already computed for the step, so the vocabulary softmax runs once.
    """

    def update(self, loss: torch.Tensor, num_tokens: int) -> None:
        """Add a batch whose mean token NLL is ``loss`` over ``num_tokens`` tokens."""
        self._add(loss, num_tokens, num_tokens)

    def compute(self) -> torch.Tensor:
        """``exp(total NLL / total tokens)``."""
        return torch.exp(self.nll_sum / self.total)


class BitsPerByte(_SummedNLL):
    """Bits per UTF-8 byte of text: total NLL (nats) / (ln 2 x total bytes of the targets).

    Unlike loss per token it does not depend on the tokenizer, so models with different
    vocabularies compare on it. Every target's NLL counts, also a special token's, which
    spells no bytes.
    """

    def update(self, loss: torch.Tensor, targets: torch.Tensor, token_bytes: torch.Tensor) -> None:
        """Add a batch whose mean token NLL is ``loss`` over ``targets`` (scored ids, any
        shape); ``token_bytes[i]`` is the number of bytes id ``i`` spells."""
        self._add(loss, targets.numel(), token_bytes[targets].sum())

    def compute(self) -> torch.Tensor:
        """``total NLL / (ln 2 x total bytes)``."""
        return bits_per_byte(self.nll_sum, self.total)


class EvalMetrics(torch.nn.Module):
    """The metrics of one evaluation stage, updated from each batch's mean loss: perplexity,
    and bits per byte once ``token_bytes`` (UTF-8 bytes per token id) is known."""

    def __init__(self) -> None:
        super().__init__()
        self.ppl = Perplexity()
        self.bpb = BitsPerByte()
        self.token_bytes: torch.Tensor | None = None

    def update(self, loss: torch.Tensor, targets: torch.Tensor) -> dict[str, Metric]:
        """Add a batch of mean loss ``loss`` over the scored ``targets`` (those that are not
        ``IGNORE_INDEX``, -100); returns the metrics to log."""
        targets = targets[targets != IGNORE_INDEX] if (targets < 0).any() else targets
        self.ppl.update(loss, targets.numel())
        token_bytes = self.bytes_on(targets.device)
        if token_bytes is None:
            return {"ppl": self.ppl}
        self.bpb.update(loss, targets, token_bytes)
        return {"ppl": self.ppl, "bpb": self.bpb}

    def bytes_on(self, device: torch.device) -> torch.Tensor | None:
        """``token_bytes`` on ``device`` (copied once, then a no-op), None if unknown."""
        if self.token_bytes is not None:
            self.token_bytes = self.token_bytes.to(device)
        return self.token_bytes


# ---- after training: plugintrain evaluate -------------------------------------------------


@dataclass
class Totals:
    """Summed NLL (nats) of the scored targets, their number and the bytes they spell."""

    nll: float = 0.0
    tokens: int = 0
    bytes: int = 0

    def add(self, nll: torch.Tensor, scored: torch.Tensor, nbytes: torch.Tensor | None) -> None:
        """Add the per-target ``nll`` ``(B, T)`` where ``scored``, and their bytes."""
        self.nll += float(nll[scored].double().sum())
        self.tokens += int(scored.sum())
        self.bytes += 0 if nbytes is None else int(nbytes[scored].sum())

    @property
    def loss(self) -> float | None:
        """Mean NLL per scored target; None without any."""
        return self.nll / self.tokens if self.tokens else None

    @property
    def bits_per_byte(self) -> float | None:
        """Bits per byte of the scored targets; None where their bytes are unknown."""
        return bits_per_byte(self.nll, self.bytes) if self.bytes else None


def target_nll(module: PretrainedLM, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """NLL (nats, fp32) of each target ``y`` ``(B, T)`` after the tokens ``x`` ``(B, T)``
    up to it: ``(B, T)``. One row's logits are upcast at a time."""
    import torch.nn.functional as F

    logits = module.model(x)  # (B, T, V)
    rows = zip(logits, y, strict=True)
    return torch.stack([F.cross_entropy(r.float(), t, reduction="none") for r, t in rows])


def window_totals(
    module: PretrainedLM,
    windows: Sequence[tuple[torch.Tensor, torch.Tensor]],
    count: int,
    batch_size: int,
    token_bytes: torch.Tensor | None,
) -> Totals:
    """The totals over the first ``count`` text ``windows`` (inputs, targets; read one
    batch at a time), every target scored; ``token_bytes[i]`` is the number of bytes id
    ``i`` spells (None: unknown)."""
    totals = Totals()
    for start in range(0, count, batch_size):
        rows = [windows[i] for i in range(start, min(start + batch_size, count))]
        x, y = (torch.stack(column).to(module.device) for column in zip(*rows, strict=True))
        nbytes = None if token_bytes is None else token_bytes[y]
        totals.add(target_nll(module, x, y), torch.ones_like(y, dtype=torch.bool), nbytes)
    return totals


def chat_totals(
    module: PretrainedLM,
    examples: Iterable[tuple[np.ndarray, np.ndarray]],
    batch_size: int,
    source: Path,
) -> tuple[Totals, int]:
    """The totals over the target tokens of ``examples`` (ids, mask: True where the token
    is a target) of ``source``, and their number.

    Raises:
        ValueError: If an example is longer than the model reads at once.
    """
    totals, count, batch = Totals(), 0, []
    for ids, mask in examples:
        count += 1
        if len(ids) > module.max_seq_len + 1:
            raise ValueError(
                f"{source} example {count} holds {len(ids)} tokens, more than the model's"
                f" block_size={module.max_seq_len} reads (+1 target); prepare the data with"
                f" --seq_len {module.max_seq_len}"
            )
        batch.append((ids, mask))
        if len(batch) == batch_size:
            totals.add(*_scored_nll(module, batch))
            batch = []
    if batch:
        totals.add(*_scored_nll(module, batch))
    return totals, count


def _scored_nll(
    module: PretrainedLM, batch: list[tuple[np.ndarray, np.ndarray]]
) -> tuple[torch.Tensor, torch.Tensor, None]:
    """Each target's NLL, and which are scored, of examples padded on the right: the pads
    come after a row's tokens, so causal attention keeps them out of every scored one."""
    width = max(1, max(len(ids) for ids, _ in batch) - 1)
    x = torch.zeros(len(batch), width, dtype=torch.long)
    y = torch.zeros(len(batch), width, dtype=torch.long)
    scored = torch.zeros(len(batch), width, dtype=torch.bool)
    for row, (ids, mask) in enumerate(batch):
        ids, n = torch.from_numpy(ids.astype("int64")), len(ids) - 1
        x[row, :n], y[row, :n] = ids[:-1], ids[1:]
        scored[row, :n] = torch.from_numpy(mask[1:].astype(bool))  # token t+1 is a target
    device = module.device
    return target_nll(module, x.to(device), y.to(device)), scored.to(device), None
