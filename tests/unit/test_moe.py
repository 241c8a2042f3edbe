"""The mixture-of-experts layer against transformers' DeepSeek-V3 and Qwen3-MoE layers,
and its routing, grouped experts, capacity, balance loss and bias updates against plain
PyTorch written out here.

The transformers layers are built from configs spelled out field by field (random
weights, nothing downloaded) and their weights copied into ours by hand: the fused
``gate_up_proj`` ``(E, 2I, C)`` holds each expert's gate rows, then its up rows.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
import transformers
from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3MoE
from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

from plugintrain.model_zoo import MoEConfig, TransformerConfig
from plugintrain.model_zoo.moe import GroupedExperts, MoE, Router

from _hf_models import randomize_

WIDTH = 64
# DeepSeek-V3's routing at small size: 16 experts in 4 groups, a token takes 4 of the
# experts of its 2 best groups; 2 shared experts; weights scaled by 2.5.
DEEPSEEK = MoEConfig(
    n_routed_experts=16, top_k=4, moe_intermediate_size=16, n_shared_experts=2,
    score_func="sigmoid", routed_scaling_factor=2.5, n_group=4, topk_group=2,
)  # fmt: skip


def _config(moe: MoEConfig) -> TransformerConfig:
    return TransformerConfig.from_name("deepseek-v3-debug", n_embd=WIDTH, moe=moe)


def _inputs(seed: int = 0, shape: tuple[int, ...] = (2, 12, WIDTH)) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed))


def _hf_deepseek(moe: MoEConfig) -> DeepseekV3MoE:
    config = transformers.DeepseekV3Config(
        hidden_size=WIDTH, n_routed_experts=moe.n_routed_experts, num_experts_per_tok=moe.top_k,
        moe_intermediate_size=moe.moe_intermediate_size, n_shared_experts=moe.n_shared_experts,
        routed_scaling_factor=moe.routed_scaling_factor, n_group=moe.n_group,
        topk_group=moe.topk_group, norm_topk_prob=moe.norm_topk_prob,
    )  # fmt: skip
    return randomize_(DeepseekV3MoE(config), seed=1)


def _hf_qwen(moe: MoEConfig) -> Qwen3MoeSparseMoeBlock:
    config = transformers.Qwen3MoeConfig(
        hidden_size=WIDTH, num_experts=moe.n_routed_experts, num_experts_per_tok=moe.top_k,
        moe_intermediate_size=moe.moe_intermediate_size, norm_topk_prob=moe.norm_topk_prob,
    )  # fmt: skip
    return randomize_(Qwen3MoeSparseMoeBlock(config), seed=1)


def _hand_mapping(theirs: dict[str, torch.Tensor], inter: int) -> dict[str, torch.Tensor]:
    """Our tensor names -> tensors of a transformers layer (its weights or their gradients):
    the fused ``gate_up_proj`` is cut into the gate and up projections."""
    gate_up = theirs["experts.gate_up_proj"]
    ours = {
        "router.weight": theirs["gate.weight"],
        "experts.w1": gate_up[:, :inter],
        "experts.w3": gate_up[:, inter:],
        "experts.w2": theirs["experts.down_proj"],
    }
    for w, hf in (("w1", "gate_proj"), ("w3", "up_proj"), ("w2", "down_proj")):
        if f"shared_experts.{hf}.weight" in theirs:
            ours[f"shared_experts.{w}.weight"] = theirs[f"shared_experts.{hf}.weight"]
    return ours


@torch.no_grad()
def _ours_from(hf: torch.nn.Module, moe: MoEConfig) -> MoE:
    ours = MoE(_config(moe)).eval()
    params = dict(ours.named_parameters())
    weights = _hand_mapping(dict(hf.named_parameters()), moe.moe_intermediate_size)
    assert weights.keys() == params.keys()
    for name, tensor in weights.items():
        params[name].copy_(tensor)
    if hasattr(hf.gate, "e_score_correction_bias"):
        ours.router.expert_bias.copy_(hf.gate.e_score_correction_bias)
    return ours


def _as_sets(indices: torch.Tensor) -> list[set[int]]:
    return [set(row) for row in indices.tolist()]


def _sorted_by_expert(weights: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
    return weights.gather(1, indices.argsort(dim=1))


def _assert_same_layer(hf: torch.nn.Module, ours: MoE) -> None:
    """Outputs, and gradients of the input and every weight after the same backward."""
    x = _inputs()
    x_hf, x_ours = x.clone().requires_grad_(), x.clone().requires_grad_()
    y_hf, y_ours = hf(x_hf), ours(x_ours)
    torch.testing.assert_close(y_ours, y_hf, atol=1e-5, rtol=1e-5)
    probe = torch.randn(y_hf.shape, generator=torch.Generator().manual_seed(2))
    (y_hf * probe).sum().backward()
    (y_ours * probe).sum().backward()
    torch.testing.assert_close(x_ours.grad, x_hf.grad, atol=1e-5, rtol=1e-5)
    hf_grads = {name: p.grad for name, p in hf.named_parameters()}
    expected = _hand_mapping(hf_grads, ours.moe.moe_intermediate_size)
    for name, param in ours.named_parameters():
        torch.testing.assert_close(param.grad, expected[name], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("norm_topk_prob", [True, False], ids=["normalized", "unnormalized"])
def test_deepseek_v3_layer_equals_transformers(norm_topk_prob: bool) -> None:
    moe = MoEConfig(**{**vars(DEEPSEEK), "norm_topk_prob": norm_topk_prob})
    hf = _hf_deepseek(moe)
    assert hf.gate.e_score_correction_bias.abs().min() > 0  # a bias that takes part
    _assert_same_layer(hf, _ours_from(hf, moe))


@pytest.mark.parametrize("norm_topk_prob", [True, False], ids=["normalized", "unnormalized"])
def test_qwen3_moe_layer_equals_transformers(norm_topk_prob: bool) -> None:
    moe = MoEConfig(n_routed_experts=8, top_k=2, moe_intermediate_size=16, score_func="softmax",
                    norm_topk_prob=norm_topk_prob)  # fmt: skip
    hf = _hf_qwen(moe)
    _assert_same_layer(hf, _ours_from(hf, moe))


@torch.no_grad()
def test_deepseek_v3_routing_chooses_transformers_experts() -> None:
    """Per token the same set of experts as ``DeepseekV3TopkRouter``, with the same weights;
    and the inputs are such that the group limit and the bias both decide some choices."""
    hf = _hf_deepseek(DEEPSEEK)
    ours = _ours_from(hf, DEEPSEEK)
    x = _inputs(shape=(64, WIDTH))
    _, hf_weights, hf_indices = hf.gate(x)
    weights, indices, scores = ours.router(x)
    assert _as_sets(indices) == _as_sets(hf_indices)
    torch.testing.assert_close(
        _sorted_by_expert(weights, indices), _sorted_by_expert(hf_weights, hf_indices)
    )
    ungrouped = (scores + ours.router.expert_bias).topk(4).indices
    assert _as_sets(ungrouped) != _as_sets(indices)  # the group limit decides some
    ours.router.expert_bias.zero_()
    assert _as_sets(ours.router(x)[1]) != _as_sets(indices)  # and the bias some


@torch.no_grad()
def test_qwen3_moe_routing_chooses_transformers_experts() -> None:
    moe = MoEConfig(n_routed_experts=8, top_k=2, moe_intermediate_size=16, score_func="softmax")
    hf = _hf_qwen(moe)
    ours = _ours_from(hf, moe)
    x = _inputs(shape=(64, WIDTH))
    _, hf_weights, hf_indices = hf.gate(x)
    weights, indices, _ = ours.router(x)
    assert _as_sets(indices) == _as_sets(hf_indices)
    torch.testing.assert_close(
        _sorted_by_expert(weights, indices), _sorted_by_expert(hf_weights, hf_indices)
    )


@pytest.mark.parametrize("norm_topk_prob", [True, False], ids=["normalized", "unnormalized"])
@torch.no_grad()
def test_routing_bias_chooses_experts_but_never_weighs_them(norm_topk_prob: bool) -> None:
    """Auxiliary-loss-free balancing (DeepSeek-V3, section 2.1.2): a large bias changes the
    choice, but each chosen expert's weight is still its sigmoid score (normalized over
    the chosen ones), computed here by hand."""
    moe = MoEConfig(n_routed_experts=8, top_k=2, routed_scaling_factor=2.5,
                    norm_topk_prob=norm_topk_prob)  # fmt: skip
    router = Router(WIDTH, moe)
    gen = torch.Generator().manual_seed(0)
    router.weight.copy_(torch.randn(router.weight.shape, generator=gen) * 0.1)
    x = _inputs(shape=(64, WIDTH))
    sigmoid = torch.sigmoid(x @ router.weight.T)  # (N, E), by hand

    def expected(indices: torch.Tensor) -> torch.Tensor:
        chosen = sigmoid.gather(1, indices)
        return 2.5 * (chosen / chosen.sum(dim=1, keepdim=True) if norm_topk_prob else chosen)

    plain_weights, plain = router(x)[:2]
    router.expert_bias.copy_(torch.randn(8, generator=gen))  # >> the scores' spread
    biased_weights, biased = router(x)[:2]
    changed = [a != b for a, b in zip(_as_sets(plain), _as_sets(biased), strict=True)]
    kept = [bool(a & b) for a, b in zip(_as_sets(plain), _as_sets(biased), strict=True)]
    assert any(changed) and any(c and k for c, k in zip(changed, kept, strict=True))
    torch.testing.assert_close(plain_weights, expected(plain))
    torch.testing.assert_close(biased_weights, expected(biased))
    if not norm_topk_prob:  # an expert chosen both times has the very same weight
        for n, (a, b) in enumerate(zip(plain.tolist(), biased.tolist(), strict=True)):
            for e in set(a) & set(b):
                assert plain_weights[n, a.index(e)] == biased_weights[n, b.index(e)]


def _swiglu(x: torch.Tensor, w1: torch.Tensor, w3: torch.Tensor, w2: torch.Tensor):
    return (F.silu(x @ w1.T) * (x @ w3.T)) @ w2.T


@pytest.mark.parametrize("counts", [[3, 0, 5, 1], [0, 0, 9, 0], [2, 2, 2, 2]])
def test_grouped_experts_equal_a_loop_over_experts(counts: list[int]) -> None:
    """Outputs and every gradient, also of an expert that gets no token (zeros)."""
    torch.manual_seed(0)
    experts = GroupedExperts(8, 12, len(counts))
    for param in experts.parameters():
        torch.nn.init.normal_(param, std=0.3)
    reference = [p.detach().clone().requires_grad_() for p in (experts.w1, experts.w3, experts.w2)]
    x = torch.randn(sum(counts), 8)
    x_ours, x_ref = x.clone().requires_grad_(), x.clone().requires_grad_()
    y = experts(x_ours, torch.tensor(counts))
    pieces = x_ref.split(counts)
    y_ref = torch.cat([_swiglu(pieces[e], *(w[e] for w in reference)) for e in range(len(counts))])
    torch.testing.assert_close(y, y_ref)
    probe = torch.randn(y.shape)
    (y * probe).sum().backward()
    (y_ref * probe).sum().backward()
    torch.testing.assert_close(x_ours.grad, x_ref.grad)
    for ours, ref in zip((experts.w1, experts.w3, experts.w2), reference, strict=True):
        torch.testing.assert_close(ours.grad, ref.grad)
    idle = [e for e, c in enumerate(counts) if c == 0]
    assert all(experts.w1.grad[e].abs().sum() == 0 for e in idle)


def test_capacity_factor_keeps_each_expert_s_first_tokens() -> None:
    """Capacity ``ceil(0.7 x 16 tokens x 2 / 4 experts) = ceil(5.6) = 6``: each expert keeps
    its first 6 tokens in token order (a hand-written loop here); the rest are counted as
    dropped."""
    moe = MoEConfig(n_routed_experts=4, top_k=2, moe_intermediate_size=16, score_func="softmax",
                    capacity_factor=0.7)  # fmt: skip
    torch.manual_seed(0)
    layer = MoE(_config(moe)).train()
    with torch.no_grad():
        for param in layer.parameters():
            param.normal_(std=0.3)
    x = _inputs(shape=(1, 16, WIDTH))
    y = layer(x)[0]
    with torch.no_grad():
        flat = x[0]
        weights, indices = (flat @ layer.router.weight.T).softmax(dim=-1).topk(2)
        weights = weights / weights.sum(dim=-1, keepdim=True)
        expected, kept, dropped = torch.zeros_like(flat), [0] * 4, 0
        for n in range(16):
            for j, e in enumerate(indices[n].tolist()):
                if kept[e] == 6:
                    dropped += 1
                    continue
                kept[e] += 1
                w = (layer.experts.w1[e], layer.experts.w3[e], layer.experts.w2[e])
                expected[n] += weights[n, j] * _swiglu(flat[n], *w)
    assert dropped > 0
    assert layer.dropped_tokens.item() == dropped
    routed = torch.bincount(indices.flatten(), minlength=4)  # before the drops
    assert layer.tokens_per_expert.tolist() == routed.tolist()
    torch.testing.assert_close(y, expected)
    with torch.no_grad():  # evaluation forwards count nothing
        layer(x)
    assert layer.dropped_tokens.item() == dropped


def test_sequence_balance_loss_is_deepseek_v3_s_formula() -> None:
    """``alpha * sum_i f_i P_i`` per sequence (DeepSeek-V3, eqs. 17-20), averaged over the
    batch: ``f_i = E / (K T) x`` the sequence's picks of expert i, ``P_i`` the mean over
    the sequence of its score normalized over all experts."""
    moe = MoEConfig(n_routed_experts=4, top_k=2, moe_intermediate_size=16, aux_loss_coeff=0.01)
    torch.manual_seed(0)
    layer = MoE(_config(moe)).train()
    with torch.no_grad():
        layer.router.weight.normal_(std=0.3)
    x = _inputs(shape=(2, 5, WIDTH))
    layer(x)
    loss = layer.take_aux_loss()
    assert layer.take_aux_loss() is None  # taken once
    by_hand = []
    with torch.no_grad():
        for sequence in x:
            scores = torch.sigmoid(sequence @ layer.router.weight.T)  # (T, E)
            picks = scores.topk(2).indices.flatten().tolist()
            total = 0.0
            for i in range(4):
                f = 4 / (2 * 5) * picks.count(i)
                p = (scores[:, i] / scores.sum(dim=1)).mean()
                total += f * p
            by_hand.append(0.01 * total)
    torch.testing.assert_close(loss, torch.stack(by_hand).mean())
    loss.backward()
    assert layer.router.weight.grad.abs().sum() > 0


def test_bias_update_moves_towards_balance_and_recentres() -> None:
    """Loads (6, 1, 1, 0) around their mean 2: the busiest expert's bias goes down by the
    rate, the others up, then all shift by the mean (rate / 2) to keep a zero mean."""
    layer = MoE(_config(MoEConfig(n_routed_experts=4, top_k=2, bias_update_rate=0.01)))
    layer.update_bias(torch.tensor([6, 1, 1, 0]))
    torch.testing.assert_close(
        layer.router.expert_bias, torch.tensor([-0.015, 0.005, 0.005, 0.005])
    )


_DEEPSEEK_FIELDS = {
    "name": "bad", "family": "deepseek_v3", "vocab_size": 96, "block_size": 64, "n_layer": 2,
    "n_head": 4, "n_embd": 64, "norm": "rmsnorm", "mlp": "swiglu", "position": "rope",
    "bias": False, "attention": "mla", "mla": {"kv_lora_rank": 32, "q_lora_rank": None},
}  # fmt: skip


@pytest.mark.parametrize(
    ("moe", "message"),
    [
        ({"n_routed_experts": 8, "top_k": 9}, "top_k=9 is larger than n_routed_experts=8"),
        ({"n_routed_experts": 8, "n_group": 3}, "n_group=3 must divide n_routed_experts=8"),
        ({"n_routed_experts": 8, "n_group": 4, "topk_group": 1, "top_k": 3},
         "top_k=3 exceeds the 2 experts of topk_group=1 groups"),
        ({"score_func": "relu"}, "unknown score_func='relu'"),
        ({"capacity_factor": 0.0}, "capacity_factor=0.0 must be > 0"),
    ],
    ids=["top_k", "n_group", "topk_group", "score_func", "capacity"],
)  # fmt: skip
def test_bad_routing_is_one_line_naming_the_value(moe: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message) as info:
        TransformerConfig.from_dict({**_DEEPSEEK_FIELDS, "moe": moe})
    assert "\n" not in str(info.value)


def test_more_dense_layers_than_layers_is_refused() -> None:
    with pytest.raises(ValueError, match=r"moe\.first_k_dense=3 exceeds n_layer=2"):
        TransformerConfig.from_dict({**_DEEPSEEK_FIELDS, "moe": {"first_k_dense": 3}})
