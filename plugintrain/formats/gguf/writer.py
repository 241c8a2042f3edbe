"""GGUF files for llama.cpp written from our weights with the ``gguf`` package: the model's
metadata through the family's :class:`~plugintrain.model_zoo.family_spec.GGUFLayout`, the
tokenizer's ``tokenizer.*`` keys (:mod:`.tokenizer_keys`), and each tensor in the type
asked for (:data:`WRITE_TYPES`; norms and biases stay F32, as llama.cpp keeps them), one
tensor at a time.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import torch
from gguf import GGMLQuantizationType as Q
from torch import Tensor

from plugintrain.formats.base import WeightFormatError
from plugintrain.formats.gguf.links import links
from plugintrain.formats.gguf.reader import llama3_rope_divisors
from plugintrain.formats.gguf.tokenizer_keys import tokenizer_fields
from plugintrain.model_zoo.config import TransformerConfig
from plugintrain.model_zoo.families import FAMILIES, family_of
from plugintrain.model_zoo.family_spec import FamilySpec

WRITE_TYPES = {"float32": Q.F32, "float16": Q.F16, "bfloat16": Q.BF16, "q8_0": Q.Q8_0}
"""``--dtype`` -> the type every matrix is written in (norms stay F32, as llama.cpp)."""
_FLOAT_KEYS = ("attention.layer_norm_epsilon", "attention.layer_norm_rms_epsilon", "rope.freq_base")
"""The model metadata GGUF stores as float32 (the rest of it is uint32)."""
_TORCH_TYPES = {Q.F32: torch.float32, Q.F16: torch.float16, Q.BF16: torch.bfloat16}


def write_gguf(weights: Any, out: Path, dtype: str) -> None:
    """Write ``weights`` (our names) as a GGUF file for llama.cpp: architecture metadata,
    the tokenizer fields when the weights came from a GGUF with one, and each tensor in
    ``dtype`` (:data:`WRITE_TYPES`; 1-D tensors stay F32), one tensor at a time.

    Raises:
        WeightFormatError: For a family llama.cpp's architectures do not cover, or a
            tokenizer llama.cpp would run differently (before anything is written).
    """
    config = weights.config
    family = family_of(config)
    if family.gguf is None:
        writable = sorted(s.name for s in FAMILIES.values() if s.gguf is not None)
        raise WeightFormatError(
            f"{config.name} ({config.family}) cannot be written as GGUF: plugintrain writes"
            f" llama.cpp's architectures for {writable}; export it with --format hf instead."
        )
    fields = tokenizer_fields(config, weights.tokenizer)  # a refusal comes before any write
    writer = gguf.GGUFWriter(out, family.gguf.architecture)
    writer.add_name(config.name)
    _add_architecture(writer, family, config)
    for key, value in fields.items():
        _add_field(writer, key, value)
    tensors = _gguf_plan(weights, family)
    for gguf_name, (shape, _) in tensors.items():
        qtype = _tensor_type(shape, dtype)
        stored_dtype, stored = _stored(shape, qtype)
        size = math.prod(stored) * stored_dtype.itemsize
        raw = None if qtype in (Q.F32, Q.F16) else qtype
        writer.add_tensor_info(gguf_name, stored, stored_dtype, size, raw_dtype=raw)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    for shape, read in tensors.values():
        writer.write_tensor_data(_encoded(read(), _tensor_type(shape, dtype)))
    writer.close()


def _tensor_type(shape: tuple[int, ...], dtype: str) -> Q:
    """The type a tensor is written in: ``dtype``'s for matrices, F32 for norms and biases
    (as llama.cpp), F16 for a matrix whose rows are not whole blocks of a block type."""
    if len(shape) < 2:
        return Q.F32
    qtype = WRITE_TYPES[dtype]
    block = gguf.GGML_QUANT_SIZES[qtype][0]
    return qtype if shape[-1] % block == 0 else Q.F16


def _encoded(tensor: Tensor, qtype: Q) -> np.ndarray:
    """``tensor`` as the array GGUF stores for ``qtype``: a float type is one cast in torch
    (bf16 as its raw bytes, which numpy has no type for); a block type is quantized by the
    ``gguf`` package from fp32."""
    if qtype not in _TORCH_TYPES:
        return gguf.quants.quantize(tensor.float().numpy(), qtype)
    cast = tensor.to(_TORCH_TYPES[qtype]).contiguous()
    if qtype == Q.BF16:
        return cast.view(torch.uint8).numpy().reshape(*cast.shape[:-1], -1)
    return cast.numpy()


def _stored(shape: tuple[int, ...], qtype: Q) -> tuple[np.dtype, tuple[int, ...]]:
    """The numpy dtype and shape a tensor of ``shape`` is written as in type ``qtype``."""
    if qtype == Q.F32:
        return np.dtype(np.float32), shape
    if qtype == Q.F16:
        return np.dtype(np.float16), shape
    return np.dtype(np.uint8), tuple(gguf.quants.quant_shape_to_byte_shape(shape, qtype))


def _add_architecture(writer: Any, family: FamilySpec, config: TransformerConfig) -> None:
    """The model's metadata: each key of the family's layout from its Hugging Face
    ``config.json``, and Llama 3 scaling's original context length."""
    layout = family.gguf
    hf = family.to_hf_config(config)
    for key, hf_key in layout.config.items():
        name = f"{layout.architecture}.{key}"
        if key in _FLOAT_KEYS:
            writer.add_float32(name, float(hf[hf_key]))
        else:
            writer.add_uint32(name, int(hf[hf_key]))
    if layout.rope_freqs and config.rope_scaling is not None:
        writer.add_rope_scaling_orig_ctx_len(config.rope_scaling.original_max_position_embeddings)


def _add_field(writer: Any, key: str, value: Any) -> None:
    kinds = gguf.GGUFValueType
    if isinstance(value, np.ndarray):
        items = {
            np.dtype("<i4"): kinds.INT32,
            np.dtype("<f4"): kinds.FLOAT32,
            np.dtype("<u4"): kinds.UINT32,
        }
        writer.add_key_value(key, value.tolist(), kinds.ARRAY, sub_type=items[value.dtype])
    elif isinstance(value, list):
        writer.add_key_value(key, value, kinds.ARRAY, sub_type=kinds.STRING)
    else:
        kind = {str: kinds.STRING, bool: kinds.BOOL, int: kinds.UINT32, float: kinds.FLOAT32}
        writer.add_key_value(key, value, kind[type(value)])


def _gguf_plan(weights: Any, family: FamilySpec) -> dict[str, tuple[tuple[int, ...], Any]]:
    """GGUF name -> (shape in numpy order, a function reading that tensor)."""
    config = weights.config
    plan = family.hf_export_plan(config)
    where = links(family, config)

    def read(hf_name: str) -> Tensor:
        rule = plan[hf_name]
        return where[hf_name].to_gguf(rule.build(*(weights.read(s) for s in rule.sources)))

    out: dict[str, tuple[tuple[int, ...], Any]] = {}
    for hf_name, rule in plan.items():
        meta = rule.build(*(torch.empty(weights.shape(s), device="meta") for s in rule.sources))
        shape = tuple(meta.shape)[::-1] if where[hf_name].transpose else tuple(meta.shape)
        out[where[hf_name].gguf_name] = (shape, lambda n=hf_name: read(n))
    if family.gguf.rope_freqs and config.rope_scaling is not None:
        divisors = llama3_rope_divisors(config)
        out["rope_freqs.weight"] = (tuple(divisors.shape), lambda: divisors)
    return out
