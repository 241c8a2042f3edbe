"""The mixture-of-experts families, DeepSeek-V3 and Qwen3-MoE, as whole models: logits and
every gradient against transformers, Hugging Face directories both ways, greedy
generation, the published presets' sizes, and config errors through the CLI.

Every reference model is built by ``transformers`` from a config spelled out field by
field (random weights, nothing downloaded); transformers 5 fuses each layer's experts in
memory but saves them one by one, as on the Hub (:func:`_hf_models.hub_state_dict`).
"""

from __future__ import annotations

import json
from pathlib import Path

import lightning as L
import numpy as np
import pytest
import torch
import torch.nn.functional as F
import transformers
from safetensors.torch import load_file
from torch.utils.data import DataLoader, TensorDataset

from plugintrain.cli import main
from plugintrain.core.memory import LiveTensorMemory
from plugintrain.core.tensor_boxes import select
from plugintrain.data import write_token_bin
from plugintrain.formats import WeightFormatError, convert, load_into, open_weights
from plugintrain.formats.base import ARCHITECTURE_FIELDS
from plugintrain.formats.hf import write_hf
from plugintrain.model_zoo import (
    CausalLM,
    MLAConfig,
    MoEConfig,
    Transformer,
    TransformerConfig,
    deepseek_v3,
    qwen3_moe,
)

from _hf_models import hub_state_dict, ours_from_hf, randomize_

VOCAB = 96
TOKENS = torch.randint(0, VOCAB, (2, 24), generator=torch.Generator().manual_seed(0))
FAMILIES = {"deepseek_v3": deepseek_v3, "qwen3_moe": qwen3_moe}
RECIPE = Path(__file__).resolve().parents[2] / "recipes" / "deepseek_v3_debug_shakespeare_cpu.yaml"


def _deepseek(
    q_lora_rank: int | None = 48, rope_interleave: bool = True, **moe: object
) -> TransformerConfig:
    """deepseek-v3-debug, shrunk: a dense first block, then 8 experts (top 2 of 2 of 4
    groups, weights scaled by 2.5) and a shared expert."""
    mla = MLAConfig(
        kv_lora_rank=32, q_lora_rank=q_lora_rank, qk_nope_head_dim=16, qk_rope_head_dim=8,
        v_head_dim=24, rope_interleave=rope_interleave,
    )  # fmt: skip
    routing = dict(
        n_routed_experts=8, top_k=2, moe_intermediate_size=32, n_shared_experts=1,
        first_k_dense=1, routed_scaling_factor=2.5, n_group=4, topk_group=2,
    )  # fmt: skip
    return TransformerConfig.from_name(
        "deepseek-v3-debug", vocab_size=VOCAB, block_size=64, n_layer=3, n_embd=64,
        intermediate_size=96, tokenizer=None, mla=mla, moe=MoEConfig(**(routing | moe)),
    )  # fmt: skip


def _qwen(tied: bool = True, **moe: object) -> TransformerConfig:
    """qwen3-moe-debug, shrunk: heads of 32 over a width of 64, a dense first block."""
    routing = dict(
        n_routed_experts=8, top_k=2, moe_intermediate_size=32, score_func="softmax", first_k_dense=1
    )
    return TransformerConfig.from_name(
        "qwen3-moe-debug", vocab_size=VOCAB, block_size=64, n_layer=3, n_embd=64, head_size=32,
        intermediate_size=96, tokenizer=None, tie_embeddings=tied,
        moe=MoEConfig(**(routing | moe)),
    )  # fmt: skip


VARIANTS = {
    "deepseek-v3": lambda: _deepseek(),
    "deepseek-v3-direct-query": lambda: _deepseek(
        q_lora_rank=None, rope_interleave=False, n_group=1, topk_group=1, norm_topk_prob=False
    ),
    "qwen3-moe": lambda: _qwen(),
    "qwen3-moe-unnormalized-untied": lambda: _qwen(tied=False, norm_topk_prob=False),
}


