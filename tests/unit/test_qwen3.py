"""Qwen3 (dense): our model against transformers' Qwen3ForCausalLM, presets against the
published sizes, Hugging Face directories both ways, KV-cache generation, config checks.

Every reference model is built by ``transformers`` from a config (random weights, nothing
downloaded). Norm weights are drawn at random before comparing, so a query/key norm mapped
to the wrong tensor (all of them start at one) shows in the logits.
"""

from __future__ import annotations

import json
from pathlib import Path

import lightning as L
import pytest
import torch
import transformers
from torch.utils.data import DataLoader, TensorDataset

from plugintrain.cli import main
from plugintrain.formats import load_into, open_weights
from plugintrain.formats.base import ARCHITECTURE_FIELDS
from plugintrain.model_zoo import CausalLM, Transformer, TransformerConfig, gpt2, llama3, qwen3
from plugintrain.model_zoo.weight_plans import apply_plan

from _hf_models import ours_from_hf

VOCAB = 96
TOKENS = torch.randint(0, VOCAB, (2, 24), generator=torch.Generator().manual_seed(0))

# qwen3-debug, shrunk: heads of 64 over a width of 128 (query width 256 != n_embd).
VARIANTS = {
    "decoupled-head": {},
    "untied": {"tie_embeddings": False},
    "head-is-width-over-heads": {"head_size": 32},  # 4 heads x 32 == n_embd
}


def _config(**overrides: object) -> TransformerConfig:
    fields = {"vocab_size": VOCAB, "block_size": 64, "n_layer": 2, "tokenizer": None}
    return TransformerConfig.from_name("qwen3-debug", **(fields | overrides))


def _hf_config(config: TransformerConfig) -> transformers.Qwen3Config:
    """transformers' config for ``config``, spelled out field by field (not through our
    ``to_hf_config``)."""
    return transformers.Qwen3Config(
        vocab_size=config.vocab_size, hidden_size=config.n_embd,
        intermediate_size=config.ffn_dim, num_hidden_layers=config.n_layer,
        num_attention_heads=config.n_head, num_key_value_heads=config.kv_heads,
        head_dim=config.head_dim, max_position_embeddings=config.block_size,
        rms_norm_eps=config.norm_eps, tie_word_embeddings=config.tie_embeddings,
        rope_parameters={"rope_type": "default", "rope_theta": config.rope_theta},
    )  # fmt: skip


@torch.no_grad()
def _random_norms(model: torch.nn.Module, seed: int) -> torch.nn.Module:
    gen = torch.Generator().manual_seed(seed)
    for name, param in model.named_parameters():
        if "norm" in name:
            param.copy_(torch.rand(param.shape, generator=gen) + 0.5)
    return model.eval()


def _hf_model(config: TransformerConfig) -> transformers.Qwen3ForCausalLM:
    torch.manual_seed(0)
    return _random_norms(transformers.Qwen3ForCausalLM(_hf_config(config)), seed=1)


@torch.no_grad()
def _logits(model: torch.nn.Module) -> torch.Tensor:
    out = model.eval()(TOKENS)
    return out.logits if hasattr(out, "logits") else out


