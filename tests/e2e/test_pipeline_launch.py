"""End to end: the pipeline and 4-D recipes through the real CLI, on CPU processes.

The GPT-2 pipeline recipe (pp=2, 1F1B, tied head) runs on 2 processes, resumes its
step-2 DCP checkpoint under another layout (interleaved, 2 chunks per rank: the layers
move between ranks) with the uninterrupted run's losses, and ends with the weights of a
single-process fit on the same batches. The 4-D recipe (dp2 x tp2+SP x pp2, ZeRO-1) runs
on 8 processes and matches a single process too, and both export to the same Hugging
Face weights. Layouts that cannot run are refused at parse time, before any process starts.
Every command runs forked from the fork server (``_cli.run_cli``), the multi-process fits
as torchrun starts its ranks (Lightning's own launcher is ``test_hybrid_launch.py``'s).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import transformers
from safetensors.torch import load_file

from plugintrain.checkpoints.dcp import read_weights
from plugintrain.cli import PluginTrainCLI, main
from plugintrain.data import get_tokenizer

from _cli import RECIPES, REPO, logged_losses, run_cli

PIPELINE = RECIPES / "gpt2_debug_pipeline_cpu.yaml"
FOUR_D = RECIPES / "llama3_debug_4d_cpu.yaml"
STEPS = 4
FAST = (
    "--data.init_args.seq_len=32",
    "--trainer.limit_val_batches=0",
    "--trainer.log_every_n_steps=1",
    "--trainer.enable_progress_bar=false",
    "--checkpoint.every_n_train_steps=2",
    "--checkpoint.save_top_k=-1",
    "--throughput.window_size=2",
)


def _losses(save_dir: Path, name: str) -> dict[int, float]:
    return logged_losses(save_dir / name / "version_0")


def _fit_args(recipe: Path, data_dir: Path, save_dir: Path, *extra: str) -> list[str]:
    return [
        "fit", "--config", str(recipe),
        f"--data.init_args.data_dir={data_dir}",
        f"--trainer.logger.init_args.save_dir={save_dir}",
        f"--trainer.max_steps={STEPS}", *FAST, *extra,
    ]  # fmt: skip


def _single_process_weights(
    recipe: str, data_dir: Path, tmp_path: Path, batch_size: int
) -> dict[str, torch.Tensor]:
    run_cli(
        *_fit_args(RECIPES / f"{recipe}.yaml", data_dir, tmp_path),
        f"--data.init_args.batch_size={batch_size}",
        cwd=REPO,
        fresh_interpreter=False,
    )
    last = tmp_path / recipe / "checkpoints" / "last.ckpt"
    return torch.load(last, weights_only=True)["state_dict"]


@pytest.fixture(scope="module")
def pipeline_run(shakespeare_gpt2: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The uninterrupted 2-process pipeline run; returns its save dir."""
    save_dir = tmp_path_factory.mktemp("pipeline")
    run_cli(
        *_fit_args(PIPELINE, shakespeare_gpt2, save_dir), cwd=REPO, fresh_interpreter=False, ranks=2
    )
    return save_dir


def test_pipeline_recipe_trains_and_writes_dcp_checkpoints(pipeline_run: Path) -> None:
    losses = _losses(pipeline_run, "gpt2_debug_pipeline_cpu")
    assert sorted(losses) == list(range(STEPS))
    assert all(torch.isfinite(torch.tensor(v)) for v in losses.values())
    last = pipeline_run / "gpt2_debug_pipeline_cpu" / "checkpoints" / "last.ckpt"
    assert (last / ".metadata").is_file()
    assert {path.name.split("_")[2] for path in last.glob("*.distcp")} == {"0", "1"}


def test_pipeline_resumes_under_interleaved_layout(
    pipeline_run: Path, shakespeare_gpt2: Path, tmp_path: Path
) -> None:
    name = "gpt2_debug_pipeline_cpu"
    ckpt = pipeline_run / name / "checkpoints" / "epoch=0-step=2.ckpt"
    run_cli(
        *_fit_args(PIPELINE, shakespeare_gpt2, tmp_path, f"--ckpt_path={ckpt}"),
        "--trainer.strategy.init_args.schedule=interleaved",
        "--trainer.strategy.init_args.virtual_pipeline_parallel=2",
        cwd=REPO,
        fresh_interpreter=False,
        ranks=2,
    )
    resumed, uninterrupted = _losses(tmp_path, name), _losses(pipeline_run, name)
    assert sorted(resumed) == [2, 3]
    for step, loss in resumed.items():
        assert loss == pytest.approx(uninterrupted[step], rel=1e-5)


def test_pipeline_weights_match_single_process_fit(
    pipeline_run: Path, shakespeare_gpt2: Path, tmp_path: Path
) -> None:
    single = _single_process_weights("gpt2_debug_shakespeare_cpu", shakespeare_gpt2, tmp_path, 8)
    last = pipeline_run / "gpt2_debug_pipeline_cpu" / "checkpoints" / "last.ckpt"
    piped = read_weights(last)
    # Every weight is saved under its full-model name; the last stage's copy of the tied
    # head is `output.weight`, equal to the first stage's embedding.
    assert set(piped) == set(single)
    for name, weight in piped.items():
        torch.testing.assert_close(weight, single[name], rtol=1e-4, atol=1e-5, msg=name)


