"""GGUF files (llama.cpp) read as a Hugging Face model's tensors: the architecture from the
metadata through the family's :class:`~plugintrain.model_zoo.family_spec.GGUFLayout`, and
each tensor dequantized to fp32 one at a time (F32, F16, BF16 and the common block types,
:data:`READ_TYPES`) from the file's memory map. Llama 3 RoPE scaling travels as llama.cpp's
``rope_freqs`` tensor (per-frequency divisors).
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

from plugintrain.checkpoints.files import first_line
from plugintrain.core.gguf_header import TOKENIZER_KEYS, GGUFTensorInfo, read_gguf_header
from plugintrain.formats.base import WeightFormatError
from plugintrain.formats.gguf.links import Link, links
from plugintrain.model_zoo.config import RopeScaling, TransformerConfig
from plugintrain.model_zoo.families import FAMILIES, by_gguf_architecture
from plugintrain.model_zoo.layers import rope_frequencies

READ_TYPES = (
    *(Q.F32, Q.F16, Q.BF16),
    *(Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1),
    *(Q.Q2_K, Q.Q3_K, Q.Q4_K, Q.Q5_K, Q.Q6_K),
)
"""Tensor types this reader dequantizes (the rest, e.g. the IQ types, are refused)."""
_HEAD_DIM = "head_dim"


def _defaults(found: dict[str, Any]) -> dict[str, Any]:
    """llama.cpp's values for metadata keys a file leaves out."""
    heads, width = found.get("attention.head_count"), found.get("embedding_length")
    return {
        "context_length": 2048,
        "attention.head_count_kv": heads,
        "attention.key_length": width // heads if heads and width else None,
        "attention.layer_norm_epsilon": 1e-5,
        "attention.layer_norm_rms_epsilon": 1e-5,
        "rope.freq_base": 10000.0,
    }


