"""GGUF files (llama.cpp) of Llama-, Qwen3- and GPT-2-architecture models, read and
written with the ``gguf`` package.

Reading dequantizes one tensor at a time (F32, F16, BF16 and the common block types,
:data:`READ_TYPES`) from the file's memory map. llama.cpp's converter permutes each Llama
attention head's query and key rows from Hugging Face's rotate-half RoPE layout to the
interleaved one its kernels use (``convert_hf_to_gguf.py``, ``LlamaModel.permute``); the
reader undoes it, with the key/value head count for K, and the writer applies it. Qwen3
runs llama.cpp's NEOX (rotate-half) RoPE, so its rows are stored as Hugging Face has them.
Llama 3.1 RoPE scaling travels as llama.cpp's ``rope_freqs`` tensor (per-frequency
divisors).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import torch
from gguf import GGMLQuantizationType as Q
from torch import Tensor

from plugintrain.checkpoints.files import first_line
from plugintrain.data.assets import resolve_model_path
from plugintrain.data.tokenizers.gguf_metadata import GGUFTensorInfo, is_gguf, read_gguf_header
from plugintrain.data.tokenizers.registry import TOKENIZER_NAMES, family_tokenizer, get_tokenizer
from plugintrain.formats.base import WeightFormatError
from plugintrain.formats.tokenizer_files import hf_gguf_vocabulary, tiktoken_gguf_vocabulary
from plugintrain.model_zoo.config import RopeScaling, TransformerConfig
from plugintrain.model_zoo.families import FAMILIES, by_gguf_architecture, family_of
from plugintrain.model_zoo.layers import rope_frequencies

READ_TYPES = (Q.F32, Q.F16, Q.BF16, Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1,
              Q.Q2_K, Q.Q3_K, Q.Q4_K, Q.Q5_K, Q.Q6_K)  # fmt: skip
"""Tensor types this reader dequantizes (the rest, e.g. the IQ types, are refused)."""
WRITE_TYPES = {"f32": Q.F32, "f16": Q.F16, "bf16": Q.BF16, "q8_0": Q.Q8_0}
"""``--gguf_type`` -> the type every matrix is written in (norms stay F32, as llama.cpp)."""

_LLAMA_BLOCK = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_QWEN3_BLOCK = {
    **_LLAMA_BLOCK,
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
}
_GPT2_BLOCK = {  # GGUF name -> (Hugging Face name, stored transposed in Hugging Face)
    "attn_norm": ("ln_1", False),
    "attn_qkv": ("attn.c_attn", True),
    "attn_output": ("attn.c_proj", True),
    "ffn_norm": ("ln_2", False),
    "ffn_up": ("mlp.c_fc", True),
    "ffn_down": ("mlp.c_proj", True),
}


def permute_for_gguf(weight: Tensor, heads: int) -> Tensor:
    """Hugging Face's rotate-half rows of each head -> llama.cpp's interleaved pairs."""
    rows = weight.shape
    return weight.reshape(heads, 2, rows[0] // heads // 2, *rows[1:]).transpose(1, 2).reshape(rows)


def unpermute_from_gguf(weight: Tensor, heads: int) -> Tensor:
    """The inverse of :func:`permute_for_gguf`."""
    rows = weight.shape
    return weight.reshape(heads, rows[0] // heads // 2, 2, *rows[1:]).transpose(1, 2).reshape(rows)


@dataclass(frozen=True)
class _Link:
    """Where a Hugging Face tensor lies in a GGUF file, and the layout change between."""

    gguf_name: str
    transpose: bool = False
    """GPT-2's ``Conv1D`` weights: Hugging Face stores ``(in, out)``, GGUF ``(out, in)``."""
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


def _links(config: TransformerConfig, arch: str) -> dict[str, _Link]:
    """Hugging Face name -> its GGUF tensor, for every tensor of ``config``'s model."""
    return _gpt2_links(config) if arch == "gpt2" else _rope_links(config, arch)


