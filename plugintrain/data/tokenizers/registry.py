"""Tokenizers by spec: GPT-2 and Llama 3 built offline with tiktoken from fetched rank
files, and the tokenizers that come with pretrained weights (see `hf_tokenizer`)."""

from __future__ import annotations

import functools
import re
from collections.abc import Callable, Iterable
from pathlib import Path

import numpy as np
import tiktoken
from tiktoken.load import load_tiktoken_bpe

from plugintrain.data.assets import ASSETS, PRETRAINED_MODELS, fetch_asset, resolve_model_path
from plugintrain.data.tokenizers.hf_tokenizer import HFTokenizer, load_hf_tokenizer
from plugintrain.data.tokenizers.split_patterns import GPT2_PATTERN, LLAMA3_PATTERN

# The named specials at the start of Llama 3's 256 special ids, in the order of the
# llama-models 0.3.0 wheel (the Llama 3.1+ layout); the rest are reserved tokens.
_LLAMA3_NAMED_SPECIALS = (
    "<|begin_of_text|>",
    "<|end_of_text|>",
    "<|reserved_special_token_0|>",
    "<|reserved_special_token_1|>",
    "<|finetune_right_pad_id|>",
    "<|step_id|>",
    "<|start_header_id|>",
    "<|end_header_id|>",
    "<|eom_id|>",
    "<|eot_id|>",
    "<|python_tag|>",
    "<|image|>",
)
_LLAMA3_NUM_SPECIALS = 256


class Tokenizer:
    """A byte-level BPE tokenizer with named special tokens.

    Text is always encoded as ordinary text: a literal ``"<|endoftext|>"`` in a document
    becomes plain tokens, never a special id, so data cannot inject control tokens.

    Args:
        name: Short name, e.g. ``"gpt2"``.
        encoding: The tiktoken encoding (mergeable ranks, split pattern, specials).
        bos_token: Special token that `encode` prepends with ``bos=True``.
        eos_token: Special token that `encode` appends with ``eos=True``.
        add_bos: Whether the family's own tokenizer leads every text with BOS (Llama 3's
            does; GPT-2's does not).
    """

    def __init__(
        self,
        name: str,
        encoding: tiktoken.Encoding,
        bos_token: str,
        eos_token: str,
        add_bos: bool = False,
    ) -> None:
        self.name = name
        self.encoding = encoding
        self.add_bos = add_bos
        self.bos_id = encoding.encode_single_token(bos_token)
        self.eos_id = encoding.encode_single_token(eos_token)

    @property
    def vocab_size(self) -> int:
        """Number of token ids, specials included."""
        return self.encoding.n_vocab

    @property
    def special_tokens(self) -> dict[str, int]:
        """Special token strings and their ids."""
        return {t: self.encoding.encode_single_token(t) for t in self.encoding.special_tokens_set}

    def encode(self, text: str, bos: bool = False, eos: bool = False) -> list[int]:
        """Token ids of ``text``, optionally framed by the BOS and EOS ids."""
        ids = self.encoding.encode_ordinary(text)
        return ([self.bos_id] if bos else []) + ids + ([self.eos_id] if eos else [])

    def encode_batch(self, texts: Iterable[str], bos: bool = False) -> list[list[int]]:
        """Encode several documents in parallel threads, each optionally led by BOS."""
        batches = self.encoding.encode_ordinary_batch(list(texts))
        return [([self.bos_id] if bos else []) + ids for ids in batches]

    def encode_array(self, text: str) -> np.ndarray:
        """`encode`'s ids of ``text`` as uint32, without a Python list in between."""
        # No special is allowed, and none is refused: special strings are plain text, as
        # in encode_ordinary.
        return self.encoding.encode_to_numpy(text, allowed_special=set(), disallowed_special=())

    def encode_with_specials(self, text: str) -> list[int]:
        """Token ids of text a chat template wrote, special token strings as their ids
        (``"<|eot_id|>"`` -> 128009); never for a document's text, which `encode` reads."""
        return self.encoding.encode(text, allowed_special="all")

    def decode(self, ids: Iterable[int]) -> str:
        """Text of token ids; invalid UTF-8 byte sequences become U+FFFD."""
        return self.encoding.decode(list(ids))

    def token_bytes(self) -> np.ndarray:
        """UTF-8 bytes of text each id stands for, int32 ``(vocab_size,)``; 0 for specials.

        Read from each token's bytes, never by decoding: a token holding part of a
        multi-byte character would decode to the 3-byte U+FFFD.
        """
        special = set(self.special_tokens.values())
        counts = [
            0 if i in special else len(self.encoding.decode_single_token_bytes(i))
            for i in range(self.vocab_size)
        ]
        return np.array(counts, dtype=np.int32)

    def __repr__(self) -> str:
        return f"Tokenizer(name={self.name!r}, vocab_size={self.vocab_size})"


