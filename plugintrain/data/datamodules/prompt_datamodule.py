"""Prompts for reinforcement learning (:class:`~plugintrain.model_zoo.GRPOLM`), read from a
``plugintrain prepare chat`` folder: each example's tokens up to its first trained token
(the chat template's conversation and assistant header, as ``plugintrain chat`` would
prompt the model) are the prompt; the trained tokens, less their stop tokens, decoded, are
the ``answer`` field the rewards compare against. The chat data's template, tokenization
and checks are thus the prompts' too.

A batch is a list of ``(prompt_ids, fields)`` (:class:`PromptBatch`): ``prompt_ids`` a 1-D
int64 tensor, ``fields`` ``{"prompt": text, "answer": text, "index": example}``. Batches are split by
data-parallel rank (each rank samples and scores its own prompts' groups whole) and
resumable, as every plugintrain datamodule's.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset

from plugintrain.data.datamodules.chat_datamodule import ChatExamples, _chat_meta
from plugintrain.data.datamodules.resumable import ResumableBatches
from plugintrain.data.tokenizers.registry import get_tokenizer


class PromptSet(Dataset):
    """One split of a chat folder as prompts and reference answers.

    Args:
        examples: The split's examples.
        stop_ids: Token ids that end an answer (left out of the decoded answer).
        decode: Token ids -> text.
    """

    def __init__(self, examples: ChatExamples, stop_ids: set[int], decode: Any) -> None:
        self.examples, self.stop_ids, self.decode = examples, stop_ids, decode
        self.prompt_lengths = prompt_lengths(examples)

    def __len__(self) -> int:
        return len(self.examples)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, dict[str, Any]]:
        ids, mask = self.examples.example(index)
        prompt = ids[: self.prompt_lengths[index]]
        answer = [int(t) for t in ids[mask] if int(t) not in self.stop_ids]
        fields = {
            "prompt": self.decode(prompt.tolist()),
            "answer": self.decode(answer).strip(),
            "index": int(index),
        }
        return torch.from_numpy(prompt), fields


def prompt_lengths(examples: ChatExamples) -> np.ndarray:
    """Tokens before each example's first trained token, ``(n,)`` (an example that trains
    on nothing: all of it)."""
    trained = np.flatnonzero(np.asarray(examples.mask))
    starts, ends = examples.offsets[:-1], examples.offsets[1:]
    first = np.searchsorted(trained, starts)  # each example's first trained position, if any
    found = np.append(trained, np.iinfo(np.int64).max)[first]
    return np.where(found < ends, found, ends) - starts


class PromptBatch(list):
    """A batch of ``(prompt_ids, fields)``, which says its own size to the throughput
    monitor: ``samples`` and ``tokens`` are its prompts' until the objective sets them to
    what the step trained on (completions, and their prompts' and completions' tokens)."""

    def __init__(self, items: list[tuple[torch.Tensor, dict[str, Any]]]) -> None:
        super().__init__(items)
        self.samples = len(items)
        self.tokens = sum(int(ids.numel()) for ids, _ in items)


class PromptDataModule(ResumableBatches):
    """Prompt batches for :class:`~plugintrain.model_zoo.GRPOLM` from a folder written by
    ``plugintrain prepare chat``.

    Args:
        data_dir: The folder ``plugintrain prepare chat`` wrote.
        batch_size: Prompts per batch on each data-parallel rank (each sampled as a group).
        vocab_size: The model's vocabulary size; a folder of a larger vocabulary is refused.
        max_seq_len: The model's maximum sequence length (checked against the prompts and
            the objective's ``max_new_tokens`` when the run starts).
        tokenizer: The tokenizer whose ids the model reads; a folder prepared with another
            one is refused.
        seed: Seed of each epoch's shuffle (``seed + epoch``).
        shuffle: Shuffle the prompts each epoch (validation keeps the file order).
        num_workers: DataLoader worker processes.
    """

    rl_prompts = True
    """Its batches are prompts to sample from (what :class:`GRPOLM` trains on)."""

    def __init__(
        self,
        data_dir: str = "data/chat",
        batch_size: int = 2,
        vocab_size: int | None = None,
        max_seq_len: int | None = None,
        tokenizer: str | None = None,
        seed: int = 1337,
        shuffle: bool = True,
        num_workers: int = 0,
    ) -> None:
        super().__init__(batch_size, seed, shuffle, num_workers)
        self.save_hyperparameters()
        if batch_size < 1:
            raise ValueError(f"batch_size={batch_size}: at least one prompt per batch")
        self.data_dir = Path(data_dir)
        self.meta = _chat_meta(self.data_dir, tokenizer, vocab_size)
        self.max_seq_len = max_seq_len
        self.stop_ids = {int(t) for t in self.meta.get("stop_ids", [self.meta.get("eos_id")])}
        self.collate_fn = PromptBatch
        self._tokenizer: Any = None

    @property
    def tokenizer(self) -> Any:
        """The folder's tokenizer (loaded on first use)."""
        if self._tokenizer is None:
            self._tokenizer = get_tokenizer(str(self.meta["tokenizer"]))
        return self._tokenizer

    def decode(self, ids: list[int]) -> str:
        """Token ids as text."""
        return self.tokenizer.decode(ids)

    def longest_prompt(self, split: str = "train") -> tuple[int, int]:
        """``(tokens, example)`` of the split's longest prompt."""
        lengths = prompt_lengths(ChatExamples(self.data_dir, split))
        index = int(np.argmax(lengths))
        return int(lengths[index]), index

    def setup(self, stage: str) -> None:
        """Open the splits ``stage`` needs."""
        if stage in ("fit", "validate") and self.val_set is None:
            self.val_set = self._prompts("val")
        if stage == "fit" and self.train_set is None:
            self.train_set = self._prompts("train")

    def _prompts(self, split: str) -> PromptSet:
        return PromptSet(ChatExamples(self.data_dir, split), self.stop_ids, self.decode)
