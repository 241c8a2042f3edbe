"""Precision plugins on one process: dtypes, weight-cast cache, loss scaler, checkpoints.

This CPU has no bf16/fp16 hardware (autocast runs ~30x slower than fp32), so every
model here is a few tiny Linear layers.
"""

from __future__ import annotations

import math

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks.throughput_monitor import _plugin_to_compute_dtype
from lightning.pytorch.cli import LightningCLI
from lightning.pytorch.plugins.precision import MixedPrecision
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.data import DataLoader, TensorDataset

from plugintrain.core.contracts import AutocastSwitch, default_gradient_layout
from plugintrain.precision_plugins import (
    PRECISION_PLUGINS,
    BF16MixedPrecision,
    DynamicLossScaler,
    FP16MixedPrecision,
    clip_grads_by_global_norm_,
    precision_dtypes,
    precision_plugin_from_name,
)

EXPECTED = {  # name -> (matmul output dtype, weight dtype, compute dtype Lightning sees)
    "32-true": (torch.float32, torch.float32, torch.float32),
    "bf16-true": (torch.bfloat16, torch.bfloat16, torch.bfloat16),
    "bf16-mixed": (torch.bfloat16, torch.float32, torch.bfloat16),
    "16-mixed": (torch.float16, torch.float32, torch.float16),
}


class TinyModel(L.LightningModule):
    """Two Linear layers on (x, y) regression; records dtypes seen in the step.

    Args:
        inf_at: Batch indices whose loss is multiplied by inf (injected overflow).
        lr: SGD learning rate.
    """

    def __init__(self, inf_at: tuple[int, ...] = (), lr: float = 0.1) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))
        self.inf_at = inf_at
        self.lr = lr
        self.seen: dict[str, torch.dtype] = {}

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int):
        x, y = batch
        hidden = self.net[0](x)
        loss = nn.functional.mse_loss(self.net[2](hidden.relu()).float(), y)
        self.seen = {"matmul": hidden.dtype, "loss": loss.dtype}
        return loss * math.inf if batch_idx in self.inf_at else loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=self.lr)


def _loader(batches: int = 6) -> DataLoader:
    generator = torch.Generator().manual_seed(0)
    data = TensorDataset(
        torch.randn(batches * 2, 4, generator=generator), torch.randn(batches * 2, 1)
    )
    return DataLoader(data, batch_size=2)


def _trainer(plugin, max_steps: int, **kwargs) -> L.Trainer:
    return L.Trainer(
        accelerator="cpu",
        plugins=[plugin],
        max_steps=max_steps,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        **kwargs,
    )


@pytest.mark.parametrize("name", list(EXPECTED))
def test_forward_dtypes_and_master_weights(name: str) -> None:
    matmul_dtype, weight_dtype, compute_dtype = EXPECTED[name]
    plugin = precision_plugin_from_name(name)
    model = TinyModel()
    trainer = _trainer(plugin, max_steps=1)
    trainer.fit(model, _loader(1))
    assert trainer.precision_plugin is plugin
    assert trainer.precision == name  # 16-mixed stays fp16 on CPU
    assert model.seen == {"matmul": matmul_dtype, "loss": torch.float32}
    assert {p.dtype for p in model.parameters()} == {weight_dtype}
    assert _plugin_to_compute_dtype(plugin) == compute_dtype


def test_mixed_keeps_optimizer_state_fp32_and_clips_fused_optimizers() -> None:
    model = TinyModel()
    model.configure_optimizers = lambda: torch.optim.AdamW(model.parameters(), fused=True)
    plugin = FP16MixedPrecision(init_scale=1024.0)  # 2**16 overflows this net: a skipped step
    _trainer(plugin, max_steps=1, gradient_clip_val=1.0).fit(model, _loader(1))
    states = model.trainer.optimizers[0].state.values()
    assert {s["exp_avg"].dtype for s in states} == {torch.float32}


def test_registry_names_and_aliases() -> None:
    assert set(PRECISION_PLUGINS) == set(EXPECTED)
    assert isinstance(precision_plugin_from_name(16), FP16MixedPrecision)
    assert isinstance(precision_plugin_from_name("bf16"), BF16MixedPrecision)
    assert (
        precision_plugin_from_name("16-mixed", growth_interval=3).loss_scaler.growth_interval == 3
    )
    with pytest.raises(ValueError, match="'64-true'"):
        precision_plugin_from_name("64-true")


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_precision_dtypes_match_what_training_computes_in(name: str) -> None:
    """What strategies read (the pipeline's wire and inputs, FSDP2's policy) is what the
    plugin makes a step do (``EXPECTED``), and Lightning's own plugins read the same."""
    matmul, weights, _ = EXPECTED[name]
    dtypes = precision_dtypes(precision_plugin_from_name(name))
    assert (dtypes.compute, dtypes.params, dtypes.mixed) == (matmul, weights, matmul != weights)
    if "mixed" in name:
        assert precision_dtypes(MixedPrecision(name, "cpu")) == dtypes


def test_autocast_can_be_left_to_the_strategy() -> None:
    plugin = BF16MixedPrecision()
    assert isinstance(plugin, AutocastSwitch) and plugin.autocast
    plugin.autocast = False  # FSDP2 gathers bf16 weights: no autocast on top
    with plugin.forward_context():
        assert not torch.is_autocast_enabled("cpu")
        assert torch.nn.Linear(2, 2)(torch.ones(1, 2)).dtype == torch.float32