def _hf_config(config: TransformerConfig) -> transformers.PretrainedConfig:
    """transformers' config for ``config``, spelled out field by field (not through our
    ``to_hf_config``)."""
    moe = config.moe
    shared = dict(
        vocab_size=config.vocab_size, hidden_size=config.n_embd,
        intermediate_size=config.ffn_dim, moe_intermediate_size=moe.moe_intermediate_size,
        num_hidden_layers=config.n_layer, num_attention_heads=config.n_head,
        num_key_value_heads=config.kv_heads, num_experts_per_tok=moe.top_k,
        norm_topk_prob=moe.norm_topk_prob, max_position_embeddings=config.block_size,
        rms_norm_eps=config.norm_eps, tie_word_embeddings=config.tie_embeddings,
        rope_parameters={"rope_type": "default", "rope_theta": config.rope_theta},
        bos_token_id=None, eos_token_id=None, pad_token_id=None,
    )  # fmt: skip
    if config.family == "qwen3_moe":
        hf = transformers.Qwen3MoeConfig(
            **shared, head_dim=config.head_dim, num_experts=moe.n_routed_experts,
            mlp_only_layers=list(range(moe.first_k_dense)),
        )  # fmt: skip
    else:
        mla = config.mla
        hf = transformers.DeepseekV3Config(
            **shared, n_routed_experts=moe.n_routed_experts,
            n_shared_experts=moe.n_shared_experts, first_k_dense_replace=moe.first_k_dense,
            routed_scaling_factor=moe.routed_scaling_factor, n_group=moe.n_group,
            topk_group=moe.topk_group, kv_lora_rank=mla.kv_lora_rank,
            q_lora_rank=mla.q_lora_rank, qk_nope_head_dim=mla.qk_nope_head_dim,
            qk_rope_head_dim=mla.qk_rope_head_dim, v_head_dim=mla.v_head_dim,
            rope_interleave=mla.rope_interleave,
        )  # fmt: skip
    hf._attn_implementation = "eager"
    return hf


def _hf_model(config: TransformerConfig) -> transformers.PreTrainedModel:
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(_hf_config(config))
    return randomize_(model, seed=1)


def _logits(model: torch.nn.Module) -> torch.Tensor:
    out = model.eval()(TOKENS)
    return out.logits if hasattr(out, "logits") else out


def _imported(source: Path) -> Transformer:
    weights = open_weights(source)
    model = Transformer(weights.config)
    load_into(model, weights)
    return model.eval()


@pytest.mark.parametrize("variant", VARIANTS)
def test_hugging_face_weights_give_its_logits_and_gradients(variant: str) -> None:
    """Logits, then the gradient of every parameter after the same loss's backward (the
    transformers gradients mapped to our names as the weights are: per expert, stacked)."""
    config = VARIANTS[variant]()
    family = FAMILIES[config.family]
    hf = _hf_model(config)
    ours = Transformer(config)
    ours.load_state_dict(ours_from_hf(hub_state_dict(hf), config))
    hf_logits, our_logits = _logits(hf), _logits(ours)
    torch.testing.assert_close(our_logits, hf_logits, atol=1e-5, rtol=1e-5)
    targets = torch.roll(TOKENS, -1, dims=1)
    F.cross_entropy(hf_logits.flatten(0, 1), targets.flatten()).backward()
    F.cross_entropy(our_logits.flatten(0, 1), targets.flatten()).backward()
    hf_grads = hub_state_dict({n: p.grad for n, p in hf.named_parameters()})
    plan = family.hf_import_plan(config)
    for name, param in ours.named_parameters():
        rule = plan[name]
        expected = rule.build(*(hf_grads[source] for source in rule.sources))
        torch.testing.assert_close(param.grad, expected, atol=1e-5, rtol=1e-5, msg=name)


@pytest.mark.parametrize("variant", ["deepseek-v3", "qwen3-moe"])
def test_hub_layout_is_what_save_pretrained_writes(variant: str, tmp_path: Path) -> None:
    """The test helper that splits fused experts agrees with transformers' own saving."""
    hf = _hf_model(VARIANTS[variant]())
    hf.save_pretrained(tmp_path)
    saved = load_file(tmp_path / "model.safetensors")
    expected = hub_state_dict(hf)
    tied = {"lm_head.weight"} if hf.config.tie_word_embeddings else set()
    assert saved.keys() == expected.keys() - tied
    for name, tensor in saved.items():
        assert torch.equal(tensor, expected[name]), name


