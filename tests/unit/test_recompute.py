"""Activation recomputation and per-block compile (``plugintrain.strategies.blocks``) in one
process, against the same model without them (plain autograd, the reference).

Gradients must match exactly enough for fp32 (recomputation replays the same operators,
dropout included), parameter names must not change, and the peak of live tensor bytes
measured by :class:`~plugintrain.core.memory.LiveTensorMemory` (which sees every tensor) must
fall: full below selective below none. The distributed layouts (tp, pp, FSDP2, ZeRO) are
in ``tests/distributed/test_recompute_distributed.py``.
"""

from __future__ import annotations

import copy
import json
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.checkpoint import CheckpointPolicy

from plugintrain.cli import main
from plugintrain.core.memory import LiveTensorMemory
from plugintrain.data import write_token_bin
from plugintrain.data.idx import write_idx
from plugintrain.model_zoo import Transformer, TransformerConfig
from plugintrain.strategies import BlockOptions, HybridParallelStrategy, ZeroStrategy
from plugintrain.strategies.blocks import _selective_policy, is_recomputed, transformer_blocks

REPO = Path(__file__).resolve().parents[2]
PRESETS = ["gpt2-debug", "llama3-debug", "qwen3-debug"]
OPTIONS = {
    "full": BlockOptions("full"),
    "selective": BlockOptions("selective"),
    "full/2": BlockOptions("full", every_n_layers=2),
}


def _model(preset: str, **overrides: object) -> Transformer:
    torch.manual_seed(0)
    # GPT-2 with dropout: recomputation must replay the same masks.
    dropout = 0.1 if preset == "gpt2-debug" else 0.0
    fields = {"vocab_size": 256, "dropout": dropout, **overrides}
    return Transformer(TransformerConfig.from_name(preset, **fields))


def _grads(model: Transformer, tokens: torch.Tensor) -> tuple[float, dict[str, torch.Tensor]]:
    torch.manual_seed(1)  # the dropout masks
    loss = torch.nn.functional.cross_entropy(
        model(tokens[:, :-1]).flatten(0, 1), tokens[:, 1:].flatten()
    )
    loss.backward()
    return loss.item(), {n: p.grad.clone() for n, p in model.named_parameters()}


def _norm_calls(model: Transformer) -> list[int]:
    """Counts forward calls of the first block's attention norm (recomputation reruns it)."""
    calls = [0]
    norm = model.layers["0"].attention_norm
    norm.register_forward_hook(lambda *_: calls.__setitem__(0, calls[0] + 1))
    return calls


@pytest.mark.parametrize("preset", PRESETS)
@pytest.mark.parametrize("option", OPTIONS)
def test_gradients_equal_no_recompute(preset: str, option: str) -> None:
    reference = _model(preset)
    model = copy.deepcopy(reference)
    OPTIONS[option].apply(model)
    tokens = torch.randint(0, 256, (2, 33), generator=torch.Generator().manual_seed(2))
    reference_calls, calls = _norm_calls(reference), _norm_calls(model)
    want_loss, want = _grads(reference, tokens)
    loss, got = _grads(model, tokens)
    assert (reference_calls, calls) == ([1], [2])  # block 0 did run again in backward
    assert loss == want_loss
    assert got.keys() == want.keys()  # no name changed
    for name, grad in want.items():
        torch.testing.assert_close(got[name], grad, rtol=1e-5, atol=1e-7, msg=name)


def test_full_every_n_layers_picks_blocks_by_full_model_index() -> None:
    model = _model("llama3-debug", n_layer=5)
    BlockOptions("full", every_n_layers=2).apply(model)
    assert [is_recomputed(b) for _, b in transformer_blocks(model)] == [
        "full", None, "full", None, "full"
    ]  # fmt: skip
    # A pipeline stage holding blocks 3 and 4 recomputes block 4, as the whole model does.
    stage = _model("llama3-debug", n_layer=5)
    for key in ("0", "1", "2"):
        del stage.layers[key]
    BlockOptions("full", every_n_layers=2).apply(stage)
    assert [is_recomputed(b) for _, b in transformer_blocks(stage)] == [None, "full"]


