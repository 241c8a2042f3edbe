"""Instruction and chat batches: examples from ``plugintrain prepare chat``, packed into
rows with their loss masks and per-example positions, sharded by data-parallel rank and
resumable.

A packed row holds several whole examples back to back. Each example's positions count
from 0, which is all the model needs: it masks attention so no token sees another
example's (``model_zoo.layers.document_mask``) and rotates queries and keys by the
positions within their example, so a packed row computes what its examples compute one
at a time. Targets the example does not train on (the prompt, by default) and the last
token of each example (whose next token belongs to the next example) are
``IGNORE_INDEX``; the model's loss skips them and the precision plugin averages the
step's gradient over the scored targets of the whole global batch.
"""

from __future__ import annotations

import shlex
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset

from plugintrain.data.datamodules.resumable import ResumableBatches
from plugintrain.data.datamodules.token_shards import read_meta
from plugintrain.data.tokenizers.registry import tokenizer_spec

IGNORE_INDEX = -100
"""A target that is not scored (the model zoo's ``cross_entropy.IGNORE_INDEX``; the data
layer does not import the model zoo)."""

CHAT_KIND = "chat"
"""``meta.json``'s ``kind`` in a folder written by ``plugintrain prepare chat``."""


def is_chat_folder(meta: dict[str, Any]) -> bool:
    """Whether ``meta`` (a folder's ``meta.json``) is ``plugintrain prepare chat``'s."""
    return meta.get("kind") == CHAT_KIND


class ChatExamples:
    """One split of a chat folder, memory-mapped: every example's token ids and the mask
    of the tokens it trains on.

    Args:
        folder: A folder written by ``plugintrain prepare chat``.
        split: ``"train"`` or ``"val"``.
    """

    def __init__(self, folder: Path, split: str) -> None:
        self.folder, self.split = folder, split
        self.ids = np.load(folder / f"{split}.ids.npy", mmap_mode="r")  # (N,) uint32
        self.mask = np.load(folder / f"{split}.mask.npy", mmap_mode="r")  # (N,) uint8
        self.offsets = np.load(folder / f"{split}.offsets.npy")  # (n + 1,) int64

    def __len__(self) -> int:
        return len(self.offsets) - 1

    @property
    def lengths(self) -> np.ndarray:
        """Tokens of each example, ``(n,)``."""
        return np.diff(self.offsets)

    def example(self, index: int) -> tuple[np.ndarray, np.ndarray]:
        """The ids (int64) and the target mask (True: trained on) of example ``index``."""
        start, end = self.offsets[index], self.offsets[index + 1]
        return self.ids[start:end].astype(np.int64), self.mask[start:end].astype(bool)


def pack_rows(lengths: np.ndarray, order: np.ndarray, seq_len: int, pack: bool) -> np.ndarray:
    """Rows of whole examples, filled greedily in ``order``: row ``r`` holds the examples
    ``order[starts[r]:starts[r + 1]]``.

    Args:
        lengths: Tokens of each example (each at most ``seq_len``).
        order: The examples in the order they fill rows.
        seq_len: Tokens per row.
        pack: Several examples per row; False: one example per row (padded).

    Returns:
        ``starts``, ``(rows + 1,)`` int64 offsets into ``order``.
    """
    if not pack:
        return np.arange(len(order) + 1, dtype=np.int64)
    starts, filled = [0], 0
    for i, length in enumerate(lengths[order].tolist()):
        if filled + length > seq_len:
            starts.append(i)
            filled = 0
        filled += length
    starts.append(len(order))
    return np.asarray(starts, dtype=np.int64)