@pytest.mark.parametrize("variant", VARIANTS)
def test_saved_pretrained_directory_imports(variant: str, tmp_path: Path) -> None:
    config = VARIANTS[variant]()
    hf = _hf_model(config)
    hf.save_pretrained(tmp_path / "hf")
    weights = open_weights(tmp_path / "hf")
    for field in ARCHITECTURE_FIELDS:
        assert getattr(weights.config, field) == getattr(config, field), field
    torch.testing.assert_close(
        _logits(_imported(tmp_path / "hf")), _logits(hf), atol=1e-5, rtol=1e-5
    )
    lm = CausalLM(weights=str(tmp_path / "hf"))
    lm.configure_model()
    torch.testing.assert_close(_logits(lm.model), _logits(hf), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("variant", VARIANTS)
def test_converted_directory_loads_in_transformers(variant: str, tmp_path: Path) -> None:
    hf = _hf_model(VARIANTS[variant]())
    hf.save_pretrained(tmp_path / "hf")
    convert(tmp_path / "hf", tmp_path / "out", "hf")
    reloaded = type(hf).from_pretrained(tmp_path / "out").eval()
    torch.testing.assert_close(_logits(reloaded), _logits(hf), atol=1e-5, rtol=1e-5)
    if isinstance(hf, transformers.DeepseekV3ForCausalLM):  # the routing bias kept as it was
        for theirs, back in zip(hf.model.layers[1:], reloaded.model.layers[1:], strict=True):
            assert torch.equal(
                back.mlp.gate.e_score_correction_bias, theirs.mlp.gate.e_score_correction_bias
            )


def test_an_expert_shard_reads_only_its_experts(tmp_path: Path) -> None:
    """What an expert-parallel rank loads at ep=4: the box of a stacked expert tensor (2 of
    8 experts) equals that box of the whole stack, and reading it holds its own rows plus one
    expert's source at the peak, measured by a mode that sees every tensor the read makes."""
    _hf_model(_deepseek()).save_pretrained(tmp_path)
    weights = open_weights(tmp_path)
    name = "layers.1.feed_forward.experts.w1"
    with LiveTensorMemory() as memory:
        whole = weights.read(name)
    assert memory.peak_bytes >= whole.nbytes  # the mode sees what a whole read makes
    experts = whole.shape[0]
    for rank in range(4):
        box = ((rank * experts // 4, 0, 0), (experts // 4, *whole.shape[1:]))
        with LiveTensorMemory() as memory:
            part = weights.read_box(name, box)
        assert torch.equal(part, select(whole, box, (0, 0, 0)))
        assert memory.peak_bytes <= whole.nbytes // 4 + whole.nbytes // experts


def test_export_reads_each_stacked_expert_tensor_once(tmp_path: Path) -> None:
    """Writing the Hub's one-tensor-per-expert layout reads each of our stacked tensors once
    (not once per expert: a whole DeepSeek-V3 layer's stack is gigabytes)."""
    _hf_model(_deepseek()).save_pretrained(tmp_path / "hf")
    weights = open_weights(tmp_path / "hf")
    reads: list[str] = []
    whole_read = weights.read
    weights.read = lambda name: reads.append(name) or whole_read(name)  # type: ignore[method-assign]
    write_hf(weights, tmp_path / "out", "float32")
    assert sorted(reads) == sorted(weights.names())


def test_a_config_that_routes_otherwise_is_refused_for_the_weights(tmp_path: Path) -> None:
    """top_k changes no shape, but another function: the weights' architecture is refused;
    how the experts are balanced in training may differ from the file's."""
    config = VARIANTS["deepseek-v3"]()
    _hf_model(config).save_pretrained(tmp_path / "hf")
    with pytest.raises(WeightFormatError, match="moe=MoEConfig") as info:
        CausalLM(_deepseek(top_k=3), weights=str(tmp_path / "hf"))
    assert "top_k=2" in str(info.value) and "top_k=3" in str(info.value)
    CausalLM(_deepseek(bias_update_rate=0.01, aux_loss_coeff=0.001), weights=str(tmp_path / "hf"))


def _fit_one_step(config: TransformerConfig, root: Path) -> CausalLM:
    """A CausalLM trained one step (its routing biases moved when the config says so),
    saved as ``root/m.ckpt``."""
    L.seed_everything(0, verbose=False)
    module = CausalLM(config, warmup_steps=0, lr_decay_steps=1)
    trainer = L.Trainer(
        accelerator="cpu", max_steps=1, logger=False, enable_progress_bar=False,
        enable_model_summary=False, enable_checkpointing=False, default_root_dir=root,
    )  # fmt: skip
    data = TensorDataset(TOKENS[:, :-1], TOKENS[:, 1:])
    trainer.fit(module, DataLoader(data, batch_size=2))
    trainer.save_checkpoint(root / "m.ckpt")
    return module


def test_trained_deepseek_v3_exports_with_its_routing_bias(tmp_path: Path) -> None:
    module = _fit_one_step(_deepseek(bias_update_rate=0.01), tmp_path)
    bias = module.model.layers["1"].feed_forward.router.expert_bias
    assert bias.abs().min() > 0
    assert main(["export", str(tmp_path / "m.ckpt"), str(tmp_path / "hf"), "--format", "hf"]) == 0
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf")
    assert isinstance(reloaded, transformers.DeepseekV3ForCausalLM)
    assert torch.equal(reloaded.model.layers[1].mlp.gate.e_score_correction_bias, bias)
    torch.testing.assert_close(_logits(reloaded), _logits(module.model), atol=1e-5, rtol=1e-5)


def test_trained_qwen3_moe_exports_only_without_a_routing_bias(tmp_path: Path, capfd) -> None:
    """Qwen3-MoE has no routing bias: one trained by ``bias_update_rate`` is refused (it
    would route otherwise in transformers), one balanced without it exports exactly."""
    _fit_one_step(_qwen(bias_update_rate=0.01), tmp_path / "biased")
    ckpt = str(tmp_path / "biased" / "m.ckpt")
    capfd.readouterr()
    assert main(["export", ckpt, str(tmp_path / "refused"), "--format", "hf"]) == 2
    error = capfd.readouterr().err.strip().splitlines()
    assert len(error) == 1 and "layers.1.feed_forward.router.expert_bias is nonzero" in error[0]
    assert not (tmp_path / "refused").exists() and not (tmp_path / "refused.partial").exists()
    module = _fit_one_step(_qwen(), tmp_path / "plain")
    ckpt = str(tmp_path / "plain" / "m.ckpt")
    assert main(["export", ckpt, str(tmp_path / "hf"), "--format", "hf"]) == 0
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf")
    assert isinstance(reloaded, transformers.Qwen3MoeForCausalLM)
    torch.testing.assert_close(_logits(reloaded), _logits(module.model), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("variant", ["deepseek-v3", "qwen3-moe"])
def test_greedy_generation_equals_transformers(variant: str) -> None:
    """Our cached decoding (MLA's latent cache) against transformers' ``generate``."""
    config = VARIANTS[variant]()
    hf = _hf_model(config)
    lm = CausalLM(config)
    lm.configure_model()
    lm.model.load_state_dict(ours_from_hf(hub_state_dict(hf), config))
    lm.eval()
    prompt = TOKENS[:, :5]
    ours = lm.generate(prompt, max_new_tokens=10, temperature=0.0)
    theirs = hf.generate(
        prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=10, do_sample=False
    )
    torch.testing.assert_close(ours, theirs, rtol=0, atol=0)


def _billions(count: int) -> float:
    return count / 1e9


def test_deepseek_v3_preset_has_transformers_parameters_671b_total_37b_active() -> None:
    """Built on the meta device, against ``DeepseekV3ForCausalLM`` with its default
    (DeepSeek-V3) config, which builds no multi-token-prediction layer. Active: what one
    token runs through, all but the ``E - top_k`` routed experts it is not sent to, counted
    again from the transformers model."""
    with torch.device("meta"):
        hf = transformers.DeepseekV3ForCausalLM(transformers.DeepseekV3Config())
        ours = Transformer(TransformerConfig.from_name("deepseek-v3"))
    assert len(hf.model.layers) == 61
    config = ours.config
    total = sum(p.numel() for p in hf.parameters())
    assert sum(p.numel() for p in ours.parameters()) == total == config.num_params()
    routed = sum(p.numel() for n, p in hf.named_parameters() if ".mlp.experts." in n)
    active = total - routed + routed * 8 // 256
    assert config.num_params(active=True) == active
    assert round(_billions(total)) == 671 and 37 <= _billions(active) < 38


def test_qwen3_30b_a3b_preset_has_transformers_parameters_30b_total_3b_active() -> None:
    published = transformers.Qwen3MoeConfig(
        vocab_size=151936, hidden_size=2048, intermediate_size=6144, num_hidden_layers=48,
        num_attention_heads=32, num_key_value_heads=4, head_dim=128, moe_intermediate_size=768,
        num_experts=128, num_experts_per_tok=8, norm_topk_prob=True, tie_word_embeddings=False,
        max_position_embeddings=40960,
        rope_parameters={"rope_type": "default", "rope_theta": 1_000_000.0},
    )  # fmt: skip
    with torch.device("meta"):
        hf = transformers.Qwen3MoeForCausalLM(published)
        ours = Transformer(TransformerConfig.from_name("qwen3-30b-a3b"))
    config = ours.config
    total = sum(p.numel() for p in hf.parameters())
    assert sum(p.numel() for p in ours.parameters()) == total == config.num_params()
    routed = sum(p.numel() for n, p in hf.named_parameters() if ".mlp.experts." in n)
    active = total - routed + routed * 8 // 128
    assert config.num_params(active=True) == active
    assert f"{_billions(total):.1f}" == "30.5" and 3.3 <= _billions(active) < 3.4


def test_published_deepseek_v3_config_json_is_the_preset_but_for_yarn() -> None:
    """DeepSeek-V3's config.json (as published, its YaRN context extension left out: our
    model builds plain RoPE) imports as the ``deepseek-v3`` preset."""
    published = {
        "architectures": ["DeepseekV3ForCausalLM"], "attention_bias": False,
        "first_k_dense_replace": 3, "hidden_act": "silu", "hidden_size": 7168,
        "intermediate_size": 18432, "kv_lora_rank": 512, "max_position_embeddings": 163840,
        "model_type": "deepseek_v3", "moe_intermediate_size": 2048, "n_group": 8,
        "n_routed_experts": 256, "n_shared_experts": 1, "norm_topk_prob": True,
        "num_attention_heads": 128, "num_experts_per_tok": 8, "num_hidden_layers": 61,
        "num_key_value_heads": 128, "num_nextn_predict_layers": 1, "q_lora_rank": 1536,
        "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "rms_norm_eps": 1e-06,
        "rope_theta": 10000, "routed_scaling_factor": 2.5, "scoring_func": "sigmoid",
        "tie_word_embeddings": False, "topk_group": 4, "topk_method": "noaux_tc",
        "v_head_dim": 128, "vocab_size": 129280,
    }  # fmt: skip
    imported = deepseek_v3.from_hf_config(published, "DeepSeek-V3")
    preset = TransformerConfig.from_name("deepseek-v3")
    for field in ARCHITECTURE_FIELDS:
        if field != "moe":
            assert getattr(imported, field) == getattr(preset, field), field
    training = {"bias_update_rate": 0.001, "aux_loss_coeff": 0.0001}
    assert MoEConfig(**{**vars(imported.moe), **training}) == preset.moe
    yarn = {"type": "yarn", "factor": 40, "original_max_position_embeddings": 4096}
    with pytest.raises(ValueError, match=r"^DeepSeek-V3: RoPE type 'yarn' is not supported"):
        deepseek_v3.from_hf_config({**published, "rope_scaling": yarn}, "DeepSeek-V3")


@pytest.mark.parametrize(
    "name", ["deepseek-v3", "moe-1b", "deepseek-v3-debug", "qwen3-30b-a3b", "qwen3-moe-debug"]
)
def test_hf_config_round_trips(name: str) -> None:
    config = TransformerConfig.from_name(name)
    family = FAMILIES[config.family]
    back = family.from_hf_config(family.to_hf_config(config), name)
    for field in (*ARCHITECTURE_FIELDS, "block_size", "norm_eps"):
        if field != "moe":
            assert getattr(back, field) == getattr(config, field), field
    neutral = {"bias_update_rate": 0.0, "aux_loss_coeff": 0.0}
    assert back.moe == MoEConfig(**{**vars(config.moe), **neutral})


def test_bad_routing_through_the_cli_is_one_line_naming_the_value(tmp_path: Path, capfd) -> None:
    data = tmp_path / "tokens"
    data.mkdir()
    for split in ("train", "val"):
        write_token_bin(data / f"{split}.bin", np.arange(300) % 1000)
    meta = {"dataset": "shakespeare", "tokenizer": "gpt2", "vocab_size": 50257}
    (data / "meta.json").write_text(json.dumps(meta))
    fields = {
        "name": "bad", "family": "deepseek_v3", "vocab_size": 50257, "block_size": 256,
        "n_layer": 2, "n_head": 4, "n_embd": 64, "norm": "rmsnorm", "mlp": "swiglu",
        "position": "rope", "bias": False, "attention": "mla",
        "mla": {"kv_lora_rank": 16, "q_lora_rank": None, "qk_nope_head_dim": 16,
                "qk_rope_head_dim": 8, "v_head_dim": 16},
        "moe": {"n_routed_experts": 4, "top_k": 8, "moe_intermediate_size": 32},
    }  # fmt: skip
    code = main([
        "fit", "--config", str(RECIPE), f"--data.init_args.data_dir={data}",
        f"--trainer.logger.init_args.save_dir={tmp_path / 'runs'}",
        f"--model.init_args.config={json.dumps(fields)}",
    ])  # fmt: skip
    assert code == 2 and not (tmp_path / "runs").exists()
    line = capfd.readouterr().err.strip().splitlines()[-1]
    assert line == (
        "plugintrain fit: error: MoEConfig: top_k=8 is larger than n_routed_experts=4; pick"
        " top_k <= 4."
    )