class GGUFFileReader:
    """A GGUF file's tensors under Hugging Face names and layouts, dequantized to fp32 one
    at a time.

    Args:
        path: The ``.gguf`` file.
    """

    def __init__(self, path: Path) -> None:
        self.path = path
        try:
            self._fields, self._tensors = read_gguf_header(path)
        except (ValueError, OSError) as error:
            raise WeightFormatError(
                f"{path}: truncated or not a GGUF file ({first_line(error)}); download or"
                " export it again."
            ) from None
        self.arch = self._field("general.architecture")
        family = by_gguf_architecture(self.arch)
        if family is None:
            read = sorted(s.gguf.architecture for s in FAMILIES.values() if s.gguf is not None)
            raise WeightFormatError(
                f"{path}: GGUF architecture {self.arch!r} is not supported; plugintrain"
                f" imports {read} (Llama 2/3, SmolLM, Qwen3 dense and GPT-2 models)."
            )
        self.family = family
        self._check_tensors()
        self._map: np.memmap | None = None  # mapped on the first read (and after release)
        self.config = self._config()
        self.tokenizer = str(path) if TOKENIZER_KEYS.LIST in self._fields else None
        self._names = self._hf_names()

    def release(self) -> None:
        """Unmap the file; mapped again on the next read."""
        self._map = None

    def _field(self, key: str, default: Any = None) -> Any:
        value = self._fields.get(key, default)
        # GGUF stores epsilons and bases as float32: 1e-5 reads back as 9.99999974e-06.
        return float(f"{value:.7g}") if isinstance(value, float) else value

    def _check_tensors(self) -> None:
        """Every tensor is of a type this reader dequantizes, and lies inside the file."""
        size = self.path.stat().st_size
        for info in self._tensors.values():
            qtype = Q(info.type_id) if info.type_id in Q._value2member_map_ else None
            if qtype not in READ_TYPES:
                found = qtype.name if qtype is not None else f"type {info.type_id}"
                raise WeightFormatError(
                    f"{self.path}: tensor {info.name} is {found}, a type plugintrain does not"
                    f" dequantize; supported: {[t.name for t in READ_TYPES]} (requantize the"
                    " model, e.g. to Q8_0, with llama.cpp's llama-quantize)."
                )
            if info.offset + nbytes(info.shape, qtype) > size:
                raise WeightFormatError(
                    f"{self.path}: truncated: tensor {info.name} ends past the file's"
                    f" {size} bytes; download or export it again."
                )

    def _metadata(self) -> dict[str, Any]:
        """The model's metadata keys the family's layout names (without the architecture
        prefix), llama.cpp's defaults for those left out."""
        prefix = f"{self.arch}."
        found = {
            key: self._field(prefix + key)
            for key in self.family.gguf.config
            if prefix + key in self._fields
        }
        return _defaults(found) | found

    def _config(self) -> TransformerConfig:
        """The architecture the metadata describes, as the family reads a Hugging Face
        ``config.json`` (Llama 3 scaling from ``rope_freqs``)."""
        found = self._metadata()
        hf: dict[str, Any] = {}
        for key, hf_key in self.family.gguf.config.items():
            if found.get(key) is not None:
                hf.setdefault(hf_key, found[key])
        hf["vocab_size"] = int(self._tensors["token_embd.weight"].shape[0])
        hf["tie_word_embeddings"] = "output.weight" not in self._tensors
        config = self.family.from_hf_config(hf, self.path.stem)
        self._check_head_dims(found, config.head_dim)
        if not self.family.gguf.rope_freqs:
            return config
        original = self._field(f"{self.arch}.rope.scaling.original_context_length", 8192)
        return _with_rope_scaling(config, self._rope_freqs(), original, self.path)

    def _check_head_dims(self, found: dict[str, Any], head_dim: int) -> None:
        """RoPE turns each whole head, and values are as wide as keys (one ``head_dim``)."""
        keys = [k for k, v in self.family.gguf.config.items() if v == _HEAD_DIM]
        bad = {k: found[k] for k in keys if found.get(k, head_dim) != head_dim}
        if bad:
            raise WeightFormatError(
                f"{self.path}: {bad} differ from the {head_dim}-channel heads; plugintrain"
                " rotates whole heads and builds values as wide as keys."
            )

    def _rope_freqs(self) -> Tensor | None:
        tensor = self._tensors.get("rope_freqs.weight")
        return None if tensor is None else self._dequantized(tensor)

    def _hf_names(self) -> dict[str, Link]:
        """Hugging Face name -> how its tensor is stored in this file."""
        found = {}
        for hf_name, link in links(self.family, self.config).items():
            if link.gguf_name in self._tensors:
                found[hf_name] = link
        known = {link.gguf_name for link in found.values()} | {"rope_freqs.weight"}
        for name in self._tensors.keys() - known:  # reported as unexpected by the plan check
            found[name] = Link(name)
        return found

    def names(self) -> list[str]:
        """Hugging Face tensor names."""
        return list(self._names)

    def dtype(self, name: str) -> torch.dtype:
        """fp32: every type is dequantized to it."""
        return torch.float32

    def shape(self, name: str) -> tuple[int, ...]:
        """Shape of ``name`` in Hugging Face's layout."""
        link = self._names[name]
        shape = self._tensors[link.gguf_name].shape
        return shape[::-1] if link.transpose else shape

    def read(self, name: str) -> Tensor:
        """Tensor ``name``, dequantized to fp32 (F16/BF16/F32 exactly)."""
        link = self._names[name]
        return link.from_gguf(self._dequantized(self._tensors[link.gguf_name]))

    def _dequantized(self, info: GGUFTensorInfo) -> Tensor:
        qtype = Q(info.type_id)
        if self._map is None:
            self._map = np.memmap(self.path, dtype=np.uint8, mode="r")
        raw = self._map[info.offset : info.offset + nbytes(info.shape, qtype)]
        raw = raw.reshape(gguf.quants.quant_shape_to_byte_shape(info.shape, qtype))
        array = gguf.quants.dequantize(raw, qtype)
        return torch.from_numpy(np.array(array, dtype=np.float32).reshape(info.shape))


def nbytes(shape: tuple[int, ...], qtype: Q) -> int:
    """Bytes a tensor of ``shape`` takes in ``qtype`` (whole blocks along the last axis)."""
    return math.prod(gguf.quants.quant_shape_to_byte_shape(shape, qtype))


def llama3_rope_divisors(config: TransformerConfig) -> Tensor:
    """llama.cpp's ``rope_freqs``: by how much Llama 3 scaling divides each frequency."""
    plain = rope_frequencies(config.head_dim, config.rope_theta)
    return plain / rope_frequencies(config.head_dim, config.rope_theta, config.rope_scaling)


def _with_rope_scaling(
    config: TransformerConfig, divisors: Tensor | None, original: int, path: Path
) -> TransformerConfig:
    """``config`` with the Llama 3 scaling whose divisors llama.cpp stored. llama.cpp keeps
    only the divisors (and, from plugintrain, the original context length), so Meta's
    parameters (factor = the largest divisor, low/high frequency factors 1 and 4) must
    reproduce them."""
    if divisors is None or bool((divisors == 1).all()):
        return config
    factor = float(f"{float(divisors.max()):.6g}")
    scaling = RopeScaling(
        factor=factor,
        low_freq_factor=1.0,
        high_freq_factor=4.0,
        original_max_position_embeddings=original,
    )
    scaled = TransformerConfig.from_dict({**config.__dict__, "rope_scaling": scaling})
    if not torch.allclose(llama3_rope_divisors(scaled), divisors, rtol=1e-4):
        raise WeightFormatError(
            f"{path}: its rope_freqs are not a Llama 3 RoPE scaling plugintrain can rebuild"
            f" (factor {factor}, low/high frequency factors 1 and 4, original context {original})."
        )
    return scaled
