"""The batch of preference pairs: what ``PreferenceDataModule`` writes and
``PreferenceLM`` reads (plugintrain.data and plugintrain.model_zoo share it here).

A batch is ``(x, y)``. ``x`` ``(2P, T)`` int64 holds the rows' token ids but the last: row
``2i`` is pair ``i``'s prompt and chosen answer, row ``2i + 1`` the same prompt and its
rejected answer, right-padded. ``y`` ``(2P, T + 4)`` int64 holds:

- in its first ``T`` columns, each position's next token: the id itself on an answer
  token (the targets the preference losses score), ``-101 - id`` on a prompt token
  (ORPO's NLL scores the prompt too), :data:`IGNORE_INDEX` on padding;
- in column ``T``, the row's reference log-prob as float64 bits (NaN without one);
- in columns ``T + 1 .. T + 3``, the same on every row, the :data:`STEP_TOTALS` of the
  optimizer step the batch belongs to, over every micro-batch and data-parallel rank of
  it: its pairs, its chosen answers' targets, and its chosen rows' targets (prompt and
  answer). The NLL terms divide by them, so they are the mean over the step's tokens, as
  the chat loss is, however the step is split. 0 where the data does not know them: the
  batch's own then stand in.

One tensor carries all of it, so every strategy's batch splitting (data-parallel ranks,
pipeline micro-batches) moves it with its row.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import Tensor

IGNORE_INDEX = -100
"""A target that is not scored (torch's ``cross_entropy`` default ``ignore_index``)."""
STEP_TOTALS = ("pairs", "answer_targets", "row_targets")
"""What ``y``'s last three columns count over the batch's optimizer step."""
EXTRA_COLUMNS = 1 + len(STEP_TOTALS)
"""``y``'s columns after the ``T`` targets: the reference log-prob, the step's totals."""


def encode_targets(ids: np.ndarray, answer: np.ndarray) -> np.ndarray:
    """The first ``T`` columns of ``y`` for one row: ``ids`` ``(n,)`` its tokens and
    ``answer`` ``(n,)`` bool which are answer tokens; ``(n - 1,)`` int64, one a position."""
    following = ids[1:].astype(np.int64)
    return np.where(answer[1:], following, IGNORE_INDEX - 1 - following)


def pack_batch(
    targets: Tensor, reference: Tensor | np.ndarray, step_totals: Tensor | None = None
) -> Tensor:
    """``y`` ``(N, T + 4)`` int64 from ``targets`` ``(N, T)`` (:func:`encode_targets`'s),
    each row's reference log-prob ``(N,)`` (stored as its float64 bits) and the step's
    :data:`STEP_TOTALS` ``(3,)`` (None: unknown, zeros)."""
    bits = torch.as_tensor(reference, dtype=torch.float64).contiguous().view(torch.int64)
    totals = torch.zeros(len(STEP_TOTALS), dtype=torch.int64)
    if step_totals is not None:
        totals = torch.as_tensor(step_totals, dtype=torch.int64)
    totals = totals.to(targets.device).expand(targets.size(0), -1)
    return torch.cat((targets, bits.to(targets.device)[:, None], totals), dim=1)


def with_reference(y: Tensor, reference: Tensor) -> Tensor:
    """``y`` with its rows' reference log-probs replaced by ``reference`` ``(N,)``."""
    T = y.size(1) - EXTRA_COLUMNS
    bits = reference.to(torch.float64).contiguous().view(torch.int64)
    return torch.cat((y[:, :T], bits[:, None], y[:, T + 1 :]), dim=1)


def unpack_reference(y: Tensor) -> tuple[Tensor, Tensor]:
    """``y``'s answer targets ``(N, T)`` (every other position :data:`IGNORE_INDEX`) and
    reference log-probs ``(N,)`` float64, NaN where the data holds none."""
    T = y.size(1) - EXTRA_COLUMNS
    targets = y[:, :T]
    return torch.where(targets >= 0, targets, IGNORE_INDEX), y[:, T].contiguous().view(
        torch.float64
    )


def step_totals(y: Tensor) -> Tensor:
    """The :data:`STEP_TOTALS` ``y`` carries: ``(3,)`` int64 on ``y``'s device, zeros
    where the data did not know them (read without a host sync)."""
    if y.size(0) == 0:
        return torch.zeros(len(STEP_TOTALS), dtype=torch.int64, device=y.device)
    return y[0, y.size(1) - len(STEP_TOTALS) :]


def row_targets(y: Tensor) -> Tensor:
    """``y``'s targets of every prompt and answer token ``(N, T)``, padding
    :data:`IGNORE_INDEX`."""
    targets = y[:, : y.size(1) - EXTRA_COLUMNS]
    prompt = targets < IGNORE_INDEX
    return torch.where(prompt, IGNORE_INDEX - 1 - targets, targets)
