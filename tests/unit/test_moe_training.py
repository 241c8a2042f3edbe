"""Training a mixture of experts: bias balancing, routing under recomputation, the balance
loss and the routing statistics, against plain-torch references."""

from __future__ import annotations

import dataclasses

import lightning as L
import pytest
import torch
import torch.nn.functional as F

from plugintrain.model_zoo import CausalLM, MoEConfig, Transformer, TransformerConfig
from plugintrain.model_zoo.moe import MoE
from plugintrain.model_zoo.routing_stats import reduce_routing, routing_step
from plugintrain.strategies.blocks import recompute


def _config(**moe: object) -> TransformerConfig:
    base = TransformerConfig.from_name("deepseek-v3-debug")
    fields = dict(n_routed_experts=8, top_k=2, moe_intermediate_size=16, n_shared_experts=1,
                  first_k_dense=1, n_group=1, topk_group=1)  # fmt: skip
    return dataclasses.replace(
        base,
        vocab_size=97,
        block_size=32,
        n_layer=3,
        n_embd=64,
        intermediate_size=48,
        moe=MoEConfig(**(fields | moe)),
    )


def _skewed_tokens(layer: MoE, n: int = 512) -> torch.Tensor:
    """Tokens leaning towards experts 0 and 1: most tokens' top-2 are those two."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(n, layer.router.weight.size(1), generator=gen)
    favored = layer.router.weight[:2].sum(dim=0)
    return (x + 3 * favored / favored.norm()).unsqueeze(0)  # (1, n, C)


def _imbalance(indices: torch.Tensor, experts: int) -> float:
    """Busiest expert's load over the mean load, from the chosen experts alone."""
    load = torch.bincount(indices.flatten(), minlength=experts).float()
    return float(load.max() / load.mean())


def _balance_curve(rate: float, steps: int) -> list[float]:
    torch.manual_seed(0)
    config = _config(bias_update_rate=rate)
    layer = Transformer(config).layers["1"].feed_forward
    x = _skewed_tokens(layer)
    chosen: list[torch.Tensor] = []
    layer.router.register_forward_hook(lambda m, i, out: chosen.append(out[1]))
    curve = []
    for _ in range(steps):
        with torch.enable_grad():
            layer(x)
        curve.append(_imbalance(chosen[-1], config.moe.n_routed_experts))
        if rate:
            layer.update_bias(layer.tokens_per_expert)
        layer.reset_counts()
    return curve


def test_bias_balancing_drives_the_load_of_a_skewed_input_towards_one() -> None:
    balanced = _balance_curve(rate=0.01, steps=120)
    unbalanced = _balance_curve(rate=0.0, steps=120)
    assert balanced[0] == unbalanced[0] > 2.5  # the same skewed start
    assert min(unbalanced) > 2.5  # nothing moves without the bias
    assert sum(balanced[-10:]) / 10 < 1.3
    # The curve comes down: each stretch of 20 steps is more balanced than the first.
    means = [sum(balanced[i : i + 20]) / 20 for i in range(0, 120, 20)]
    assert all(later < means[0] for later in means[1:])


def test_bias_picks_experts_but_the_weights_stay_the_scores() -> None:
    torch.manual_seed(0)
    layer = Transformer(_config()).layers["1"].feed_forward
    x = torch.randn(64, 64)
    layer.router.expert_bias.copy_(torch.linspace(-1.0, 1.0, 8))
    weights, indices, _ = layer.router(x)
    scores = torch.sigmoid(x @ layer.router.weight.t())  # plain torch, no bias
    expected = scores.gather(1, indices)
    expected = expected / expected.sum(dim=1, keepdim=True)
    torch.testing.assert_close(weights, expected)
    unbiased = scores.topk(2, dim=1).indices.sort(dim=1).values
    assert not torch.equal(indices.sort(dim=1).values, unbiased)  # the bias did choose


@pytest.mark.parametrize("mode", ["full", "selective"])
def test_recomputed_forward_routes_as_the_first_one(mode: str) -> None:
    torch.manual_seed(0)
    config = _config(aux_loss_coeff=0.01)
    reference = Transformer(config)
    model = Transformer(config)
    model.load_state_dict(reference.state_dict())
    calls: dict[str, list[torch.Tensor]] = {}
    for key, layer in model.moe_layers():
        recompute(model.layers[key], mode)
        layer.router.register_forward_hook(
            lambda m, i, out, key=key: calls.setdefault(key, []).append(out[1].clone())
        )
    tokens = torch.randint(0, 97, (2, 16))
    for net in (reference, model):
        loss = F.cross_entropy(net(tokens).flatten(0, 1), tokens.flatten())
        (loss + net.take_aux_loss()).backward()
    for key, chosen in calls.items():
        assert len(chosen) == 2  # the forward and its recomputation in backward
        assert torch.equal(chosen[0], chosen[1])
        # Counted once: every token's top-2 picks, not twice.
        assert model.layers[key].feed_forward.tokens_per_expert.sum() == 2 * 16 * 2
    for (name, p), q in zip(model.named_parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, msg=name)


