"""Exports that carry their tokenizer as other tools read it (issue 29): a Hugging Face
export's ``AutoTokenizer`` gives plugintrain's ids for every tokenizer plugintrain has
(GPT-2's and Llama 3's tiktoken vocabularies with BOS as each family adds it, SmolLM2's
from its GGUF) and ``pipeline("text-generation")`` runs it with our greedy answer; a
GGUF export names llama.cpp's pre-tokenizer (``gpt-2``, ``llama-bpe``) and add-BOS flag;
a Hugging Face ``tokenizer.json`` becomes the GGUF fields llama.cpp's own converter
wrote for SmolLM2; ``generate`` leads a Llama 3 prompt with BOS; DeepSeek-V3, which
llama.cpp's files cannot hold from here, is refused in one line."""

from __future__ import annotations

import json
from pathlib import Path

import lightning as L
import numpy as np
import pytest
import torch
import transformers
from torch.utils.data import DataLoader, TensorDataset

from plugintrain.cli import main
from plugintrain.core.gguf_header import read_gguf_metadata
from plugintrain.data.tokenizers.registry import get_tokenizer
from plugintrain.formats.gguf.tokenizer_keys import hf_gguf_vocabulary
from plugintrain.formats.tokenizer_files import write_hf_tokenizer
from plugintrain.model_zoo import CausalLM, TransformerConfig

TEXTS = [
    "Hello world! The quick brown fox.",
    "  two leading spaces,\ttabs,\n\nand blank lines\n",
    "Numbers 1234567 and 3.14159; dates 2031-03-03.",
    "Ünïcödé, 日本語のテキスト, emoji 😀🚀 and Ελληνικά.",
    "def f(x):\n    return x ** 2  # code\n",
    "it's they'll I'M we've DON'T",
]


def _fit(preset: str, root: Path) -> Path:
    """``preset`` trained one step on random tokens, saved as ``fit`` saves it."""
    L.seed_everything(0, verbose=False)
    module = CausalLM(TransformerConfig.from_name(preset), warmup_steps=0, lr_decay_steps=1)
    vocab = module.config.vocab_size
    tokens = torch.randint(0, vocab, (2, 17), generator=torch.Generator().manual_seed(0))
    trainer = L.Trainer(
        accelerator="cpu", max_steps=1, logger=False, enable_progress_bar=False,
        enable_model_summary=False, enable_checkpointing=False, default_root_dir=root,
    )  # fmt: skip
    trainer.fit(module, DataLoader(TensorDataset(tokens[:, :-1], tokens[:, 1:]), batch_size=2))
    trainer.save_checkpoint(root / f"{preset}.ckpt")
    return root / f"{preset}.ckpt"


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("ckpts")
    return {p: _fit(p, root) for p in ("gpt2-debug", "llama3-debug", "qwen3-debug")}


@pytest.mark.parametrize("spec", ["gpt2", "llama3", "smollm2-135m"])
def test_auto_tokenizer_gives_our_ids(spec: str, tmp_path: Path) -> None:
    tokenizer = get_tokenizer(spec)
    write_hf_tokenizer(spec, tokenizer, tmp_path, 2048)
    theirs = transformers.AutoTokenizer.from_pretrained(tmp_path)
    for text in TEXTS:
        ours = tokenizer.encode(text, bos=tokenizer.add_bos)
        assert theirs(text)["input_ids"] == ours, text
        assert theirs.decode(ours, skip_special_tokens=True) == text
    assert theirs.bos_token_id == tokenizer.bos_id and theirs.eos_token_id == tokenizer.eos_id
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    assert config["add_bos_token"] is (spec == "llama3")
    assert ("chat_template" in config) is (
        spec == "smollm2-135m"
    )  # the base vocabularies have none
    generation = json.loads((tmp_path / "generation_config.json").read_text())
    assert generation["eos_token_id"] == tokenizer.eos_id


@pytest.mark.parametrize("preset", ["gpt2-debug", "qwen3-debug"])
def test_hf_export_runs_in_a_pipeline_with_our_greedy_text(
    checkpoints: dict[str, Path], tmp_path: Path, preset: str, capsys
) -> None:
    """The export's own tokenizer and generation config: ``pipeline`` needs nothing else,
    and its greedy text is ``plugintrain generate``'s."""
    out = tmp_path / "hf"
    assert main(["export", str(checkpoints[preset]), str(out), "--format", "hf"]) == 0
    capsys.readouterr()
    pipe = transformers.pipeline("text-generation", model=str(out), device="cpu")
    theirs = pipe("The king said", max_new_tokens=6, do_sample=False)[0]["generated_text"]
    argv = ["generate", "--weights", str(checkpoints[preset]), "--prompt", "The king said",
            "--max_new_tokens", "6", "--temperature", "0", "--json"]  # fmt: skip
    assert main(argv) == 0
    ours = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert theirs == ours["text"]


