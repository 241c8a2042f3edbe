"""The ``tokenizer.*`` keys of a GGUF file, as llama.cpp's own converter writes them
(``convert_hf_to_gguf.py``), for every tokenizer plugintrain has: a GGUF source's own, a
tiktoken vocabulary (GPT-2's, Llama 3's) spelled out, a Hugging Face ``tokenizer.json``.
Types follow llama.cpp: token types int32, ids uint32.

Reading them back into a tokenizer is the data layer's job
(:mod:`plugintrain.data.tokenizers.hf_tokenizer`): preparing a corpus with a GGUF model's
tokenizer needs it, and the data layer imports nothing above the floor.
"""

from __future__ import annotations

import json
from typing import Any

import numpy as np

from plugintrain.core.gguf_header import TOKENIZER_KEYS, is_gguf, read_gguf_header
from plugintrain.data.assets import resolve_model_path
from plugintrain.data.tokenizers.hf_tokenizer import byte_alphabet
from plugintrain.data.tokenizers.registry import (
    TOKENIZER_NAMES,
    Tokenizer,
    family_tokenizer,
    get_tokenizer,
)
from plugintrain.data.tokenizers.split_patterns import GPT2_PATTERN, LLAMA3_PATTERN, QWEN2_PATTERN
from plugintrain.formats.base import WeightFormatError
from plugintrain.formats.tokenizer_files import chat_template_of, spelled, tiktoken_merges
from plugintrain.model_zoo.config import TransformerConfig

_PRE_OF_SPLITS = {
    (GPT2_PATTERN,): "gpt-2",
    (r"\p{N}", GPT2_PATTERN): "smollm",
    (LLAMA3_PATTERN,): "llama-bpe",
    (QWEN2_PATTERN,): "qwen2",
}
"""The split regexes of a tokenizer -> llama.cpp's name for them, its ``tokenizer.ggml.pre``
(llama.cpp knows ``gpt-2``, not ``gpt2``; src/llama-vocab.cpp)."""

_NORMAL, _CONTROL, _USER_DEFINED = 1, 3, 4  # gguf.TokenType


def tokenizer_fields(config: TransformerConfig, tokenizer: str | None) -> dict[str, Any]:
    """The ``tokenizer.*`` fields llama.cpp needs to run a model of ``config`` whose weights
    came with ``tokenizer`` (else its family's): a GGUF source's as they were; a tiktoken
    vocabulary spelled out (pre-tokenizer ``gpt-2`` / ``llama-bpe``, BOS/EOS, add-BOS); a
    Hugging Face directory's ``tokenizer.json`` with its chat template.

    Raises:
        WeightFormatError: If the tokenizer is one llama.cpp would run differently.
    """
    spec = tokenizer or family_tokenizer(config.family)
    if spec is None:
        return {}
    if spec in TOKENIZER_NAMES:
        tok = get_tokenizer(spec)
        return tiktoken_gguf_vocabulary(tok) if tok.vocab_size == config.vocab_size else {}
    path = resolve_model_path(spec)
    if is_gguf(path):
        fields = read_gguf_header(path)[0]
        return {k: v for k, v in fields.items() if k.startswith("tokenizer.")}
    try:
        return hf_gguf_vocabulary(get_tokenizer(spec), spec)
    except ValueError as error:
        raise WeightFormatError(f"{config.name} cannot be written as GGUF: {error}.") from None


def tiktoken_gguf_vocabulary(tokenizer: Tokenizer) -> dict[str, Any]:
    """The ``tokenizer.ggml.*`` fields that make llama.cpp tokenize as a tiktoken
    ``tokenizer``: tokens spelled in GPT-2's byte alphabet, merges ranked as tiktoken
    ranks, the pre-tokenizer name llama.cpp's converter writes for its split regex,
    BOS/EOS and whether BOS leads a text."""
    encoding = tokenizer.encoding
    ranks = encoding._mergeable_ranks  # tiktoken keeps them only there
    spell = {b: c for c, b in byte_alphabet().items()}
    by_id = {i: piece for piece, i in ranks.items()}
    specials = {i: t for t, i in tokenizer.special_tokens.items()}
    tokens = [specials.get(i) or spelled(by_id[i], spell) for i in range(tokenizer.vocab_size)]
    merges = [f"{spelled(a, spell)} {spelled(b, spell)}" for a, b in tiktoken_merges(ranks)]
    types = [_CONTROL if i in specials else _NORMAL for i in range(len(tokens))]
    pre = _PRE_OF_SPLITS[(encoding._pat_str,)]
    return _gguf_fields(tokens, types, merges, pre, tokenizer)