class PackedChat(Dataset):
    """Rows ``(x, y, positions)`` of packed (or padded) chat examples.

    Args:
        examples: One split's examples.
        seq_len: Tokens per row (T).
        pack: Several examples per row; False: one per row, padded.
        pad_id: Token that fills a row's tail (never a target).
        order: The order examples fill rows in; None: the file's.
    """

    def __init__(
        self,
        examples: ChatExamples,
        seq_len: int,
        pack: bool,
        pad_id: int,
        order: np.ndarray | None = None,
    ) -> None:
        self.examples, self.seq_len, self.pad_id = examples, seq_len, pad_id
        self.order = np.arange(len(examples)) if order is None else order
        self.starts = pack_rows(examples.lengths, self.order, seq_len, pack)

    def __len__(self) -> int:
        return len(self.starts) - 1

    def __getitem__(self, row: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        T = self.seq_len
        x = np.full(T, self.pad_id, dtype=np.int64)
        y = np.full(T, IGNORE_INDEX, dtype=np.int64)
        positions = np.zeros(T, dtype=np.int64)
        filled = 0
        for index in self.order[self.starts[row] : self.starts[row + 1]]:
            ids, mask = self.examples.example(int(index))
            n = len(ids)
            x[filled : filled + n] = ids
            # Token t predicts token t + 1 of the same example, scored where t + 1 is trained
            # on; the example's last token predicts nothing.
            y[filled : filled + n - 1] = np.where(mask[1:], ids[1:], IGNORE_INDEX)
            positions[filled : filled + n] = np.arange(n)
            filled += n
        positions[filled:] = np.arange(T - filled)  # the padding: a document of its own
        return torch.from_numpy(x), torch.from_numpy(y), torch.from_numpy(positions)


class ChatDataModule(ResumableBatches):
    """Instruction / chat fine-tuning batches ``(x, y, positions)`` of shape (B, T) from a
    folder written by ``plugintrain prepare chat``.

    Targets outside the trained spans are -100 (``IGNORE_INDEX``); ``positions`` restart
    at 0 at each example, which resets attention and RoPE there (see the module
    docstring). Training rows are packed once, in an order drawn from ``seed``, and the
    rows are shuffled every epoch; checkpoints record the position in the epoch, and a
    resumed ``fit`` continues with the rows the uninterrupted run would have seen next.

    Args:
        data_dir: The folder ``plugintrain prepare chat`` wrote.
        batch_size: Rows per batch on each data-parallel rank (B).
        seq_len: Tokens per row (T); None: the ``--seq_len`` the folder was prepared with.
            No example may be longer.
        pack: Several examples per row (attention and positions reset at each); False:
            one example per row, padded; None: the folder's ``--pack``.
        vocab_size: The model's vocabulary size; a folder of a larger vocabulary is refused.
        max_seq_len: The model's maximum sequence length; ``seq_len`` may not exceed it.
        tokenizer: The tokenizer whose ids the model reads; a folder prepared with another
            one is refused.
        seed: Seed of the packing order and of each epoch's shuffle (``seed + epoch``).
        shuffle: Shuffle the training rows each epoch (validation keeps the file order).
        num_workers: DataLoader worker processes.
    """

    loss_mask = True
    """Its targets are masked: models count the scored targets (see ``CountsTargets``)."""

    def __init__(
        self,
        data_dir: str = "data/chat",
        batch_size: int = 4,
        seq_len: int | None = None,
        pack: bool | None = None,
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
        self.meta = _chat_meta(self.data_dir, tokenizer, vocab_size)
        self.seq_len = int(self.meta["seq_len"]) if seq_len is None else seq_len
        self.pack = bool(self.meta.get("pack", True)) if pack is None else pack
        if batch_size < 1 or self.seq_len < 1:
            raise ValueError(f"batch_size ({batch_size}) and seq_len ({self.seq_len}) must be >= 1")
        check_seq_len(self.seq_len, max_seq_len, "example")
        self.pad_id = int(self.meta.get("pad_id", self.meta.get("eos_id", 0)))

    def setup(self, stage: str) -> None:
        """Open the splits ``stage`` needs and pack their rows."""
        if stage in ("fit", "validate") and self.val_set is None:
            self.val_set = self._rows("val", None)
        if stage == "fit" and self.train_set is None:
            examples = self._examples("train")
            order = np.random.default_rng(self.seed).permutation(len(examples))
            self.train_set = PackedChat(examples, self.seq_len, self.pack, self.pad_id, order)

    def _rows(self, split: str, order: np.ndarray | None) -> PackedChat:
        return PackedChat(self._examples(split), self.seq_len, self.pack, self.pad_id, order)

    def _examples(self, split: str) -> ChatExamples:
        examples = ChatExamples(self.data_dir, split)
        check_split(self.data_dir, split, examples.lengths, self.seq_len, "examples", "an example")
        return examples


def check_seq_len(seq_len: int, max_seq_len: int | None, unit: str) -> None:
    """Refuse a ``seq_len`` over the model's ``max_seq_len`` (``unit``: what the folder
    holds, each at most ``seq_len`` tokens)."""
    if max_seq_len is not None and seq_len > max_seq_len:
        raise ValueError(
            f"seq_len={seq_len} exceeds the model's max_seq_len={max_seq_len}; set"
            f" --data.init_args.seq_len {max_seq_len} (and prepare with --seq_len"
            f" {max_seq_len} so no {unit} is longer)"
        )


def check_split(
    folder: Path, split: str, lengths: np.ndarray, seq_len: int, items: str, one: str
) -> None:
    """Refuse a split of ``folder`` that holds no ``items`` (its ``lengths``: tokens of each
    sequence), or one (``one``: ``"an example"``) longer than ``seq_len``."""
    if len(lengths) == 0:
        raise ValueError(
            f"{folder} holds no {split} {items} (its meta.json); prepare it again"
            " with a larger --val_fraction or --val_examples"
        )
    longest = int(lengths.max())
    if longest > seq_len:
        raise ValueError(
            f"{folder}/{split} holds {one} of {longest} tokens, longer than"
            f" seq_len={seq_len}; set --data.init_args.seq_len {longest} or leave it"
            " unset (the folder's own)"
        )


def _chat_meta(folder: Path, tokenizer: str | None, vocab_size: int | None) -> dict[str, Any]:
    """The folder's ``meta.json``, checked: a chat folder, of the model's tokenizer and
    within its vocabulary."""
    meta = read_meta(folder)
    if meta.get("kind") == "preference":
        raise ValueError(
            f"{folder} holds preference pairs (plugintrain prepare preference), not chat"
            " examples; train on it with `data: class_path:"
            f" plugintrain.data.PreferenceDataModule` (init_args: data_dir: {folder})"
        )
    if not is_chat_folder(meta):
        what, out = prepare_hint(folder, meta, CHAT_KIND)
        raise ValueError(
            f"{folder} holds {what}, not chat examples; prepare them with `plugintrain prepare"
            f" chat FILE.jsonl --tokenizer T --out {out}` and pass"
            f" `--data.init_args.data_dir {out}`, or train on text with"
            " `data: class_path: plugintrain.data.TokenDataModule`"
        )
    check_tokens(folder, meta, tokenizer, vocab_size, "the chat data")
    return meta


def prepare_hint(folder: Path, meta: dict[str, Any], kind: str) -> tuple[str, str]:
    """What ``folder`` holds instead of ``kind`` data (by its ``meta``), and the folder to
    prepare that data in, shell-quoted: ``folder`` if it is empty, else ``FOLDER_kind``
    beside it (a folder with anything in it stays as it is)."""
    empty = not folder.is_dir() or not any(folder.iterdir())
    out = folder if empty else folder.with_name(f"{folder.name}_{kind}")
    what = "no meta.json" if not meta else "text tokens (plugintrain prepare text/shakespeare)"
    return what, shlex.quote(str(out))


def check_tokens(
    folder: Path, meta: dict[str, Any], tokenizer: str | None, vocab_size: int | None, data: str
) -> None:
    """Refuse a folder (its ``meta``) of another tokenizer than the model's, or of ids
    outside its vocabulary (``data``: the folder's data, as the fix names it)."""
    recorded = meta.get("tokenizer")
    if tokenizer is not None and recorded and tokenizer_spec(recorded) != tokenizer_spec(tokenizer):
        raise ValueError(
            f"{folder} holds {recorded} tokens (its meta.json) but the model reads {tokenizer}"
            f" tokens; prepare {data} with `--tokenizer {tokenizer}`"
        )
    if vocab_size is not None and int(meta.get("vocab_size", 0)) > vocab_size:
        raise ValueError(
            f"{folder} holds {recorded} tokens with ids up to {meta['vocab_size'] - 1}, outside"
            f" the model's vocab_size={vocab_size}; prepare it with the model's tokenizer"
        )
