"""Several prepared folders blended by weight (Megatron's and torchtitan's blended data).

An epoch of a mixture has as many samples as its sources have windows together (N);
source ``k`` gives ``m_k`` of them, its weight's share (largest remainders), spread evenly
through the epoch: the ``i``-th of its samples has the key ``(i + 1/2) / m_k`` and the
epoch is every source's samples in key order (ties: the lower source first). Each source is
read as an endless stream of its windows, one seeded permutation per pass, so a source
weighted above its size is repeated and one below it is subsampled, never twice in a pass.

Nothing here grows with the data: which source the ``j``-th sample comes from, and how many
of each source precede it, are computed from the counts alone (exact, in fractions: the
next ``3K/2`` keys after a bound below ``(j + 1/2) / N``, merged from the ``K`` sources), and a
permutation maps an index to its window through a seeded Feistel network
(`IndexPermutation`), never as a table.

The state that makes a resume exact is where each source's stream stood at the start of an
epoch (``base``): with unchanged weights, epoch ``e`` starts source ``k`` at
``base_k + (e - base_epoch) * m_k``. When a run resumes with other weights, every source
continues exactly where it stopped, and the new weights apply from the resumed sample on.
Other sources, or a source whose windows changed, are refused.
"""

from __future__ import annotations

import hashlib
import heapq
import itertools
import math
from collections.abc import Iterator, Sequence
from fractions import Fraction
from typing import Any

from torch.utils.data import Dataset


def apportion(weights: Sequence[float], total: int) -> list[int]:
    """Integer shares of ``total`` proportional to ``weights`` (largest remainders)."""
    w = [float(x) for x in weights]
    if not all(math.isfinite(x) and x > 0 for x in w):
        raise ValueError(f"mixture weights must be finite numbers > 0, got {list(weights)}")
    exact = [x / sum(w) * total for x in w]
    counts = [math.floor(e) for e in exact]
    order = sorted(range(len(w)), key=lambda k: (-(exact[k] - counts[k]), k))
    for k in order[: total - sum(counts)]:
        counts[k] += 1
    return counts


