"""Preference batches for DPO and its family: pairs from ``plugintrain prepare
preference``, a pair's chosen and rejected sequences side by side in one micro-batch,
sharded by data-parallel rank and resumable.

**The batch** ``(x, y)`` of ``B`` pairs (what ``PreferenceLM`` reads):

- ``x`` int64 ``(2B, T)``: row ``2i`` pair ``i``'s chosen sequence ``ids[:-1]``, row
  ``2i + 1`` its rejected one, right-padded with ``pad_id``;
- ``y`` int64 ``(2B, T + 4)``: ``y[:, :T]`` the targets ``ids[1:]`` (an answer token's
  id, ``-101 - id`` on a prompt token, ``IGNORE_INDEX`` on padding); ``y[:, T]`` the
  row's reference log-prob, its float64 bits (NaN's where the folder has none);
  ``y[:, T + 1:]`` the totals of the batch's optimizer step (its pairs, its chosen
  answers' and chosen rows' targets), which make the NLL terms token-weighted over the
  step. The layout and its readers are :mod:`plugintrain.core.preference_batch`'s.

``T`` is the batch's longest row rounded up to ``pad_multiple``, at most ``seq_len``. One
dataset item is one pair, so no sampler, rank or micro-batch split ever parts a pair.

**Step totals.** Ranks are dealt the shuffled order in turn, so one optimizer step (each
rank's ``accumulate_grad_batches`` micro-batches of ``batch_size`` pairs) is a contiguous
run of ``ranks * accumulate * batch_size`` pairs of it: every rank's sampler
(:class:`StepTotalsSampler`) sums the step's targets from the order alone, before its
first micro-batch is drawn and with no communication, as a token-weighted loss needs
(Hugging Face's Trainer counts them by fetching the step's batches ahead and all-reducing).
Validation batches carry their own totals.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
import torch
from torch.utils.data import Dataset

from plugintrain.core.preference_batch import encode_targets, pack_batch
from plugintrain.data.datamodules.chat_datamodule import (  # a chat folder's arrays, checks
    IGNORE_INDEX,
    ChatExamples,
    check_seq_len,
    check_split,
    check_tokens,
    prepare_hint,
)
from plugintrain.data.datamodules.resumable import ResumableBatches, ResumableSampler
from plugintrain.data.datamodules.token_shards import read_meta

PREFERENCE_KIND = "preference"
"""``meta.json``'s ``kind`` in a folder written by ``plugintrain prepare preference``."""


def is_preference_folder(meta: dict[str, Any]) -> bool:
    """Whether ``meta`` (a folder's ``meta.json``) is ``plugintrain prepare preference``'s."""
    return meta.get("kind") == PREFERENCE_KIND


class PreferencePairs(Dataset):
    """One split of a preference folder, memory-mapped: item ``i`` is pair ``i``'s chosen
    and rejected ``(ids, mask)`` and their reference log-probs (NaN without).

    Args:
        folder: A folder written by ``plugintrain prepare preference``.
        split: ``"train"`` or ``"val"``.
    """

    def __init__(self, folder: Path, split: str) -> None:
        self.sequences = ChatExamples(folder, split)  # the same three arrays, 2n sequences
        path = folder / f"{split}.ref_logps.npy"
        count = len(self.sequences)
        self.ref = np.load(path) if path.is_file() else np.full(count, np.nan)
        if count % 2 or self.ref.shape != (count,):
            raise ValueError(
                f"{folder}/{split} holds {count} sequences and {self.ref.shape} reference"
                " log-probs, not two of each a pair; prepare it again"
            )

    def __len__(self) -> int:
        return len(self.sequences) // 2

    @property
    def lengths(self) -> np.ndarray:
        """Tokens of each sequence, ``(2n,)``."""
        return self.sequences.lengths

    def target_counts(self, pairs: np.ndarray) -> np.ndarray:
        """``(answer, row)`` targets of each pair's chosen sequence: ``(len(pairs), 2)``
        int64 (its answer tokens after the first token, and all its tokens but one)."""
        chosen = 2 * np.asarray(pairs, dtype=np.int64)
        starts, ends = self.sequences.offsets[chosen], self.sequences.offsets[chosen + 1]
        mask = self.sequences.mask
        spans = zip(starts.tolist(), ends.tolist(), strict=True)
        answers = [int(mask[a + 1 : b].sum(dtype=np.int64)) for a, b in spans]
        return np.stack((np.asarray(answers, dtype=np.int64), ends - starts - 1), axis=1)

    def __getitem__(self, key: int | tuple[int, tuple[int, int, int]]) -> Any:
        """Pair ``key``'s chosen and rejected ``(ids, mask, reference log-prob)``; a
        :class:`StepPair` for ``(pair, step totals)`` (:class:`StepTotalsSampler`'s)."""
        pair, totals = key if isinstance(key, tuple) else (key, None)
        rows = [(*self.sequences.example(i), float(self.ref[i])) for i in (2 * pair, 2 * pair + 1)]
        return rows if totals is None else StepPair(rows, totals)