@pytest.mark.parametrize("variant", VARIANTS)
def test_hugging_face_weights_give_its_logits(variant: str) -> None:
    config = _config(**VARIANTS[variant])
    hf = _hf_model(config)
    ours = Transformer(config)
    ours.load_state_dict(ours_from_hf(hf.state_dict(), config))
    torch.testing.assert_close(_logits(ours), _logits(hf), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("variant", VARIANTS)
def test_our_weights_exported_give_our_logits_in_transformers(variant: str) -> None:
    config = _config(**VARIANTS[variant])
    torch.manual_seed(2)
    ours = _random_norms(Transformer(config), seed=3)
    hf = transformers.Qwen3ForCausalLM(_hf_config(config))
    exported = apply_plan(qwen3.hf_export_plan(config), ours.state_dict())
    result = hf.load_state_dict(exported, strict=False)
    assert result.missing_keys == (["lm_head.weight"] if config.tie_embeddings else [])
    assert not result.unexpected_keys
    torch.testing.assert_close(_logits(hf), _logits(ours), atol=1e-5, rtol=1e-5)


# Published config.json values (Qwen/Qwen3-0.6B, -1.7B, -8B) and the model cards' figures:
# total parameters and non-embedding ones (the cards leave out the embedding and the head).
PUBLISHED = {
    "qwen3-0.6b": ({"hidden_size": 1024, "intermediate_size": 3072, "num_hidden_layers": 28,
                    "num_attention_heads": 16, "tie_word_embeddings": True}, "0.6", "0.44"),
    "qwen3-1.7b": ({"hidden_size": 2048, "intermediate_size": 6144, "num_hidden_layers": 28,
                    "num_attention_heads": 16, "tie_word_embeddings": True}, "1.7", "1.4"),
    "qwen3-8b": ({"hidden_size": 4096, "intermediate_size": 12288, "num_hidden_layers": 36,
                  "num_attention_heads": 32, "tie_word_embeddings": False}, "8.2", "6.95"),
}  # fmt: skip
_SHARED = {"vocab_size": 151936, "num_key_value_heads": 8, "head_dim": 128,
           "max_position_embeddings": 40960, "rms_norm_eps": 1e-6,
           "rope_parameters": {"rope_type": "default", "rope_theta": 1_000_000.0}}  # fmt: skip


def _billions(count: int, figure: str) -> str:
    """``count`` in billions, rounded to as many decimals as ``figure`` has."""
    decimals = len(figure.partition(".")[2])
    return f"{count / 1e9:.{decimals}f}"


@pytest.mark.parametrize("name", PUBLISHED)
def test_preset_parameter_counts_are_transformers_and_the_model_cards(name: str) -> None:
    sizes, total_figure, body_figure = PUBLISHED[name]
    with torch.device("meta"):
        hf = transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**_SHARED, **sizes))
        ours = Transformer(TransformerConfig.from_name(name))
    config = ours.config
    hf_total = sum(p.numel() for p in hf.parameters())  # a tied head counts once
    hf_body = sum(
        p.numel()
        for n, p in hf.named_parameters()
        if not n.startswith(("model.embed_tokens.", "lm_head."))
    )
    assert sum(p.numel() for p in ours.parameters()) == hf_total == config.num_params()
    # Ours keeps the output projection in the non-embedding count (the 6N of training FLOPs).
    head = config.vocab_size * config.n_embd
    assert config.num_params(include_embeddings=False) - head == hf_body
    assert (_billions(hf_total, total_figure), _billions(hf_body, body_figure)) == (
        total_figure,
        body_figure,
    )


def test_published_config_json_is_the_preset() -> None:
    """Qwen3-0.6B's config.json (as published) imports as the ``qwen3-0.6b`` preset."""
    published = {
        "architectures": ["Qwen3ForCausalLM"], "attention_bias": False,
        "attention_dropout": 0.0, "bos_token_id": 151643, "eos_token_id": 151645,
        "head_dim": 128, "hidden_act": "silu", "hidden_size": 1024, "initializer_range": 0.02,
        "intermediate_size": 3072, "max_position_embeddings": 40960, "max_window_layers": 28,
        "model_type": "qwen3", "num_attention_heads": 16, "num_hidden_layers": 28,
        "num_key_value_heads": 8, "rms_norm_eps": 1e-06, "rope_scaling": None,
        "rope_theta": 1000000, "sliding_window": None, "tie_word_embeddings": True,
        "torch_dtype": "bfloat16", "use_cache": True, "use_sliding_window": False,
        "vocab_size": 151936,
    }  # fmt: skip
    imported = qwen3.from_hf_config(published, "Qwen3-0.6B")
    preset = TransformerConfig.from_name("qwen3-0.6b")
    for field in (*ARCHITECTURE_FIELDS, "block_size", "norm_eps"):
        assert getattr(imported, field) == getattr(preset, field), field


@pytest.mark.parametrize(
    "name",
    [n for n in TransformerConfig.presets() if TransformerConfig.from_name(n).family == "qwen3"],
)
def test_hf_config_round_trips(name: str) -> None:
    config = TransformerConfig.from_name(name)
    back = qwen3.from_hf_config(qwen3.to_hf_config(config), name)
    for field in (*ARCHITECTURE_FIELDS, "block_size", "norm_eps"):
        assert getattr(back, field) == getattr(config, field), field


