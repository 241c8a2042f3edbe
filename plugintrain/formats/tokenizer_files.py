"""Tokenizers as the files ``transformers`` reads them from: a Hugging Face directory's
``tokenizer.json``, ``tokenizer_config.json`` and ``generation_config.json``
(``AutoTokenizer``, ``pipeline``).

Every tokenizer plugintrain has is covered: the tiktoken vocabularies (GPT-2's, Llama
3's) rebuilt as a `tokenizers` BPE that gives tiktoken's ids, and the Hugging Face
tokenizers plugintrain reads (a ``tokenizer.json``, a GGUF's vocabulary) as they are. A
GGUF file's ``tokenizer.*`` keys are :mod:`plugintrain.formats.gguf.tokenizer_keys`'.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers, processors
from tokenizers import Tokenizer as Backend

from plugintrain.data.tokenizers.chat_templates import ChatTemplateError, load_chat_template
from plugintrain.data.tokenizers.hf_tokenizer import byte_alphabet
from plugintrain.data.tokenizers.registry import TOKENIZER_NAMES, Tokenizer


def spelled(piece: bytes, spell: dict[int, str]) -> str:
    """``piece`` spelled in a byte alphabet (``spell``: byte -> character)."""
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
    vocab = {spelled(piece, spell): rank for piece, rank in ranks.items()}
    merges = [(spelled(a, spell), spelled(b, spell)) for a, b in tiktoken_merges(ranks)]
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
                single=f"{bos} $A",
                pair=f"{bos} $A {bos} $B",
                special_tokens=[(bos, tokenizer.bos_id)],
            )
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


def _write_json(path: Path, data: dict[str, Any]) -> None:
    path.write_text(json.dumps(data, indent=2, ensure_ascii=False) + "\n")
