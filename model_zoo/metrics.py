"""What a language model reports of held-out text: perplexity and bits per byte, summed
over every batch and rank (token-weighted, not a mean of per-batch means)."""

from __future__ import annotations

import math

import torch
from torchmetrics import Metric

from plugintrain.model_zoo.cross_entropy import IGNORE_INDEX


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
        return self.nll_sum / (math.log(2) * self.total)


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