def test_names_state_dict_copies_and_inference_are_unchanged() -> None:
    reference = _model("llama3-debug")
    model = copy.deepcopy(reference)
    BlockOptions("selective").apply(model)
    assert list(model.state_dict()) == list(reference.state_dict())
    twin = copy.deepcopy(model)  # deep copies keep the recomputation and their own weights
    assert is_recomputed(twin.layers["0"]) == "selective"
    assert twin.layers["0"].attention.wq.weight is not model.layers["0"].attention.wq.weight
    tokens = torch.randint(0, 256, (1, 16))
    with torch.no_grad():  # recomputation stands aside where autograd does not record
        torch.testing.assert_close(model(tokens), reference(tokens), rtol=0, atol=0)
        torch.testing.assert_close(twin(tokens), reference(tokens), rtol=0, atol=0)


def _activation_peak(model: Transformer, tokens: torch.Tensor) -> int:
    """Peak bytes of what forward + backward allocate (activations, gradients, logits)."""
    with LiveTensorMemory() as memory:
        loss = model(tokens).float().square().mean()
        loss.backward()
    return memory.peak_bytes


def test_recomputation_lowers_the_measured_peak() -> None:
    # Long sequence, small vocabulary: activations dominate, as in real training.
    tokens = torch.randint(0, 256, (4, 256), generator=torch.Generator().manual_seed(3))
    peaks = {}
    for option in ("none", *OPTIONS):
        model = _model("llama3-debug")
        if option != "none":
            OPTIONS[option].apply(model)
        peaks[option] = _activation_peak(model, tokens)
    assert peaks["full"] < peaks["full/2"] < peaks["none"]
    assert peaks["full"] < peaks["selective"] < peaks["none"]
    # Full recomputation keeps one tensor per block where none keeps dozens.
    assert peaks["full"] < peaks["none"] / 2


class _BackwardOps(TorchDispatchMode):
    """Counts the operators run while it is active."""

    def __init__(self) -> None:
        super().__init__()
        self.counts: Counter[str] = Counter()

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        self.counts[func.__name__] += 1
        return func(*args, **(kwargs or {}))


def _backward_ops(option: str) -> Counter[str]:
    model = _model("llama3-debug")
    if option != "none":
        OPTIONS[option].apply(model)
    loss = model(torch.randint(0, 256, (2, 32))).square().mean()
    with _BackwardOps() as ops:
        loss.backward()
    return ops.counts


def test_selective_reruns_norms_and_activations_but_no_matmul() -> None:
    none, selective, full = (_backward_ops(o) for o in ("none", "selective", "full"))
    # Backward's own matmuls (input and weight gradients) only: forward's are kept...
    assert selective["mm.default"] == none["mm.default"]
    # ...while the forward's cheap work runs again: RMSNorm's rsqrt, SwiGLU's silu.
    for op in ("rsqrt.default", "silu.default"):
        assert none[op] == 0 and selective[op] == full[op] > 0, op
    # Full recomputation reruns the forward matmuls too: per block, all but the last (w2),
    # as the replay stops once it has rebuilt what backward reads (w2 needs only its input).
    assert full["mm.default"] == none["mm.default"] + 6 * 4


def test_selective_reruns_fused_attention_that_draws_dropout() -> None:
    # Rerunning every random draw keeps the replayed stream aligned (the residual dropout
    # after attention gets its forward mask); CPU's fused kernel takes no dropout, so the
    # policy is asked directly, as CUDA's flash kernel would ask it.
    flash = torch.ops.aten._scaled_dot_product_flash_attention.default
    q = torch.zeros(1, 1, 4, 8)
    assert _selective_policy(None, flash, q, q, q, 0.0) == CheckpointPolicy.MUST_SAVE
    assert _selective_policy(None, flash, q, q, q, 0.1) == CheckpointPolicy.PREFER_RECOMPUTE
    assert (
        _selective_policy(None, flash, q, q, q, dropout_p=0.1) == CheckpointPolicy.PREFER_RECOMPUTE
    )


