"""Language-model batches from llm.c token files, sharded by data-parallel rank, resumable."""

from __future__ import annotations

import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch
from lightning.pytorch import LightningDataModule
from lightning.pytorch.utilities.warnings import PossibleUserWarning
from torch.utils.data import DataLoader, Dataset, DistributedSampler

from plugintrain.data.token_bin import read_token_bin

# Lightning warns on every mid-epoch resume unless the DataLoader itself is stateful; this
# datamodule restores the position through its sampler instead, so the warning is wrong here.
_NOT_RESUMABLE_WARNING = "You're resuming from a checkpoint that ended before the epoch ended"


class TokenWindows(Dataset):
    """Non-overlapping windows of a token file: item ``i`` is ``(x, y)``, int64 of shape (T,).

    ``x = tokens[i*T : i*T + T]`` and ``y = tokens[i*T + 1 : i*T + T + 1]`` (next tokens).

    Args:
        path: llm.c token file, memory-mapped on first access (also in each worker).
        seq_len: Window length T.
    """

    def __init__(self, path: str | Path, seq_len: int) -> None:
        self.path = Path(path)
        self.seq_len = seq_len
        self._tokens: np.memmap | None = None
        self.num_tokens = len(self.tokens)

    @property
    def tokens(self) -> np.memmap:
        """The memory-mapped token ids."""
        if self._tokens is None:
            self._tokens = read_token_bin(self.path)
        return self._tokens

    def __len__(self) -> int:
        # The last window needs one extra token for its final target.
        return max(self.num_tokens - 1, 0) // self.seq_len

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        start = i * self.seq_len
        chunk = torch.from_numpy(self.tokens[start : start + self.seq_len + 1].astype(np.int64))
        return chunk[:-1], chunk[1:]

    def __getstate__(self) -> dict[str, Any]:
        # Workers re-open the memmap rather than receive a pickled copy of the whole file.
        return {**self.__dict__, "_tokens": None}


class ResumableSampler(DistributedSampler):
    """Shuffles with ``seed + epoch``, shards by data-parallel rank, and can resume mid-epoch.

    A `DistributedSampler` subclass so Lightning keeps it instead of injecting its own.

    Args:
        dataset: The dataset to sample.
        num_replicas: Data-parallel world size (tensor-parallel peers share a replica).
        rank: Data-parallel rank.
        shuffle: Shuffle each epoch.
        seed: Base seed; epoch ``e`` uses ``seed + e``.
        drop_last: Drop the tail that does not split evenly, instead of repeating samples.
    """

    def __init__(
        self,
        dataset: Dataset,
        num_replicas: int,
        rank: int,
        shuffle: bool,
        seed: int,
        drop_last: bool,
    ) -> None:
        super().__init__(
            dataset, num_replicas, rank, shuffle=shuffle, seed=seed, drop_last=drop_last
        )
        self.resume_epoch = -1
        self.resume_samples = 0

    def resume(self, epoch: int, samples: int) -> None:
        """Skip this rank's first ``samples`` samples whenever ``epoch`` is iterated."""
        self.resume_epoch, self.resume_samples = epoch, samples

    def __iter__(self) -> Iterator[int]:
        indices = list(super().__iter__())
        if self.epoch == self.resume_epoch:
            indices = indices[self.resume_samples :]
        return iter(indices)