def test_balance_loss_equals_the_papers_formula() -> None:
    torch.manual_seed(0)
    config = _config(aux_loss_coeff=0.1)
    layer = Transformer(config).layers["1"].feed_forward
    x = torch.randn(3, 10, 64)
    layer(x)
    loss = layer.take_aux_loss()
    # DeepSeek-V3 eq. 17-20 by loops: f_i = E / (K T) * #picks of i, P_i = mean of s'_i.
    scores = torch.sigmoid(x @ layer.router.weight.t())  # (B, T, E)
    picks = (scores + layer.router.expert_bias).topk(2, dim=-1).indices
    total = 0.0
    for b in range(3):
        share = scores[b] / scores[b].sum(dim=-1, keepdim=True)
        for i in range(8):
            f = 8 / (2 * 10) * float((picks[b] == i).sum())
            total += f * float(share[:, i].mean())
    assert float(loss) == pytest.approx(0.1 * total / 3, rel=1e-5)


def test_routing_statistics_and_bias_update_of_one_step() -> None:
    torch.manual_seed(0)
    config = _config(bias_update_rate=0.5)
    model = Transformer(config)
    chosen: dict[int, torch.Tensor] = {}
    for key, layer in model.moe_layers():
        layer.router.register_forward_hook(
            lambda m, i, out, key=int(key): chosen.__setitem__(key, out[1])
        )
    with torch.enable_grad():
        model(torch.randint(0, 97, (4, 16)))
    layers = {int(key): layer for key, layer in model.moe_layers()}
    stats = reduce_routing(layers, config.n_layer, 8)
    assert stats.layers == [1, 2]
    for row, key in enumerate(stats.layers):
        load = torch.bincount(chosen[key].flatten(), minlength=8).float()
        torch.testing.assert_close(stats.load[row], load / load.sum())
        assert float(stats.imbalance[row]) == pytest.approx(_imbalance(chosen[key], 8))
    metrics = routing_step(layers, config.n_layer, 8).metrics()
    for key, layer in layers.items():
        load = torch.bincount(chosen[key].flatten(), minlength=8).float()
        step = 0.5 * torch.sign(load.mean() - load)
        torch.testing.assert_close(layer.router.expert_bias, step - step.mean())
        assert layer.tokens_per_expert.sum() == 0  # counters restart for the next step
    assert metrics["moe/imbalance_max"] == pytest.approx(float(stats.imbalance.max()))


def test_causal_lm_trains_with_the_balance_loss_and_logs_routing(tmp_path) -> None:
    torch.manual_seed(0)
    config = _config(aux_loss_coeff=0.01, bias_update_rate=0.01)
    module = CausalLM(config, warmup_steps=1, lr_decay_steps=10)
    tokens = torch.randint(0, 97, (6, 16))
    data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(tokens, tokens), batch_size=2)
    trainer = L.Trainer(
        max_steps=3,
        accelerator="cpu",
        logger=L.pytorch.loggers.CSVLogger(tmp_path),
        log_every_n_steps=1,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(module, train_dataloaders=data)
    logged = trainer.logged_metrics
    for tag in ("moe/imbalance", "moe/aux_loss", "moe/bias_norm", "moe/layer2/max_load"):
        assert tag in logged
    assert float(logged["moe/aux_loss"]) > 0
    for _, layer in module.model.moe_layers():
        assert layer.router.expert_bias.abs().sum() > 0  # balancing moved the biases


class _BiasAtBatchEnd(L.Callback):
    """What a checkpoint callback saving at ``on_train_batch_end`` would save."""

    def __init__(self) -> None:
        self.before: list[torch.Tensor] = []
        self.after: list[torch.Tensor] = []

    def on_train_batch_start(self, trainer, module, batch, batch_idx) -> None:
        self.before.append(module.model.layers["1"].feed_forward.router.expert_bias.clone())

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx) -> None:
        self.after.append(module.model.layers["1"].feed_forward.router.expert_bias.clone())


def test_callbacks_at_batch_end_see_the_step_s_bias_update(tmp_path) -> None:
    # A checkpoint written by a callback at the end of step N must hold step N's bias, or
    # a run resumed from it routes differently from the uninterrupted one.
    torch.manual_seed(0)
    module = CausalLM(_config(bias_update_rate=0.1), warmup_steps=1, lr_decay_steps=10)
    tokens = torch.randint(0, 97, (6, 16))
    data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(tokens, tokens), batch_size=2)
    seen = _BiasAtBatchEnd()
    trainer = L.Trainer(
        max_steps=3, accelerator="cpu", logger=False, callbacks=[seen],
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
    )  # fmt: skip
    trainer.fit(module, train_dataloaders=data)
    for before, after in zip(seen.before, seen.after, strict=True):
        assert not torch.equal(before, after)  # the update came before the callbacks


def test_routing_stays_fp32_under_bf16() -> None:
    torch.manual_seed(0)
    layer = Transformer(_config()).layers["1"].feed_forward
    layer.router.expert_bias.copy_(torch.linspace(-0.0123456, 0.0123456, 8))
    bias = layer.router.expert_bias.clone()
    x = torch.randn(64, 64)
    reference = layer.router(x)
    with torch.autocast("cpu", dtype=torch.bfloat16):  # bf16-mixed
        weights, indices, scores = layer.router(x)
    assert weights.dtype == scores.dtype == torch.float32
    torch.testing.assert_close(scores, reference[2])
    assert torch.equal(indices, reference[1])
    layer.to(torch.bfloat16)  # bf16-true converts the whole module
    assert layer.router.weight.dtype == torch.bfloat16
    assert torch.equal(layer.router.expert_bias, bias)  # fp32, not rounded through bf16
    assert layer.tokens_per_expert.dtype == torch.float32
