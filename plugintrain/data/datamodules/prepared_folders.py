"""The prepared folders a `TokenDataModule` reads: checked before anything is launched,
and cut into each split's windows."""

from __future__ import annotations

import math
import shlex
from pathlib import Path
from typing import Any

import numpy as np

from plugintrain.data.assets import cache_root
from plugintrain.data.datamodules.token_shards import (
    TokenWindows,
    document_starts,
    is_text_shards,
    read_meta,
    split_paths,
    verify_shards,
)
from plugintrain.data.tokenizers.registry import tokenizer_short_name, tokenizer_spec

_OTHER_KINDS = {
    "chat": ("chat examples", "chat", "ChatDataModule"),
    "preference": ("preference pairs", "preference", "PreferenceDataModule"),
}
"""Folders of other data (``meta.json``'s ``kind``): what they hold, the command that
wrote them and the datamodule that reads them."""


class PreparedFolders:
    """One folder, or a mixture's folders, of prepared tokens.

    Args:
        paths: The folders.
        train_file: The training token file of a folder without ``prepare text``'s
            ``meta.json`` (which lists its shards).
        val_file: Likewise, the validation file.
        tokenizer: The tokenizer whose ids the model reads (None: not checked).
    """

    def __init__(
        self, paths: list[Path], train_file: str, val_file: str, tokenizer: str | None
    ) -> None:
        self.paths = paths
        self.tokenizer = tokenizer
        self.train_file = train_file
        self.val_file = val_file

    def check(self, vocab_size: int | None, verify: bool) -> None:
        """Refuse missing token files, files of another tokenizer or a larger vocabulary,
        shards that changed since ``prepare text`` wrote them, and mixtures of folders of
        different tokenizers.

        Runs on construction, so a bad ``data_dir`` stops ``plugintrain fit`` before any
        process is launched. ``plugintrain prepare`` records the tokenizer and its
        vocabulary size in ``meta.json``; files without one (from llm.c, say) are checked
        by their largest token id when opened.
        """
        tokenizer, tokenizers = self.tokenizer, set()
        for folder in self.paths:
            meta = read_meta(folder)
            if meta.get("kind") in _OTHER_KINDS:
                what, command, module = _OTHER_KINDS[meta["kind"]]
                raise ValueError(
                    f"{folder} holds {what} (plugintrain prepare {command}), not text tokens;"
                    f" train on it with `data: class_path: plugintrain.data.{module}`"
                    f" (init_args: data_dir: {folder})"
                )
            recorded = meta.get("tokenizer")
            tokenizers.add(None if recorded is None else tokenizer_spec(recorded))
            if tokenizer is not None and _written_by_another(recorded, tokenizer):
                raise ValueError(_other_tokenizer(folder, recorded, tokenizer))
            if vocab_size is not None and meta.get("vocab_size", 0) > vocab_size:
                raise ValueError(
                    f"{folder} holds {recorded} tokens with ids up to {meta['vocab_size'] - 1}"
                    f" (its meta.json), outside the model's vocab_size={vocab_size}; give"
                    f" the model a vocab_size of at least {meta['vocab_size']}"
                )
            if is_text_shards(meta):
                if not meta["splits"]["val"]["shards"]:
                    raise ValueError(
                        f"{folder} holds no held-out documents (its meta.json), so there is"
                        " nothing to validate on; prepare it again with --val_docs N"
                        " --overwrite"
                    )
                if verify:
                    verify_shards(folder, meta, cache_root() / "verified-shards.json")
                continue
            for name in (self.train_file, self.val_file):
                if not (folder / name).is_file():
                    raise FileNotFoundError(_missing(folder, folder / name, tokenizer, bool(meta)))
        if len(tokenizers) > 1:
            raise ValueError(
                "the mixture's folders hold tokens of different tokenizers"
                f" ({sorted(map(str, tokenizers))}); prepare every folder with the model's"
                " tokenizer"
            )

    def windows(
        self,
        split: str,
        seq_len: int,
        vocab_size: int | None,
        documents: bool = False,
        folders: list[Path] | None = None,
    ) -> TokenWindows:
        """One split's windows over the folders' shards (in order): all folders', or
        ``folders``'."""
        folders = self.paths if folders is None else folders
        name = self.train_file if split == "train" else self.val_file
        paths, checked = [], True
        for folder in folders:
            meta = read_meta(folder)
            paths += split_paths(folder, meta, split, name)
            checked = checked and is_text_shards(meta)
        for path in paths:
            if not path.exists():
                raise FileNotFoundError(_missing(folders[0], path, self.tokenizer, overwrite=True))
        if not paths:
            raise ValueError(
                f"{folders[0]} holds no {split} shard; prepare it with --val_docs 1 or a larger"
                " --val_fraction"
            )
        windows = TokenWindows(paths, seq_len)
        if documents:
            windows.starts = document_windows(windows, _eos_of(folders[0]), seq_len)
        if len(windows) == 0:
            raise ValueError(
                f"{paths[0]} holds {windows.num_tokens} tokens, too few for one window of "
                f"seq_len={seq_len} (needs {seq_len + 1})"
            )
        if not checked:  # prepare text's shards: ids checked by meta.json and sha256
            _check_vocab(windows, vocab_size)
        return windows