class TokenDataModule(LightningDataModule):
    """Next-token batches ``(x, y)`` of shape (B, T) from ``train.bin`` / ``val.bin``.

    Batches are split by data-parallel rank only, taken from the strategy's
    ``distributed_sampler_kwargs``, so tensor-parallel peers receive identical batches.
    Checkpoints record how far into the epoch training got, and a resumed ``fit`` continues
    with exactly the batches the uninterrupted run would have seen next.

    Args:
        data_dir: Directory with the token files written by ``plugintrain prepare``.
        seq_len: Tokens per training sequence (T).
        batch_size: Sequences per batch on each data-parallel rank (B).
        vocab_size: The model's vocabulary size; a token id at or above it is an error.
        max_seq_len: The model's maximum sequence length; ``seq_len`` may not exceed it.
        seed: Shuffling seed; epoch ``e`` is shuffled with ``seed + e``.
        shuffle: Shuffle training windows each epoch (validation is never shuffled).
        num_workers: DataLoader worker processes.
        train_file: Training token file name inside ``data_dir``.
        val_file: Validation token file name inside ``data_dir``.
    """

    def __init__(
        self,
        data_dir: str = "data/shakespeare_gpt2",
        seq_len: int = 256,
        batch_size: int = 8,
        vocab_size: int | None = None,
        max_seq_len: int | None = None,
        seed: int = 1337,
        shuffle: bool = True,
        num_workers: int = 0,
        train_file: str = "train.bin",
        val_file: str = "val.bin",
    ) -> None:
        super().__init__()
        if seq_len < 1 or batch_size < 1:
            raise ValueError(f"seq_len ({seq_len}) and batch_size ({batch_size}) must be >= 1")
        if max_seq_len is not None and seq_len > max_seq_len:
            raise ValueError(f"seq_len={seq_len} exceeds the model's max_seq_len={max_seq_len}")
        self.save_hyperparameters()
        self.data_dir = Path(data_dir)
        self.seq_len = seq_len
        self.batch_size = batch_size
        self.vocab_size = vocab_size
        self.seed = seed
        self.shuffle = shuffle
        self.num_workers = num_workers
        self.train_file = train_file
        self.val_file = val_file
        self.train_set: TokenWindows | None = None
        self.val_set: TokenWindows | None = None
        self._train_sampler: ResumableSampler | None = None
        self._resume = (-1, 0)

    def setup(self, stage: str) -> None:
        """Open and check the token files needed by ``stage``."""
        if stage in ("fit", "validate") and self.val_set is None:
            self.val_set = self._open(self.val_file)
        if stage == "fit" and self.train_set is None:
            self.train_set = self._open(self.train_file)

    def train_dataloader(self) -> DataLoader:
        """Shuffled, rank-sharded training batches; full batches only."""
        assert self.train_set is not None, "call setup('fit') first"
        self._train_sampler = self._sampler(self.train_set, self.shuffle, drop_last=True)
        self._train_sampler.resume(*self._resume)
        return self._loader(self.train_set, self._train_sampler, drop_last=True)

    def val_dataloader(self) -> DataLoader:
        """In-order, rank-sharded validation batches."""
        assert self.val_set is not None, "call setup('fit') or setup('validate') first"
        sampler = self._sampler(self.val_set, shuffle=False, drop_last=False)
        return self._loader(self.val_set, sampler, drop_last=False)

    def state_dict(self) -> dict[str, int]:
        """Training position for checkpoints: the epoch and the samples this rank trained on.

        Lightning counts a batch as ``processed`` once its optimizer work is done and before
        ``on_train_batch_end`` (where ModelCheckpoint saves); on restart it skips exactly the
        processed batches of that epoch, or moves to the next epoch when all were processed.
        """
        if self.trainer is None:
            return {}
        batches = self.trainer.fit_loop.epoch_loop.batch_progress.current.processed
        return {"epoch": self.trainer.current_epoch, "samples": batches * self.batch_size}

    def load_state_dict(self, state_dict: dict[str, int]) -> None:
        """Resume the training sampler at the position saved by `state_dict`."""
        if not state_dict:
            return
        self._resume = (state_dict["epoch"], state_dict["samples"])
        if self._train_sampler is not None:
            self._train_sampler.resume(*self._resume)
        warnings.filterwarnings("ignore", _NOT_RESUMABLE_WARNING, PossibleUserWarning)

    def _open(self, name: str) -> TokenWindows:
        path = self.data_dir / name
        if not path.exists():
            raise FileNotFoundError(
                f"token file {path} not found; create it with "
                f"`plugintrain prepare shakespeare --out_dir {self.data_dir}`"
            )
        windows = TokenWindows(path, self.seq_len)
        if len(windows) == 0:
            raise ValueError(
                f"{path} holds {windows.num_tokens} tokens, too few for one window of "
                f"seq_len={self.seq_len} (needs {self.seq_len + 1})"
            )
        self._check_vocab(windows)
        return windows

    def _check_vocab(self, windows: TokenWindows) -> None:
        if self.vocab_size is None:
            return
        top = _max_token(windows.tokens)
        if top >= self.vocab_size:
            raise ValueError(
                f"{windows.path} contains token id {top}, outside the model's "
                f"vocab_size={self.vocab_size}; was it prepared with another tokenizer?"
            )

    def _sampler(self, dataset: Dataset, shuffle: bool, drop_last: bool) -> ResumableSampler:
        replicas, rank = self._data_parallel_layout()
        return ResumableSampler(
            dataset, replicas, rank, shuffle=shuffle, seed=self.seed, drop_last=drop_last
        )

    def _data_parallel_layout(self) -> tuple[int, int]:
        """(data-parallel size, rank) from the attached strategy, else a single replica."""
        strategy = self.trainer.strategy if self.trainer is not None else None
        kwargs = getattr(strategy, "distributed_sampler_kwargs", None)
        if kwargs is None:
            return 1, 0
        return kwargs["num_replicas"], kwargs["rank"]

    def _loader(self, dataset: Dataset, sampler: ResumableSampler, drop_last: bool) -> DataLoader:
        return DataLoader(
            dataset,
            batch_size=self.batch_size,
            sampler=sampler,
            drop_last=drop_last,
            num_workers=self.num_workers,
            persistent_workers=self.num_workers > 0,
        )


def _max_token(tokens: np.ndarray, chunk: int = 1 << 24) -> int:
    """Largest id, read in chunks so a huge memmap is never loaded whole."""
    return max(int(tokens[i : i + chunk].max()) for i in range(0, len(tokens), chunk))
