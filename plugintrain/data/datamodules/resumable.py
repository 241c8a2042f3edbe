"""What every plugintrain datamodule shares: a sampler that shards by data-parallel rank
and resumes mid-epoch, and the checkpointed training position that drives it under any
data-parallel size or batch size."""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from lightning.pytorch import LightningDataModule
from lightning.pytorch.utilities.warnings import PossibleUserWarning
from torch.utils.data import DataLoader, Dataset, DistributedSampler

from plugintrain.data.datamodules._pinning import pin_memory_for

# Lightning warns on every mid-epoch resume unless the DataLoader itself is stateful; these
# datamodules restore the position through their sampler instead, so the warning is wrong.
_NOT_RESUMABLE_WARNING = "You're resuming from a checkpoint that ended before the epoch ended"


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
        self.resume_position = 0

    def resume(self, epoch: int, position: int) -> None:
        """Start ``epoch`` at ``position``: the samples the whole data-parallel group (any
        number of ranks) consumed of it, whenever ``epoch`` is iterated."""
        self.resume_epoch, self.resume_position = epoch, position

    def __iter__(self) -> Iterator[int]:
        # The group's order from the position on, dealt out to this layout's ranks in turn:
        # exactly DistributedSampler's own split (the same permutation, padding and
        # dropping), skipped ahead in a resumed epoch; held as an array or a range, never
        # as a list of the epoch's indices.
        rest, end = self._rest()
        return map(int, rest[self.rank : end : self.num_replicas])

    def _rest(self) -> tuple[Sequence[int], int]:
        """The group's order from the resume position on, and where its dealt part ends
        (``end`` a multiple of the ranks: the tail dropped, or padded by repeating)."""
        start = self.resume_position if self.epoch == self.resume_epoch else 0
        rest = self._group_order()[start:]
        end = len(rest) // self.num_replicas * self.num_replicas
        if not self.drop_last and len(rest) > end:
            end += self.num_replicas
            rest = (list(rest) * (end // max(len(rest), 1) + 1))[:end]
        return rest, end

    @property
    def _by_epoch(self) -> bool:
        """Whether the dataset numbers its samples by epoch (a mixture: epoch ``e``'s are
        ``e*N .. e*N + N - 1``, in that order)."""
        return bool(getattr(self.dataset, "indexed_by_epoch", False))

    def _group_order(self) -> Sequence[int]:
        """This epoch's sample order for the whole data-parallel group (before the split)."""
        if self._by_epoch:  # a range: sliced and dealt out lazily, never listed
            size = len(self.dataset)  # type: ignore[arg-type]
            return range(self.epoch * size, (self.epoch + 1) * size)
        if not self.shuffle:
            return range(len(self.dataset))  # type: ignore[arg-type]
        generator = torch.Generator()
        generator.manual_seed(self.seed + self.epoch)
        return torch.randperm(len(self.dataset), generator=generator).numpy()  # type: ignore[arg-type,return-value]


class ResumableBatches(LightningDataModule):
    """A datamodule whose training batches continue, after a resume, exactly where the
    uninterrupted run would be, under any data-parallel size or batch size.

    Subclasses set ``train_set`` and ``val_set`` in ``setup`` and call ``__init__`` with the
    batching options. Batches are split by data-parallel rank only, taken from the
    strategy's ``distributed_sampler_kwargs``, so tensor-parallel peers receive identical
    batches.

    Args:
        batch_size: Sequences per batch on each data-parallel rank.
        seed: Shuffling seed; epoch ``e`` is shuffled with ``seed + e``.
        shuffle: Shuffle training samples each epoch (validation is never shuffled).
        num_workers: DataLoader worker processes.
    """

    def __init__(self, batch_size: int, seed: int, shuffle: bool, num_workers: int) -> None:
        super().__init__()
        self.batch_size = batch_size
        self.seed = seed
        self.shuffle = shuffle
        self.num_workers = num_workers
        self.train_set: Dataset | None = None
        self.val_set: Dataset | None = None
        # How a batch's samples are joined (None: PyTorch's default stacking).
        self.collate_fn: Callable[[list[Any]], Any] | None = None
        self._train_sampler: ResumableSampler | None = None
        # (epoch, group position, Lightning's processed count when the epoch resumed)
        self._resume: tuple[int, int, int | None] = (-1, 0, 0)

    def train_dataloader(self) -> DataLoader:
        """Shuffled (``shuffle``), rank-sharded training batches; full batches only."""
        assert self.train_set is not None, "call setup('fit') first"
        self._train_sampler = self._sampler(self.train_set, self.shuffle, drop_last=True)
        epoch, position, processed_before = self._resume
        if processed_before is None:
            # Lightning restored its loops by now: remember its count for the resumed epoch.
            self._resume = (epoch, position, self._processed_batches())
        self._train_sampler.resume(epoch, position)
        return self._loader(self.train_set, self._train_sampler, drop_last=True)

    def val_dataloader(self) -> DataLoader:
        """In-order, rank-sharded validation batches."""
        assert self.val_set is not None, "call setup('fit') or setup('validate') first"
        sampler = self._sampler(self.val_set, shuffle=False, drop_last=False)
        return self._loader(self.val_set, sampler, drop_last=False)

    def state_dict(self) -> dict[str, Any]:
        """Training position for checkpoints: the epoch and how many samples of it the whole
        data-parallel group trained on, so a resume under any dp size or batch size
        continues with the samples the uninterrupted run would see next.

        Lightning counts a batch as ``processed`` once its optimizer work is done and before
        ``on_train_batch_end`` (where ModelCheckpoint saves). In the epoch a run resumed in,
        the count it restored was made under the saving layout, so only the batches since
        are counted under this one.
        """
        if self.trainer is None:
            return {}
        epoch, processed = self.trainer.current_epoch, self._processed_batches()
        resumed_epoch, position, processed_before = self._resume
        if epoch != resumed_epoch or processed_before is None:  # None: no batch drawn yet
            position, processed_before = (0, 0) if epoch != resumed_epoch else (position, processed)
        replicas, _ = self._data_parallel_layout()
        position += (processed - processed_before) * self.batch_size * replicas
        return {"epoch": epoch, "position": position}

    def _processed_batches(self) -> int:
        """Lightning's count of this epoch's finished training batches (0 without a fit loop)."""
        fit_loop = getattr(self.trainer, "fit_loop", None)
        return 0 if fit_loop is None else fit_loop.epoch_loop.batch_progress.current.processed

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Resume the training sampler at the position saved by `state_dict`."""
        if not state_dict:
            return
        if "position" in state_dict:
            position = state_dict["position"]
        else:  # older checkpoints counted this rank's samples, under the same layout
            position = state_dict["samples"] * self._data_parallel_layout()[0]
        self._resume = (state_dict["epoch"], position, None)
        if self._train_sampler is not None:
            self._train_sampler.resume(state_dict["epoch"], position)
        warnings.filterwarnings("ignore", _NOT_RESUMABLE_WARNING, PossibleUserWarning)

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
            collate_fn=self.collate_fn,
            num_workers=self.num_workers,
            persistent_workers=self.num_workers > 0,
            pin_memory=pin_memory_for(self.trainer),
        )
