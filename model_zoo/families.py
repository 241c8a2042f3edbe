"""The model families: name -> :class:`~plugintrain.model_zoo.family_spec.FamilySpec`.

A new family is its own module (presets, plans, Hugging Face config mapping, its
``SPEC``) plus one entry here.
"""

from __future__ import annotations

from plugintrain.model_zoo import deepseek_v3, gpt2, llama3, qwen3, qwen3_moe
from plugintrain.model_zoo.config import TransformerConfig
from plugintrain.model_zoo.family_spec import FamilySpec
from plugintrain.model_zoo.layers import QK_NORM_PLAN

FAMILIES: dict[str, FamilySpec] = {
    spec.name: spec
    for spec in (gpt2.SPEC, llama3.SPEC, qwen3.SPEC, deepseek_v3.SPEC, qwen3_moe.SPEC)
}


def family_of(config: TransformerConfig) -> FamilySpec:
    """The spec of ``config``'s family."""
    return FAMILIES[config.family]


def by_hf_model_type(model_type: str) -> FamilySpec | None:
    """The family a Hugging Face ``model_type`` is, None if plugintrain has none."""
    return next((s for s in FAMILIES.values() if s.hf_model_type == model_type), None)


def by_gguf_architecture(architecture: str) -> FamilySpec | None:
    """The family a GGUF ``general.architecture`` is, None if plugintrain reads none."""
    readers = (s for s in FAMILIES.values() if s.gguf is not None)
    return next((s for s in readers if s.gguf.architecture == architecture), None)


def tp_plan(config: TransformerConfig) -> dict[str, str]:
    """``config``'s family plan, with the query/key norms' entries exactly when the config
    has them (whatever the family)."""
    plan = {k: v for k, v in family_of(config).tp_plan(config).items() if k not in QK_NORM_PLAN}
    return plan | QK_NORM_PLAN if config.qk_norm else plan
