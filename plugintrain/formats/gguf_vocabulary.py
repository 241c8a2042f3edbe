"""A tiktoken tokenizer (GPT-2's, Llama 3's) as the vocabulary fields of a GGUF file.

llama.cpp runs a byte-level BPE vocabulary from its tokens (each spelled in GPT-2's byte
alphabet) and its ranked merges. tiktoken keeps only ranks and merges, at each step, the
adjacent pair whose join ranks lowest; the same rule as merges is every split of a token
into two tokens, ranked by the token (transformers' tiktoken converter does the same).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from plugintrain.data.hf_tokenizer import byte_alphabet
from plugintrain.data.tokenizers import Tokenizer

_PRE = {"gpt2": "gpt2", "llama3": "llama-bpe"}
"""Our tokenizer -> llama.cpp's ``tokenizer.ggml.pre`` (its split regexes)."""
_NORMAL, _CONTROL = 1, 3


def gguf_vocabulary(tokenizer: Tokenizer) -> dict[str, Any]:
    """The ``tokenizer.ggml.*`` fields that make llama.cpp tokenize as ``tokenizer``."""
    ranks = tokenizer.encoding._mergeable_ranks  # tiktoken keeps them only there
    spell = {b: c for c, b in byte_alphabet().items()}

    def spelled(piece: bytes) -> str:
        return "".join(spell[b] for b in piece)

    by_id = {i: piece for piece, i in ranks.items()}
    specials = {i: t for t, i in tokenizer.special_tokens.items()}
    tokens = [specials.get(i) or spelled(by_id[i]) for i in range(tokenizer.vocab_size)]
    merges = [f"{spelled(left)} {spelled(right)}" for left, right in _merges(ranks)]
    return {
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.pre": _PRE[tokenizer.name],
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.token_type": np.array(
            [_CONTROL if i in specials else _NORMAL for i in range(len(tokens))], dtype="<i4"
        ),
        "tokenizer.ggml.merges": merges,
        "tokenizer.ggml.bos_token_id": tokenizer.bos_id,
        "tokenizer.ggml.eos_token_id": tokenizer.eos_id,
    }


def _merges(ranks: dict[bytes, int]) -> list[tuple[bytes, bytes]]:
    """Every ``(left, right)`` whose join is a token, ordered by that token's rank (ties by
    the parts' ranks)."""
    found = []
    for piece, rank in ranks.items():
        for cut in range(1, len(piece)):
            left, right = piece[:cut], piece[cut:]
            if left in ranks and right in ranks:
                found.append((rank, ranks[left], ranks[right], left, right))
    return [(left, right) for *_, left, right in sorted(found)]
