"""What a model family declares: one :class:`FamilySpec` per family module (torchtitan's
``TrainSpec``), collected in :mod:`plugintrain.model_zoo.families`.

Everything outside a family's module that depends on the family (tensor parallelism, the
Hugging Face and GGUF readers and writers) reads it from the spec, so a new family is its
own module plus one line in the registry.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from plugintrain.model_zoo.config import TransformerConfig
from plugintrain.model_zoo.weight_plans import Plan


def _same_key(key: str) -> str:
    return key


@dataclass(frozen=True)
class GGUFLayout:
    """How llama.cpp's converter (``convert_hf_to_gguf.py``) lays a family out in a GGUF
    file: what :mod:`plugintrain.formats.gguf` reads and writes for it."""

    architecture: str
    """``general.architecture`` (``llama``), also the prefix of the model's metadata keys."""
    tensors: Mapping[str, str]
    """Hugging Face tensor name -> GGUF tensor name; ``{i}`` stands for a block's index."""
    config: Mapping[str, str]
    """GGUF metadata key (after ``<architecture>.``) -> the Hugging Face ``config.json``
    key it holds, in the order written; where several hold one key, the first read sets
    it and the others must agree."""
    permuted_qk: bool = False
    """Each head's query and key rows are stored permuted into the interleaved pairs
    llama.cpp's RoPE kernel turns (Llama's layout; Qwen3 runs NEOX RoPE, unpermuted)."""
    rope_freqs: bool = False
    """Llama 3 RoPE scaling travels as llama.cpp's ``rope_freqs`` tensor (per-frequency
    divisors) and the original context length."""


@dataclass(frozen=True)
class FamilySpec:
    """A model family's surface, the same for every family."""

    name: str
    """Our name, ``TransformerConfig.family`` (``llama3``)."""
    hf_model_type: str
    """Hugging Face ``config.json``'s ``model_type`` (``llama``)."""
    tp_plan: Callable[[TransformerConfig], dict[str, str]]
    """The tensor/sequence-parallel plan for a config: module path pattern -> style name
    (:mod:`plugintrain.strategies.tensor_parallel`)."""
    hf_import_plan: Callable[[TransformerConfig], Plan]
    """Our tensors from a Hugging Face checkpoint's (per-expert Hub tensors stacked)."""
    hf_export_plan: Callable[[TransformerConfig], Plan]
    """A Hugging Face checkpoint's tensors from ours."""
    from_hf_config: Callable[[dict[str, Any], str], TransformerConfig]
    """Our config from a Hugging Face ``config.json`` and a name for it (one-line errors
    for variants the family does not build)."""
    to_hf_config: Callable[[TransformerConfig], dict[str, Any]]
    """The Hugging Face ``config.json`` of a config."""
    gguf: GGUFLayout | None = None
    """The family's GGUF layout; None where plugintrain reads and writes no GGUF of it."""
    hf_conv1d: tuple[str, ...] = ()
    """Hugging Face modules (names inside a block, ``attn.c_attn``) kept as GPT-2's
    ``Conv1D``: ``(in, out)`` weights, PEFT's ``fan_in_fan_out``, transposed in GGUF."""
    hf_key: Callable[[str], str] = _same_key
    """A Hugging Face tensor name as the import plan names it (GPT-2's headless
    ``GPT2Model`` keys get their ``transformer.`` prefix)."""
