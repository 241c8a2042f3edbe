"""GPT-2 and Llama 3 tokenizers built offline with tiktoken from fetched rank files."""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable
from pathlib import Path

import tiktoken
from tiktoken.load import load_tiktoken_bpe

from plugintrain.data.assets import ASSETS, fetch_asset

# tiktoken's r50k/gpt2 split pattern (tiktoken_ext.openai_public.r50k_pat_str): the
# original GPT-2 regex with possessive quantifiers, which tokenizes identically but faster.
GPT2_PATTERN = (
    r"""'(?:[sdmt]|ll|ve|re)| ?\p{L}++| ?\p{N}++| ?[^\s\p{L}\p{N}]++|\s++$|\s+(?!\S)|\s"""
)

# Meta's Llama 3 split pattern (llama_models/llama3/tokenizer.py).
LLAMA3_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)

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
    """

    def __init__(
        self, name: str, encoding: tiktoken.Encoding, bos_token: str, eos_token: str
    ) -> None:
        self.name = name
        self.encoding = encoding
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

    def decode(self, ids: Iterable[int]) -> str:
        """Text of token ids; invalid UTF-8 byte sequences become U+FFFD."""
        return self.encoding.decode(list(ids))

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
    return Tokenizer("llama3", enc, bos_token="<|begin_of_text|>", eos_token="<|end_of_text|>")


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


@functools.lru_cache(maxsize=8)
def get_tokenizer(name: str, cache_dir: str | Path | None = None) -> Tokenizer:
    """Build (once per process) the named tokenizer from its offline rank file.

    Args:
        name: ``"gpt2"`` (vocab 50,257) or ``"llama3"`` (vocab 128,256).
        cache_dir: Asset cache directory; see `fetch_asset`.

    Raises:
        ValueError: If ``name`` is not a known tokenizer.
    """
    if name not in _BUILDERS:
        raise ValueError(f"unknown tokenizer {name!r}; known tokenizers: {list(TOKENIZER_NAMES)}")
    return _BUILDERS[name](cache_dir)
