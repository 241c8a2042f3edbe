"""Language-model batches from llm.c token files, sharded by data-parallel rank, resumable."""

from __future__ import annotations

import json
import shlex
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch
from lightning.pytorch import LightningDataModule
from lightning.pytorch.utilities.warnings import PossibleUserWarning
from torch.utils.data import DataLoader, Dataset, DistributedSampler

from plugintrain.data._pinning import pin_memory_for
from plugintrain.data.token_bin import read_token_bin
from plugintrain.data.token_bytes import read_token_bytes
from plugintrain.data.tokenizers import tokenizer_short_name, tokenizer_spec

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
        self.resume_position = 0

    def resume(self, epoch: int, position: int) -> None:
        """Start ``epoch`` at ``position``: the samples the whole data-parallel group (any
        number of ranks) consumed of it, whenever ``epoch`` is iterated."""
        self.resume_epoch, self.resume_position = epoch, position

    def __iter__(self) -> Iterator[int]:
        if self.epoch != self.resume_epoch:
            return iter(list(super().__iter__()))
        # The group's order from the position on, dealt out to this layout's ranks in turn:
        # with the same layout exactly DistributedSampler's own split, skipped ahead.
        rest = self._group_order()[self.resume_position :]
        end = len(rest) // self.num_replicas * self.num_replicas
        if not self.drop_last and len(rest) > end:
            end += self.num_replicas
            rest = (rest * (end // max(len(rest), 1) + 1))[:end]
        return iter(rest[self.rank : end : self.num_replicas])

    def _group_order(self) -> list[int]:
        """This epoch's sample order for the whole data-parallel group (before the split)."""
        if not self.shuffle:
            return list(range(len(self.dataset)))  # type: ignore[arg-type]
        generator = torch.Generator()
        generator.manual_seed(self.seed + self.epoch)
        return torch.randperm(len(self.dataset), generator=generator).tolist()  # type: ignore[arg-type]


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
        tokenizer: str | None = None,
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
        self.tokenizer = tokenizer
        self.seed = seed
        self.shuffle = shuffle
        self.num_workers = num_workers
        self.train_file = train_file
        self.val_file = val_file
        self.train_set: TokenWindows | None = None
        self.val_set: TokenWindows | None = None
        self._train_sampler: ResumableSampler | None = None
        self._token_bytes: torch.Tensor | None = None
        # (epoch, group position, Lightning's processed count when the epoch resumed)
        self._resume: tuple[int, int, int | None] = (-1, 0, 0)
        self._check_prepared()

    def setup(self, stage: str) -> None:
        """Open and check the token files needed by ``stage``, and the bytes per token."""
        if stage in ("fit", "validate") and self.val_set is None:
            self.val_set = self._open(self.val_file)
        if stage == "fit" and self.train_set is None:
            self.train_set = self._open(self.train_file)
        if self._token_bytes is None:
            counts = read_token_bytes(self.data_dir)
            self._token_bytes = None if counts is None else torch.from_numpy(counts)

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

    def state_dict(self) -> dict[str, int]:
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
        group_batch = self.batch_size * replicas
        return {"epoch": epoch, "position": position + (processed - processed_before) * group_batch}

    def _processed_batches(self) -> int:
        """Lightning's count of this epoch's finished training batches (0 without a fit loop)."""
        fit_loop = getattr(self.trainer, "fit_loop", None)
        return 0 if fit_loop is None else fit_loop.epoch_loop.batch_progress.current.processed

    def load_state_dict(self, state_dict: dict[str, int]) -> None:
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

    def _check_prepared(self) -> None:
        """Refuse missing token files, and files of another tokenizer or a larger vocabulary.

        Runs on construction, so a bad ``data_dir`` stops ``plugintrain fit`` before any
        process is launched. ``plugintrain prepare`` records the tokenizer and its
        vocabulary size in ``meta.json``; files without one (from llm.c, say) are checked
        by their largest token id when opened.
        """
        meta = _read_meta(self.data_dir)
        recorded = meta.get("tokenizer")
        if self.tokenizer is not None and _written_by_another(recorded, self.tokenizer):
            raise ValueError(_other_tokenizer(self.data_dir, recorded, self.tokenizer))
        if self.vocab_size is not None and meta.get("vocab_size", 0) > self.vocab_size:
            raise ValueError(
                f"{self.data_dir} holds {recorded} tokens with ids up to {meta['vocab_size'] - 1}"
                f" (its meta.json), outside the model's vocab_size={self.vocab_size}; give the"
                f" model a vocab_size of at least {meta['vocab_size']}"
            )
        for name in (self.train_file, self.val_file):
            if not (self.data_dir / name).is_file():
                raise FileNotFoundError(self._missing(self.data_dir / name, bool(meta)))

    def _missing(self, path: Path, overwrite: bool) -> str:
        command = _prepare_command(self.data_dir, self.tokenizer or "gpt2", overwrite)
        return f"token file {path} not found; create it with `{command}`"

    def _open(self, name: str) -> TokenWindows:
        path = self.data_dir / name
        if not path.exists():
            raise FileNotFoundError(self._missing(path, overwrite=True))
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
            pin_memory=pin_memory_for(self.trainer),
        )


def _read_meta(data_dir: Path) -> dict[str, Any]:
    """The ``meta.json`` that ``plugintrain prepare`` wrote in ``data_dir``, else ``{}``."""
    path = data_dir / "meta.json"
    return json.loads(path.read_text()) if path.is_file() else {}


def _written_by_another(recorded: str | None, wanted: str) -> bool:
    """Whether token files whose ``meta.json`` records ``recorded`` hold other ids than
    ``wanted``'s (specs compared in canonical form; files that record none pass)."""
    return recorded is not None and tokenizer_spec(recorded) != tokenizer_spec(wanted)


def _prepare_command(out: Path, tokenizer: str, overwrite: bool) -> str:
    """The ``plugintrain prepare`` command that writes ``tokenizer``'s token files to ``out``."""
    args = ["plugintrain", "prepare", "shakespeare", "--tokenizer", tokenizer, "--out", str(out)]
    return shlex.join([*args, "--overwrite"] if overwrite else args)


def _other_tokenizer(data_dir: Path, recorded: str, wanted: str) -> str:
    """Why ``data_dir`` (``recorded``'s tokens) cannot feed a model that reads ``wanted``'s,
    and the command that prepares the right files beside it."""
    out = data_dir.parent / f"shakespeare_{tokenizer_short_name(wanted)}"
    overwrite = _written_by_another(_read_meta(out).get("tokenizer"), wanted)
    return (
        f"{data_dir} holds {recorded} tokens (its meta.json) but the model reads {wanted}"
        f" tokens; prepare them with `{_prepare_command(out, wanted, overwrite)}` and pass"
        f" `--data.init_args.data_dir {shlex.quote(str(out))}`"
    )


def _max_token(tokens: np.ndarray, chunk: int = 1 << 24) -> int:
    """Largest id, read in chunks so a huge memmap is never loaded whole."""
    return max(int(tokens[i : i + chunk].max()) for i in range(0, len(tokens), chunk))