def hf_gguf_vocabulary(tokenizer: Any, spec: str) -> dict[str, Any]:
    """The ``tokenizer.ggml.*`` fields of a byte-level BPE ``tokenizer.json`` (a Hugging
    Face directory's), as llama.cpp's converter writes them: its vocabulary, merges and
    added tokens (special ones as control tokens), the name llama.cpp gives its split
    regexes, BOS/EOS, add-BOS and its chat template.

    Raises:
        ValueError: If the tokenizer is not byte-level BPE, or splits text in a way
            llama.cpp has no name for (llama.cpp would tokenize it otherwise).
    """
    data = json.loads(tokenizer.backend.to_str())
    model = data.get("model") or {}
    splits = tuple(_split_patterns(data.get("pre_tokenizer") or {}))
    pre = _PRE_OF_SPLITS.get(splits)
    if model.get("type") != "BPE" or not tokenizer.byte_level or pre is None:
        raise ValueError(
            f"the tokenizer of {spec} ({model.get('type')}, splits {list(splits)}) is not"
            " one llama.cpp names (byte-level BPE split as GPT-2, SmolLM, Llama 3 or Qwen2"
            " split): llama.cpp would tokenize differently; export with --format hf instead"
        )
    added = {t["id"]: t for t in data.get("added_tokens", [])}
    size = max([*model["vocab"].values(), *added]) + 1
    tokens = [""] * size
    for token, i in model["vocab"].items():
        tokens[i] = token
    types = [_NORMAL] * size
    for i, token in added.items():
        tokens[i] = token["content"]
        types[i] = _CONTROL if token.get("special") else _USER_DEFINED
    merges = [m if isinstance(m, str) else " ".join(m) for m in model.get("merges", [])]
    fields = _gguf_fields(tokens, types, merges, pre, tokenizer)
    template = chat_template_of(spec)
    if template is not None:
        fields[TOKENIZER_KEYS.CHAT_TEMPLATE] = template
    return fields


def _split_patterns(pre: dict[str, Any]) -> list[str]:
    """The regexes a ``tokenizer.json`` pre-tokenizer splits with, in order (a
    ``ByteLevel`` step with its own regex counts as GPT-2's; ``Digits`` as ``\\p{N}``)."""
    steps = pre.get("pretokenizers", [pre]) if pre.get("type") == "Sequence" else [pre]
    found = []
    for step in steps:
        kind = step.get("type")
        if kind == "Split":
            pattern = step.get("pattern") or {}
            found.append(pattern.get("Regex") or pattern.get("String"))
        elif kind == "Digits" and step.get("individual_digits"):
            found.append(r"\p{N}")
        elif kind == "ByteLevel" and step.get("use_regex", True):
            found.append(GPT2_PATTERN)
    return found


def _gguf_fields(
    tokens: list[str], types: list[int], merges: list[str], pre: str, tokenizer: Any
) -> dict[str, Any]:
    return {
        TOKENIZER_KEYS.MODEL: "gpt2",
        TOKENIZER_KEYS.PRE: pre,
        TOKENIZER_KEYS.LIST: tokens,
        TOKENIZER_KEYS.TOKEN_TYPE: np.array(types, dtype="<i4"),
        TOKENIZER_KEYS.MERGES: merges,
        TOKENIZER_KEYS.BOS_ID: int(tokenizer.bos_id),
        TOKENIZER_KEYS.EOS_ID: int(tokenizer.eos_id),
        TOKENIZER_KEYS.ADD_BOS: bool(tokenizer.add_bos),
        TOKENIZER_KEYS.ADD_EOS: False,
    }
