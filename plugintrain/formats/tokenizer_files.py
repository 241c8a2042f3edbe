"""Tokenizers as the files other tools read them from: a Hugging Face directory's
``tokenizer.json``, ``tokenizer_config.json`` and ``generation_config.json``
(``AutoTokenizer``, ``pipeline``), and a GGUF file's ``tokenizer.*`` keys as llama.cpp's
own converter writes them (``convert_hf_to_gguf.py``).

Every tokenizer plugintrain has is covered: the tiktoken vocabularies (GPT-2's, Llama
3's) rebuilt as a `tokenizers` BPE that gives tiktoken's ids, and the Hugging Face
tokenizers plugintrain reads (a ``tokenizer.json``, a GGUF's vocabulary) as they are.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers, processors
from tokenizers import Tokenizer as Backend

from plugintrain.data.tokenizers.chat_templates import ChatTemplateError, load_chat_template
from plugintrain.data.tokenizers.hf_tokenizer import byte_alphabet
from plugintrain.data.tokenizers.registry import TOKENIZER_NAMES, Tokenizer
from plugintrain.data.tokenizers.split_patterns import GPT2_PATTERN, LLAMA3_PATTERN, QWEN2_PATTERN

GGUF_PRE = {"gpt2": "gpt-2", "llama3": "llama-bpe"}
"""Our tiktoken tokenizer -> the ``tokenizer.ggml.pre`` llama.cpp's converter writes for
it (llama.cpp knows ``gpt-2``, not ``gpt2``; src/llama-vocab.cpp)."""

_PRE_OF_SPLITS = {
    (GPT2_PATTERN,): "gpt-2",
    (r"\p{N}", GPT2_PATTERN): "smollm",
    (LLAMA3_PATTERN,): "llama-bpe",
    (QWEN2_PATTERN,): "qwen2",
}
"""The split regexes of a ``tokenizer.json`` -> llama.cpp's name for them."""

_NORMAL, _CONTROL, _USER_DEFINED = 1, 3, 4  # gguf.TokenType


def _spelled(piece: bytes, spell: dict[int, str]) -> str:
    return "".join(spell[b] for b in piece)


def tiktoken_merges(ranks: dict[bytes, int]) -> list[tuple[bytes, bytes]]:
    """Every ``(left, right)`` whose join is a token, ordered by that token's rank (ties
    by the parts' ranks): with these merges, BPE joins what tiktoken joins (transformers'
    tiktoken converter derives them the same way)."""
    found = []
    for piece, rank in ranks.items():
        for cut in range(1, len(piece)):
            left, right = piece[:cut], piece[cut:]
            if left in ranks and right in ranks:
                found.append((rank, ranks[left], ranks[right], left, right))
    return [(left, right) for *_, left, right in sorted(found)]


def tiktoken_backend(tokenizer: Tokenizer) -> Backend:
    """A `tokenizers` tokenizer giving ``tokenizer``'s ids: byte-level BPE over the same
    split regex, a word that is itself a token taken whole (tiktoken's rule:
    ``ignore_merges``), its special tokens added under their ids, and, for a family whose
    tokenizer leads every text with BOS (Llama 3), a post-processor that adds it."""
    encoding = tokenizer.encoding
    ranks = encoding._mergeable_ranks  # tiktoken keeps them only there
    spell = {b: c for c, b in byte_alphabet().items()}
    vocab = {_spelled(piece, spell): rank for piece, rank in ranks.items()}
    merges = [(_spelled(a, spell), _spelled(b, spell)) for a, b in tiktoken_merges(ranks)]
    backend = Backend(models.BPE(vocab, merges, fuse_unk=False, ignore_merges=True))
    split = pre_tokenizers.Split(Regex(encoding._pat_str), behavior="isolated", invert=False)
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    backend.pre_tokenizer = pre_tokenizers.Sequence([split, byte_level])
    backend.decoder = decoders.ByteLevel()
    specials = sorted(tokenizer.special_tokens.items(), key=lambda item: item[1])
    backend.add_special_tokens([AddedToken(t, special=True, normalized=False) for t, _ in specials])
    for token, i in specials:  # ids follow the ranks in order, as tiktoken numbers them
        assert backend.token_to_id(token) == i, (token, i)
    if tokenizer.add_bos:
        bos = tokenizer.decode([tokenizer.bos_id])
        backend.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, tokenizer.bos_id)]
        )
    else:
        backend.post_processor = processors.ByteLevel(trim_offsets=False)
    return backend


