"""Several prepared folders blended by weight (Megatron's and torchtitan's blended data).

An epoch of a mixture has as many samples as its sources have windows together; source
``k`` gives ``round(weight_k * N)`` of them (largest remainders), spread evenly through the
epoch (the ``i``-th of its ``m`` samples sits at ``(i + 1/2) / m`` of the way). Each source
is read as an endless stream of its windows, one seeded permutation per pass, so a source
weighted above its size is repeated and one below it is subsampled, never twice in a pass.

The state that makes a resume exact is where each source's stream stood at the start of an
epoch (``base``): with unchanged weights, epoch ``e`` starts source ``k`` at
``base_k + (e - base_epoch) * m_k``. When a run resumes with other weights, every source
continues exactly where it stopped, and the new weights apply from the resumed sample on.
Other sources, or a source whose windows changed, are refused.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

import numpy as np
from torch.utils.data import Dataset


def apportion(weights: Sequence[float], total: int) -> np.ndarray:
    """Integer shares of ``total`` proportional to ``weights`` (largest remainders), each
    at least 1."""
    w = np.asarray(weights, dtype=np.float64)
    exact = w / w.sum() * total
    counts = np.maximum(np.floor(exact).astype(np.int64), 1)
    order = np.argsort(-(exact - np.floor(exact)), kind="stable")
    for k in order[: max(total - int(counts.sum()), 0)]:
        counts[k] += 1
    return counts


def interleave(counts: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Each sample's source and its rank within that source, spread evenly."""
    keys = np.concatenate([(np.arange(m) + 0.5) / m for m in counts])
    sources = np.concatenate([np.full(m, k, dtype=np.int32) for k, m in enumerate(counts)])
    ranks = np.concatenate([np.arange(m, dtype=np.int64) for m in counts])
    order = np.lexsort((sources, keys))
    return sources[order], ranks[order]


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
        self.base = np.zeros(len(self.sources), dtype=np.int64)
        self.base_epoch = 0
        self.reweight(weights)

    def reweight(self, weights: Sequence[float]) -> None:
        self.weights = [float(w) for w in weights]
        self.counts = apportion(self.weights, self.total)
        self.source_of, self.rank_of = interleave(self.counts)

    def __len__(self) -> int:
        return self.total

    def locate(self, sample: int) -> tuple[int, int]:
        """Source of global sample ``sample`` and its place in that source's stream."""
        epoch, j = divmod(sample, self.total)
        k = int(self.source_of[j])
        n = self.base[k] + (epoch - self.base_epoch) * self.counts[k] + self.rank_of[j]
        return k, int(n)

    def __getitem__(self, sample: int) -> Any:
        k, n = self.locate(sample)
        passes, r = divmod(n, self.sizes[k])
        return self.sources[k][int(self._permutation(k, passes)[r])]

    @functools.lru_cache(maxsize=8)  # noqa: B019 (a dataset lives as long as its run)
    def _permutation(self, k: int, passes: int) -> np.ndarray:
        if not self.shuffle:
            return np.arange(self.sizes[k])
        return np.random.default_rng([self.seed, k, passes]).permutation(self.sizes[k])

    def consumed(self, epoch: int, position: int) -> np.ndarray:
        """How far each source's stream is after ``position`` samples of ``epoch``."""
        before = np.bincount(self.source_of[:position], minlength=len(self.sources))
        return self.base + (epoch - self.base_epoch) * self.counts + before

    def state(self, epoch: int, position: int) -> dict[str, Any]:
        """What a checkpoint records of the mixture at ``position`` of ``epoch``."""
        return {
            "sources": [[n, s] for n, s in zip(self.names, self.sizes, strict=True)],
            "weights": self.weights,
            "consumed": self.consumed(epoch, position).tolist(),
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
        before = np.bincount(self.source_of[:position], minlength=len(self.sources))
        self.base = np.asarray(saved["consumed"], dtype=np.int64) - before
        self.base_epoch = epoch