@pytest.mark.parametrize(
    ("kwargs", "message", "fixed"),
    [
        ({"activation_checkpointing": "ful"}, "activation_checkpointing='ful' is not one of",
         {"activation_checkpointing": "full"}),
        ({"activation_checkpointing": "full", "every_n_layers": 0}, "every_n_layers=0 must be",
         {"activation_checkpointing": "full", "every_n_layers": 1}),
        ({"activation_checkpointing": "selective", "every_n_layers": 2},
         "every_n_layers=2 needs activation_checkpointing='full'",
         {"activation_checkpointing": "full", "every_n_layers": 2}),
    ],
)  # fmt: skip
def test_bad_options_are_refused_with_a_fix_that_works(
    kwargs: dict, message: str, fixed: dict
) -> None:
    for strategy in (HybridParallelStrategy, ZeroStrategy):
        with pytest.raises(ValueError, match=message):
            strategy(**kwargs)
        strategy(**fixed)  # the fix the message names


def test_compiled_tensor_parallelism_needs_sequence_parallelism() -> None:
    with pytest.raises(ValueError, match="compile=True with tensor_parallel=2 needs sequence_"):
        HybridParallelStrategy(tensor_parallel=2, compile=True)
    HybridParallelStrategy(tensor_parallel=2, sequence_parallel=True, compile=True)  # the fix


def _fit_error(capfd, tmp_path: Path, *args: str) -> str:
    code = main(["fit", *args, f"--trainer.default_root_dir={tmp_path}"])
    assert code == 2
    err = capfd.readouterr().err
    assert "Traceback" not in err and "usage:" not in err
    return err.strip().splitlines()[-1]


def test_cli_refuses_recomputation_of_a_model_without_blocks(capfd, tmp_path: Path) -> None:
    data = tmp_path / "mnist"
    for split in ("train", "t10k"):
        write_idx(data / f"{split}-images-idx3-ubyte", np.zeros((8, 28, 28), dtype=np.uint8))
        write_idx(data / f"{split}-labels-idx1-ubyte", np.zeros(8, dtype=np.uint8))
    args = [
        "--config", str(REPO / "recipes" / "mnist.yaml"), "--trainer.logger=false",
        f"--data.init_args.data_dir={data}",
        "--trainer.strategy.class_path=plugintrain.strategies.ZeroStrategy",
        "--trainer.strategy.init_args.activation_checkpointing=full",
    ]  # fmt: skip
    line = _fit_error(capfd, tmp_path, *args)
    assert "MNISTClassifier has none; set activation_checkpointing: none" in line, line
    assert [p.name for p in tmp_path.iterdir()] == ["mnist"]  # nothing written


def test_cli_refuses_an_unknown_mode_in_one_line(capfd, tmp_path: Path) -> None:
    data = tmp_path / "tokens"  # tiny token files, so that a clean clone needs no prepare
    write_token_bin(data / "train.bin", np.arange(300) % 1000)
    write_token_bin(data / "val.bin", np.arange(300) % 1000)
    meta = {"dataset": "shakespeare", "tokenizer": "gpt2", "vocab_size": 50257}
    (data / "meta.json").write_text(json.dumps(meta))
    args = [
        "--config", str(REPO / "recipes" / "gpt2_debug_shakespeare_cpu.yaml"),
        "--trainer.logger=false", f"--data.init_args.data_dir={data}",
        "--trainer.strategy.class_path=plugintrain.strategies.HybridParallelStrategy",
        "--trainer.strategy.init_args.activation_checkpointing=everything",
    ]  # fmt: skip
    line = _fit_error(capfd, tmp_path, *args)
    assert "activation_checkpointing='everything' is not one of" in line, line
