"""Tokenizers that come with pretrained weights, run by the Hugging Face `tokenizers` library.

Two sources: a ``tokenizer.json`` (or a Hugging Face model directory holding one), and the
vocabulary a GGUF file embeds under llama.cpp's ``tokenizer.ggml.*`` keys. A GGUF
vocabulary is rebuilt the way llama.cpp runs it: ``gpt2`` is byte-level BPE split by the
regexes its ``tokenizer.ggml.pre`` names, ``llama`` is SentencePiece BPE over ``▁``-joined
text with byte fallback.
"""

from __future__ import annotations

import functools
import json
import re
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import numpy as np
from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers
from tokenizers import Tokenizer as Backend

from plugintrain.core.gguf_header import TOKENIZER_KEYS, is_gguf, read_gguf_metadata
from plugintrain.data.tokenizers.split_patterns import GGUF_PRE_SPLITS


# llama.cpp's token types (gguf.TokenType) that matter here (6, BYTE, is a <0xNN> token).
_NORMAL, _UNKNOWN, _CONTROL, _USER_DEFINED = 1, 2, 3, 4
# Where a vocabulary names neither, the BOS/EOS tokens these conventions use, in order.
_BOS_NAMES = ("<|begin_of_text|>", "<s>", "<bos>", "<|endoftext|>")
_EOS_NAMES = ("<|end_of_text|>", "</s>", "<eos>", "<|endoftext|>")
_BYTE_FALLBACK = re.compile(r"<0x[0-9A-Fa-f]{2}>")
# `tokenizer.ggml.pre` values llama.cpp runs with `ignore_merges` (src/llama-vocab.cpp).
_WHOLE_WORD_PRES = frozenset(("llama3", "llama-v3", "llama-bpe", "falcon3"))


class HFTokenizer:
    """A tokenizer of the `tokenizers` library behind the interface of `Tokenizer`.

    Text is always encoded as ordinary text: a literal special token (``"<|im_start|>"``)
    in a document becomes plain tokens, never the control id.

    Args:
        name: Short name, e.g. ``"smollm2-135m"``.
        backend: The `tokenizers.Tokenizer` (vocabulary, merges, splits, decoder).
        bos_id: Id that `encode` prepends with ``bos=True``.
        eos_id: Id that `encode` appends with ``eos=True``.
        byte_level: Whether tokens are spelled in GPT-2's byte alphabet (else
            SentencePiece's, ``▁`` for a space and ``<0xNN>`` for a fallback byte).
        add_bos: Whether the model's own tokenizer leads every text with BOS (its
            ``tokenizer_config.json``, post-processor or GGUF ``add_bos_token`` says so).
    """

    def __init__(
        self,
        name: str,
        backend: Backend,
        bos_id: int,
        eos_id: int,
        byte_level: bool,
        add_bos: bool = False,
    ) -> None:
        self.name = name
        self.add_bos = add_bos
        self.backend = backend
        self.backend.encode_special_tokens = True  # no control ids from text
        self.bos_id = bos_id
        self.eos_id = eos_id
        self.byte_level = byte_level
        self._vocab_size = max(backend.get_vocab(with_added_tokens=True).values()) + 1

    @property
    def vocab_size(self) -> int:
        """Number of token ids (one more than the largest), specials included."""
        return self._vocab_size

    @property
    def special_tokens(self) -> dict[str, int]:
        """Special token strings and their ids."""
        added = self.backend.get_added_tokens_decoder()
        return {token.content: i for i, token in added.items() if token.special}

    def encode(self, text: str, bos: bool = False, eos: bool = False) -> list[int]:
        """Token ids of ``text``, optionally framed by the BOS and EOS ids."""
        ids = self.backend.encode(text, add_special_tokens=False).ids
        return ([self.bos_id] if bos else []) + ids + ([self.eos_id] if eos else [])

    def encode_batch(self, texts: Iterable[str], bos: bool = False) -> list[list[int]]:
        """Encode several documents in parallel threads, each optionally led by BOS."""
        batch = self.backend.encode_batch_fast(list(texts), add_special_tokens=False)
        return [([self.bos_id] if bos else []) + e.ids for e in batch]

    def encode_array(self, text: str) -> np.ndarray:
        """`encode`'s ids of ``text`` as uint32."""
        return np.asarray(self.backend.encode(text, add_special_tokens=False).ids, np.uint32)

    def encode_with_specials(self, text: str) -> list[int]:
        """Token ids of text a chat template wrote, special token strings as their ids
        (``"<|im_start|>"`` -> 1); never for a document's text, which `encode` reads.

        A copy of the backend parses them, so `encode` never does, whatever thread runs.
        """
        return self._special_parser.encode(text, add_special_tokens=False).ids

    @functools.cached_property
    def _special_parser(self) -> Backend:
        parser = Backend.from_str(self.backend.to_str())
        parser.encode_special_tokens = False
        return parser

    def decode(self, ids: Iterable[int]) -> str:
        """Text of token ids, specials spelled out; invalid UTF-8 becomes U+FFFD."""
        return self.backend.decode(list(ids), skip_special_tokens=False)

    def token_bytes(self) -> np.ndarray:
        """UTF-8 bytes of text each id stands for, int32 ``(vocab_size,)``.

        Read off each token's spelling, never by decoding (a token holding part of a
        multi-byte character would decode to U+FFFD): 0 for special tokens and unused
        ids, 1 for a fallback byte, and a SentencePiece ``▁`` counts as the space it
        replaces (also the one prepended to a document's first word).
        """
        counts = np.zeros(self.vocab_size, dtype=np.int32)
        spelled = _byte_level_length if self.byte_level else _sentencepiece_length
        for token, i in self.backend.get_vocab(with_added_tokens=False).items():
            counts[i] = spelled(token)
        for i, token in self.backend.get_added_tokens_decoder().items():
            counts[i] = 0 if token.special else len(token.content.encode())
        return counts

    def __repr__(self) -> str:
        return f"HFTokenizer(name={self.name!r}, vocab_size={self.vocab_size})"


