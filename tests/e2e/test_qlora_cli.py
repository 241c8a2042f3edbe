"""QLoRA through the command line (a LoRA run with ``quantize: nf4``), on small random
Hugging Face Llamas as bases: adapter-only checkpoints that record the quantization,
refuse to resume with another, and read back (export, ``generate --adapter``) on the base
as the run held it, against references built with plain torch and ``bitsandbytes``; and a
PEFT adapter trained by ``peft`` on a ``bitsandbytes`` 4-bit base, run by plugintrain."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import transformers
import yaml
from test_lora_cli import VOCAB, _error, _generate, _recipe

from plugintrain.checkpoints.files import load_torch_file
from plugintrain.cli import PluginTrainCLI, main
from plugintrain.data.token_bin import write_token_bin
from plugintrain.formats import open_weights
from plugintrain.formats.lora_checkpoints import weights_sha256
from plugintrain.formats.peft_adapters import QUANTIZATION_PREFIX, read_peft
from plugintrain.model_zoo.lora import is_adapter_name
from plugintrain.tools._models import load_model

from _hf_models import random_hf_llama

bnb = pytest.importorskip("bitsandbytes")

# hidden 40: wq (40 x 40) and w2 (40 x 96) split into blocks of 64, wv (20 x 40) does not
# and stays unquantized.
TARGETS = ["*.attention.wq", "*.attention.wv", "*.feed_forward.w2"]
QUANTIZED = {"attention.wq": "self_attn.q_proj", "feed_forward.w2": "mlp.down_proj"}
KEPT = {"attention.wv": "self_attn.v_proj"}
LORA = {"r": 4, "alpha": 8, "quantize": "nf4", "target_modules": TARGETS}


def _tokens() -> torch.Tensor:
    return torch.randint(0, VOCAB, (2, 12), generator=torch.Generator().manual_seed(0))


def _fit_module(config: Path, save_dir: Path, *args: str) -> Any:
    """Fit through the CLI in this process; the trained LightningModule (its base held
    quantized, as the run trained it)."""
    cli = PluginTrainCLI(
        args=["fit", "--config", str(config), f"--trainer.logger.init_args.save_dir={save_dir}",
              f"--trainer.default_root_dir={save_dir}", *args],
    )  # fmt: skip
    return cli.model.eval()


@pytest.fixture(scope="module")
def qlora_run(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    root = tmp_path_factory.mktemp("qlora_cli")
    base = random_hf_llama(root / "base", VOCAB, 0, hidden=40)
    tokens = np.random.default_rng(0).integers(0, VOCAB, 4096)
    for name in ("train.bin", "val.bin"):
        write_token_bin(root / "data" / name, tokens)
    config = root / "qlora.yaml"
    config.write_text(yaml.safe_dump(_recipe(base, root / "data", LORA)))
    with pytest.warns(UserWarning, match="kept unquantized: model.layers.0.attention.wv"):
        module = _fit_module(config, root / "run")
    with torch.no_grad():
        trained = module.model(_tokens())  # the logits of the run's own (quantized) model
    checkpoint = root / "run" / "lora" / "checkpoints" / "last.ckpt"
    return {"root": root, "base": base, "config": config, "checkpoint": checkpoint,
            "saved": load_torch_file(checkpoint), "trained_logits": trained}  # fmt: skip


def test_checkpoint_holds_adapters_and_records_the_quantization(qlora_run: dict[str, Any]):
    """Adapters only (no packed base bytes), the base named by path and sha256, and the
    spec with ``quantize: nf4``."""
    saved = qlora_run["saved"]
    assert all(is_adapter_name(n) for n in saved["state_dict"])
    assert len(saved["state_dict"]) == 2 * 2 * len(TARGETS)
    record = saved["lora"]
    assert record["base"] == str(qlora_run["base"])
    assert record["sha256"] == weights_sha256(qlora_run["base"])
    assert record["spec"]["quantize"] == "nf4" and record["spec"]["r"] == 4


@pytest.mark.parametrize(("quantize", "shown"), [("int8", '"int8"'), (None, "null")])
def test_resume_with_another_quantization_is_refused(
    qlora_run: dict[str, Any], capsys, tmp_path: Path, quantize: str | None, shown: str
) -> None:
    """One line naming both quantizations, before anything is launched or written."""
    recipe = yaml.safe_load(qlora_run["config"].read_text())
    recipe["trainer"]["callbacks"][0]["init_args"]["quantize"] = quantize
    config = tmp_path / "other.yaml"
    config.write_text(yaml.safe_dump(recipe))
    message = _error(
        capsys, "fit", "--config", str(config), f"--ckpt_path={qlora_run['checkpoint']}",
        f"--trainer.default_root_dir={tmp_path / 'root'}", "--trainer.logger=false",
    )  # fmt: skip
    assert f'trained with LoRA quantize: "nf4" (this run: {shown})' in message
    assert not (tmp_path / "root").exists()


def _bnb_nf4(weight: torch.Tensor) -> torch.Tensor:
    """``weight`` quantized and dequantized by ``bitsandbytes`` (NF4, blocks of 64, double
    quantization). NF4 blocks run over the flattened weight, so rows of 64 quantize the
    same; bnb 0.50's CPU dequantization kernel reads a block's scale by row, wrong for a
    row length that 64 does not divide (96 here), and right for rows of 64."""
    packed, state = bnb.functional.quantize_4bit(
        weight.reshape(-1, 64), blocksize=64, quant_type="nf4", compress_statistics=True
    )
    return bnb.functional.dequantize_4bit(packed, state).reshape(weight.shape)


def _reference(qlora_run: dict[str, Any], quantized: bool = True) -> torch.nn.Module:
    """transformers' base with each adapted weight replaced, in plain torch, by the weight
    the run trained on (``bitsandbytes``' NF4 round trip of those the run held quantized)
    plus ``alpha / r * B A``."""
    model = transformers.LlamaForCausalLM.from_pretrained(qlora_run["base"]).eval()
    state = qlora_run["saved"]["state_dict"]
    scaling = LORA["alpha"] / LORA["r"]
    with torch.no_grad():
        for layer in range(2):
            for ours, hf in (QUANTIZED | KEPT).items():
                weight = model.get_submodule(f"model.layers.{layer}.{hf}").weight
                if quantized and ours in QUANTIZED:
                    weight.copy_(_bnb_nf4(weight))
                a = state[f"model.layers.{layer}.{ours}.lora_A"]
                b = state[f"model.layers.{layer}.{ours}.lora_B"]
                weight.add_(scaling * (b @ a))
    return model


def test_export_hf_is_the_dequantized_base_with_adapters_merged(
    qlora_run: dict[str, Any], tmp_path: Path
) -> None:
    """transformers' logits of ``export --format hf --merge-lora`` == a plain-torch model:
    bitsandbytes' NF4 round trip of the quantized layers, B A * alpha / r merged; and ==
    the logits of the run's own model (base held quantized, adapters apart)."""
    out = tmp_path / "merged"
    ckpt = str(qlora_run["checkpoint"])
    assert main(["export", ckpt, str(out), "--format", "hf", "--merge-lora"]) == 0
    exported = transformers.LlamaForCausalLM.from_pretrained(out).eval()
    x = _tokens()
    with torch.no_grad():
        got, expected = exported(x).logits, _reference(qlora_run)(x).logits
        unquantized = _reference(qlora_run, quantized=False)(x).logits
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(got, qlora_run["trained_logits"], rtol=1e-4, atol=1e-4)
    assert (got - unquantized).abs().max() > 1e-3  # the quantization shows in the logits


def test_generate_adapter_computes_what_training_did(qlora_run: dict[str, Any], capsys):
    """``--adapter`` kept apart or merged, and the checkpoint read as one model: the
    logits of the plain-torch reference and of the run's own model, and one text."""
    ckpt, base = str(qlora_run["checkpoint"]), str(qlora_run["base"])
    x = _tokens()
    with torch.no_grad():
        apart = load_model(base, ckpt)(x)
        merged = load_model(None, ckpt, merge=True)(x)
        expected = _reference(qlora_run)(x).logits
    torch.testing.assert_close(apart, expected, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(apart, qlora_run["trained_logits"], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(merged, apart, rtol=1e-5, atol=1e-5)
    sampled = _generate(capsys, "--weights", base, "--adapter", ckpt)
    assert sampled == _generate(capsys, "--adapter", ckpt, "--merge_lora")
    assert sampled == _generate(capsys, "--weights", ckpt)


def test_export_peft_notes_the_quantization(qlora_run: dict[str, Any], tmp_path: Path, capsys):
    """``export --format peft`` writes peft's model card with the bitsandbytes config of
    the base; peft loads the directory, plugintrain reads it back as an nf4 adapter, and
    ``generate --adapter`` of it samples what the run's checkpoint does."""
    import peft

    ckpt, out = str(qlora_run["checkpoint"]), tmp_path / "adapter"
    assert main(["export", ckpt, str(out), "--format", "peft"]) == 0
    lines = (out / "README.md").read_text().splitlines()
    section = lines[lines.index(QUANTIZATION_PREFIX) + 1 :]
    for line in ("- load_in_4bit: True", "- load_in_8bit: False",
                 "- bnb_4bit_quant_type: nf4", "- bnb_4bit_use_double_quant: True",
                 "- bnb_4bit_compute_dtype: float32"):  # fmt: skip
        assert line in section
    assert "## Training procedure" in lines and "library_name: peft" in lines
    hf = transformers.LlamaForCausalLM.from_pretrained(qlora_run["base"])
    config = transformers.BitsAndBytesConfig(**_card_config(section))
    assert config.load_in_4bit and config.bnb_4bit_quant_type == "nf4"
    peft.PeftModel.from_pretrained(hf, out)  # the card is no obstacle to peft
    spec, _ = read_peft(out, open_weights(str(qlora_run["base"])).config)
    assert spec.quantize == "nf4"
    capsys.readouterr()
    from_peft = _generate(capsys, "--weights", str(qlora_run["base"]), "--adapter", str(out))
    assert from_peft == _generate(capsys, "--adapter", ckpt)


def _card_config(section: list[str]) -> dict[str, Any]:
    """The ``- name: value`` lines of a model card's quantization section as
    ``BitsAndBytesConfig`` arguments (its public ones)."""
    names = ("load_in_4bit", "load_in_8bit", "bnb_4bit_quant_type", "bnb_4bit_use_double_quant")
    pairs = dict(line[2:].split(": ", 1) for line in section[: section.index("")])
    return {k: {"True": True, "False": False}.get(pairs[k], pairs[k]) for k in names}


# -- a PEFT adapter trained by peft on a bitsandbytes 4-bit base ---------------------------

ALL_LINEAR = ["*.attention.*", "*.feed_forward.*"]


@pytest.fixture(scope="module")
def peft_bnb(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """A base whose rows all split into blocks of 64 (hidden 64, intermediate 128), loaded
    by transformers in 4 bits through bitsandbytes (NF4, double quantization) on the CPU;
    peft adapters on every Linear layer trained one AdamW step and saved; the logits of
    the saved adapter loaded by peft on the 4-bit base again."""
    import peft

    root = tmp_path_factory.mktemp("peft_bnb")
    base = random_hf_llama(root / "base", VOCAB, 3, intermediate=128)
    quantization = transformers.BitsAndBytesConfig(
        load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
        bnb_4bit_compute_dtype=torch.float32,
    )  # fmt: skip
    model = transformers.LlamaForCausalLM.from_pretrained(
        base, quantization_config=quantization, device_map="cpu", dtype=torch.float32
    )
    assert isinstance(model.model.layers[0].self_attn.q_proj, bnb.nn.Linear4bit)
    lora = peft.LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", lora_dropout=0.0)
    model = peft.get_peft_model(model, lora)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    x = _tokens()
    model(x, labels=x).loss.backward()
    optimizer.step()
    model.save_pretrained(root / "adapter")
    base_4bit = transformers.LlamaForCausalLM.from_pretrained(
        base, quantization_config=quantization, device_map="cpu", dtype=torch.float32
    )
    loaded = peft.PeftModel.from_pretrained(base_4bit, root / "adapter").eval()
    for layer in loaded.modules():
        if isinstance(layer, bnb.nn.Linear4bit):
            # On a CPU with AVX512-BF16, bnb 0.50 repacks a 4-bit weight at its first
            # gradient-free eval call and multiplies in bf16 (whatever the compute dtype):
            # logits 4e-3 away. Off, its matmul is the dequantized weight's, in fp32.
            layer.support_avx512bf16_for_cpu = False
    with torch.no_grad():
        logits = loaded(x).logits
    return {"root": root, "base": base, "adapter": root / "adapter", "logits": logits,
            "quantization": base_4bit.config.quantization_config}  # fmt: skip


def test_peft_bnb_adapter_runs_in_a_qlora_run(peft_bnb: dict[str, Any], tmp_path: Path):
    """The LoRA callback's ``adapter:`` on an nf4 QLoRA run of the same base: before any
    change (one step at learning rate 0), its logits are peft + bitsandbytes' (the same NF4
    bytes, the same adapters)."""
    recipe = _recipe(peft_bnb["base"], peft_bnb["root"] / "data", None)
    recipe["trainer"]["callbacks"] = [{"class_path": "plugintrain.callbacks.LoRA", "init_args": {
        "r": 4, "alpha": 8, "quantize": "nf4", "target_modules": ALL_LINEAR,
        "adapter": str(peft_bnb["adapter"])}}]  # fmt: skip
    tokens = np.random.default_rng(0).integers(0, VOCAB, 4096)
    for name in ("train.bin", "val.bin"):
        write_token_bin(peft_bnb["root"] / "data" / name, tokens)
    config = tmp_path / "qlora_peft.yaml"
    config.write_text(yaml.safe_dump(recipe))
    module = _fit_module(config, tmp_path / "run", "--trainer.max_steps=1",
                         "--model.init_args.optimizer.init_args.lr=0.0")  # fmt: skip
    with torch.no_grad():
        ours = module.model(_tokens())
    torch.testing.assert_close(ours, peft_bnb["logits"], rtol=1e-4, atol=1e-4)


def test_generate_takes_a_peft_bnb_adapter(peft_bnb: dict[str, Any], tmp_path: Path, capsys):
    """``generate --weights BASE --adapter PEFT_DIR`` samples; with the quantization on
    the model card (peft's section, which peft 0.21 leaves out: its check reads the
    config as an object, while it holds a dict), the model is peft + bitsandbytes'."""
    base, adapter = str(peft_bnb["base"]), str(peft_bnb["adapter"])
    assert len(_generate(capsys, "--weights", base, "--adapter", adapter)) > 0
    carded = tmp_path / "carded"
    carded.mkdir()
    for file in peft_bnb["adapter"].iterdir():
        (carded / file.name).write_bytes(file.read_bytes())
    section = "\n".join(
        [f"\n{QUANTIZATION_PREFIX}"]
        + [f"- {k}: {v}" for k, v in peft_bnb["quantization"].to_dict().items()]
    )
    with (carded / "README.md").open("a") as card:
        card.write(f"\n## Training procedure\n{section}\n")
    with torch.no_grad():
        ours = load_model(base, str(carded))(_tokens())
        plain = load_model(base, adapter)(_tokens())
    torch.testing.assert_close(ours, peft_bnb["logits"], rtol=1e-4, atol=1e-4)
    assert (plain - peft_bnb["logits"]).abs().max() > 1e-3  # unquantized: another model


def test_a_quantized_base_needs_pretrained_weights(
    qlora_run: dict[str, Any], capsys, tmp_path: Path
) -> None:
    """A randomly initialized base has nothing to keep in 4 bits (and its checkpoints would
    hold it whole): one line naming the option to set, before anything is launched."""
    recipe = yaml.safe_load(qlora_run["config"].read_text())
    recipe["model"]["init_args"].update(weights=None, config="llama3-debug")
    config = tmp_path / "random.yaml"
    config.write_text(yaml.safe_dump(recipe))
    message = _error(
        capsys, "fit", "--config", str(config), f"--trainer.default_root_dir={tmp_path / 'root'}",
        "--trainer.logger=false",
    )  # fmt: skip
    assert message.endswith(
        "LoRA quantize: nf4 quantizes a pretrained base, and this model has none; set"
        " model.init_args.weights (a Hugging Face directory, GGUF, llm.c file, checkpoint or"
        " pretrained name), or drop quantize"
    ), message
    assert not (tmp_path / "root").exists()


def test_an_unknown_quantization_is_one_line(
    qlora_run: dict[str, Any], capsys, tmp_path: Path
) -> None:
    """``quantize: nf5``: one line naming it and the schemes there are, exit 2, before any
    weight loads or anything is written (nf4, the hint, is what the other tests run)."""
    recipe = yaml.safe_load(qlora_run["config"].read_text())
    recipe["trainer"]["callbacks"][0]["init_args"]["quantize"] = "nf5"
    config = tmp_path / "nf5.yaml"
    config.write_text(yaml.safe_dump(recipe))
    message = _error(
        capsys, "fit", "--config", str(config), f"--trainer.default_root_dir={tmp_path / 'root'}",
        "--trainer.logger=false",
    )  # fmt: skip
    assert message.endswith("LoRA quantize='nf5': use one of null, nf4, int8"), message
    assert not (tmp_path / "root").exists()


@pytest.mark.parametrize("strategy", ["auto", "ddp_bucketed", "zero1", "zero2", "hybrid"])
def test_every_strategy_quantizes_the_base_as_it_loads(
    qlora_run: dict[str, Any], monkeypatch: pytest.MonkeyPatch, strategy: str
) -> None:
    """At world size 1, under Lightning's default and each plugintrain strategy that holds
    whole weights: when the base weights are read, the adapted layers are already
    QuantizedWeights (the full-precision base is never allocated), and a step trains."""
    import lightning as L
    import torch.distributed as dist

    from plugintrain import strategies
    from plugintrain.bench.gpu_checks import _QUIET_TRAINER
    from plugintrain.callbacks import LoRA
    from plugintrain.formats import base as formats_base
    from plugintrain.model_zoo import CausalLM
    from plugintrain.model_zoo.lora import quantized_weights

    strategies.register()
    seen: list[int] = []
    load_into = formats_base.load_into

    def spy(model: torch.nn.Module, *args: Any, **kwargs: Any) -> None:
        seen.append(len(list(quantized_weights(model))))
        load_into(model, *args, **kwargs)

    monkeypatch.setattr(formats_base, "load_into", spy)
    module = CausalLM(weights=str(qlora_run["base"]), warmup_steps=0)
    tokens = torch.randint(0, VOCAB, (1, 2, 17), generator=torch.Generator().manual_seed(0))
    data = torch.utils.data.TensorDataset(tokens[..., :-1], tokens[..., 1:])
    trainer = L.Trainer(
        accelerator="cpu", devices=1, strategy=strategy, max_steps=1,
        callbacks=[LoRA(r=4, alpha=8, quantize="nf4", target_modules=TARGETS)],
        use_distributed_sampler=False, **_QUIET_TRAINER,
    )  # fmt: skip
    try:
        with pytest.warns(UserWarning, match="kept unquantized"):
            trainer.fit(module, torch.utils.data.DataLoader(data, batch_size=None))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    # 2 layers x (wq, w2): wv (20 x 40) is kept as it is.
    assert seen == [4], seen
    assert trainer.global_step == 1
