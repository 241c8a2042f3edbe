"""Quantized frozen weights for QLoRA (Dettmers et al. 2023, "QLoRA: Efficient Finetuning
of Quantized LLMs"): a LoRA layer's base weight held in 4 or 8 bits, dequantized per
matmul, while its adapters train in the model's precision.

Two schemes (:data:`QUANTIZATIONS`):

- ``nf4``: NormalFloat-4 in blocks of 64 weights, each block scaled by its absmax, and
  the absmax values double-quantized: their mean subtracted (one fp32 ``offset``), the rest
  coded in 8 bits on the signed dynamic map (:func:`dynamic_map`) in groups of 256 blocks,
  each group with an fp32 scale. 4 + 8/64 + 32/16384 = 4.127 bits per weight, the paper's
  and bitsandbytes' layout: the codes, block scales and dequantized values equal
  bitsandbytes' ``quantize_4bit(..., quant_type="nf4", compress_statistics=True)``
  (``tests/unit/test_quantization.py`` compares them).
- ``int8``: per-row absmax (LLM.int8()'s vector-wise quantization, without its outlier
  split): ``round(w * 127 / absmax_row)``, an fp32 scale per row, 8 + 32/in bits a weight.

A quantized weight is one :class:`QuantizedWeight` module holding a single flat ``uint8``
parameter (``packed``: codes, block codes, scales, in that order, each part 4-byte
aligned), frozen. One integer tensor is what makes it compose with every strategy:
FSDP2 shards it along dim 0 like any parameter and all-gathers it as bytes
(``MixedPrecisionPolicy`` casts floating parameters only), ``Module.to(dtype)`` and the
precision plugins leave it alone, the gradient engines skip it (it has no gradient), and a
pipeline stage holds its layers' own.

The matmul dequantizes the whole weight into the compute dtype (in fp32 first, as
bitsandbytes does), multiplies, and lets it go; the backward dequantizes again for the
input's gradient (no weight gradient). The module reads its ``packed`` parameter when it
runs, so under FSDP2 each pass sees the parameter the block's all-gather put there.
"""

from __future__ import annotations

import contextlib
import functools
import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

QUANTIZATIONS = ("nf4", "int8")
"""The schemes a LoRA base can be held in."""

BLOCK = 64
"""Weights per NF4 block (one absmax each)."""

SCALE_GROUP = 256
"""NF4 blocks per group of the double quantization (one fp32 scale each)."""

NF4_LEVELS = (
    -1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453,
    -0.28444138169288635, -0.18477343022823334, -0.09105003625154495, 0.0,
    0.07958029955625534, 0.16093020141124725, 0.24611230194568634, 0.33791524171829224,
    0.44070982933044434, 0.5626170039176941, 0.7229568362236023, 1.0,
)  # fmt: skip
"""The 16 NormalFloat-4 levels (the QLoRA paper's appendix E): quantiles of N(0, 1) scaled
to [-1, 1], with an exact zero; as float32."""

_INV_127 = float(torch.tensor(1 / 127, dtype=torch.float32))
"""1/127 rounded to float32: the int8 dequantization multiplies by it (as bitsandbytes does)."""

_CHUNK = 1 << 16
"""Weights quantized at a time: the scratch of one chunk (its fp32 copy, scaled values and
codes) stays a fraction of a MiB, whatever the size of the tensor."""


@functools.cache
def dynamic_map() -> Tensor:
    """The signed 8-bit dynamic quantization map (Dettmers 2016, "8-Bit Approximations for
    Parallelism in Deep Learning"), 256 float32 values in ascending order: for exponent
    ``e`` in 0..6, ``2^e`` evenly spaced fractions in (0.1, 1] times ``10^(e-6)``, both signs,
    plus 0 and 1; the NF4 block scales are coded on it."""
    values: list[float] = []
    for e in range(7):
        bounds = torch.linspace(0.1, 1, 2**e + 1, dtype=torch.float32)
        means = (bounds[:-1] + bounds[1:]) / 2.0
        scaled = (10 ** (e - 6)) * means
        values += scaled.tolist() + (-scaled).tolist()
    values += [0.0, 1.0]
    values += [0.0] * (256 - len(values))
    return torch.tensor(sorted(values), dtype=torch.float32)


@functools.cache
def _levels(device: torch.device) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """NF4 levels, their midpoints, and the dynamic map, on ``device``; plus the 256-entry
    table of a byte's two levels (high nibble first), each entry the two float32 values'
    bytes as one int64: a byte dequantizes with one scalar gather (``index_select`` of
    scalars is the vectorized path; of rows of two it is 3x slower on a CPU)."""
    nf4 = torch.tensor(NF4_LEVELS, dtype=torch.float32, device=device)
    dyn = dynamic_map().to(device)
    pairs = torch.stack((nf4.repeat_interleave(16), nf4.repeat(16)), dim=1)  # (256, 2)
    return nf4, (nf4[:-1] + nf4[1:]) / 2, dyn, pairs.contiguous().view(torch.int64).view(-1)


