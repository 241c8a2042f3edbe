"""GPT-2 and Llama 3 tokenizers built offline from the fetched rank files."""

import pytest

from plugintrain.data import get_tokenizer

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
