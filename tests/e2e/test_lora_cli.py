"""LoRA through the command line, on a small random Hugging Face Llama as the base:
adapter-only checkpoints that resume exactly (against an uninterrupted run), refuse
another base, generate merged or not, and export merged for ``transformers``; bad
options end in one line before anything is launched."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import transformers
import yaml
from huggingface_hub import ModelCard

from plugintrain.checkpoints.files import load_torch_file
from plugintrain.checkpoints.resume import checkpoint_entry
from plugintrain.cli import PluginTrainCLI, main
from plugintrain.data.token_bin import write_token_bin
from plugintrain.formats.lora_checkpoints import weights_sha256
from plugintrain.formats.model_card import RUN_RECORD_KEY
from plugintrain.model_zoo.lora import is_adapter_name

from _hf_models import random_hf_llama

VOCAB = 50257  # GPT-2's ids, so `generate --tokenizer gpt2` can prompt it
TARGETS = ["*.attention.wq", "*.attention.wv", "*.feed_forward.w2"]


def _hf_llama(root: Path, seed: int) -> Path:
    return random_hf_llama(root, VOCAB, seed)


def _recipe(base: Path, data: Path, lora: dict[str, Any] | None) -> dict[str, Any]:
    callbacks = [] if lora is None else [{"class_path": "plugintrain.callbacks.LoRA",
                                          "init_args": lora}]  # fmt: skip
    return {
        "seed_everything": 7,
        "trainer": {
            "accelerator": "cpu",
            "devices": 1,
            "precision": "32-true",
            "max_steps": 4,
            "limit_val_batches": 0,
            "enable_progress_bar": False,
            "callbacks": callbacks,
            "logger": {
                "class_path": "lightning.pytorch.loggers.TensorBoardLogger",
                "init_args": {"save_dir": "runs", "name": "lora"},
            },
        },
        "model": {
            "class_path": "plugintrain.model_zoo.CausalLM",
            "init_args": {
                "weights": str(base),
                "warmup_steps": 0,
                "min_lr_ratio": 1.0,
                "weight_decay": 0.0,
                "optimizer": {"class_path": "torch.optim.AdamW", "init_args": {"lr": 0.01}},
            },
        },
        "data": {
            "class_path": "plugintrain.data.TokenDataModule",
            "init_args": {"data_dir": str(data), "seq_len": 16, "batch_size": 2},
        },
        "checkpoint": {"every_n_train_steps": 2},
    }


@pytest.fixture(scope="module")
def lora_run(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    root = tmp_path_factory.mktemp("lora_cli")
    base, other = _hf_llama(root / "base", 0), _hf_llama(root / "other", 1)
    tokens = np.random.default_rng(0).integers(0, VOCAB, 4096)
    for name in ("train.bin", "val.bin"):
        write_token_bin(root / "data" / name, tokens)
    configs = {}
    for name, spec in (("lora", {"r": 4, "alpha": 8, "target_modules": TARGETS}), ("plain", None)):
        configs[name] = root / f"{name}.yaml"
        configs[name].write_text(yaml.safe_dump(_recipe(base, root / "data", spec)))
    interrupted = _fit(configs["lora"], root / "interrupted")
    checkpoint = root / "interrupted" / "lora" / "checkpoints" / "last.ckpt"
    saved = load_torch_file(checkpoint)
    resumed = _fit(configs["lora"], root / "interrupted", "--trainer.max_steps=6",
                   "--ckpt_path=last")  # fmt: skip
    straight = _fit(configs["lora"], root / "straight", "--trainer.max_steps=6")
    return {
        "root": root, "base": base, "other": other, "configs": configs,
        "checkpoint": checkpoint, "saved": saved, "interrupted": interrupted,
        "resumed": resumed, "straight": straight,
    }  # fmt: skip


def _fit(config: Path, save_dir: Path, *args: str) -> dict[str, torch.Tensor]:
    """Fit through the CLI in this process; the trained tensors of the model."""
    cli = PluginTrainCLI(
        args=["fit", "--config", str(config), f"--trainer.logger.init_args.save_dir={save_dir}",
              f"--trainer.default_root_dir={save_dir}", *args],
    )  # fmt: skip
    return {n: p.detach().clone() for n, p in cli.model.named_parameters() if p.requires_grad}


def test_adapter_checkpoint_holds_adapters_only(lora_run: dict[str, Any]) -> None:
    """The checkpoint holds the trained tensors (4 layers' A and B per block) and their
    AdamW state, no base weight, and names the base by the sha256 of its files."""
    saved = lora_run["saved"]
    names = set(saved["state_dict"])
    assert names == set(lora_run["interrupted"]) and len(names) == 2 * 2 * len(TARGETS)
    assert all(is_adapter_name(n) for n in names)
    (optimizer,) = saved["optimizer_states"]
    assert len(optimizer["state"]) == len(names)
    record = saved["lora"]
    assert record["base"] == str(lora_run["base"])
    assert record["sha256"] == weights_sha256(lora_run["base"])
    assert record["spec"]["r"] == 4 and record["spec"]["target_modules"] == TARGETS


def test_resumed_adapters_match_an_uninterrupted_run(lora_run: dict[str, Any]) -> None:
    """4 steps, an adapter checkpoint, 2 resumed steps == 6 steps in one go."""
    for name, value in lora_run["straight"].items():
        torch.testing.assert_close(lora_run["resumed"][name], value, rtol=1e-5, atol=1e-6)
    assert not torch.equal(lora_run["interrupted"][TARGET_B], lora_run["resumed"][TARGET_B])


TARGET_B = "model.layers.0.attention.wq.lora_B"


def _error(capsys: pytest.CaptureFixture, *argv: str) -> str:
    """Run ``plugintrain ARGV`` in this process; it must end as a one-line user error."""
    assert main(list(argv)) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert "Traceback" not in "\n".join(err)
    return err[-1]


def test_resume_on_another_base_is_refused(lora_run: dict[str, Any], capsys) -> None:
    """Same architecture, other weights: one line naming both bases and the fix."""
    message = _error(
        capsys, "fit", "--config", str(lora_run["configs"]["lora"]),
        f"--model.init_args.weights={lora_run['other']}",
        f"--ckpt_path={lora_run['checkpoint']}",
        f"--trainer.default_root_dir={lora_run['root']}", "--trainer.logger=false",
    )  # fmt: skip
    assert "sha256" in message and str(lora_run["other"]) in message
    assert f"set model.init_args.weights to {lora_run['base']}" in message


def test_resume_with_another_spec_is_refused(
    lora_run: dict[str, Any], capsys, tmp_path: Path
) -> None:
    """Other adapters than the checkpoint's: one line naming the field and both values."""
    recipe = yaml.safe_load(lora_run["configs"]["lora"].read_text())
    recipe["trainer"]["callbacks"][0]["init_args"]["r"] = 8
    config = tmp_path / "r8.yaml"
    config.write_text(yaml.safe_dump(recipe))
    message = _error(
        capsys, "fit", "--config", str(config), f"--ckpt_path={lora_run['checkpoint']}",
        f"--trainer.default_root_dir={tmp_path}", "--trainer.logger=false",
    )  # fmt: skip
    assert "trained with LoRA r: 4 (this run: 8)" in message


def test_resume_without_the_callback_is_refused(lora_run: dict[str, Any], capsys) -> None:
    message = _error(
        capsys, "fit", "--config", str(lora_run["configs"]["plain"]),
        f"--ckpt_path={lora_run['checkpoint']}",
        f"--trainer.default_root_dir={lora_run['root']}", "--trainer.logger=false",
    )  # fmt: skip
    assert "holds LoRA adapters" in message and "plugintrain.callbacks.LoRA" in message


@pytest.mark.parametrize(
    ("lora", "expected"),
    [
        ({"r": 0}, "r=0: the rank must be a positive integer"),
        ({"target_modules": ["*.attn.q"]}, "matches no module; the module paths are"),
        ({"target_modules": ["*.attention_norm"]}, "matches no Linear layer"),
        ({"bias": "some"}, "bias='some': use one of none, all, lora_only"),
    ],
    ids=["rank", "no-match", "not-linear", "bias"],
)
def test_bad_lora_options_end_in_one_line(
    lora_run: dict[str, Any], capsys, tmp_path: Path, lora: dict, expected: str
) -> None:
    """Refused before anything is launched or written (no run directory appears)."""
    recipe = yaml.safe_load(lora_run["configs"]["lora"].read_text())
    recipe["trainer"]["callbacks"][0]["init_args"].update(lora)
    config = tmp_path / "bad.yaml"
    config.write_text(yaml.safe_dump(recipe))
    message = _error(capsys, "fit", "--config", str(config),
                     f"--trainer.logger.init_args.save_dir={tmp_path / 'runs'}")  # fmt: skip
    assert expected in message
    assert not (tmp_path / "runs").exists()
    if "matches no module" in expected:
        assert "model.layers.*.attention.wq" in message  # the paths that exist, folded


def _generate(capsys, *args: str) -> list[int]:
    common = ["--tokenizer", "gpt2", "--prompt", "ROMEO:", "--temperature", "0",
              "--max_new_tokens", "8", "--json"]  # fmt: skip
    assert main(["generate", *args, *common]) == 0
    import json

    return json.loads(capsys.readouterr().out.strip().splitlines()[-1])["tokens"]


def test_generate_merged_or_not_agrees(lora_run: dict[str, Any], capsys) -> None:
    """Adapters kept apart, merged into the base, or read as one merged model: one text."""
    ckpt = str(lora_run["checkpoint"])
    apart = _generate(capsys, "--weights", str(lora_run["base"]), "--adapter", ckpt)
    merged = _generate(capsys, "--adapter", ckpt, "--merge_lora")
    whole = _generate(capsys, "--weights", ckpt)
    assert apart == merged == whole


def test_export_merged_loads_in_transformers(lora_run: dict[str, Any], tmp_path: Path, capsys):
    """transformers' logits of the exported merged model == ours with adapters unmerged."""
    from plugintrain.tools._models import load_with_adapter

    ckpt, out = str(lora_run["checkpoint"]), tmp_path / "merged"
    message = _error(capsys, "export", ckpt, str(out), "--format", "hf")
    assert "pass --merge-lora" in message and not out.exists()
    assert main(["export", ckpt, str(out), "--format", "hf", "--merge-lora"]) == 0
    x = torch.randint(0, VOCAB, (2, 12), generator=torch.Generator().manual_seed(0))
    ours = load_with_adapter(str(lora_run["base"]), ckpt, merge=False).eval()
    hf = transformers.LlamaForCausalLM.from_pretrained(out).eval()
    base = transformers.LlamaForCausalLM.from_pretrained(lora_run["base"]).eval()
    with torch.no_grad():
        expected, got, untrained = ours(x), hf(x).logits, base(x).logits
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)
    assert (got - untrained).abs().max() > 1e-3  # the adapters changed the model