def _check_vocab(windows: TokenWindows, vocab_size: int | None) -> None:
    if vocab_size is None:
        return
    top = max(int(chunk.max()) for _, chunk in windows.tokens.chunks() if len(chunk))
    if top >= vocab_size:
        raise ValueError(
            f"{windows.path} contains token id {top}, outside the model's "
            f"vocab_size={vocab_size}; was it prepared with another tokenizer?"
        )


def _missing(folder: Path, path: Path, tokenizer: str | None, overwrite: bool) -> str:
    command = _prepare_command(folder, tokenizer or "gpt2", overwrite)
    return f"token file {path} not found; create it with `{command}`"


def mixture_entries(mix: list[dict[str, Any]] | None) -> list[tuple[Path, float]] | None:
    """``mix`` as (folder, weight) pairs, each checked."""
    if not mix:
        return None
    entries = []
    for i, entry in enumerate(mix):
        if not isinstance(entry, dict) or set(entry) != {"path", "weight"}:
            raise ValueError(
                f"mix[{i}] = {entry!r}: each entry is {{path: FOLDER, weight: NUMBER}}"
            )
        weight = entry["weight"]
        number = isinstance(weight, int | float) and not isinstance(weight, bool)
        if not number or not math.isfinite(weight) or not weight > 0:
            raise ValueError(
                f"mix[{i}].weight = {weight!r} ({entry['path']}): weights must be numbers > 0;"
                " give it a positive weight or drop the entry"
            )
        entries.append((Path(entry["path"]), float(weight)))
    return entries


def _eos_of(folder: Path) -> int:
    meta = read_meta(folder)
    if "eos_id" not in meta or not meta.get("add_eos"):
        raise ValueError(
            f"{folder}: respect_documents needs the document ends that `plugintrain prepare"
            " text` records in meta.json; prepare the folder with it, or set"
            " respect_documents: false"
        )
    return int(meta["eos_id"])


def document_windows(windows: TokenWindows, eos_id: int, seq_len: int) -> np.ndarray:
    """Starts of the whole windows inside each document (a document ends at its EOS)."""
    starts = document_starts(windows.tokens, eos_id)
    ends = np.append(starts[1:], windows.num_tokens)
    count = np.maximum((ends - starts - 1) // seq_len, 0)
    first = np.repeat(starts, count)
    within = np.arange(int(count.sum())) - np.repeat(np.cumsum(count) - count, count)
    return first + within * seq_len


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
    overwrite = _written_by_another(read_meta(out).get("tokenizer"), wanted)
    return (
        f"{data_dir} holds {recorded} tokens (its meta.json) but the model reads {wanted}"
        f" tokens; prepare them with `{_prepare_command(out, wanted, overwrite)}` and pass"
        f" `--data.init_args.data_dir {shlex.quote(str(out))}`"
    )