def _rope_links(config: TransformerConfig, arch: str) -> dict[str, _Link]:
    """Llama's and Qwen3's tensors; only Llama's query/key rows are permuted."""
    links = {
        "model.embed_tokens.weight": _Link("token_embd.weight"),
        "model.norm.weight": _Link("output_norm.weight"),
        "lm_head.weight": _Link("output.weight"),
    }
    llama = arch == "llama"
    heads = {"attn_q": config.n_head, "attn_k": config.kv_heads} if llama else {}
    for i in range(config.n_layer):
        for kind, module in (_LLAMA_BLOCK if llama else _QWEN3_BLOCK).items():
            links[f"model.layers.{i}.{module}.weight"] = _Link(
                f"blk.{i}.{kind}.weight", heads=heads.get(kind)
            )
    return links


def _gpt2_links(config: TransformerConfig) -> dict[str, _Link]:
    hf = "transformer."
    links = {"lm_head.weight": _Link("output.weight")}
    for gguf_name, module in (("token_embd", "wte"), ("position_embd", "wpe")):
        links[f"{hf}{module}.weight"] = _Link(f"{gguf_name}.weight")
    for suffix in ("weight", "bias"):
        links[f"{hf}ln_f.{suffix}"] = _Link(f"output_norm.{suffix}")
        for i in range(config.n_layer):
            for kind, (module, conv1d) in _GPT2_BLOCK.items():
                links[f"{hf}h.{i}.{module}.{suffix}"] = _Link(
                    f"blk.{i}.{kind}.{suffix}", transpose=conv1d and suffix == "weight"
                )
    return links


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
        if by_gguf_architecture(self.arch) is None:
            raise WeightFormatError(
                f"{path}: GGUF architecture {self.arch!r} is not supported; plugintrain"
                " imports 'llama' (Llama 2/3, SmolLM, ...), 'qwen3' (dense) and 'gpt2'."
            )
        self._check_tensors()
        self._map = np.memmap(path, dtype=np.uint8, mode="r")
        self.config = self._gpt2_config() if self.arch == "gpt2" else self._rope_config()
        self.tokenizer = str(path) if "tokenizer.ggml.tokens" in self._fields else None
        self._names = self._hf_names()

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
            if info.offset + _nbytes(info.shape, qtype) > size:
                raise WeightFormatError(
                    f"{self.path}: truncated: tensor {info.name} ends past the file's"
                    f" {size} bytes; download or export it again."
                )

    def _rope_config(self) -> TransformerConfig:
        """A llama or qwen3 file's architecture (Llama 3 scaling from ``rope_freqs``)."""
        key = f"{self.arch}."
        heads = self._field(f"{key}attention.head_count")
        width = self._field(f"{key}embedding_length")
        head_dim = self._field(f"{key}attention.key_length", width // heads)
        self._check_head_dims(key, head_dim)
        config = by_gguf_architecture(self.arch).from_hf_config(
            {
                "vocab_size": self._vocab_size(),
                "max_position_embeddings": self._field(f"{key}context_length", 2048),
                "num_hidden_layers": self._field(f"{key}block_count"),
                "num_attention_heads": heads,
                "num_key_value_heads": self._field(f"{key}attention.head_count_kv", heads),
                "hidden_size": width,
                "head_dim": head_dim,
                "intermediate_size": self._field(f"{key}feed_forward_length"),
                "rms_norm_eps": self._field(f"{key}attention.layer_norm_rms_epsilon", 1e-5),
                "rope_theta": self._field(f"{key}rope.freq_base", 10000.0),
                "tie_word_embeddings": "output.weight" not in self._tensors,
            },
            self.path.stem,
        )
        if self.arch != "llama":
            return config
        original = self._field(f"{key}rope.scaling.original_context_length", 8192)
        return _with_rope_scaling(config, self._rope_freqs(), original, self.path)

    def _check_head_dims(self, key: str, head_dim: int) -> None:
        """RoPE turns each whole head, and values are as wide as keys (one ``head_dim``)."""
        dims = {
            "rope.dimension_count": self._field(f"{key}rope.dimension_count", head_dim),
            "attention.value_length": self._field(f"{key}attention.value_length", head_dim),
        }
        bad = {name: value for name, value in dims.items() if value != head_dim}
        if bad:
            raise WeightFormatError(
                f"{self.path}: {bad} differ from the {head_dim}-channel heads; plugintrain"
                " rotates whole heads and builds values as wide as keys."
            )

    def _gpt2_config(self) -> TransformerConfig:
        key = "gpt2."
        return FAMILIES["gpt2"].from_hf_config(
            {
                "vocab_size": self._vocab_size(),
                "n_positions": self._field(f"{key}context_length"),
                "n_layer": self._field(f"{key}block_count"),
                "n_head": self._field(f"{key}attention.head_count"),
                "n_embd": self._field(f"{key}embedding_length"),
                "n_inner": self._field(f"{key}feed_forward_length"),
                "layer_norm_epsilon": self._field(f"{key}attention.layer_norm_epsilon", 1e-5),
                "tie_word_embeddings": "output.weight" not in self._tensors,
            },
            self.path.stem,
        )

    def _vocab_size(self) -> int:
        return int(self._tensors["token_embd.weight"].shape[0])

    def _rope_freqs(self) -> Tensor | None:
        tensor = self._tensors.get("rope_freqs.weight")
        return None if tensor is None else self._dequantized(tensor)

    def _hf_names(self) -> dict[str, _Link]:
        """Hugging Face name -> how its tensor is stored in this file."""
        links = {}
        for hf_name, link in _links(self.config, self.arch).items():
            if link.gguf_name in self._tensors:
                links[hf_name] = link
        known = {link.gguf_name for link in links.values()} | {"rope_freqs.weight"}
        for name in self._tensors.keys() - known:  # reported as unexpected by the plan check
            links[name] = _Link(name)
        return links

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
        raw = self._map[info.offset : info.offset + _nbytes(info.shape, qtype)]
        raw = raw.reshape(gguf.quants.quant_shape_to_byte_shape(info.shape, qtype))
        array = gguf.quants.dequantize(raw, qtype)
        return torch.from_numpy(np.array(array, dtype=np.float32).reshape(info.shape))


def _nbytes(shape: tuple[int, ...], qtype: Q) -> int:
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
    scaling = RopeScaling(factor=factor, low_freq_factor=1.0, high_freq_factor=4.0,
                          original_max_position_embeddings=original)  # fmt: skip
    scaled = TransformerConfig.from_dict({**config.__dict__, "rope_scaling": scaling})
    if not torch.allclose(llama3_rope_divisors(scaled), divisors, rtol=1e-4):
        raise WeightFormatError(
            f"{path}: its rope_freqs are not a Llama 3 RoPE scaling plugintrain can rebuild"
            f" (factor {factor}, low/high frequency factors 1 and 4, original context {original})."
        )
    return scaled


def write_gguf(weights: Any, out: Path, kind: str) -> None:
    """Write ``weights`` (our names) as a GGUF file for llama.cpp: architecture metadata,
    the tokenizer fields when the weights came from a GGUF with one, and each tensor in
    ``kind`` (:data:`WRITE_TYPES`; 1-D tensors stay F32), one tensor at a time."""
    config = weights.config
    arch = family_of(config).gguf_architecture
    if arch is None:
        writable = sorted(s.name for s in FAMILIES.values() if s.gguf_architecture is not None)
        raise WeightFormatError(
            f"{config.name} ({config.family}) cannot be written as GGUF: plugintrain writes"
            f" llama.cpp's architectures for {writable}; export it with --format hf instead."
        )
    fields = _tokenizer_fields(config, weights.tokenizer)  # a refusal comes before any write
    writer = gguf.GGUFWriter(out, arch)
    writer.add_name(config.name)
    _add_architecture(writer, arch, config)
    for key, value in fields.items():
        _add_field(writer, key, value)
    tensors = _gguf_plan(weights, arch)
    for gguf_name, (shape, _) in tensors.items():
        qtype = _tensor_type(shape, kind)
        dtype, stored = _stored(shape, qtype)
        nbytes = math.prod(stored) * dtype.itemsize
        raw = None if qtype in (Q.F32, Q.F16) else qtype
        writer.add_tensor_info(gguf_name, stored, dtype, nbytes, raw_dtype=raw)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    for shape, read in tensors.values():
        writer.write_tensor_data(_encoded(read(), _tensor_type(shape, kind)))
    writer.close()


def _tensor_type(shape: tuple[int, ...], kind: str) -> Q:
    """The type a tensor is written in: ``kind`` for matrices, F32 for norms and biases (as
    llama.cpp), F16 for a matrix whose rows are not whole blocks of a block type."""
    if len(shape) < 2:
        return Q.F32
    qtype = WRITE_TYPES[kind]
    block = gguf.GGML_QUANT_SIZES[qtype][0]
    return qtype if shape[-1] % block == 0 else Q.F16


_TORCH_TYPES = {Q.F32: torch.float32, Q.F16: torch.float16, Q.BF16: torch.bfloat16}


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


def _add_architecture(writer: Any, arch: str, config: TransformerConfig) -> None:
    writer.add_context_length(config.block_size)
    writer.add_embedding_length(config.n_embd)
    writer.add_block_count(config.n_layer)
    writer.add_feed_forward_length(config.ffn_dim)
    writer.add_head_count(config.n_head)
    writer.add_vocab_size(config.vocab_size)
    if arch == "gpt2":
        writer.add_layer_norm_eps(config.norm_eps)
        return
    writer.add_head_count_kv(config.kv_heads)
    writer.add_layer_norm_rms_eps(config.norm_eps)
    writer.add_rope_freq_base(config.rope_theta)
    writer.add_rope_dimension_count(config.head_dim)
    # llama.cpp takes n_embd / n_head per head unless told (Qwen3's heads are wider).
    writer.add_key_length(config.head_dim)
    writer.add_value_length(config.head_dim)
    if config.rope_scaling is not None:
        writer.add_rope_scaling_orig_ctx_len(config.rope_scaling.original_max_position_embeddings)


def _tokenizer_fields(config: TransformerConfig, tokenizer: str | None) -> dict[str, Any]:
    """The ``tokenizer.*`` fields llama.cpp needs to run the model, as its own converter
    writes them: a GGUF source's as they were; GPT-2's or Llama 3's tokenizer spelled out
    (pre-tokenizer ``gpt-2`` / ``llama-bpe``, BOS/EOS, add-BOS); a Hugging Face
    directory's ``tokenizer.json`` with its chat template. Types follow llama.cpp: token
    types int32, ids uint32.

    Raises:
        WeightFormatError: If the tokenizer is one llama.cpp would run differently.
    """
    spec = tokenizer or family_tokenizer(config.family)
    if spec is None:
        return {}
    if spec in TOKENIZER_NAMES:
        tok = get_tokenizer(spec)
        return tiktoken_gguf_vocabulary(tok) if tok.vocab_size == config.vocab_size else {}
    path = resolve_model_path(spec)
    if is_gguf(path):
        fields = read_gguf_header(path)[0]
        return {k: v for k, v in fields.items() if k.startswith("tokenizer.")}
    try:
        return hf_gguf_vocabulary(get_tokenizer(spec), spec)
    except ValueError as error:
        raise WeightFormatError(f"{config.name} cannot be written as GGUF: {error}.") from None


def _add_field(writer: Any, key: str, value: Any) -> None:
    kinds = gguf.GGUFValueType
    if isinstance(value, np.ndarray):
        item = {np.dtype("<i4"): kinds.INT32, np.dtype("<f4"): kinds.FLOAT32,
                np.dtype("<u4"): kinds.UINT32}[value.dtype]  # fmt: skip
        writer.add_key_value(key, value.tolist(), kinds.ARRAY, sub_type=item)
    elif isinstance(value, list):
        writer.add_key_value(key, value, kinds.ARRAY, sub_type=kinds.STRING)
    else:
        kind = {str: kinds.STRING, bool: kinds.BOOL, int: kinds.UINT32, float: kinds.FLOAT32}
        writer.add_key_value(key, value, kind[type(value)])


def _gguf_plan(weights: Any, arch: str) -> dict[str, tuple[tuple[int, ...], Any]]:
    """GGUF name -> (shape in numpy order, a function reading that tensor)."""
    config = weights.config
    plan = family_of(config).hf_export_plan(config)
    links = _links(config, arch)

    def read(hf_name: str) -> Tensor:
        rule = plan[hf_name]
        return links[hf_name].to_gguf(rule.build(*(weights.read(s) for s in rule.sources)))

    out: dict[str, tuple[tuple[int, ...], Any]] = {}
    for hf_name, rule in plan.items():
        meta = rule.build(*(torch.empty(weights.shape(s), device="meta") for s in rule.sources))
        shape = tuple(meta.shape)[::-1] if links[hf_name].transpose else tuple(meta.shape)
        out[links[hf_name].gguf_name] = (shape, lambda n=hf_name: read(n))
    if arch == "llama" and config.rope_scaling is not None:
        divisors = llama3_rope_divisors(config)
        out["rope_freqs.weight"] = (tuple(divisors.shape), lambda: divisors)
    return out
