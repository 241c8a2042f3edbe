"""GPT-2 (Radford et al. 2019): presets, Hugging Face weight adapter, tensor-parallel plan."""

from typing import Any

from plugintrain.model_zoo.config import TransformerConfig, register_preset
from plugintrain.model_zoo.family_spec import FamilySpec, GGUFLayout
from plugintrain.model_zoo.weight_plans import (
    Plan,
    chunk_of,
    concatenated,
    renamed,
    same,
    transposed,
)


def _gpt2(name: str, n_layer: int, n_head: int, n_embd: int, block_size: int = 1024) -> None:
    register_preset(
        TransformerConfig(
            name=name,
            family="gpt2",
            vocab_size=50257,
            block_size=block_size,
            n_layer=n_layer,
            n_head=n_head,
            n_embd=n_embd,
            bias=True,
            norm="layernorm",
            norm_eps=1e-5,
            mlp="gelu",
            position="learned",
            tie_embeddings=True,
        )
    )


_gpt2("gpt2-124m", n_layer=12, n_head=12, n_embd=768)
_gpt2("gpt2-350m", n_layer=24, n_head=16, n_embd=1024)
_gpt2("gpt2-774m", n_layer=36, n_head=20, n_embd=1280)
_gpt2("gpt2-1.5b", n_layer=48, n_head=25, n_embd=1600)
# Tiny CPU model (~7M parameters, mostly the embedding): learns Shakespeare in minutes.
_gpt2("gpt2-debug", n_layer=4, n_head=4, n_embd=128, block_size=256)


def hf_key(key: str) -> str:
    """A ``GPT2Model`` key (no ``transformer.`` prefix) as ``GPT2LMHeadModel`` names it."""
    return key if key.startswith(("transformer.", "lm_head.")) else f"transformer.{key}"


# Our module -> Hugging Face module, inside one block (``Conv1D`` weights are transposed).
_NORMS = {"attention_norm": "ln_1", "ffn_norm": "ln_2"}
_CONV1DS = {
    "attention.wo": "attn.c_proj",
    "feed_forward.w1": "mlp.c_fc",
    "feed_forward.w2": "mlp.c_proj",
}
_QKV = ("wq", "wk", "wv")
HF_CONV1D = ("attn.c_attn", *_CONV1DS.values())
"""The Hugging Face modules stored as ``Conv1D``: ``(in, out)`` weights."""


def hf_import_plan(config: TransformerConfig) -> Plan:
    """Our tensors from a Hugging Face ``GPT2LMHeadModel``'s (names as its state dict has
    them). Hugging Face stores the Linear layers as ``Conv1D`` with transposed weights
    ``(in, out)`` and fuses the query, key and value projections into ``c_attn``."""
    hf = "transformer."
    plan = renamed(
        {
            "tok_embeddings.weight": f"{hf}wte.weight",
            "pos_embeddings.weight": f"{hf}wpe.weight",
            "norm.weight": f"{hf}ln_f.weight",
            "norm.bias": f"{hf}ln_f.bias",
            "output.weight": f"{hf}wte.weight" if config.tie_embeddings else "lm_head.weight",
        }
    )
    for i in range(config.n_layer):
        ours, theirs = f"layers.{i}.", f"{hf}h.{i}."
        for new, old in _NORMS.items():
            for kind in ("weight", "bias"):
                plan[f"{ours}{new}.{kind}"] = same(f"{theirs}{old}.{kind}")
        for new, old in _CONV1DS.items():
            plan[f"{ours}{new}.weight"] = transposed(f"{theirs}{old}.weight")
            plan[f"{ours}{new}.bias"] = same(f"{theirs}{old}.bias")
        for j, name in enumerate(_QKV):  # c_attn: (C, 3C) = [q | k | v] columns
            qkv = f"{theirs}attn.c_attn."
            plan[f"{ours}attention.{name}.weight"] = chunk_of(f"{qkv}weight", j, 3, transpose=True)
            plan[f"{ours}attention.{name}.bias"] = chunk_of(f"{qkv}bias", j, 3)
    return plan


def hf_export_plan(config: TransformerConfig) -> Plan:
    """Hugging Face ``GPT2LMHeadModel`` tensors from ours; the inverse of
    :func:`hf_import_plan` (a tied head is left out, as ``save_pretrained`` does).

    Raises:
        ValueError: If ``config`` has query/key norms or heads whose widths do not add up
            to ``n_embd``: ``c_attn`` holds three ``n_embd``-wide projections, nothing else.
    """
    if config.qk_norm or config.n_head * config.head_dim != config.n_embd:
        raise ValueError(
            f"{config.name}: a Hugging Face GPT-2 needs n_head * head_dim == n_embd and no"
            f" query/key norms, got n_head={config.n_head}, head_dim={config.head_dim},"
            f" n_embd={config.n_embd}, qk_norm={config.qk_norm}; drop head_size and qk_norm."
        )
    hf = "transformer."
    plan = renamed(
        {
            f"{hf}wte.weight": "tok_embeddings.weight",
            f"{hf}wpe.weight": "pos_embeddings.weight",
            f"{hf}ln_f.weight": "norm.weight",
            f"{hf}ln_f.bias": "norm.bias",
        }
    )
    if not config.tie_embeddings:
        plan["lm_head.weight"] = same("output.weight")
    for i in range(config.n_layer):
        ours, theirs = f"layers.{i}.", f"{hf}h.{i}."
        for new, old in _NORMS.items():
            for kind in ("weight", "bias"):
                plan[f"{theirs}{old}.{kind}"] = same(f"{ours}{new}.{kind}")
        for new, old in _CONV1DS.items():
            plan[f"{theirs}{old}.weight"] = transposed(f"{ours}{new}.weight")
            plan[f"{theirs}{old}.bias"] = same(f"{ours}{new}.bias")
        for kind in ("weight", "bias"):
            sources = [f"{ours}attention.{name}.{kind}" for name in _QKV]
            plan[f"{theirs}attn.c_attn.{kind}"] = concatenated(sources, transpose=kind == "weight")
    return plan