def test_generate_takes_a_run_directory(lora_run: dict[str, Any], capsys) -> None:
    """``--adapter runs/<recipe>/checkpoints`` (what `make train` passes) samples from the
    newest complete checkpoint there."""
    from plugintrain.checkpoints.files import newest_complete

    directory = lora_run["checkpoint"].parent
    from_directory = _generate(capsys, "--adapter", str(directory))
    assert from_directory == _generate(capsys, "--adapter", str(newest_complete(directory)))


def test_export_peft_loads_in_peft_and_back(lora_run: dict[str, Any], tmp_path: Path, capsys):
    """``export --format peft``: ``peft``'s PeftModel on the base gives our logits (base +
    adapters, unmerged); ``generate --adapter`` of the PEFT directory samples what the
    run's checkpoint does; its model card is read by ``huggingface_hub``; a whole model or a
    merge is refused in one line."""
    import peft

    from plugintrain.tools._models import load_with_adapter

    ckpt, out = str(lora_run["checkpoint"]), tmp_path / "adapter"
    message = _error(capsys, "export", ckpt, str(out), "--format", "peft", "--merge-lora")
    assert "drop --dtype and --merge-lora" in message and not out.exists()
    assert main(["export", ckpt, str(out), "--format", "peft"]) == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert summary["r"] == 4 and summary["modules"] == 2 * len(TARGETS)
    x = torch.randint(0, VOCAB, (2, 12), generator=torch.Generator().manual_seed(0))
    ours = load_with_adapter(str(lora_run["base"]), ckpt, merge=False).eval()
    hf = transformers.LlamaForCausalLM.from_pretrained(lora_run["base"])
    model = peft.PeftModel.from_pretrained(hf, out).eval()
    with torch.no_grad():
        torch.testing.assert_close(model(x).logits, ours(x), rtol=1e-4, atol=1e-4)
    from_peft = _generate(capsys, "--weights", str(lora_run["base"]), "--adapter", str(out))
    assert from_peft == _generate(capsys, "--adapter", ckpt)
    card = ModelCard.load(out / "README.md")  # huggingface_hub's parser reads the card
    assert card.data.library_name == "peft" and {"lora", "peft"} <= set(card.data.tags)
    assert card.data.base_model is None  # a local base has no Hub id to name
    assert "LoRA (r=4" in card.text
    record = checkpoint_entry(ckpt, RUN_RECORD_KEY)  # what fit's RunRecord kept
    assert card.data.datasets == ["data"] and f"**Steps**: {record['step']}" in card.text
    message = _error(
        capsys, "export", str(lora_run["base"]), str(tmp_path / "x"), "--format", "peft"
    )
    assert "is not a checkpoint written by `plugintrain fit`" in message
