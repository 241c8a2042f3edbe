"""PEFT adapters both ways (issue 29), checked by ``peft`` itself on ``transformers``
models: our adapters written as a PEFT directory give, in ``PeftModel``, the logits of
plugintrain's base + adapters; an adapter made by ``peft`` (random ``B``, so it does
something) loads into plugintrain with ``peft``'s logits. Llama (one HF module per
adapter, ``nn.Linear``) and GPT-2 (``Conv1D`` weights, PEFT's ``fan_in_fan_out``, and q,
k, v fused into ``c_attn``: one PEFT adapter of rank 3r for three of ours, and three of
ours from one of PEFT's)."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch
import transformers

from plugintrain.formats.peft_adapters import read_peft, write_peft
from plugintrain.model_zoo import lora
from plugintrain.model_zoo.generation import PretrainedLM
from plugintrain.model_zoo.lora import LoRASpec
from plugintrain.tools._models import load_with_peft_adapter

from _hf_models import random_hf_llama, randomize_

peft = pytest.importorskip("peft")

VOCAB = 96
ATOL = 1e-4
LLAMA_TARGETS = ("*.attention.wq", "*.attention.wk", "*.attention.wv", "*.attention.wo",
                 "*.feed_forward.*")  # fmt: skip


def _gpt2_base(root: Path) -> Path:
    config = transformers.GPT2Config(
        vocab_size=VOCAB, n_positions=32, n_embd=32, n_layer=2, n_head=4,
        bos_token_id=0, eos_token_id=0,
    )  # fmt: skip
    torch.manual_seed(0)
    randomize_(transformers.GPT2LMHeadModel(config), seed=1).save_pretrained(root)
    return root


@pytest.fixture(scope="module")
def bases(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("peft")
    return {"llama": random_hf_llama(root / "llama", VOCAB, seed=3),
            "gpt2": _gpt2_base(root / "gpt2")}  # fmt: skip


def _tokens() -> torch.Tensor:
    return torch.randint(0, VOCAB, (2, 12), generator=torch.Generator().manual_seed(0))


def _ours_with_adapters(base: Path, targets: tuple[str, ...]) -> tuple[PretrainedLM, LoRASpec]:
    """Our model of ``base`` with adapters on ``targets``, A and B random."""
    module = PretrainedLM(weights=str(base)).eval()
    spec = LoRASpec(r=4, alpha=12.0, dropout=0.1, target_modules=targets)
    lora.inject(module, spec)
    gen = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for _, layer in lora.adapted_layers(module):
            layer.lora_A.copy_(torch.randn(layer.lora_A.shape, generator=gen) * 0.2)
            layer.lora_B.copy_(torch.randn(layer.lora_B.shape, generator=gen) * 0.2)
    return module.eval(), spec


def _adapters(module: PretrainedLM) -> dict[str, torch.Tensor]:
    return {n.removeprefix("model."): p.detach() for n, p in module.named_parameters()
            if lora.is_adapter_name(n)}  # fmt: skip


@pytest.mark.parametrize(
    ("family", "targets"),
    [("llama", LLAMA_TARGETS),
     ("gpt2", ("*.attention.wq", "*.attention.wk", "*.attention.wv", "*.attention.wo",
               "*.feed_forward.*"))],
)  # fmt: skip
def test_exported_adapter_gives_our_logits_in_peft(
    bases: dict[str, Path], tmp_path: Path, family: str, targets: tuple[str, ...]
) -> None:
    base = bases[family]
    ours, spec = _ours_with_adapters(base, targets)
    write_peft(tmp_path / "adapter", ours.config, spec, _adapters(ours), str(base))
    hf = transformers.AutoModelForCausalLM.from_pretrained(base).eval()
    with torch.no_grad():
        untouched = hf(_tokens()).logits
    model = peft.PeftModel.from_pretrained(hf, tmp_path / "adapter").eval()
    with torch.no_grad():
        expected, got = ours(_tokens()), model(_tokens()).logits
    torch.testing.assert_close(got, expected, atol=ATOL, rtol=ATOL)
    assert (got - untouched).abs().max() > 1e-2  # the adapters do something
    config = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert config["fan_in_fan_out"] is (family == "gpt2")
    if family == "gpt2":  # q, k, v of rank 4 each: one c_attn adapter of rank 12
        ranks = set(config["rank_pattern"].values())
        assert ranks == {12} and len(config["rank_pattern"]) == 2


def _peft_made(base: Path, out: Path, targets: list[str], fan_in_fan_out: bool) -> torch.Tensor:
    """An adapter made and saved by peft, B random; its logits on :func:`_tokens`."""
    hf = transformers.AutoModelForCausalLM.from_pretrained(base).eval()
    config = peft.LoraConfig(r=6, lora_alpha=9, target_modules=targets, lora_dropout=0.0,
                             init_lora_weights=False, fan_in_fan_out=fan_in_fan_out)  # fmt: skip
    torch.manual_seed(11)
    model = peft.get_peft_model(hf, config).eval()
    model.save_pretrained(out)
    with torch.no_grad():
        return model(_tokens()).logits


@pytest.mark.parametrize(
    ("family", "targets"),
    [("llama", ["q_proj", "v_proj", "down_proj"]), ("gpt2", ["c_attn", "c_fc"])],
)
@pytest.mark.parametrize("merge", [False, True])
def test_peft_made_adapter_loads_with_peft_logits(
    bases: dict[str, Path], tmp_path: Path, family: str, targets: list[str], merge: bool
) -> None:
    expected = _peft_made(bases[family], tmp_path / "adapter", targets, family == "gpt2")
    ours = load_with_peft_adapter(str(bases[family]), str(tmp_path / "adapter"), merge).eval()
    with torch.no_grad():
        got = ours(_tokens())
    torch.testing.assert_close(got, expected, atol=ATOL, rtol=ATOL)


def test_round_trip_keeps_every_update(bases: dict[str, Path], tmp_path: Path) -> None:
    """Ours -> PEFT -> ours: each layer's update ``scaling * B A`` is unchanged (GPT-2's
    c_attn comes back as three adapters of rank 12, zero-padded elsewhere)."""
    ours, spec = _ours_with_adapters(bases["gpt2"], LLAMA_TARGETS)
    write_peft(tmp_path / "adapter", ours.config, spec, _adapters(ours), None)
    spec_in, tensors = read_peft(tmp_path / "adapter", ours.config)
    assert spec_in.r == 12 and spec_in.alpha / spec_in.r == pytest.approx(spec.alpha / spec.r)
    for path, layer in lora.adapted_layers(ours):
        name = path.removeprefix("model.")
        before = layer.scaling * layer.lora_B @ layer.lora_A
        after = spec_in.alpha / spec_in.r * tensors[f"{name}.lora_B"] @ tensors[f"{name}.lora_A"]
        torch.testing.assert_close(after, before, atol=1e-6, rtol=1e-6)


def test_callback_starts_from_a_peft_adapter(bases: dict[str, Path], tmp_path: Path) -> None:
    """The LoRA callback with ``adapter=`` starts its adapters from PEFT's tensors (the
    model's logits are peft's), and refuses another rank in one line."""
    from plugintrain.callbacks import LoRA
    from plugintrain.model_zoo import CausalLM

    expected = _peft_made(bases["llama"], tmp_path / "adapter", ["q_proj", "v_proj"], False)
    targets = ["*.attention.wq", "*.attention.wv", "*.attention.wo"]
    callback = LoRA(r=6, alpha=9, target_modules=targets, adapter=str(tmp_path / "adapter"))
    module = CausalLM(weights=str(bases["llama"]))
    module.configure_model()
    callback.check_model(module)
    callback.on_model_built(None, module)
    with torch.no_grad():
        got = module.model.eval()(_tokens())
    torch.testing.assert_close(got, expected, atol=ATOL, rtol=ATOL)
    wrong = LoRA(r=4, alpha=9, target_modules=targets, adapter=str(tmp_path / "adapter"))
    with pytest.raises(ValueError, match=r"has r=6, alpha=9; set the LoRA callback's r: 6"):
        wrong.check_model(CausalLM(weights=str(bases["llama"])))
    narrow = LoRA(
        r=6, alpha=9, target_modules=["*.attention.wq"], adapter=str(tmp_path / "adapter")
    )
    with pytest.raises(ValueError, match=r"adapts model.layers.0.attention.wv, which"):
        narrow.check_model(CausalLM(weights=str(bases["llama"])))


def test_what_peft_cannot_hold_is_refused(bases: dict[str, Path], tmp_path: Path) -> None:
    """GPT-2 adapters on q alone (c_attn fuses q, k, v), and a run that trained whole
    modules: one line each, nothing written."""
    ours, spec = _ours_with_adapters(bases["gpt2"], ("*.attention.wq",))
    with pytest.raises(ValueError, match=r"fuses .* adapt all of them or none"):
        write_peft(tmp_path / "a", ours.config, spec, _adapters(ours), None)
    trained = dataclasses.replace(spec, trainable=("model.output",))
    with pytest.raises(ValueError, match=r"trained \['model.output'\] whole"):
        write_peft(tmp_path / "b", ours.config, trained, _adapters(ours), None)
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()