class StepPair(NamedTuple):
    """A training pair and the totals of the optimizer step it is trained in."""

    rows: list[tuple[np.ndarray, np.ndarray, float]]
    totals: tuple[int, int, int]  # pairs, chosen answer targets, chosen row targets


class StepTotalsSampler(ResumableSampler):
    """The training pairs' sampler: yields ``(pair, step totals)`` (see the module
    docstring), the totals of the optimizer step the pair is trained in.

    Lightning steps whenever its count of the epoch's ready micro-batches reaches a
    multiple of ``accumulate``, a count a resumed run carries on from its checkpoint (made
    under any layout): so a resumed run's first step here may hold fewer. Both are read
    when an epoch is iterated (after callbacks such as ``GradientAccumulationScheduler``
    have set them).

    Args:
        dataset: The training pairs.
        num_replicas: Data-parallel world size.
        rank: Data-parallel rank.
        shuffle: Shuffle each epoch.
        seed: Base seed (as `ResumableSampler`'s; the tail is dropped).
        batch_size: Pairs per micro-batch (the loader drops a short last one).
        phase: ``() -> (accumulate, micro-batches Lightning has counted toward its
            steps before this iteration)``, from the trainer.
    """

    def __init__(
        self,
        dataset: PreferencePairs,
        num_replicas: int,
        rank: int,
        shuffle: bool,
        seed: int,
        batch_size: int,
        phase: Callable[[], tuple[int, int]],
    ) -> None:
        super().__init__(dataset, num_replicas, rank, shuffle=shuffle, seed=seed, drop_last=True)
        self.pairs, self.batch_size, self.phase = dataset, batch_size, phase

    def __iter__(self) -> Iterator[tuple[int, tuple[int, int, int]]]:  # type: ignore[override]
        rest, end = self._rest()
        ranks = self.num_replicas
        used = end // ranks // self.batch_size * self.batch_size * ranks  # whole batches
        accumulate, done = self.phase()
        step = ranks * accumulate * self.batch_size
        lead = (-done) % accumulate * ranks * self.batch_size  # the first step's rest
        current, totals = -1, (0, 0, 0)
        for position in range(self.rank, used, ranks):
            index = 0 if position < lead else (lead > 0) + (position - lead) // step
            if index != current:  # a new step: its run of the order, summed
                current = index
                first = 0 if index == 0 else lead + (index - (lead > 0)) * step
                last = lead if index == 0 and lead else first + step
                run = np.asarray(rest[first : min(last, used)])
                answers, rows = self.pairs.target_counts(run).sum(axis=0).tolist()
                totals = (len(run), answers, rows)
            yield int(rest[position]), totals


