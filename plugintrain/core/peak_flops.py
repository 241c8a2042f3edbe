"""Dense peak FLOP/s of accelerators, the denominator of MFU.

NVIDIA's datasheets list Tensor Core throughput "with sparsity" (2:4 structured sparsity,
twice the dense rate) beside or instead of the dense figure. MFU compares a model's
dense matmul FLOPs with the device's dense peak, so the table holds dense figures only.
Lightning 2.6's table takes the sparse ones for the H200 and H100 NVL, and does not know
the plain ``NVIDIA H200`` name that H200 SXM boards report.

The chip is read from ``torch.cuda.get_device_name`` (``NVIDIA H100 80GB HBM3``,
``NVIDIA A100-SXM4-80GB``, ``NVIDIA H200 NVL``, ...) by :func:`chip_of`. fp32 matmuls
count at the TF32 rate when torch lets them use TF32
(``torch.get_float32_matmul_precision() != "highest"``).
"""

from __future__ import annotations

import platform
import re
from pathlib import Path

import torch

_T = 1e12
# Chip -> compute type -> dense FLOP/s, from NVIDIA's datasheets (sparse figures halved).
DENSE_PEAK_FLOPS: dict[str, dict[str, float]] = {
    # H100 SXM5, and the H200 / GH200 with the same Hopper SMs and clocks.
    "h100 sxm": {"fp32": 66.9 * _T, "tf32": 494.7 * _T, "bf16": 989.4 * _T, "fp16": 989.4 * _T},
    "h200": {"fp32": 66.9 * _T, "tf32": 494.7 * _T, "bf16": 989.4 * _T, "fp16": 989.4 * _T},
    "gh200": {"fp32": 66.9 * _T, "tf32": 494.7 * _T, "bf16": 989.4 * _T, "fp16": 989.4 * _T},
    "h100 nvl": {"fp32": 60.0 * _T, "tf32": 417.5 * _T, "bf16": 835.5 * _T, "fp16": 835.5 * _T},
    "h200 nvl": {"fp32": 60.0 * _T, "tf32": 417.5 * _T, "bf16": 835.5 * _T, "fp16": 835.5 * _T},
    "h100 pcie": {"fp32": 51.2 * _T, "tf32": 378.0 * _T, "bf16": 756.0 * _T, "fp16": 756.0 * _T},
    "a100": {"fp32": 19.5 * _T, "tf32": 156.0 * _T, "bf16": 312.0 * _T, "fp16": 312.0 * _T},
    "a10": {"fp32": 31.2 * _T, "tf32": 62.5 * _T, "bf16": 125.0 * _T, "fp16": 125.0 * _T},
    "l40s": {"fp32": 91.6 * _T, "tf32": 183.0 * _T, "bf16": 362.05 * _T, "fp16": 362.05 * _T},
    "l4": {"fp32": 30.3 * _T, "tf32": 60.0 * _T, "bf16": 121.0 * _T, "fp16": 121.0 * _T},
    # Volta: no bf16, no tf32.
    "v100 sxm": {"fp32": 15.7 * _T, "fp16": 125.0 * _T},
    "v100 pcie": {"fp32": 14.0 * _T, "fp16": 112.0 * _T},
}

# (pattern on the lower-cased device name, chip), first match wins: specific before general.
_CHIPS = (
    (r"gh200", "gh200"),
    (r"h200.*nvl", "h200 nvl"),
    (r"h200", "h200"),
    (r"h100.*nvl", "h100 nvl"),
    (r"h100.*pcie", "h100 pcie"),
    (r"h100", "h100 sxm"),  # "NVIDIA H100 80GB HBM3", "NVIDIA H100 SXM5 ..."
    (r"a100", "a100"),
    (r"\ba10\b", "a10"),  # not the A10G, whose rates NVIDIA does not publish
    (r"l40s", "l40s"),
    (r"\bl4\b", "l4"),
    (r"v100.*pcie", "v100 pcie"),
    (r"v100", "v100 sxm"),
)
_DTYPES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}


def chip_of(device_name: str) -> str | None:
    """The :data:`DENSE_PEAK_FLOPS` key of a CUDA device name, or None if unknown."""
    name = device_name.lower()
    return next((chip for pattern, chip in _CHIPS if re.search(pattern, name)), None)


def dense_peak_flops(device_name: str, dtype: torch.dtype, tf32: bool = False) -> float | None:
    """Dense peak FLOP/s of ``device_name`` for matmuls in ``dtype`` (fp32 at the TF32 rate
    with ``tf32``); None for an unknown chip or a type it has no rate for."""
    chip = chip_of(device_name)
    kind = _DTYPES.get(dtype)
    if chip is None or kind is None:
        return None
    rates = DENSE_PEAK_FLOPS[chip]
    if kind == "fp32" and tf32 and "tf32" in rates:
        kind = "tf32"
    return rates.get(kind)


def device_peak_flops(device: torch.device, dtype: torch.dtype) -> float | None:
    """:func:`dense_peak_flops` of a CUDA ``device``, TF32 as torch is set; None elsewhere."""
    if device.type != "cuda":
        return None
    tf32 = torch.get_float32_matmul_precision() != "highest"
    return dense_peak_flops(torch.cuda.get_device_name(device), dtype, tf32)


def cpu_name() -> str:
    """The CPU's model name (``/proc/cpuinfo``'s ``model name``; else what ``platform``
    tells), for reports and run records."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()
