"""Preference batches for DPO and its family: pairs from ``plugintrain prepare
preference``, a pair's chosen and rejected sequences side by side in one micro-batch,
sharded by data-parallel rank and resumable.

**The batch** ``(x, y)`` of ``B`` pairs (what ``PreferenceLM`` reads):

- ``x`` int64 ``(2B, T)``: row ``2i`` pair ``i``'s chosen sequence ``ids[:-1]``, row
  ``2i + 1`` its rejected one, right-padded with ``pad_id``;
- ``y`` int64 ``(2B, T + 1)``: ``y[:, :T]`` the targets ``ids[1:]`` (an answer token's
  id, ``-101 - id`` on a prompt token, ``IGNORE_INDEX`` on padding); ``y[:, T]`` the
  row's reference log-prob, its float64 bits (NaN's where the folder has none). The
  layout and its readers are :mod:`plugintrain.core.preference_batch`'s.

``T`` is the batch's longest row rounded up to ``pad_multiple``, at most ``seq_len``. One
dataset item is one pair, so no sampler, rank or micro-batch split ever parts a pair.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset

from plugintrain.core.preference_batch import encode_targets, pack_reference
from plugintrain.data.datamodules.chat_datamodule import (  # a chat folder's arrays, checks
    IGNORE_INDEX,
    ChatExamples,
    check_seq_len,
    check_split,
    check_tokens,
    prepare_hint,
)
from plugintrain.data.datamodules.resumable import ResumableBatches
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

    def __getitem__(self, pair: int) -> list[tuple[np.ndarray, np.ndarray, float]]:
        return [(*self.sequences.example(i), float(self.ref[i])) for i in (2 * pair, 2 * pair + 1)]


class PairCollator:
    """Pairs -> the batch ``(x, y)`` of the module docstring.

    Args:
        pad_id: Token that fills a row's tail.
        seq_len: Most tokens of a row (``T <= seq_len``).
        pad_multiple: ``T`` is the longest row rounded up to this.
    """

    def __init__(self, pad_id: int, seq_len: int, pad_multiple: int) -> None:
        self.pad_id, self.seq_len, self.pad_multiple = pad_id, seq_len, pad_multiple

    def __call__(self, pairs: list[list[tuple[np.ndarray, np.ndarray, float]]]) -> Any:
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
        return torch.from_numpy(x), pack_reference(torch.from_numpy(targets), ref)


class PreferenceDataModule(ResumableBatches):
    """Preference batches ``(x, y)``, ``(2B, T)`` and ``(2B, T + 1)``, from a folder written
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

    @property
    def has_reference(self) -> bool:
        """Whether the folder holds reference log-probs (``prepare preference
        --reference``)."""
        return self.meta.get("reference") is not None

    def setup(self, stage: str) -> None:
        """Open the splits ``stage`` needs."""
        if stage in ("fit", "validate") and self.val_set is None:
            self.val_set = self._pairs("val")
        if stage == "fit" and self.train_set is None:
            self.train_set = self._pairs("train")

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
