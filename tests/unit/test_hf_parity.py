"""Our GPT-2 and Llama 3 match Hugging Face transformers on tiny random models."""

import torch
import transformers  # test dependency (pyproject [test]); models built from config only

from plugintrain.model_zoo import RopeScaling, Transformer, TransformerConfig, llama3
from plugintrain.model_zoo.layers import rope_frequencies

from _hf_models import ours_from_hf


def _assert_same_logits(hf_model, ours: Transformer, vocab_size: int) -> None:
    hf_model.eval()
    ours.eval()
    tokens = torch.randint(0, vocab_size, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = hf_model(tokens).logits
        actual = ours(tokens)
    torch.testing.assert_close(actual, expected, atol=1e-5, rtol=1e-5)


def test_gpt2_matches_hugging_face():
    torch.manual_seed(0)
    hf_config = transformers.GPT2Config(
        vocab_size=96,
        n_positions=64,
        n_embd=32,
        n_layer=2,
        n_head=4,
        bos_token_id=0,
        eos_token_id=0,
    )
    hf_model = transformers.GPT2LMHeadModel(hf_config)
    config = TransformerConfig.from_name(
        "gpt2-debug", vocab_size=96, block_size=64, n_embd=32, n_layer=2, n_head=4
    )
    ours = Transformer(config)
    ours.load_state_dict(ours_from_hf(hf_model.state_dict(), config))
    _assert_same_logits(hf_model, ours, config.vocab_size)


def _tiny_llama() -> TransformerConfig:
    # GQA (4 query heads share 2 KV heads) and a short original context (64), so the
    # Llama 3 scaling keeps the high frequencies, divides the low ones and interpolates between.
    scaling = RopeScaling(
        factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=64
    )
    return TransformerConfig.from_name(
        "llama3-debug",
        vocab_size=96,
        block_size=64,
        n_embd=64,
        n_layer=2,
        n_head=4,
        n_kv_head=2,
        intermediate_size=96,
        tie_embeddings=False,
        rope_scaling=scaling,
    )


def test_tiny_llama_exercises_every_scaling_regime():
    config = _tiny_llama()
    plain = rope_frequencies(config.head_dim, config.rope_theta)
    scaled = rope_frequencies(config.head_dim, config.rope_theta, config.rope_scaling)
    ratio = plain / scaled
    assert (ratio == 1).any()  # high frequencies kept
    assert torch.isclose(ratio, torch.tensor(8.0)).any()  # low frequencies divided
    assert ((ratio > 1) & ~torch.isclose(ratio, torch.tensor(8.0))).any()  # interpolated


def test_llama3_matches_hugging_face():
    config = _tiny_llama()
    scaling = config.rope_scaling
    torch.manual_seed(0)
    hf_config = transformers.LlamaConfig(
        vocab_size=config.vocab_size,
        hidden_size=config.n_embd,
        intermediate_size=config.ffn_dim,
        num_hidden_layers=config.n_layer,
        num_attention_heads=config.n_head,
        num_key_value_heads=config.kv_heads,
        max_position_embeddings=config.block_size,
        rms_norm_eps=config.norm_eps,
        tie_word_embeddings=False,
        # transformers 5 takes the base period and the scaling together as `rope_parameters`.
        rope_parameters={
            "rope_type": "llama3",
            "rope_theta": config.rope_theta,
            "factor": scaling.factor,
            "low_freq_factor": scaling.low_freq_factor,
            "high_freq_factor": scaling.high_freq_factor,
            "original_max_position_embeddings": scaling.original_max_position_embeddings,
        },
    )
    hf_model = transformers.LlamaForCausalLM(hf_config)
    ours = Transformer(config)
    ours.load_state_dict(ours_from_hf(hf_model.state_dict(), config))
    _assert_same_logits(hf_model, ours, config.vocab_size)


def test_llama3_adapter_ties_output_to_embeddings():
    config = TransformerConfig.from_name("llama3-debug", vocab_size=96, n_layer=1)
    hf_model = transformers.LlamaForCausalLM(
        transformers.LlamaConfig(
            vocab_size=96,
            hidden_size=128,
            intermediate_size=384,
            num_hidden_layers=1,
            num_attention_heads=4,
            num_key_value_heads=2,
            tie_word_embeddings=True,
        )
    )
    sd = {k: v for k, v in hf_model.state_dict().items() if k != "lm_head.weight"}
    converted = ours_from_hf(sd, config)
    assert converted["output.weight"] is converted["tok_embeddings.weight"]
    Transformer(config).load_state_dict(converted)


def test_llama3_with_a_head_size_apart_from_the_width_matches_hugging_face():
    """A Llama whose ``head_dim`` is not ``hidden_size / num_attention_heads`` (4 heads of
    32 over a width of 64) imports with ``head_size`` set and gives transformers' logits."""
    torch.manual_seed(0)
    hf_config = transformers.LlamaConfig(
        vocab_size=96, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=64,
    )  # fmt: skip
    hf_model = transformers.LlamaForCausalLM(hf_config)
    config = llama3.from_hf_config(hf_config.to_dict(), "llama-wide-heads")
    assert (config.head_size, config.head_dim, config.n_embd) == (32, 32, 64)
    ours = Transformer(config)
    ours.load_state_dict(ours_from_hf(hf_model.state_dict(), config))
    _assert_same_logits(hf_model, ours, config.vocab_size)