class Interleave:
    """The evenly spread order of ``counts[k]`` samples of each source, by index.

    Args:
        counts: Samples of each source in one epoch.
    """

    def __init__(self, counts: Sequence[int]) -> None:
        self.counts = [int(m) for m in counts]
        self.total = sum(self.counts)

    def _at_most(self, k: int, key: Fraction) -> int:
        """Samples of source ``k`` whose key ``(2i + 1) / (2 m_k)`` is <= ``key``."""
        m, p, q = self.counts[k], key.numerator, key.denominator
        if m == 0 or p < 0:
            return 0
        # (2i + 1) q <= 2 m p  <=>  i <= (2 m p - q) / (2 q)
        return max(0, min(m, (2 * m * p - q) // (2 * q) + 1))

    def _around(self, j: int) -> tuple[list[int], Iterator[tuple[Fraction, int, int]]]:
        """Counts of every source's samples surely before the ``j``-th, and the samples
        after those in order (key, source, index), the ``j``-th among the first few.

        A source's count of keys at or below ``x`` is within 1/2 of ``x * m_k``, so below
        ``x = (j - K/2 - 1) / N`` lie at most ``j - 1`` samples in all, and at least
        ``j - 3K/2 - 1``: the ``j``-th is within the next ``3K/2 + 2`` in key order, merged
        from the sources' own orders (``O(K log K)``).
        """
        below = Fraction(2 * j - len(self.counts) - 2, 2 * self.total)
        base = [self._at_most(k, below) for k in range(len(self.counts))]
        need = j - sum(base) + 1
        streams = [
            _keys(k, m, first, min(m, first + need))
            for k, (m, first) in enumerate(zip(self.counts, base, strict=True))
        ]
        return base, heapq.merge(*streams)

    def counts_before(self, j: int) -> list[int]:
        """How many samples of each source are among the first ``j`` of the epoch."""
        if j >= self.total:
            return list(self.counts)
        base, after = self._around(j)
        for _, k, _ in itertools.islice(after, j - sum(base)):
            base[k] += 1
        return base

    def locate(self, j: int) -> tuple[int, int]:
        """Source of the ``j``-th sample and how many of that source's samples precede it."""
        base, after = self._around(j)
        _, k, i = next(itertools.islice(after, j - sum(base), None))
        return k, i


def _keys(k: int, m: int, start: int, stop: int) -> Iterator[tuple[Fraction, int, int]]:
    """Source ``k``'s samples ``start..stop-1`` as (key, source, index), in order."""
    for i in range(start, stop):
        yield Fraction(2 * i + 1, 2 * m), k, i


class IndexPermutation:
    """A seeded permutation of ``range(size)`` evaluated one index at a time.

    A balanced Feistel network over the smallest even power of two >= ``size`` (four rounds
    of a keyed blake2b), walked until it lands inside the range: a bijection that needs no
    table, so a source of a billion windows costs nothing to shuffle.
    """

    def __init__(self, size: int, *seed: int) -> None:
        self.size = size
        self.half = max(1, (max(size - 1, 1).bit_length() + 1) // 2)
        self.key = hashlib.blake2b(repr(seed).encode(), digest_size=16).digest()

    def _round(self, r: int, value: int) -> int:
        digest = hashlib.blake2b(
            value.to_bytes(8, "little"), key=self.key, digest_size=8, salt=bytes([r]) * 16
        )
        return int.from_bytes(digest.digest(), "little") & ((1 << self.half) - 1)

    def __getitem__(self, index: int) -> int:
        if not 0 <= index < self.size:
            raise IndexError(index)
        mask, x = (1 << self.half) - 1, index
        while True:
            left, right = x >> self.half, x & mask
            for r in range(4):
                left, right = right, left ^ self._round(r, right)
            x = (left << self.half) | right
            if x < self.size:
                return x


class MixtureWindows(Dataset):
    """Windows of several datasets blended by weight; item ``g`` is sample ``g % N`` of
    epoch ``g // N`` (the sampler numbers samples by epoch).

    Args:
        sources: The sources' windows (each a dataset of ``(x, y)``).
        weights: Their weights (> 0; normalized here).
        seed: Seeds each source's permutations.
        shuffle: Permute each pass over a source (else read it in order).
        names: The sources as the state records them (their folders).
    """

    indexed_by_epoch = True

    def __init__(
        self,
        sources: Sequence[Dataset],
        weights: Sequence[float],
        seed: int,
        shuffle: bool,
        names: Sequence[str],
    ) -> None:
        self.sources = list(sources)
        self.sizes = [len(s) for s in self.sources]  # type: ignore[arg-type]
        self.names = list(names)
        self.seed, self.shuffle = seed, shuffle
        self.total = sum(self.sizes)
        self.base = [0] * len(self.sources)
        self.base_epoch = 0
        self._passes: dict[int, tuple[int, IndexPermutation]] = {}
        self.reweight(weights)

    def reweight(self, weights: Sequence[float]) -> None:
        self.weights = [float(w) for w in weights]
        self.counts = apportion(self.weights, self.total)
        starved = [n for n, m in zip(self.names, self.counts, strict=True) if m == 0]
        if starved:
            raise ValueError(
                f"mix: {starved[0]}'s weight is too small to give it one of the epoch's"
                f" {self.total} samples; raise its weight or drop it"
            )
        self.order = Interleave(self.counts)

    def __len__(self) -> int:
        return self.total

    def locate(self, sample: int) -> tuple[int, int]:
        """Source of global sample ``sample`` and its place in that source's stream."""
        epoch, j = divmod(sample, self.total)
        k, rank = self.order.locate(j)
        return k, self.base[k] + (epoch - self.base_epoch) * self.counts[k] + rank

    def __getitem__(self, sample: int) -> Any:
        k, n = self.locate(sample)
        passes, r = divmod(n, self.sizes[k])
        return self.sources[k][self._permutation(k, passes, r)]

    def _permutation(self, k: int, passes: int, r: int) -> int:
        if not self.shuffle:
            return r
        cached = self._passes.get(k)
        if cached is None or cached[0] != passes:  # one pass per source kept
            cached = (passes, IndexPermutation(self.sizes[k], self.seed, k, passes))
            self._passes[k] = cached
        return cached[1][r]

    def consumed(self, epoch: int, position: int) -> list[int]:
        """How far each source's stream is after ``position`` samples of ``epoch``."""
        before = self.order.counts_before(position)
        return [
            b + (epoch - self.base_epoch) * m + c
            for b, m, c in zip(self.base, self.counts, before, strict=True)
        ]

    def state(self, epoch: int, position: int) -> dict[str, Any]:
        """What a checkpoint records of the mixture at ``position`` of ``epoch``."""
        return {
            "sources": [[n, s] for n, s in zip(self.names, self.sizes, strict=True)],
            "weights": self.weights,
            "consumed": self.consumed(epoch, position),
        }

    def resume(self, saved: dict[str, Any], epoch: int, position: int) -> None:
        """Continue a saved mixture at ``position`` of ``epoch``: each source where its
        stream stood, the weights of this run from there on.

        Raises:
            ValueError: If the sources differ from the saved ones.
        """
        mine = [[n, s] for n, s in zip(self.names, self.sizes, strict=True)]
        if [list(s) for s in saved["sources"]] != mine:
            raise ValueError(
                f"the checkpoint's data mixture has the sources {saved['sources']} (folder,"
                f" windows), this run {mine}; resume with the same folders and seq_len (only"
                " the weights may change)"
            )
        before = self.order.counts_before(position)
        self.base = [int(c) - b for c, b in zip(saved["consumed"], before, strict=True)]
        self.base_epoch = epoch