def test_generate_leads_a_llama3_prompt_with_bos(checkpoints: dict[str, Path], capsys) -> None:
    for preset, first in (("llama3-debug", 128000), ("gpt2-debug", None)):
        argv = ["generate", "--weights", str(checkpoints[preset]), "--prompt", "Hello",
                "--max_new_tokens", "2", "--temperature", "0", "--json"]  # fmt: skip
        assert main(argv) == 0
        sample = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
        hello = get_tokenizer(preset.split("-")[0]).encode("Hello")
        lead = [first] if first is not None else []
        assert sample["tokens"][: len(lead) + len(hello)] == lead + hello
        assert sample["text"].startswith("Hello")  # the BOS is not printed


@pytest.mark.parametrize(
    ("preset", "pre", "add_bos"),
    [("gpt2-debug", "gpt-2", False), ("llama3-debug", "llama-bpe", True),
     ("qwen3-debug", "gpt-2", False)],
)  # fmt: skip
def test_gguf_export_names_llama_cpp_pre_tokenizer(
    checkpoints: dict[str, Path], tmp_path: Path, preset: str, pre: str, add_bos: bool
) -> None:
    out = tmp_path / "m.gguf"
    assert main(["export", str(checkpoints[preset]), str(out), "--format", "gguf"]) == 0
    meta = read_gguf_metadata(out)
    assert meta["tokenizer.ggml.pre"] == pre
    assert meta["tokenizer.ggml.add_bos_token"] is add_bos
    reread = get_tokenizer(str(out))  # llama.cpp's rules, as plugintrain reads a GGUF
    ours = get_tokenizer(preset.split("-")[0] if preset != "qwen3-debug" else "gpt2")
    for text in TEXTS:
        assert reread.encode(text, bos=reread.add_bos) == ours.encode(text, bos=ours.add_bos)


def test_hf_tokenizer_becomes_the_fields_llama_cpp_wrote() -> None:
    """SmolLM2's GGUF was written by llama.cpp's converter from its tokenizer.json: the
    fields we derive from that tokenizer are the ones it wrote."""
    from plugintrain.data.assets import resolve_model_path

    gguf = read_gguf_metadata(resolve_model_path("smollm2-135m"))
    ours = hf_gguf_vocabulary(get_tokenizer("smollm2-135m"), "smollm2-135m")
    for key in ("pre", "tokens", "merges", "bos_token_id", "eos_token_id", "model"):
        expected, got = gguf[f"tokenizer.ggml.{key}"], ours[f"tokenizer.ggml.{key}"]
        assert list(np.atleast_1d(got)) == list(np.atleast_1d(expected)), key
    types = np.asarray(gguf["tokenizer.ggml.token_type"])
    assert np.array_equal(ours["tokenizer.ggml.token_type"], types)
    assert ours["tokenizer.chat_template"] == gguf["tokenizer.chat_template"]


def test_a_tokenizer_llama_cpp_cannot_name_is_refused() -> None:
    from tokenizers import Regex, pre_tokenizers

    tokenizer = get_tokenizer("smollm2-135m")
    odd = type(tokenizer)(
        "odd", type(tokenizer.backend).from_str(tokenizer.backend.to_str()),
        tokenizer.bos_id, tokenizer.eos_id, byte_level=True,
    )  # fmt: skip
    odd.backend.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Split(Regex(r"\w+"), behavior="isolated"),
         pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]
    )  # fmt: skip
    with pytest.raises(ValueError, match=r"not one llama.cpp names .* export with --format hf"):
        hf_gguf_vocabulary(odd, "odd")


@pytest.mark.parametrize("fmt", ["gguf", "llmc"])
def test_deepseek_v3_export_that_cannot_be_written_is_one_line(
    tmp_path: Path, fmt: str, capsys
) -> None:
    ckpt = _fit("deepseek-v3-debug", tmp_path)
    out = tmp_path / f"out.{fmt}"
    capsys.readouterr()
    assert main(["export", str(ckpt), str(out), "--format", fmt]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert "Traceback" not in "\n".join(err) and "deepseek" in err[-1].lower()
    assert "--format hf" in err[-1]
    assert not out.exists() and not Path(f"{out}.partial").exists()