@functools.lru_cache(maxsize=1)
def byte_alphabet() -> dict[str, int]:
    """GPT-2's printable stand-in character for each byte, inverted: char -> byte.

    Printable Latin-1 bytes stand for themselves; the others (controls, space, ...) are
    mapped in order onto ``chr(256)``, ``chr(257)``, ... (GPT-2's ``bytes_to_unicode``).
    """
    kept = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAC + 1), *range(0xAE, 0xFF + 1)]
    moved = [b for b in range(256) if b not in kept]
    return {chr(b): b for b in kept} | {chr(256 + n): b for n, b in enumerate(moved)}


def _byte_level_length(token: str) -> int:
    """Bytes a byte-level token spells (a character outside the alphabet as its UTF-8)."""
    alphabet = byte_alphabet()
    return sum(1 if c in alphabet else len(c.encode()) for c in token)


def _sentencepiece_length(token: str) -> int:
    """Bytes a SentencePiece token spells: ``▁`` is a space, ``<0xNN>`` one byte."""
    if _BYTE_FALLBACK.fullmatch(token):
        return 1
    return len(token.replace("\u2581", " ").encode())


def load_hf_tokenizer(path: str | Path, name: str) -> HFTokenizer:
    """The tokenizer of a ``tokenizer.json``, a directory holding one, or a GGUF file.

    BOS and EOS come from the GGUF metadata, or from ``tokenizer_config.json`` /
    ``config.json`` beside a ``tokenizer.json``; failing those, from the usual names
    (``<|begin_of_text|>``, ``<s>``, ``<|endoftext|>``, ...) in the vocabulary.

    Raises:
        ValueError: If the path holds no readable tokenizer, a GGUF tokenizer model or
            split other than those llama.cpp documents here, or no BOS/EOS token is found.
    """
    path = Path(path)
    if is_gguf(path):
        return _from_gguf(path, name)
    file = path / "tokenizer.json" if path.is_dir() else path
    try:
        backend = Backend.from_file(str(file))
    except Exception as error:  # tokenizers raises a bare Exception for I/O and JSON errors
        raise ValueError(
            f"{file}: not a Hugging Face tokenizer.json ({error}); pass a tokenizer.json, a"
            " directory holding one, or a .gguf file"
        ) from None
    configs = [_read_json(file.parent / n) for n in ("tokenizer_config.json", "config.json")]
    bos, eos = (_json_special_id(backend, configs, role, file) for role in ("bos", "eos"))
    add_bos = configs[0].get("add_bos_token")
    if not isinstance(add_bos, bool):  # else the post-processor's template says
        probe = backend.encode("a", add_special_tokens=True).ids
        add_bos = (
            bool(probe)
            and probe[0] == bos
            and backend.encode("a", add_special_tokens=False).ids[:1] != [bos]
        )
    return HFTokenizer(
        name, backend, bos, eos, byte_level=_decodes_byte_level(backend), add_bos=add_bos
    )


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as error:
        raise ValueError(f"{path}: not JSON ({error})") from None