class PairCollator:
    """Pairs -> the batch ``(x, y)`` of the module docstring.

    Args:
        pad_id: Token that fills a row's tail.
        seq_len: Most tokens of a row (``T <= seq_len``).
        pad_multiple: ``T`` is the longest row rounded up to this.
    """

    def __init__(self, pad_id: int, seq_len: int, pad_multiple: int) -> None:
        self.pad_id, self.seq_len, self.pad_multiple = pad_id, seq_len, pad_multiple

    def __call__(self, pairs: list[Any]) -> Any:
        """``pairs``: `PreferencePairs` items (a pair's two rows, or a `StepPair`)."""
        totals = {pair.totals for pair in pairs if isinstance(pair, StepPair)}
        pairs = [pair.rows if isinstance(pair, StepPair) else pair for pair in pairs]
        if len(totals) > 1:
            raise ValueError(f"one batch's pairs are of different steps: {sorted(totals)}")
        rows = [row for pair in pairs for row in pair]  # chosen, rejected, chosen, ...
        longest = max(len(ids) - 1 for ids, _, _ in rows)
        T = min(-(-longest // self.pad_multiple) * self.pad_multiple, self.seq_len)
        x = np.full((len(rows), T), self.pad_id, dtype=np.int64)
        targets = np.full((len(rows), T), IGNORE_INDEX, dtype=np.int64)
        for r, (ids, mask, _) in enumerate(rows):
            n = len(ids) - 1
            x[r, :n] = ids[:-1]
            targets[r, :n] = encode_targets(ids, mask)
        ref = np.array([ref for _, _, ref in rows], dtype=np.float64)
        step = totals.pop() if totals else _own_totals(rows)
        y = pack_batch(torch.from_numpy(targets), ref, torch.tensor(step))
        return torch.from_numpy(x), y


def _own_totals(rows: list[tuple[np.ndarray, np.ndarray, float]]) -> tuple[int, int, int]:
    """A batch's own totals: its pairs and its chosen rows' answer and row targets."""
    chosen = rows[0::2]
    answers = sum(int(mask[1:].sum()) for _, mask, _ in chosen)
    return len(chosen), answers, sum(len(ids) - 1 for ids, _, _ in chosen)


class PreferenceDataModule(ResumableBatches):
    """Preference batches ``(x, y)``, ``(2B, T)`` and ``(2B, T + 4)``, from a folder written
    by ``plugintrain prepare preference`` (the layout: the module docstring).

    Pairs are shuffled every epoch from ``seed``; checkpoints record the position in the
    epoch, and a resumed ``fit`` continues with the pairs the uninterrupted run would have
    seen next. Validation keeps the file's order.

    Args:
        data_dir: The folder ``plugintrain prepare preference`` wrote.
        batch_size: Pairs per micro-batch on each data-parallel rank (B; 2B rows).
        seq_len: Most tokens of a row; None: the ``--seq_len`` the folder was prepared
            with. No sequence may be longer.
        pad_multiple: A batch's rows are padded to its longest, rounded up to this (8:
            little padding, and lengths that tensor-parallel degrees 2, 4 and 8 divide).
        vocab_size: The model's vocabulary size; a folder of a larger vocabulary is refused.
        max_seq_len: The model's maximum sequence length; ``seq_len`` may not exceed it.
        tokenizer: The tokenizer whose ids the model reads; a folder prepared with another
            one is refused.
        seed: Seed of each epoch's shuffle (``seed + epoch``).
        shuffle: Shuffle the training pairs each epoch.
        num_workers: DataLoader worker processes.
        reference_cache: Where a run that scores its own reference log-probs keeps them
            (``PreferenceLM``'s first pass); None: ``DATA_DIR/reference_cache``. Every rank
            must see it (a shared filesystem across nodes, as for checkpoints).
    """

    loss_mask = False
    """Its targets are not the token-mean loss's: the preference objective reads them."""
    preference = True
    """Its batches are pairs (see the module docstring)."""

    def __init__(
        self,
        data_dir: str = "data/preference",
        batch_size: int = 4,
        seq_len: int | None = None,
        pad_multiple: int = 8,
        vocab_size: int | None = None,
        max_seq_len: int | None = None,
        tokenizer: str | None = None,
        seed: int = 1337,
        shuffle: bool = True,
        num_workers: int = 0,
        reference_cache: str | None = None,
    ) -> None:
        super().__init__(batch_size, seed, shuffle, num_workers)
        self.save_hyperparameters()
        self.data_dir = Path(data_dir)
        self.meta = _preference_meta(self.data_dir, tokenizer, vocab_size)
        self.seq_len = int(self.meta["settings"]["seq_len"]) if seq_len is None else seq_len
        if min(batch_size, self.seq_len, pad_multiple) < 1:
            raise ValueError(
                f"batch_size ({batch_size}), seq_len ({self.seq_len}) and pad_multiple"
                f" ({pad_multiple}) must be >= 1"
            )
        check_seq_len(self.seq_len, max_seq_len, "sequence")
        self.pad_id = int(self.meta.get("pad_id", self.meta.get("eos_id", 0)))
        self.collate_fn = PairCollator(self.pad_id, self.seq_len, pad_multiple)
        root = self.data_dir / "reference_cache" if reference_cache is None else reference_cache
        self.reference_cache_root = Path(root)
        self._scored = False

    @property
    def has_reference(self) -> bool:
        """Whether the batches carry reference log-probs: the folder's (``prepare
        preference --reference``), or a first pass's (:meth:`use_reference`)."""
        return self.meta.get("reference") is not None or self._scored

    def use_reference(self, logps: dict[str, np.ndarray]) -> None:
        """Carry ``logps`` (each split's ``(2n,)`` float64, as ``S.ref_logps.npy``) from
        now on: a first pass's, which scored the splits :meth:`setup` opened."""
        for split, values in logps.items():
            pairs = self.train_set if split == "train" else self.val_set
            assert pairs is not None and values.shape == pairs.ref.shape, split
            pairs.ref = values
        self._scored = True

    def setup(self, stage: str) -> None:
        """Open the splits ``stage`` needs."""
        if stage in ("fit", "validate") and self.val_set is None:
            self.val_set = self._pairs("val")
        if stage == "fit" and self.train_set is None:
            self.train_set = self._pairs("train")

    def _sampler(self, dataset: Dataset, shuffle: bool, drop_last: bool) -> ResumableSampler:
        if dataset is not self.train_set:
            return super()._sampler(dataset, shuffle, drop_last)
        assert isinstance(dataset, PreferencePairs) and drop_last
        replicas, rank = self._data_parallel_layout()
        return StepTotalsSampler(
            dataset, replicas, rank, shuffle, self.seed, self.batch_size, self._step_phase
        )

    def _step_phase(self) -> tuple[int, int]:
        """Lightning's ``accumulate_grad_batches`` now, and the micro-batches it counts
        toward its next step (it steps when its count of ready batches reaches a multiple:
        a resumed run's count carries on from its checkpoint's)."""
        accumulate = int(getattr(self.trainer, "accumulate_grad_batches", 1) or 1)
        fit_loop = getattr(self.trainer, "fit_loop", None)
        ready = 0 if fit_loop is None else fit_loop.epoch_loop.batch_progress.current.ready
        return accumulate, int(ready)

    def _pairs(self, split: str) -> PreferencePairs:
        pairs = PreferencePairs(self.data_dir, split)
        check_split(self.data_dir, split, pairs.lengths, self.seq_len, "pairs", "a sequence")
        return pairs


def _preference_meta(folder: Path, tokenizer: str | None, vocab_size: int | None) -> dict[str, Any]:
    """The folder's ``meta.json``, checked: a preference folder, of the model's tokenizer
    and within its vocabulary."""
    meta = read_meta(folder)
    if not is_preference_folder(meta):
        raise ValueError(_not_preference(folder, meta))
    check_tokens(folder, meta, tokenizer, vocab_size, "the pairs")
    return meta


def _not_preference(folder: Path, meta: dict[str, Any]) -> str:
    """What ``folder`` holds instead of pairs, and what to do."""
    if meta.get("kind") == "chat":
        return (
            f"{folder} holds chat examples (plugintrain prepare chat), not preference pairs;"
            " train on it with `data: class_path: plugintrain.data.ChatDataModule`, or"
            " prepare pairs with `plugintrain prepare preference`"
        )
    what, out = prepare_hint(folder, meta, PREFERENCE_KIND)
    return (
        f"{folder} holds {what}, not preference pairs; prepare them with `plugintrain prepare"
        f" preference PAIRS.jsonl --tokenizer T --out {out}` and pass"
        f" `--data.init_args.data_dir {out}`"
        + (", or train on the text with `plugintrain.data.TokenDataModule`" if meta else "")
    )