@pytest.mark.parametrize(
    ("change", "quoted"),
    [
        ({"attention_bias": True}, "'attention_bias': True"),
        ({"use_sliding_window": True}, "'use_sliding_window': True"),
        ({"hidden_act": "gelu"}, "'hidden_act': 'gelu'"),
        ({"rope_parameters": {"rope_type": "yarn", "factor": 4.0}}, "RoPE type 'yarn'"),
    ],
)
def test_unsupported_hugging_face_variants_are_refused(change: dict, quoted: str) -> None:
    hf = {**qwen3.to_hf_config(_config()), **change}
    with pytest.raises(ValueError, match=r"^qwen3-x: ") as info:
        qwen3.from_hf_config(hf, "qwen3-x")
    assert quoted in str(info.value) and "\n" not in str(info.value)


def _fit_one_step(config: TransformerConfig, root: Path) -> CausalLM:
    """A CausalLM trained one step (every norm moves off one), saved as ``root/q.ckpt``."""
    L.seed_everything(0, verbose=False)
    module = CausalLM(config, warmup_steps=0, lr_decay_steps=1)
    trainer = L.Trainer(
        accelerator="cpu", max_steps=1, logger=False, enable_progress_bar=False,
        enable_model_summary=False, enable_checkpointing=False, default_root_dir=root,
    )  # fmt: skip
    data = TensorDataset(TOKENS[:, :-1], TOKENS[:, 1:])
    trainer.fit(module, DataLoader(data, batch_size=2))
    trainer.save_checkpoint(root / "q.ckpt")
    return module


def test_exported_directory_loads_in_transformers(tmp_path: Path) -> None:
    module = _fit_one_step(_config(), tmp_path)
    assert not torch.equal(module.model.layers["0"].attention.q_norm.weight, torch.ones(64))
    assert main(["export", str(tmp_path / "q.ckpt"), str(tmp_path / "hf"), "--format", "hf"]) == 0
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["head_dim"] == 64
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf")
    assert isinstance(reloaded, transformers.Qwen3ForCausalLM)
    torch.testing.assert_close(_logits(reloaded), _logits(module.model), atol=1e-5, rtol=1e-5)


def test_saved_pretrained_directory_imports(tmp_path: Path) -> None:
    config = _config(tie_embeddings=False)
    hf = _hf_model(config)
    hf.save_pretrained(tmp_path / "hf")
    weights = open_weights(tmp_path / "hf")
    for field in ARCHITECTURE_FIELDS:
        assert getattr(weights.config, field) == getattr(config, field), field
    ours = Transformer(weights.config)
    load_into(ours, weights)
    torch.testing.assert_close(_logits(ours), _logits(hf), atol=1e-5, rtol=1e-5)


def _lm() -> CausalLM:
    torch.manual_seed(0)
    lm = CausalLM(_config(vocab_size=64, block_size=32))
    lm.configure_model()
    _random_norms(lm.model, seed=4)
    return lm.eval()


def test_cached_greedy_generation_equals_uncached() -> None:
    lm = _lm()
    prompt = torch.randint(0, 64, (2, 5), generator=torch.Generator().manual_seed(1))
    cached = lm.generate(prompt, max_new_tokens=12, temperature=0.0)
    uncached = lm.generate(prompt, max_new_tokens=12, temperature=0.0, use_cache=False)
    assert cached.shape == (2, 17)
    torch.testing.assert_close(cached, uncached, rtol=0, atol=0)