def _ranks(asset: str, cache_dir: str | Path | None) -> dict[bytes, int]:
    path = fetch_asset(asset, cache_dir)
    return load_tiktoken_bpe(str(path), expected_hash=ASSETS[asset].sha256)


def _gpt2(cache_dir: str | Path | None) -> Tokenizer:
    ranks = _ranks("gpt2-bpe", cache_dir)
    # GPT-2 has one special token; it both separates and ends documents.
    specials = {"<|endoftext|>": len(ranks)}
    enc = tiktoken.Encoding(
        "gpt2", pat_str=GPT2_PATTERN, mergeable_ranks=ranks, special_tokens=specials
    )
    return Tokenizer("gpt2", enc, bos_token="<|endoftext|>", eos_token="<|endoftext|>")


def _llama3(cache_dir: str | Path | None) -> Tokenizer:
    ranks = _ranks("llama3-bpe", cache_dir)
    reserved = range(2, 2 + _LLAMA3_NUM_SPECIALS - len(_LLAMA3_NAMED_SPECIALS))
    names = [*_LLAMA3_NAMED_SPECIALS, *(f"<|reserved_special_token_{i}|>" for i in reserved)]
    specials = {tok: len(ranks) + i for i, tok in enumerate(names)}
    enc = tiktoken.Encoding(
        "llama3", pat_str=LLAMA3_PATTERN, mergeable_ranks=ranks, special_tokens=specials
    )
    return Tokenizer(
        "llama3", enc, bos_token="<|begin_of_text|>", eos_token="<|end_of_text|>", add_bos=True
    )


_BUILDERS: dict[str, Callable[[str | Path | None], Tokenizer]] = {
    "gpt2": _gpt2,
    "llama3": _llama3,
}
TOKENIZER_NAMES = tuple(_BUILDERS)


def family_tokenizer(family: str | None) -> str | None:
    """The tokenizer whose ids a model family reads (GPT-2: ``gpt2``, Llama 3: ``llama3``).

    None for a family plugintrain has no tokenizer for, whose data cannot be checked.
    """
    return family if family in _BUILDERS else None


def _is_name(spec: str) -> bool:
    """Whether ``spec`` names a tokenizer (built in, or a pretrained model's), not a path."""
    return spec in _BUILDERS or spec in PRETRAINED_MODELS


def tokenizer_spec(spec: str | Path) -> str:
    """The canonical form of a tokenizer spec, as ``meta.json`` records it: a name as is,
    a path made absolute (so the same file matches from any working directory)."""
    spec = str(spec)
    return spec if _is_name(spec) else str(Path(spec).expanduser().resolve())


def tokenizer_short_name(spec: str | Path) -> str:
    """A filesystem-safe short name: the spec of a name, else the file or directory name
    without suffix (a ``tokenizer.json``'s directory name)."""
    spec = str(spec)
    if not _is_name(spec):
        path = Path(spec).expanduser().resolve()
        spec = path.parent.name if path.name == "tokenizer.json" else path.stem
    return re.sub(r"[^A-Za-z0-9._-]+", "_", spec) or "tokenizer"


@functools.lru_cache(maxsize=8)
def get_tokenizer(spec: str, cache_dir: str | Path | None = None) -> Tokenizer | HFTokenizer:
    """Build (once per process) the tokenizer ``spec`` names.

    Args:
        spec: ``"gpt2"`` (vocab 50,257) or ``"llama3"`` (vocab 128,256), built from their
            offline rank files; a pretrained model (``"smollm2-135m"``), whose file is
            fetched on first use; or the path of a Hugging Face ``tokenizer.json``, a
            directory holding one, or a GGUF file.
        cache_dir: Asset cache directory; see `fetch_asset`.

    Raises:
        ValueError: If ``spec`` is none of these, or its file holds no usable tokenizer.
    """
    if spec in _BUILDERS:
        return _BUILDERS[spec](cache_dir)
    path = resolve_model_path(spec, cache_dir).expanduser()
    if not path.exists():
        names = [*TOKENIZER_NAMES, *PRETRAINED_MODELS]
        raise ValueError(
            f"unknown tokenizer {spec!r}: not one of {names} and no such file or directory;"
            " give a name or the path of a tokenizer.json, a directory holding one, or a"
            " .gguf file"
        )
    return load_hf_tokenizer(path, tokenizer_short_name(spec))
