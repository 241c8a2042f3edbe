"""The batch of preference pairs: what ``PreferenceDataModule`` writes and
``PreferenceLM`` reads (plugintrain.data and plugintrain.model_zoo share it here).

A batch is ``(x, y)``. ``x`` ``(2P, T)`` int64 holds the rows' token ids but the last: row
``2i`` is pair ``i``'s prompt and chosen answer, row ``2i + 1`` the same prompt and its
rejected answer, right-padded. ``y`` ``(2P, T + 1)`` int64 holds, in its first ``T``
columns, each position's next token: the id itself on an answer token (the targets the
preference losses score), ``-101 - id`` on a prompt token (ORPO's NLL scores the prompt
too), :data:`IGNORE_INDEX` on padding; its last column holds the row's reference
log-prob as float64 bits (NaN without one). One tensor carries all of it, so every
strategy's batch splitting (data-parallel ranks, pipeline micro-batches) moves it with its
row.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import Tensor

IGNORE_INDEX = -100
"""A target that is not scored (torch's ``cross_entropy`` default ``ignore_index``)."""


def encode_targets(ids: np.ndarray, answer: np.ndarray) -> np.ndarray:
    """The first ``T`` columns of ``y`` for one row: ``ids`` ``(n,)`` its tokens and
    ``answer`` ``(n,)`` bool which are answer tokens; ``(n - 1,)`` int64, one a position."""
    following = ids[1:].astype(np.int64)
    return np.where(answer[1:], following, IGNORE_INDEX - 1 - following)


def pack_reference(targets: Tensor, reference: Tensor | np.ndarray) -> Tensor:
    """``targets`` ``(N, T)`` with each row's reference log-prob ``(N,)`` appended as its
    float64 bits: ``(N, T + 1)`` int64."""
    bits = torch.as_tensor(reference, dtype=torch.float64).contiguous().view(torch.int64)
    return torch.cat((targets, bits.to(targets.device)[:, None]), dim=1)


def unpack_reference(y: Tensor) -> tuple[Tensor, Tensor]:
    """``y``'s answer targets ``(N, T)`` (every other position :data:`IGNORE_INDEX`) and
    reference log-probs ``(N,)`` float64, NaN where the data holds none."""
    targets = y[:, :-1]
    return torch.where(targets >= 0, targets, IGNORE_INDEX), y[:, -1].contiguous().view(
        torch.float64
    )


def row_targets(y: Tensor) -> Tensor:
    """``y``'s targets of every prompt and answer token ``(N, T)``, padding
    :data:`IGNORE_INDEX`."""
    targets = y[:, :-1]
    prompt = targets < IGNORE_INDEX
    return torch.where(prompt, IGNORE_INDEX - 1 - targets, targets)
