"""Small random Hugging Face models saved by ``transformers``: independent references and
pretrained bases for tests, nothing downloaded."""

from __future__ import annotations

from pathlib import Path

import torch


def random_hf_llama(
    root: Path,
    vocab: int,
    seed: int = 0,
    tied: bool = False,
    hidden: int = 64,
    intermediate: int = 96,
) -> Path:
    """A random 2-layer Llama (GQA: 4 query, 2 key/value heads) saved at ``root``."""
    import transformers

    torch.manual_seed(seed)
    config = transformers.LlamaConfig(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=intermediate,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        max_position_embeddings=64, tie_word_embeddings=tied, bos_token_id=0, eos_token_id=0,
    )  # fmt: skip
    transformers.LlamaForCausalLM(config).save_pretrained(root)
    return root


def hub_state_dict(
    model: torch.nn.Module | dict[str, torch.Tensor],
) -> dict[str, torch.Tensor]:
    """``model``'s state dict with each fused expert tensor split per expert, as
    ``save_pretrained`` writes it and the Hub holds it: transformers 5 keeps a mixture's
    experts as ``experts.gate_up_proj`` ``(E, 2I, C)`` (gate rows first) and
    ``experts.down_proj`` ``(E, C, I)`` in memory, but saves ``experts.{e}.gate_proj.weight``
    ``(I, C)``, ``...up_proj.weight`` and ``...down_proj.weight`` ``(C, I)``.

    ``model`` may also be a dict of tensors under the model's names (its gradients)."""
    tensors = model if isinstance(model, dict) else model.state_dict()
    out = {}
    for name, value in tensors.items():
        prefix, _, leaf = name.rpartition("experts.")
        if leaf == "gate_up_proj":
            gate, up = value.chunk(2, dim=1)
            for e in range(value.size(0)):
                out[f"{prefix}experts.{e}.gate_proj.weight"] = gate[e]
                out[f"{prefix}experts.{e}.up_proj.weight"] = up[e]
        elif leaf == "down_proj":
            for e in range(value.size(0)):
                out[f"{prefix}experts.{e}.down_proj.weight"] = value[e]
        else:
            out[name] = value
    return out


@torch.no_grad()
def randomize_(model: torch.nn.Module, seed: int) -> torch.nn.Module:
    """Draw every weight of ``model`` at random (in place), returned in eval mode: normal
    matrices (std 0.1), norm weights in [0.5, 1.5) (at one, a norm mapped to the wrong
    tensor would not show) and DeepSeek-V3's routing biases (``e_score_correction_bias``,
    zero after init) normal with std 0.05, the spread of the sigmoid scores, so they change
    which experts are chosen."""
    gen = torch.Generator().manual_seed(seed)
    for name, param in model.named_parameters():
        if "norm" in name:
            param.copy_(torch.rand(param.shape, generator=gen) + 0.5)
        else:
            param.copy_(torch.randn(param.shape, generator=gen) * 0.1)
    for name, buffer in model.named_buffers():
        if name.endswith("e_score_correction_bias"):
            buffer.copy_(torch.randn(buffer.shape, generator=gen) * 0.05)
    return model.eval()


def ours_from_hf(state_dict: dict[str, torch.Tensor], config: object) -> dict[str, torch.Tensor]:
    """A whole Hugging Face state dict under our names, through ``config``'s family import
    plan: what the weight readers do one tensor at a time."""
    from plugintrain.model_zoo.families import family_of
    from plugintrain.model_zoo.weight_plans import apply_plan

    family = family_of(config)
    named = {family.hf_key(key): value for key, value in state_dict.items()}
    return apply_plan(family.hf_import_plan(config), named)