def from_hf_config(hf: dict[str, Any], name: str) -> TransformerConfig:
    """Our config for a Hugging Face ``GPT2Config`` (as its ``config.json`` holds it).

    Raises:
        ValueError: For a GPT-2 variant our model does not build (another activation,
            unscaled or per-layer-scaled attention).
    """
    variants = {
        "activation_function": (
            hf.get("activation_function", "gelu_new"),
            ("gelu_new", "gelu_pytorch_tanh"),
        ),
        "scale_attn_weights": (hf.get("scale_attn_weights", True), (True,)),
        "scale_attn_by_inverse_layer_idx": (
            hf.get("scale_attn_by_inverse_layer_idx", False),
            (False,),
        ),
    }
    bad = {key: value for key, (value, allowed) in variants.items() if value not in allowed}
    if bad:
        raise ValueError(f"{name}: plugintrain's GPT-2 does not build {bad}.")
    return TransformerConfig(
        name=name,
        family="gpt2",
        vocab_size=hf["vocab_size"],
        block_size=hf.get("n_positions", 1024),
        n_layer=hf["n_layer"],
        n_head=hf["n_head"],
        n_embd=hf["n_embd"],
        intermediate_size=hf.get("n_inner"),
        norm_eps=hf.get("layer_norm_epsilon", 1e-5),
        tie_embeddings=hf.get("tie_word_embeddings", True),
    )


def to_hf_config(config: TransformerConfig) -> dict[str, Any]:
    """The ``config.json`` of a Hugging Face ``GPT2LMHeadModel`` with ``config``'s shape."""
    return {
        "architectures": ["GPT2LMHeadModel"],
        "model_type": "gpt2",
        "vocab_size": config.vocab_size,
        "n_positions": config.block_size,
        "n_ctx": config.block_size,
        "n_embd": config.n_embd,
        "n_layer": config.n_layer,
        "n_head": config.n_head,
        "n_inner": config.ffn_dim,
        "activation_function": "gelu_new",
        "layer_norm_epsilon": config.norm_eps,
        "tie_word_embeddings": config.tie_embeddings,
    }


def tp_plan(config: TransformerConfig | None = None) -> dict[str, str]:
    """Tensor/sequence-parallel plan, as data: module path pattern -> style name.

    ``colwise`` shards a Linear's output features (heads, FFN hidden units), ``rowwise`` its
    input features (then all-reduces, or reduce-scatters with sequence parallelism).
    ``vocab_embedding`` / ``vocab_head`` shard the vocabulary of the token embedding and the
    LM head (the same split, so a tied weight stays tied). ``tp_input`` marks the input of a
    block of column-parallel Linears as one replicated tensor (all-gathered from sequence
    shards with SP). ``sequence_parallel`` and ``sequence_scatter`` apply only with sequence
    parallelism: norms run on sequence shards, and the embedding dropout is where the
    sequence gets split (after the learned positions are added). Unlisted modules
    (``pos_embeddings``) stay replicated. ``plugintrain.strategies.tensor_parallel`` maps
    the names to torch ParallelStyles.
    """
    return {
        "tok_embeddings": "vocab_embedding",
        "dropout": "sequence_scatter",
        "layers.*.attention_norm": "sequence_parallel",
        "layers.*.attention": "tp_input",
        "layers.*.attention.wq": "colwise",
        "layers.*.attention.wk": "colwise",
        "layers.*.attention.wv": "colwise",
        "layers.*.attention.wo": "rowwise",
        "layers.*.ffn_norm": "sequence_parallel",
        "layers.*.feed_forward": "tp_input",
        "layers.*.feed_forward.w1": "colwise",
        "layers.*.feed_forward.w2": "rowwise",
        "norm": "sequence_parallel",
        "output": "vocab_head",
    }


# Hugging Face module in a block -> llama.cpp's tensor kind (its GPT-2 converter).
_GGUF_BLOCK = {
    "ln_1": "attn_norm",
    "attn.c_attn": "attn_qkv",
    "attn.c_proj": "attn_output",
    "ln_2": "ffn_norm",
    "mlp.c_fc": "ffn_up",
    "mlp.c_proj": "ffn_down",
}
GGUF = GGUFLayout(
    architecture="gpt2",
    tensors={
        "transformer.wte.weight": "token_embd.weight",
        "transformer.wpe.weight": "position_embd.weight",
        "transformer.ln_f.weight": "output_norm.weight",
        "transformer.ln_f.bias": "output_norm.bias",
        "lm_head.weight": "output.weight",
        **{
            f"transformer.h.{{i}}.{module}.{kind}": f"blk.{{i}}.{gguf}.{kind}"
            for module, gguf in _GGUF_BLOCK.items()
            for kind in ("weight", "bias")
        },
    },
    config={
        "context_length": "n_positions",
        "embedding_length": "n_embd",
        "block_count": "n_layer",
        "feed_forward_length": "n_inner",
        "attention.head_count": "n_head",
        "vocab_size": "vocab_size",
        "attention.layer_norm_epsilon": "layer_norm_epsilon",
    },
)


SPEC = FamilySpec(
    name="gpt2",
    hf_model_type="gpt2",
    tp_plan=tp_plan,
    hf_import_plan=hf_import_plan,
    hf_export_plan=hf_export_plan,
    from_hf_config=from_hf_config,
    to_hf_config=to_hf_config,
    gguf=GGUF,
    hf_conv1d=HF_CONV1D,
    hf_key=hf_key,
)