def _json_special_id(backend: Backend, configs: list[dict], role: str, file: Path) -> int:
    """The ``role`` (``bos``/``eos``) id: ``tokenizer_config.json``'s token, else
    ``config.json``'s id (the first of a list), else a conventional name in the vocabulary."""
    tokenizer_config, model_config = configs
    token = tokenizer_config.get(f"{role}_token")
    token = token.get("content") if isinstance(token, dict) else token
    if isinstance(token, str) and backend.token_to_id(token) is not None:
        return backend.token_to_id(token)
    given = model_config.get(f"{role}_token_id")
    given = given[0] if isinstance(given, list) and given else given
    if isinstance(given, int):
        return given
    return _conventional_id(backend.token_to_id, role, file)


def _conventional_id(token_to_id: Any, role: str, source: Path) -> int:
    names = _BOS_NAMES if role == "bos" else _EOS_NAMES
    for token in names:
        if token_to_id(token) is not None:
            return token_to_id(token)
    raise ValueError(
        f"{source}: no {role.upper()} token: no {role}_token in a tokenizer_config.json or"
        f" config.json beside it, and none of {list(names)} in the vocabulary"
    )


def _decodes_byte_level(backend: Backend) -> bool:
    """Whether the decoder maps GPT-2's byte alphabet back to bytes (alone or in a sequence)."""
    decoder = json.loads(backend.to_str()).get("decoder") or {}
    steps = decoder.get("decoders", [decoder]) if decoder.get("type") == "Sequence" else [decoder]
    return any(step.get("type") == "ByteLevel" for step in steps)


def _from_gguf(path: Path, name: str) -> HFTokenizer:
    meta = read_gguf_metadata(path)
    model = meta.get(TOKENIZER_KEYS.MODEL)
    if model == "gpt2":
        backend, byte_level = _gguf_byte_level(meta, path), True
    elif model == "llama":
        backend, byte_level = _gguf_sentencepiece(meta), False
    else:
        raise ValueError(
            f"{path}: tokenizer.ggml.model {model!r} is not supported; plugintrain reads"
            " 'gpt2' (byte-level BPE) and 'llama' (SentencePiece BPE) vocabularies"
        )
    _add_gguf_specials(backend, meta)
    ids = {
        role: meta.get(key) for role, key in (("bos", TOKENIZER_KEYS.BOS_ID), ("eos", TOKENIZER_KEYS.EOS_ID))
    }
    bos, eos = (
        ids[role] if ids[role] is not None else _conventional_id(backend.token_to_id, role, path)
        for role in ("bos", "eos")
    )
    # llama.cpp's default where the file has no add_bos_token: SentencePiece vocabularies
    # and Llama 3's BPE add BOS, other BPE vocabularies do not (src/llama-vocab.cpp).
    default = model == "llama" or meta.get(TOKENIZER_KEYS.PRE) in _WHOLE_WORD_PRES
    add_bos = bool(meta.get(TOKENIZER_KEYS.ADD_BOS, default))
    return HFTokenizer(name, backend, bos, eos, byte_level=byte_level, add_bos=add_bos)


