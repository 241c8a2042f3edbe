"""Language-model batches from llm.c token files, sharded by data-parallel rank, resumable."""

from __future__ import annotations

import warnings
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import torch
from lightning.pytorch import LightningDataModule
from lightning.pytorch.utilities.warnings import PossibleUserWarning
from torch.utils.data import DataLoader, Dataset, DistributedSampler

from plugintrain.data._pinning import pin_memory_for
from plugintrain.data.mixture import MixtureWindows
from plugintrain.data.prepared_folders import PreparedFolders, mixture_entries
from plugintrain.data.token_bytes import read_token_bytes
from plugintrain.data.token_shards import TokenWindows

# Lightning warns on every mid-epoch resume unless the DataLoader itself is stateful; this
# datamodule restores the position through its sampler instead, so the warning is wrong here.
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
        start = self.resume_position if self.epoch == self.resume_epoch else 0
        rest = self._group_order()[start:]
        end = len(rest) // self.num_replicas * self.num_replicas
        if not self.drop_last and len(rest) > end:
            end += self.num_replicas
            rest = (list(rest) * (end // max(len(rest), 1) + 1))[:end]
        return map(int, rest[self.rank : end : self.num_replicas])

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


class TokenDataModule(LightningDataModule):
    """Next-token batches ``(x, y)`` of shape (B, T) from ``train.bin`` / ``val.bin``.

    Batches are split by data-parallel rank only, taken from the strategy's
    ``distributed_sampler_kwargs``, so tensor-parallel peers receive identical batches.
    Checkpoints record how far into the epoch training got, and a resumed ``fit`` continues
    with exactly the batches the uninterrupted run would have seen next. A
    :class:`~plugintrain.data.TokenBytesSource`: with the ``token_bytes.npy`` that
    ``plugintrain prepare`` writes, models log validation bits per byte.

    Args:
        data_dir: Directory with the token files written by ``plugintrain prepare``.
        seq_len: Tokens per training sequence (T).
        batch_size: Sequences per batch on each data-parallel rank (B).
        vocab_size: The model's vocabulary size; a token id at or above it is an error.
        max_seq_len: The model's maximum sequence length; ``seq_len`` may not exceed it.
        tokenizer: The tokenizer whose ids the model reads (a spec of `get_tokenizer`:
            ``gpt2``, ``llama3``, a pretrained name or a path); token files whose
            ``meta.json`` records another one are refused.
        seed: Shuffling seed; epoch ``e`` is shuffled with ``seed + e``.
        shuffle: Shuffle training windows each epoch (validation is never shuffled).
        num_workers: DataLoader worker processes.
        train_file: Training token file name inside ``data_dir`` (folders without
            ``prepare text``'s ``meta.json``; that one lists its shards).
        val_file: Validation token file name inside ``data_dir`` (likewise).
        mix: Several prepared folders blended by weight instead of ``data_dir``:
            ``[{path: DIR, weight: 0.7}, ...]`` (weights > 0, normalized; see
            `plugintrain.data.mixture`). Validation reads every folder's held-out split.
        respect_documents: Training windows never cross a document boundary (documents
            end with the EOS that ``prepare text`` records): each document is cut into
            whole windows from its start and a tail shorter than one window is not trained
            on (the windows' starts are found at setup by one pass over the tokens and held
            as an array: 8 bytes a window). Off: windows tile the token stream across
            boundaries (the attention is not reset at a boundary either way; packing with a
            reset comes with the loss mask).
        verify_shards: Check each shard's sha256 against ``meta.json`` before training
            (once per file version; the result is cached under ``$PLUGINTRAIN_CACHE``).
    """

    def __init__(
        self,
        data_dir: str = "data/shakespeare_gpt2",
        seq_len: int = 256,
        batch_size: int = 8,
        vocab_size: int | None = None,
        max_seq_len: int | None = None,
        tokenizer: str | None = None,
        seed: int = 1337,
        shuffle: bool = True,
        num_workers: int = 0,
        train_file: str = "train.bin",
        val_file: str = "val.bin",
        mix: list[dict[str, Any]] | None = None,
        respect_documents: bool = False,
        verify_shards: bool = True,
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
        self.tokenizer = tokenizer
        self.seed = seed
        self.shuffle = shuffle
        self.num_workers = num_workers
        self.train_file = train_file
        self.val_file = val_file
        self.mix = mixture_entries(mix)
        self.respect_documents = respect_documents
        self.verify_shards = verify_shards
        self._saved_mixture: dict[str, Any] | None = None
        self.train_set: TokenWindows | MixtureWindows | None = None
        self.val_set: TokenWindows | None = None
        self._train_sampler: ResumableSampler | None = None
        self._token_bytes: torch.Tensor | None = None
        # (epoch, group position, Lightning's processed count when the epoch resumed)
        self._resume: tuple[int, int, int | None] = (-1, 0, 0)
        paths = [path for path, _ in self.mix] if self.mix else [self.data_dir]
        self.prepared = PreparedFolders(paths, train_file, val_file, tokenizer)
        self.prepared.check(vocab_size, verify_shards)

    def setup(self, stage: str) -> None:
        """Open and check the token files needed by ``stage``, and the bytes per token."""
        if stage in ("fit", "validate") and self.val_set is None:
            self.val_set = self.prepared.windows("val", self.seq_len, self.vocab_size)
        if stage == "fit" and self.train_set is None:
            self.train_set = self._training_set()
        if self._token_bytes is None:
            counts = read_token_bytes(self.prepared.paths[0])
            self._token_bytes = None if counts is None else torch.from_numpy(counts)

    def _training_set(self) -> TokenWindows | MixtureWindows:
        """The training windows: one folder's, or the mixture of every folder's."""
        sources = [
            self.prepared.windows(
                "train", self.seq_len, self.vocab_size, self.respect_documents, [folder]
            )
            for folder in self.prepared.paths
        ]
        if not self.mix:
            return sources[0]
        weights = [w for _, w in self.mix]
        names = [str(p.resolve()) for p in self.prepared.paths]  # as the state records them
        mixture = MixtureWindows(sources, weights, self.seed, self.shuffle, names)
        if self._saved_mixture is not None:
            mixture.resume(self._saved_mixture, self._resume[0], self._resume[1])
        return mixture

    @property
    def token_bytes(self) -> torch.Tensor | None:
        """UTF-8 bytes of text per token id from ``token_bytes.npy`` (after ``setup``);
        None for token files prepared without it."""
        return self._token_bytes

    def train_dataloader(self) -> DataLoader:
        """Shuffled, rank-sharded training batches; full batches only."""
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
        state: dict[str, Any] = {"epoch": epoch, "position": position}
        if isinstance(self.train_set, MixtureWindows):
            state["mixture"] = self.train_set.state(epoch, position)
        return state

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
        if ("mixture" in state_dict) != bool(self.mix):
            had = "a mixture of folders" if "mixture" in state_dict else "one folder"
            raise ValueError(
                f"the checkpoint was trained on {had} and this run reads"
                f" {'a mixture' if self.mix else 'one folder'}; resume with the checkpoint's"
                " data (`--data.init_args.mix` as it was, or `data_dir`)"
            )
        self._saved_mixture = state_dict.get("mixture")
        if isinstance(self.train_set, MixtureWindows) and self._saved_mixture is not None:
            self.train_set.resume(self._saved_mixture, state_dict["epoch"], position)
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
            num_workers=self.num_workers,
            persistent_workers=self.num_workers > 0,
            pin_memory=pin_memory_for(self.trainer),
        )