def _pad4(n: int) -> int:
    return -(-n // 4) * 4


def packed_bytes(kind: str, shape: tuple[int, ...]) -> int:
    """Bytes of the packed parameter holding a weight of ``shape`` quantized as ``kind``:
    what a rank holds of it, whole (the exact count ``estimate`` and dry runs use)."""
    rows, cols = shape[0], math.prod(shape[1:])
    n = rows * cols
    if kind == "int8":
        return _pad4(n) + 4 * rows
    blocks = n // BLOCK
    return n // 2 + _pad4(blocks) + 4 * -(-blocks // SCALE_GROUP) + 4


def unquantizable(kind: str, shape: tuple[int, ...]) -> str | None:
    """Why a weight of ``shape`` cannot be held as ``kind`` (None: it can)."""
    n = math.prod(shape)
    if len(shape) != 2:
        return f"it is not a matrix (shape {tuple(shape)})"
    if kind == "nf4" and n % BLOCK:
        return f"its {n} weights are not a multiple of the NF4 block of {BLOCK}"
    return None


# --- NF4 ------------------------------------------------------------------------------------


def _chunk(device: torch.device) -> int:
    """Weights quantized at a time on ``device``: :data:`_CHUNK` on a CPU, 256x more on an
    accelerator, where each chunk's few kernel launches would otherwise dominate."""
    return _CHUNK if device.type == "cpu" else _CHUNK << 8


def _block_absmax(flat: Tensor) -> Tensor:
    """The absmax of each block of :data:`BLOCK` (fp32), read a chunk at a time."""
    out = torch.empty(flat.numel() // BLOCK, dtype=torch.float32, device=flat.device)
    step = _chunk(flat.device)
    for start in range(0, flat.numel(), step):
        chunk = flat[start : start + step].float().view(-1, BLOCK)
        out[start // BLOCK : start // BLOCK + chunk.size(0)] = chunk.abs().amax(dim=1)
    return out


def _code_blockwise(values: Tensor, code: Tensor, midpoints: Tensor, block: int) -> Tensor:
    """Blockwise absmax coding of fp32 ``values`` on the sorted ``code`` (bitsandbytes'
    ``quantize_blockwise``): returns the codes (uint8) and each block's absmax."""
    n = values.numel()
    full = n - n % block
    absmax = values[:full].view(-1, block).abs().amax(dim=1)
    scaled = (values[:full].view(-1, block) * (1.0 / absmax.clamp(min=1e-38)).view(-1, 1)).view(-1)
    parts, scales = [scaled.clamp(-1, 1)], [absmax]
    if n % block:
        tail_max = values[full:].abs().max().clamp(min=1e-38)
        parts.append((values[full:] / tail_max).clamp(-1, 1))
        scales.append(tail_max.view(1))
    codes = torch.bucketize(torch.cat(parts), midpoints, out_int32=True).to(torch.uint8)
    return codes, torch.cat(scales)


def _quantize_nf4(weight: Tensor, out: Tensor) -> None:
    """Quantize ``weight`` (any float dtype, ``numel % 64 == 0``) into the packed bytes
    ``out`` (:func:`packed_bytes` long)."""
    flat = weight.reshape(-1)
    n = flat.numel()
    blocks = n // BLOCK
    _, nf4_mid, dyn, _ = _levels(flat.device)
    absmax = _block_absmax(flat)
    codes = out[: n // 2]
    step = _chunk(flat.device)
    for start in range(0, n, step):
        chunk = flat[start : start + step].float().view(-1, BLOCK)
        first = start // BLOCK
        inverse = 1.0 / absmax[first : first + chunk.size(0)].clamp(min=1e-38)
        scaled = (chunk * inverse.view(-1, 1)).clamp_(-1, 1).view(-1)
        q = torch.bucketize(scaled, nf4_mid, out_int32=True).to(torch.uint8)
        codes[start // 2 : (start + q.numel()) // 2] = (q[0::2] << 4) | q[1::2]
    offset = absmax.mean()
    absmax_codes, group_scales = _code_blockwise(
        absmax - offset, dyn, (dyn[:-1] + dyn[1:]) / 2, SCALE_GROUP
    )
    at = n // 2
    out[at : at + blocks] = absmax_codes
    at += _pad4(blocks)
    groups = group_scales.numel()
    out[at : at + 4 * groups].view(torch.float32).copy_(group_scales)
    out[at + 4 * groups : at + 4 * groups + 4].view(torch.float32).copy_(offset.view(1))


def nf4_block_scales(packed: Tensor, n: int) -> Tensor:
    """The (double-dequantized) fp32 absmax of each block of an NF4 weight of ``n`` weights
    packed in ``packed``: ``dyn[code] * group_scale + offset``."""
    blocks = n // BLOCK
    at = n // 2
    codes = packed[at : at + blocks]
    at += _pad4(blocks)
    groups = -(-blocks // SCALE_GROUP)
    group_scales = packed[at : at + 4 * groups].view(torch.float32)
    offset = packed[at + 4 * groups : at + 4 * groups + 4].view(torch.float32)
    _, _, dyn, _ = _levels(packed.device)
    values = dyn.index_select(0, codes.long())
    full = blocks - blocks % SCALE_GROUP
    scales = torch.empty(blocks, dtype=torch.float32, device=packed.device)
    whole_groups = group_scales[: full // SCALE_GROUP].view(-1, 1)
    scales[:full] = (values[:full].view(-1, SCALE_GROUP) * whole_groups).view(-1)
    if full < blocks:
        scales[full:] = values[full:] * group_scales[-1]
    return scales.add_(offset)


def _dequantize_nf4(packed: Tensor, shape: tuple[int, ...], dtype: torch.dtype) -> Tensor:
    n = math.prod(shape)
    _, _, _, pairs = _levels(packed.device)
    levels = pairs.index_select(0, packed[: n // 2].int()).view(torch.float32).view(-1, BLOCK)
    weight = levels.mul_(nf4_block_scales(packed, n).view(-1, 1)).view(shape)
    return weight if dtype == torch.float32 else weight.to(dtype)


# --- int8 -----------------------------------------------------------------------------------


def _quantize_int8(weight: Tensor, out: Tensor) -> None:
    rows, cols = weight.shape[0], weight.numel() // weight.shape[0]
    matrix = weight.reshape(rows, cols)
    n = rows * cols
    codes = out[:n].view(torch.int8).view(rows, cols)
    scales = out[_pad4(n) : _pad4(n) + 4 * rows].view(torch.float32)
    step = max(1, _chunk(weight.device) // max(cols, 1))
    for start in range(0, rows, step):
        chunk = matrix[start : start + step].float()
        absmax = chunk.abs().amax(dim=1)
        scales[start : start + chunk.size(0)] = absmax
        # A row of zeros codes as zeros (127 / 0 would make 0 * inf = NaN).
        inverse = torch.where(absmax > 0, 127.0 / absmax, torch.zeros_like(absmax))
        codes[start : start + chunk.size(0)] = torch.round(chunk * inverse.unsqueeze(-1)).to(
            torch.int8
        )


def _dequantize_int8(packed: Tensor, shape: tuple[int, ...], dtype: torch.dtype) -> Tensor:
    rows = shape[0]
    n = math.prod(shape)
    codes = packed[:n].view(torch.int8).view(rows, -1)
    scales = packed[_pad4(n) : _pad4(n) + 4 * rows].view(torch.float32)
    # bitsandbytes' int8 * fp32 promotion, as one conversion and in-place products (the
    # mixed-dtype multiply is the slow elementwise path on a CPU); the same fp32 roundings.
    weight = codes.float().mul_(scales.view(-1, 1)).mul_(_INV_127).view(shape)
    return weight if dtype == torch.float32 else weight.to(dtype)


_QUANTIZE = {"nf4": _quantize_nf4, "int8": _quantize_int8}
_DEQUANTIZE = {"nf4": _dequantize_nf4, "int8": _dequantize_int8}


def quantize(weight: Tensor, kind: str) -> Tensor:
    """``weight`` quantized as ``kind``: its packed bytes (a flat uint8 tensor)."""
    problem = unquantizable(kind, tuple(weight.shape))
    if problem is not None:
        raise ValueError(f"cannot quantize a weight as {kind}: {problem}")
    nbytes = packed_bytes(kind, tuple(weight.shape))
    out = torch.zeros(nbytes, dtype=torch.uint8, device=weight.device)
    _QUANTIZE[kind](weight.detach(), out)
    return out


def dequantize(packed: Tensor, kind: str, shape: tuple[int, ...], dtype: torch.dtype) -> Tensor:
    """The weight of ``shape`` that the bytes ``packed`` hold, in ``dtype`` (computed in fp32)."""
    return _DEQUANTIZE[kind](packed, tuple(shape), dtype)


def fake_quantize(weight: Tensor, kind: str) -> Tensor:
    """``weight`` as a QLoRA run computes with it: quantized and dequantized, in its dtype
    (what a merged export of a QLoRA run starts from)."""
    return dequantize(quantize(weight, kind), kind, tuple(weight.shape), weight.dtype)


class QuantizedWeight(nn.Module):
    """A frozen weight matrix held quantized: one flat ``uint8`` parameter, ``packed``.

    It stands where a Linear layer's ``weight`` was (a :class:`~plugintrain.model_zoo.lora.
    LoRALinear`'s), and answers the questions asked of that weight (``shape``, ``dtype``,
    ``device``, ``numel()``, ``requires_grad``), so code that counts or places weights
    needs no special case; the values come from :meth:`dequantize`.

    Args:
        shape: The weight's shape (out_features, in_features).
        kind: One of :data:`QUANTIZATIONS`.
        dtype: The dtype the weight had (what it dequantizes to by default).
        device: Where ``packed`` is allocated (``meta`` to fill it later).
    """

    def __init__(
        self, shape: tuple[int, ...], kind: str, dtype: torch.dtype, device: torch.device | str
    ) -> None:
        super().__init__()
        problem = unquantizable(kind, tuple(shape))
        if kind not in QUANTIZATIONS or problem is not None:
            why = problem or f"use one of {', '.join(QUANTIZATIONS)}"
            raise ValueError(f"cannot quantize a weight of shape {tuple(shape)} as {kind}: {why}")
        self.kind, self.shape, self.dtype = kind, torch.Size(shape), dtype
        nbytes = packed_bytes(kind, tuple(shape))
        self.packed = nn.Parameter(
            torch.zeros(nbytes, dtype=torch.uint8, device=device), requires_grad=False
        )

    @classmethod
    def from_weight(cls, weight: Tensor, kind: str) -> QuantizedWeight:
        """``weight`` (a plain tensor, or the meta device: filled later) quantized."""
        module = cls(tuple(weight.shape), kind, weight.dtype, weight.device)
        if not weight.is_meta:
            module.quantize_(weight)
        return module

    @property
    def requires_grad(self) -> bool:
        return False

    @property
    def device(self) -> torch.device:
        return self.packed.device

    @property
    def is_meta(self) -> bool:
        return self.packed.is_meta

    def numel(self) -> int:
        """Weights held (the matrix's, not the packed bytes')."""
        return self.shape.numel()

    def nbytes(self) -> int:
        """Bytes held for the whole weight (every shard together)."""
        return packed_bytes(self.kind, tuple(self.shape))

    @torch.no_grad()
    def quantize_(self, weight: Tensor) -> QuantizedWeight:
        """Quantize the whole ``weight`` into :attr:`packed` (this rank's shard of it, under
        FSDP2); returns self."""
        from plugintrain.core.tensor_boxes import local_box

        if tuple(weight.shape) != tuple(self.shape):
            raise ValueError(
                f"a {self.kind} weight of shape {tuple(self.shape)} cannot take a tensor of"
                f" shape {tuple(weight.shape)}"
            )
        local, ((start,), (length,)) = local_box(self.packed)
        whole = quantize(weight.to(local.device), self.kind)
        local.copy_(whole[start : start + length])
        return self

    def dequantize(self, dtype: torch.dtype | None = None) -> Tensor:
        """The weight, in ``dtype`` (default: the dtype it had); needs the whole ``packed``
        (under FSDP2, inside the block's forward or backward)."""
        return dequantize(self.packed, self.kind, tuple(self.shape), dtype or self.dtype)

    @torch.compiler.disable
    def linear(self, x: Tensor, bias: Tensor | None) -> Tensor:
        """``x W^T + b`` in ``x``'s dtype (the autocast dtype under autocast), the weight
        dequantized for the matmul and again for the backward, never kept. Run eagerly
        under ``torch.compile`` (a compiled block breaks its graph around it): the packed
        bytes are read through float32 views, which AOTAutograd cannot replay."""
        device = x.device.type
        autocasting = device != "meta" and torch.is_autocast_enabled(device)  # (dry runs: meta)
        if autocasting:
            x = x.to(torch.get_autocast_dtype(device))
        with torch.autocast(device, enabled=False) if autocasting else contextlib.nullcontext():
            y = _DequantizedMatmul.apply(x, self)
            return y if bias is None else y + bias.to(y.dtype)

    def extra_repr(self) -> str:
        return f"{self.kind}, shape={tuple(self.shape)}, bytes={self.nbytes()}"


class _DequantizedMatmul(torch.autograd.Function):
    """``x W^T`` with ``W`` dequantized in forward and again in backward (no weight kept,
    no weight gradient)."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, weight: QuantizedWeight) -> Tensor:
        ctx.weight = weight
        return F.linear(x, weight.dequantize(x.dtype))

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, None]:
        if not ctx.needs_input_grad[0]:
            return None, None
        return grad @ ctx.weight.dequantize(grad.dtype), None