# AdamW's update of a weight whose gradient sums to almost nothing (say, where the tied
# embedding's input and output gradients cancel) is lr * g / (|g| + eps): at eps 1e-8 a last-bit
# difference in g (dp's sum of two halves against one process's single sum) moves that
# weight by up to lr * 1e-2, past the comparison's 1e-5. Both runs take eps 1e-6, where
# the same difference moves it by lr * 1e-4 (3e-8 here); every other weight is unaffected.
STEADY_ADAM = "--model.init_args.optimizer.init_args.eps=1e-6"


def test_four_d_recipe_matches_single_process(shakespeare_llama3: Path, tmp_path: Path) -> None:
    """dp2 x tp2(+SP) x pp2 on 8 processes, per-rank batches of 4 = one process on 8."""
    save_dir = tmp_path / "four_d"
    args = _fit_args(FOUR_D, shakespeare_llama3, save_dir, "--trainer.max_steps=2", STEADY_ADAM)
    run_cli(*args, cwd=REPO, fresh_interpreter=False, ranks=8)
    # (Logged losses are rank 0's replica's, so only the weights are compared.)
    assert sorted(_losses(save_dir, "llama3_debug_4d_cpu")) == [0, 1]
    single_dir = tmp_path / "single"
    run_cli(
        *_fit_args(RECIPES / "llama3_debug_shakespeare_cpu.yaml", shakespeare_llama3, single_dir),
        "--trainer.max_steps=2",
        "--data.init_args.batch_size=8",
        STEADY_ADAM,
        cwd=REPO,
        fresh_interpreter=False,
    )
    last = save_dir / "llama3_debug_4d_cpu" / "checkpoints" / "last.ckpt"
    four_d = read_weights(last)
    single = torch.load(
        single_dir / "llama3_debug_shakespeare_cpu" / "checkpoints" / "last.ckpt",
        weights_only=True,
    )["state_dict"]
    assert set(four_d) == set(single)
    for name, weight in four_d.items():
        torch.testing.assert_close(weight, single[name], rtol=1e-4, atol=1e-5, msg=name)
    # Both export to the same Hugging Face weights (the sharded one read tensor by tensor).
    single_ckpt = single_dir / "llama3_debug_shakespeare_cpu" / "checkpoints" / "last.ckpt"
    exported = {}
    for name, ckpt in (("four_d", last), ("single", single_ckpt)):
        assert main(["export", str(ckpt), str(tmp_path / f"hf_{name}"), "--format", "hf"]) == 0
        exported[name] = load_file(tmp_path / f"hf_{name}" / "model.safetensors")
    assert exported["four_d"].keys() == exported["single"].keys()
    assert "model.layers.3.self_attn.q_proj.weight" in exported["four_d"]
    for name, weight in exported["four_d"].items():
        torch.testing.assert_close(weight, exported["single"][name], rtol=1e-4, atol=1e-5, msg=name)
    hf = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "hf_four_d")
    torch.testing.assert_close(hf.model.embed_tokens.weight, four_d["model.tok_embeddings.weight"])


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (
            ["--trainer.devices=3", "--trainer.strategy.init_args.pipeline_parallel=3"],
            r"n_layer=4 is not divisible by pipeline_parallel=3 x virtual_pipeline_parallel=1",
        ),
        (
            ["--trainer.strategy.init_args.microbatches=3"],
            r"batch_size=8 does not split into microbatches=3",
        ),
        (
            [
                "--trainer.strategy.init_args.schedule=interleaved",
                "--trainer.strategy.init_args.virtual_pipeline_parallel=2",
                "--trainer.strategy.init_args.microbatches=3",
            ],
            r"multiple of pipeline_parallel=2.*microbatches=3; use e.g. 4",
        ),
        (
            [
                "--trainer.strategy.init_args.schedule=1f1b",
                "--trainer.strategy.init_args.virtual_pipeline_parallel=2",
            ],
            r"schedule='1f1b' runs one model chunk per rank",
        ),
        (
            ["--trainer.strategy.init_args.schedule=zero_bubble"],
            r"Unknown pipeline schedule 'zero_bubble'",
        ),
    ],
    ids=["layers", "batch", "interleaved-microbatches", "vpp-without-interleaved", "unknown"],
)
def test_bad_pipeline_layout_fails_before_launch(
    shakespeare_gpt2: Path, overrides: list[str], message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        PluginTrainCLI(
            args=[
                "--config", str(PIPELINE), f"--data.init_args.data_dir={shakespeare_gpt2}",
                *overrides,
            ],
            run=False,
        )  # fmt: skip


def test_generate_from_a_pipeline_checkpoint(pipeline_run: Path) -> None:
    """`plugintrain generate` merges the stages' DCP shards into one model."""
    last = pipeline_run / "gpt2_debug_pipeline_cpu" / "checkpoints" / "last.ckpt"
    out = run_cli(
        "generate", f"--ckpt_path={last}", "--prompt=ROMEO:", "--max_new_tokens=5",
        "--temperature=0", "--json", cwd=REPO, fresh_interpreter=False,
    )  # fmt: skip
    sample = json.loads(out.stdout.strip().splitlines()[-1])
    prompt = get_tokenizer("gpt2").encode("ROMEO:")
    assert sample["tokens"][: len(prompt)] == prompt and len(sample["tokens"]) == len(prompt) + 5
