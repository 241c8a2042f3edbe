"""Bits per byte, the one formula: what a model, its metrics, ``evaluate`` and the data
preparation's unigram baseline all report, so the four can never disagree."""

from __future__ import annotations

import math
from typing import TypeVar

T = TypeVar("T")


def bits_per_byte(nll: T, nbytes: T | int) -> T:
    """Bits per UTF-8 byte of text: the summed NLL (nats) of its tokens over ln 2 x the
    bytes they spell. Unlike loss per token it does not depend on the tokenizer, so models
    with different vocabularies compare on it. ``nll`` and ``nbytes`` are numbers or
    tensors alike."""
    return nll / (math.log(2) * nbytes)  # type: ignore[operator]
