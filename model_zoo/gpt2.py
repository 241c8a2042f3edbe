"""GPT-2 (Radford et al. 2019): presets, Hugging Face weight adapter, tensor-parallel plan."""

import torch

from plugintrain.model_zoo.config import TransformerConfig, register_preset


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


def from_hf_state_dict(
    state_dict: dict[str, torch.Tensor], config: TransformerConfig
) -> dict[str, torch.Tensor]:
    """Map a Hugging Face ``GPT2LMHeadModel`` (or ``GPT2Model``) state dict to ours.

    Hugging Face stores GPT-2's Linear layers as ``Conv1D`` with transposed weights
    ``(in, out)``, and fuses the query, key and value projections into ``c_attn``.

    Args:
        state_dict: Hugging Face weights.
        config: Our matching architecture.

    Returns:
        A state dict for :class:`~plugintrain.model_zoo.transformer.Transformer`.
    """
    sd = {key.removeprefix("transformer."): value for key, value in state_dict.items()}
    out = {
        "tok_embeddings.weight": sd["wte.weight"],
        "pos_embeddings.weight": sd["wpe.weight"],
        "norm.weight": sd["ln_f.weight"],
        "norm.bias": sd["ln_f.bias"],
        # Absent from checkpoints that tie it to wte.
        "output.weight": sd.get("lm_head.weight", sd["wte.weight"]),
    }
    for i in range(config.n_layer):
        out.update(_block_from_hf(sd, f"h.{i}.", f"layers.{i}."))
    return out


# Our module -> Hugging Face module, inside one block.
_NORMS = {"attention_norm": "ln_1", "ffn_norm": "ln_2"}
_CONV1DS = {
    "attention.wo": "attn.c_proj",
    "feed_forward.w1": "mlp.c_fc",
    "feed_forward.w2": "mlp.c_proj",
}


def _block_from_hf(sd: dict[str, torch.Tensor], hf: str, ours: str) -> dict[str, torch.Tensor]:
    out = {}
    for new, old in _NORMS.items():
        out[f"{ours}{new}.weight"] = sd[f"{hf}{old}.weight"]
        out[f"{ours}{new}.bias"] = sd[f"{hf}{old}.bias"]
    for new, old in _CONV1DS.items():
        out[f"{ours}{new}.weight"] = sd[f"{hf}{old}.weight"].t()  # (in, out) -> (out, in)
        out[f"{ours}{new}.bias"] = sd[f"{hf}{old}.bias"]
    weights = sd[f"{hf}attn.c_attn.weight"].t().chunk(3, dim=0)  # 3 x (C, C)
    biases = sd[f"{hf}attn.c_attn.bias"].chunk(3)  # 3 x (C,)
    for name, weight, bias in zip(("wq", "wk", "wv"), weights, biases, strict=True):
        out[f"{ours}attention.{name}.weight"] = weight
        out[f"{ours}attention.{name}.bias"] = bias
    return out


def tp_plan() -> dict[str, str]:
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
