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