def _gguf_byte_level(meta: dict[str, Any], path: Path) -> Backend:
    """Byte-level BPE, split as llama.cpp splits for the file's ``tokenizer.ggml.pre``.

    A file without the key predates it; like transformers, split it as GPT-2 does.
    """
    pre = meta.get(TOKENIZER_KEYS.PRE, "gpt2")
    if pre not in GGUF_PRE_SPLITS:
        raise ValueError(
            f"{path}: tokenizer.ggml.pre {pre!r} is not supported; plugintrain knows how"
            f" llama.cpp splits text for {sorted(GGUF_PRE_SPLITS)}"
        )
    tokens = meta[TOKENIZER_KEYS.LIST]
    merges = [tuple(m.split(" ", 1)) for m in meta.get(TOKENIZER_KEYS.MERGES, [])]
    vocab = {token: i for i, token in enumerate(tokens)}
    # Like tiktoken, llama.cpp takes a word that is itself a token whole for Llama 3's
    # vocabulary, even where the merges would spell it otherwise.
    bpe = models.BPE(vocab, merges, fuse_unk=False, ignore_merges=pre in _WHOLE_WORD_PRES)
    backend = Backend(bpe)
    splits = [pre_tokenizers.Split(Regex(r), behavior="isolated") for r in GGUF_PRE_SPLITS[pre]]
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    backend.pre_tokenizer = pre_tokenizers.Sequence([*splits, byte_level])
    backend.decoder = decoders.ByteLevel()
    return backend


def _gguf_sentencepiece(meta: dict[str, Any]) -> Backend:
    """SentencePiece BPE: spaces become ``▁`` (and lead the text unless the file says
    ``add_space_prefix`` false), and characters outside the vocabulary fall back to
    ``<0xNN>`` byte tokens."""
    tokens, types = meta[TOKENIZER_KEYS.LIST], meta.get(TOKENIZER_KEYS.TOKEN_TYPE)
    vocab = {token: i for i, token in enumerate(tokens)}
    if TOKENIZER_KEYS.MERGES in meta:
        merges = [tuple(m.split(" ", 1)) for m in meta[TOKENIZER_KEYS.MERGES]]
    else:
        merges = _merges_from_scores(tokens, meta[TOKENIZER_KEYS.SCORES], types)
    unk = meta.get(TOKENIZER_KEYS.UNK_ID)
    unk_token = tokens[unk] if unk is not None else None
    bpe = models.BPE(vocab, merges, unk_token=unk_token, fuse_unk=True, byte_fallback=True)
    backend = Backend(bpe)
    prefix = bool(meta.get(TOKENIZER_KEYS.ADD_PREFIX, True))
    backend.pre_tokenizer = pre_tokenizers.Metaspace(
        replacement="\u2581", prepend_scheme="first" if prefix else "never", split=False
    )
    steps = [decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()]
    backend.decoder = decoders.Sequence(steps + ([decoders.Strip(" ", 1, 0)] if prefix else []))
    return backend


def _merges_from_scores(
    tokens: list[str], scores: np.ndarray, types: np.ndarray | None
) -> list[tuple[str, str]]:
    """BPE merges that reproduce SentencePiece's rule (llama.cpp ``llm_tokenizer_spm``):
    of all adjacent pairs whose join is a token, join the one whose token scores highest.

    So every split of a normal token into two normal tokens is a merge, ranked by the
    joined token's score (ties: the earlier left and right ids first).
    """
    normal = {
        token: i
        for i, token in enumerate(tokens)
        if types is None or types[i] in (_NORMAL, _USER_DEFINED)
    }
    ranked = []
    for token, i in normal.items():
        for cut in range(1, len(token)):
            left, right = token[:cut], token[cut:]
            if left in normal and right in normal:
                ranked.append((-float(scores[i]), normal[left], normal[right], left, right))
    return [(left, right) for *_, left, right in sorted(ranked)]


def _add_gguf_specials(backend: Backend, meta: dict[str, Any]) -> None:
    """Control and unknown tokens as special tokens (decoded verbatim, never produced from
    text), user-defined ones as plain added tokens matched whole, as llama.cpp does."""
    tokens, types = meta[TOKENIZER_KEYS.LIST], meta.get(TOKENIZER_KEYS.TOKEN_TYPE)
    if types is None:
        return
    for kind, special in ((_CONTROL, True), (_UNKNOWN, True), (_USER_DEFINED, False)):
        added = [
            AddedToken(tokens[i], normalized=False, special=special)
            for i in np.flatnonzero(types == kind)
        ]
        if special:
            backend.add_special_tokens(added)
        else:
            backend.add_tokens(added)
