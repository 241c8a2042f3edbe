"""What a model family declares: one :class:`FamilySpec` per family module (torchtitan's
``TrainSpec``), collected in :mod:`plugintrain.model_zoo.families`.

Everything outside a family's module that depends on the family (tensor parallelism, the
Hugging Face and GGUF readers and writers) reads it from the spec, so a new family is its
own module plus one line in the registry.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from plugintrain.model_zoo.config import TransformerConfig
from plugintrain.model_zoo.weight_plans import Plan


def _same_key(key: str) -> str:
    return key


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
    gguf_architecture: str | None = None
    """llama.cpp's ``general.architecture`` for the family; None where plugintrain reads and
    writes no GGUF of it."""
    hf_key: Callable[[str], str] = _same_key
    """A Hugging Face tensor name as the import plan names it (GPT-2's headless
    ``GPT2Model`` keys get their ``transformer.`` prefix)."""