def chat_template_of(spec: str | None) -> str | None:
    """The chat template the tokenizer ``spec`` carries (None: it has none)."""
    if spec is None:
        return None
    try:
        return load_chat_template(spec).source
    except ChatTemplateError:
        return None


def write_hf_tokenizer(spec: str, tokenizer: Any, out: Path, max_length: int) -> None:
    """Write ``tokenizer`` (``spec``'s) into the Hugging Face directory ``out``:
    ``tokenizer.json``, ``tokenizer_config.json`` (BOS, EOS, whether BOS leads a text,
    the chat template) and ``generation_config.json``, so ``AutoTokenizer`` gives
    plugintrain's ids and ``pipeline("text-generation")`` runs the export as it is.

    A Hugging Face source's own tokenizer files are copied as they are; the others are
    written here."""
    folder = Path(spec) if Path(spec).is_dir() else None
    if folder is not None and (folder / "tokenizer.json").is_file():
        for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
            if (folder / name).is_file():
                (out / name).write_bytes((folder / name).read_bytes())
    else:
        backend = tiktoken_backend(tokenizer) if spec in TOKENIZER_NAMES else tokenizer.backend
        backend = Backend.from_str(backend.to_str())
        backend.encode_special_tokens = False  # transformers parses specials in text
        if spec not in TOKENIZER_NAMES and tokenizer.add_bos:
            bos = tokenizer.decode([tokenizer.bos_id])
            backend.post_processor = processors.TemplateProcessing(
                single=f"{bos} $A", pair=f"{bos} $A {bos} $B",
                special_tokens=[(bos, tokenizer.bos_id)],
            )  # fmt: skip
        backend.save(str(out / "tokenizer.json"))
        bos, eos = (tokenizer.decode([i]) for i in (tokenizer.bos_id, tokenizer.eos_id))
        config = {
            "tokenizer_class": "PreTrainedTokenizerFast",
            "bos_token": bos,
            "eos_token": eos,
            "add_bos_token": bool(tokenizer.add_bos),
            "add_eos_token": False,
            "clean_up_tokenization_spaces": False,
            "model_max_length": max_length,
        }
        template = chat_template_of(spec)
        if template is not None:
            config["chat_template"] = template
        _write_json(out / "tokenizer_config.json", config)
    if not (out / "generation_config.json").is_file():
        generation = {"bos_token_id": tokenizer.bos_id, "eos_token_id": tokenizer.eos_id}
        if folder is not None and (folder / "generation_config.json").is_file():
            generation = json.loads((folder / "generation_config.json").read_text())
        _write_json(out / "generation_config.json", generation)


def tiktoken_gguf_vocabulary(tokenizer: Tokenizer) -> dict[str, Any]:
    """The ``tokenizer.ggml.*`` fields that make llama.cpp tokenize as a tiktoken
    ``tokenizer``: tokens spelled in GPT-2's byte alphabet, merges ranked as tiktoken
    ranks, the pre-tokenizer name llama.cpp's converter writes, BOS/EOS and whether BOS
    leads a text."""
    ranks = tokenizer.encoding._mergeable_ranks
    spell = {b: c for c, b in byte_alphabet().items()}
    by_id = {i: piece for piece, i in ranks.items()}
    specials = {i: t for t, i in tokenizer.special_tokens.items()}
    tokens = [specials.get(i) or _spelled(by_id[i], spell) for i in range(tokenizer.vocab_size)]
    merges = [f"{_spelled(a, spell)} {_spelled(b, spell)}" for a, b in tiktoken_merges(ranks)]
    types = [_CONTROL if i in specials else _NORMAL for i in range(len(tokens))]
    return _gguf_fields(tokens, types, merges, GGUF_PRE[tokenizer.name], tokenizer)


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
        fields["tokenizer.chat_template"] = template
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
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.pre": pre,
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.token_type": np.array(types, dtype="<i4"),
        "tokenizer.ggml.merges": merges,
        "tokenizer.ggml.bos_token_id": int(tokenizer.bos_id),
        "tokenizer.ggml.eos_token_id": int(tokenizer.eos_id),
        "tokenizer.ggml.add_bos_token": bool(tokenizer.add_bos),
        "tokenizer.ggml.add_eos_token": False,
    }


def _write_json(path: Path, data: dict[str, Any]) -> None:
    path.write_text(json.dumps(data, indent=2, ensure_ascii=False) + "\n")
