"""CausalLM.generate: the KV-cache path reproduces the uncached one."""

import pytest
import torch

from plugintrain.model_zoo import CausalLM, TransformerConfig


def _lm(preset: str) -> CausalLM:
    torch.manual_seed(0)
    config = TransformerConfig.from_name(preset, vocab_size=64, block_size=32, n_layer=2)
    lm = CausalLM(config)
    lm.configure_model()
    return lm.eval()


def _prompt() -> torch.Tensor:
    return torch.randint(0, 64, (2, 5), generator=torch.Generator().manual_seed(1))


@pytest.mark.parametrize("preset", ["gpt2-debug", "llama3-debug"])
def test_cached_greedy_equals_uncached(preset):
    lm = _lm(preset)
    cached = lm.generate(_prompt(), max_new_tokens=12, temperature=0.0)
    uncached = lm.generate(_prompt(), max_new_tokens=12, temperature=0.0, use_cache=False)
    assert cached.shape == (2, 17)
    torch.testing.assert_close(cached, uncached, rtol=0, atol=0)


@pytest.mark.parametrize("preset", ["gpt2-debug", "llama3-debug"])
def test_cached_top_k_sampling_equals_uncached(preset):
    lm = _lm(preset)
    torch.manual_seed(2)
    cached = lm.generate(_prompt(), max_new_tokens=12, temperature=0.8, top_k=10)
    torch.manual_seed(2)
    uncached = lm.generate(_prompt(), max_new_tokens=12, temperature=0.8, top_k=10, use_cache=False)
    torch.testing.assert_close(cached, uncached, rtol=0, atol=0)


def test_prefill_logits_match_full_forward():
    lm = _lm("llama3-debug")
    tokens = torch.randint(0, 64, (2, 9))
    with torch.no_grad():
        expected = lm(tokens)
        lm.model.setup_kv_cache(2, 16)
        prefill = lm(tokens[:, :6], torch.arange(6))
        decoded = [lm(tokens[:, t : t + 1], torch.tensor([t])) for t in range(6, 9)]
    lm.model.clear_kv_cache()
    torch.testing.assert_close(torch.cat([prefill, *decoded], dim=1), expected)


def test_top_k_restricts_samples():
    lm = _lm("gpt2-debug")
    prompt = _prompt()[:1]
    with torch.no_grad():
        allowed = lm(prompt)[0, -1].topk(3).indices
    torch.manual_seed(0)
    samples = [lm.generate(prompt, 1, temperature=5.0, top_k=3)[0, -1] for _ in range(20)]
    assert all(s in allowed for s in samples)


def test_eos_stops_and_pads():
    lm = _lm("gpt2-debug")
    prompt = _prompt()
    first = lm.generate(prompt, 1, temperature=0.0)[:, -1]
    out = lm.generate(prompt, 10, temperature=0.0, eos_id=int(first[0]))
    assert out[0, 5:].eq(first[0]).all()  # row 0 finished at once and is padded
    assert out.size(1) <= 15


def test_prompt_too_long_for_cache_raises():
    lm = _lm("gpt2-debug")
    with pytest.raises(ValueError, match="block_size=32"):
        lm.generate(torch.zeros(1, 30, dtype=torch.long), max_new_tokens=3)
    assert all(layer.attention.kv_cache is None for layer in lm.model.layers.values())


def test_uncached_generation_crops_to_block_size():
    lm = _lm("gpt2-debug")
    out = lm.generate(torch.zeros(1, 30, dtype=torch.long), 5, use_cache=False)
    assert out.shape == (1, 35)