def test_lightning_refuses_plugin_and_precision_flag_together() -> None:
    # The CLI must map `precision:` onto a plugin, not pass both.
    with pytest.raises(ValueError, match="Received both"):
        L.Trainer(accelerator="cpu", plugins=[FP16MixedPrecision()], precision="bf16-mixed")


def test_plugin_from_yaml_class_path(tmp_path) -> None:
    plugin = {
        "class_path": "plugintrain.precision_plugins.FP16MixedPrecision",
        "init_args": {"growth_interval": 7},
    }
    cli = LightningCLI(
        TinyModel,
        run=False,
        args={"trainer": {"plugins": [plugin], "accelerator": "cpu", "logger": False}},
        save_config_callback=None,
    )
    assert isinstance(cli.trainer.precision_plugin, FP16MixedPrecision)
    assert cli.trainer.precision_plugin.loss_scaler.growth_interval == 7


class _CastCounter(TorchDispatchMode):
    """Counts fp32 -> low-precision casts of tensors with a given shape (weight casts)."""

    def __init__(self, shape: torch.Size) -> None:
        super().__init__()
        self.shape, self.casts = shape, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        weight_like = args and args[0].shape == self.shape and args[0].dtype == torch.float32
        if func is torch.ops.aten._to_copy.default and weight_like:
            self.casts += 1
        return func(*args, **(kwargs or {}))


def _weight_casts(plugin) -> int:
    """Casts of a weight used three times in one forward, under ``plugin``."""
    linear = nn.Linear(8, 8, bias=False)
    x = torch.randn(2, 8)
    with _CastCounter(linear.weight.shape) as counter, plugin.forward_context():
        linear(linear(linear(x))).sum().backward()
    return counter.casts


def test_weight_is_cast_once_per_step_not_per_use() -> None:
    assert _weight_casts(MixedPrecision("bf16-mixed", "cpu")) == 3  # Lightning: cache off
    assert _weight_casts(BF16MixedPrecision(device="cpu")) == 1
    assert _weight_casts(FP16MixedPrecision(device="cpu")) == 1


def test_scaler_skips_on_inf_and_grows_after_clean_steps() -> None:
    scaler = DynamicLossScaler(init_scale=8.0, growth_interval=2)
    grads = [torch.tensor([16.0, 8.0]), torch.tensor([float("inf")])]
    assert scaler.unscale_(grads).item() == 1.0
    assert grads[0].tolist() == [2.0, 1.0]
    scaler.update(found_inf=True)
    assert (scaler.scale, scaler.skipped_steps) == (4.0, 1)
    scaler.update(found_inf=False)
    assert scaler.scale == 4.0
    scaler.update(found_inf=False)
    assert (scaler.scale, scaler.clean_steps) == (8.0, 0)


class _ParamHistory(L.Callback):
    def __init__(self) -> None:
        self.params: list[torch.Tensor] = []
        self.scales: list[float] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.params.append(nn.utils.parameters_to_vector(pl_module.parameters()).detach().clone())
        self.scales.append(trainer.precision_plugin.loss_scaler.scale)


def test_fp16_trainer_skips_injected_inf_step_and_grows() -> None:
    history = _ParamHistory()
    plugin = FP16MixedPrecision(init_scale=1024.0, growth_interval=2)
    trainer = _trainer(plugin, max_steps=5, callbacks=[history], gradient_clip_val=1.0)
    trainer.fit(TinyModel(inf_at=(1,)), _loader(5))
    assert torch.equal(history.params[0], history.params[1])  # step 1 skipped
    assert not torch.equal(history.params[1], history.params[2])
    # 1024 -> clean (1 of 2) -> inf: 512 -> clean -> clean: 1024 -> clean
    assert history.scales == [1024.0, 512.0, 512.0, 1024.0, 1024.0]
    assert plugin.loss_scaler.skipped_steps == 1


def test_scale_survives_checkpoint_and_resume(tmp_path) -> None:
    plugin = FP16MixedPrecision(init_scale=1024.0, growth_interval=100)
    trainer = _trainer(plugin, max_steps=2)
    trainer.fit(TinyModel(inf_at=(0,)), _loader(4))
    path = tmp_path / "fp16.ckpt"
    trainer.save_checkpoint(path)
    assert torch.load(path, weights_only=True)["FP16MixedPrecision"]["scale"] == 512.0

    resumed = FP16MixedPrecision(init_scale=1024.0, growth_interval=100)
    history = _ParamHistory()
    _trainer(resumed, max_steps=3, callbacks=[history]).fit(TinyModel(), _loader(4), ckpt_path=path)
    assert history.scales == [512.0]
    assert (resumed.loss_scaler.clean_steps, resumed.loss_scaler.skipped_steps) == (2, 1)


def test_single_process_clipping_matches_torch() -> None:
    torch.manual_seed(0)
    params = [nn.Parameter(torch.randn(3, 4)), nn.Parameter(torch.randn(5))]
    for param in params:
        param.grad = torch.randn_like(param) * 10
    reference = [nn.Parameter(p.detach().clone()) for p in params]
    for ref, param in zip(reference, params, strict=True):
        ref.grad = param.grad.clone()
    expected_norm = nn.utils.clip_grad_norm_(reference, 1.0)
    norm = clip_grads_by_global_norm_(default_gradient_layout(params), 1.0)
    torch.testing.assert_close(norm, expected_norm)
    for param, ref in zip(params, reference, strict=True):
        torch.testing.assert_close(param.grad, ref.grad)
