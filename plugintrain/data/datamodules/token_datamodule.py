"""Language-model batches from llm.c token files, sharded by data-parallel rank, resumable."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from plugintrain.data.datamodules.mixture import MixtureWindows
from plugintrain.data.datamodules.prepared_folders import PreparedFolders, mixture_entries
from plugintrain.data.datamodules.resumable import ResumableBatches, ResumableSampler
from plugintrain.data.tokenizers.token_bytes import read_token_bytes
from plugintrain.data.datamodules.token_shards import TokenWindows

__all__ = ["ResumableSampler", "TokenDataModule"]


class TokenDataModule(ResumableBatches):
    """Next-token batches ``(x, y)`` of shape (B, T) from ``train.bin`` / ``val.bin``.

    Batches are split by data-parallel rank only (see
    :class:`~plugintrain.data.datamodules.resumable.ResumableBatches`). Checkpoints record how far into
    the epoch training got, and a resumed ``fit`` continues with exactly the batches the
    uninterrupted run would have seen next. A
    :class:`~plugintrain.core.contracts.TokenBytesSource`: with the ``token_bytes.npy`` that
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
            `plugintrain.data.datamodules.mixture`). Validation reads every folder's held-out split.
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
        super().__init__(batch_size, seed, shuffle, num_workers)
        if seq_len < 1 or batch_size < 1:
            raise ValueError(f"seq_len ({seq_len}) and batch_size ({batch_size}) must be >= 1")
        if max_seq_len is not None and seq_len > max_seq_len:
            raise ValueError(f"seq_len={seq_len} exceeds the model's max_seq_len={max_seq_len}")
        self.save_hyperparameters()
        self.data_dir = Path(data_dir)
        self.seq_len = seq_len
        self.vocab_size = vocab_size
        self.tokenizer = tokenizer
        self.train_file = train_file
        self.val_file = val_file
        self.mix = mixture_entries(mix)
        self.respect_documents = respect_documents
        self.verify_shards = verify_shards
        self._saved_mixture: dict[str, Any] | None = None
        self._token_bytes: torch.Tensor | None = None
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

    def state_dict(self) -> dict[str, Any]:
        """The training position (see `ResumableBatches.state_dict`), and a mixture's
        state at it."""
        state = super().state_dict()
        if state and isinstance(self.train_set, MixtureWindows):
            state["mixture"] = self.train_set.state(state["epoch"], state["position"])
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Resume the training sampler (and a mixture) at the saved position."""
        if not state_dict:
            return
        if ("mixture" in state_dict) != bool(self.mix):
            had = "a mixture of folders" if "mixture" in state_dict else "one folder"
            raise ValueError(
                f"the checkpoint was trained on {had} and this run reads"
                f" {'a mixture' if self.mix else 'one folder'}; resume with the checkpoint's"
                " data (`--data.init_args.mix` as it was, or `data_dir`)"
            )
        super().load_state_dict(state_dict)
        self._saved_mixture = state_dict.get("mixture")
        if isinstance(self.train_set, MixtureWindows) and self._saved_mixture is not None:
            self.train_set.resume(self._saved_mixture, state_dict["epoch"], self._resume[1])