def test_prefill_and_decode_logits_equal_the_full_forward() -> None:
    lm = _lm()
    tokens = torch.randint(0, 64, (2, 9), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        expected = lm(tokens)
        lm.model.setup_kv_cache(2, 16)
        prefill = lm(tokens[:, :6], torch.arange(6))
        decoded = [lm(tokens[:, t : t + 1], torch.tensor([t])) for t in range(6, 9)]
    lm.model.clear_kv_cache()
    torch.testing.assert_close(torch.cat([prefill, *decoded], dim=1), expected)


def test_meta_built_model_initializes_the_head_norms_to_one() -> None:
    with torch.device("meta"):
        model = Transformer(_config())
    model.to_empty(device="cpu")
    model.init_weights()
    attention = model.layers["1"].attention
    assert torch.equal(attention.q_norm.weight, torch.ones(64))
    assert torch.equal(attention.k_norm.weight, torch.ones(64))


def test_head_size_frees_the_width_from_the_head_count() -> None:
    config = _config(n_embd=130, head_size=32)  # 130 is not divisible by 4 heads
    model = Transformer(config)
    assert config.head_dim == 32
    assert config.num_params() == sum(p.numel() for p in model.parameters())
    assert model(TOKENS).shape == (2, 24, VOCAB)


def test_odd_head_size_with_rope_is_refused() -> None:
    with pytest.raises(ValueError, match=r"head_size=33 is odd; make head_size even"):
        _config(head_size=33)


def test_attention_flops_count_the_query_width() -> None:
    config = TransformerConfig.from_name("qwen3-0.6b")  # 16 heads x 128 = 2048 = 2 x n_embd
    n = config.num_params(include_embeddings=False)
    assert config.flops_per_token(4096) == 6 * n + 12 * 28 * 2048 * 4096


def test_families_without_the_features_refuse_to_export_them() -> None:
    with pytest.raises(ValueError, match="qk_norm=True; build the model as family 'qwen3'"):
        llama3.hf_export_plan(TransformerConfig.from_name("llama3-debug", qk_norm=True))
    with pytest.raises(ValueError, match="head_dim=64, n_embd=128"):
        gpt2.hf_export_plan(TransformerConfig.from_name("gpt2-debug", head_size=64))
    with pytest.raises(ValueError, match=r"has \{'qk_norm': False\}"):
        qwen3.hf_export_plan(_config(qk_norm=False))


def test_gguf_export_loads_in_transformers(tmp_path: Path) -> None:
    """transformers' GGUF loader reads qwen3 tensors unpermuted (llama.cpp's NEOX RoPE) but
    ignores ``attention.key_length``, taking Qwen3Config's 128-channel default: heads of 128
    over a width of 64 are what it can check."""
    hf = _hf_model(_config(n_embd=64, head_size=128, n_head=2, n_kv_head=1))
    hf.save_pretrained(tmp_path / "hf")
    assert (
        main(["convert", str(tmp_path / "hf"), str(tmp_path / "m.gguf"), "--format", "gguf"]) == 0
    )
    reloaded = transformers.Qwen3ForCausalLM.from_pretrained(tmp_path, gguf_file="m.gguf")
    torch.testing.assert_close(_logits(reloaded), _logits(hf), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])
def test_gguf_round_trip_is_bit_exact(tied: bool, tmp_path: Path) -> None:
    hf = _hf_model(_config(tie_embeddings=tied))
    hf.save_pretrained(tmp_path / "hf")
    first = open_weights(tmp_path / "hf")
    assert (
        main(["convert", str(tmp_path / "hf"), str(tmp_path / "m.gguf"), "--format", "gguf"]) == 0
    )
    second = open_weights(tmp_path / "m.gguf")
    for field in ARCHITECTURE_FIELDS:
        assert getattr(second.config, field) == getattr(first.config, field), field
    for name in first.names():
        assert torch.equal(second.read(name), first.read(name)), name


@pytest.mark.parametrize(
    ("preset", "qk_norm"), [("qwen3-debug", True), ("qwen3-debug", False), ("llama3-debug", True)]
)
def test_tp_plan_splits_query_key_norms_exactly_when_the_model_has_them(
    preset: str, qk_norm: bool
) -> None:
    module = CausalLM(TransformerConfig.from_name(preset, qk_norm=qk_norm))
    norms = {k: v for k, v in module.tp_plan().items() if k.endswith(("q_norm", "k_norm"))}
    expected = {"model.layers.*.attention.q_norm", "model.layers.*.attention.k_norm"}
    assert norms == (dict.fromkeys(expected, "head_norm") if qk_norm else {})
