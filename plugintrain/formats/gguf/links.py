"""Where each Hugging Face tensor lies in a GGUF file, and the layout change between, from
the family's :class:`~plugintrain.model_zoo.family_spec.GGUFLayout`.

llama.cpp's converter permutes each Llama attention head's query and key rows from Hugging
Face's rotate-half RoPE layout to the interleaved one its kernels use
(``convert_hf_to_gguf.py``, ``LlamaModel.permute``), with the key/value head count for K;
GPT-2's ``Conv1D`` weights, ``(in, out)`` in Hugging Face, are stored ``(out, in)``.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import Tensor

from plugintrain.model_zoo.config import TransformerConfig
from plugintrain.model_zoo.family_spec import FamilySpec

_PERMUTED = ("attn_q", "attn_k")
"""The tensor kinds whose rows llama.cpp permutes per head (query, key)."""


def permute_for_gguf(weight: Tensor, heads: int) -> Tensor:
    """Hugging Face's rotate-half rows of each head -> llama.cpp's interleaved pairs."""
    rows = weight.shape
    return weight.reshape(heads, 2, rows[0] // heads // 2, *rows[1:]).transpose(1, 2).reshape(rows)


def unpermute_from_gguf(weight: Tensor, heads: int) -> Tensor:
    """The inverse of :func:`permute_for_gguf`."""
    rows = weight.shape
    return weight.reshape(heads, rows[0] // heads // 2, 2, *rows[1:]).transpose(1, 2).reshape(rows)


@dataclass(frozen=True)
class Link:
    """Where a Hugging Face tensor lies in a GGUF file, and the layout change between."""

    gguf_name: str
    transpose: bool = False
    """A ``Conv1D`` weight: Hugging Face stores ``(in, out)``, GGUF ``(out, in)``."""
    heads: int | None = None
    """Query/key rows permuted per head for llama.cpp's RoPE (the head count)."""

    def from_gguf(self, tensor: Tensor) -> Tensor:
        if self.heads is not None:
            tensor = unpermute_from_gguf(tensor, self.heads)
        return tensor.t().contiguous() if self.transpose else tensor

    def to_gguf(self, tensor: Tensor) -> Tensor:
        if self.transpose:
            tensor = tensor.t()
        return permute_for_gguf(tensor, self.heads) if self.heads is not None else tensor


def links(family: FamilySpec, config: TransformerConfig) -> dict[str, Link]:
    """Hugging Face name -> its GGUF tensor, for every tensor of ``config``'s model."""
    layout = family.gguf
    assert layout is not None, f"{family.name} has no GGUF layout"
    conv1d = tuple(f".{module}.weight" for module in family.hf_conv1d)
    heads = {"attn_q": config.n_head, "attn_k": config.kv_heads}
    found = {}
    for hf_name, gguf_name in layout.tensors.items():
        blocks = range(config.n_layer) if "{i}" in hf_name else [None]
        kind = gguf_name.split(".")[-2]
        for i in blocks:
            name = hf_name.format(i=i)
            permuted = layout.permuted_qk and kind in _PERMUTED
            found[name] = Link(
                gguf_name.format(i=i),
                transpose=name.endswith(conv1d),
                heads=heads[kind] if permuted else None,
            )
    return found
