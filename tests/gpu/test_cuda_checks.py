"""The gpu tier: the checks of ``make gpu-check`` as tests, on the first CUDA device.

Deselected by default (pyproject's ``-m 'not gpu'``); ``pytest -m gpu`` runs them on a
machine with a GPU. Each compares the device with the CPU (see :mod:`plugintrain.bench.gpu_checks`).
"""

from __future__ import annotations

import pytest
import torch

from plugintrain.bench import gpu_checks

pytestmark = pytest.mark.gpu
CUDA = torch.device("cuda", 0)


@pytest.fixture(autouse=True, scope="module")
def _quiet() -> None:
    gpu_checks.quiet()


@pytest.mark.parametrize("family", gpu_checks.FAMILIES)
def test_logits_on_cuda_equal_the_cpu_s(family: str) -> None:
    check = gpu_checks.logits_parity(family, CUDA)
    assert check.ok, check.detail


@pytest.mark.parametrize("precision", gpu_checks.PRECISIONS)
def test_reduced_precision_trains_on_cuda(precision: str) -> None:
    check = gpu_checks.precision_trains(precision, CUDA)
    assert check.ok, check.detail


@pytest.mark.parametrize("strategy", gpu_checks.STRATEGIES)
def test_strategy_on_cuda_gives_the_cpu_losses(strategy: str) -> None:
    check = gpu_checks.strategy_parity(strategy, CUDA)
    assert check.ok, check.detail


@pytest.mark.parametrize("preset", list(gpu_checks.THROUGHPUT_RUNS))
def test_throughput_is_measured(preset: str) -> None:
    check = gpu_checks.throughput(preset, CUDA)
    figures = check.figures
    assert figures["tokens_per_s"] > 0 and figures["peak_bytes"] > 0, check.detail
    assert figures["loss"] is not None and figures["loss"] < 20, check.detail
    name = torch.cuda.get_device_name(CUDA)
    from plugintrain.core.peak_flops import chip_of

    if chip_of(name) is not None:  # a chip in the dense-peak table has an MFU
        assert 0 < figures["mfu"] < 1, check.detail


@pytest.mark.parametrize("kind", gpu_checks.QUANTIZATIONS)
def test_qlora_dequantize_on_cuda_equals_the_cpu_s(kind: str) -> None:
    check = gpu_checks.qlora_parity(kind, CUDA)
    assert check.ok, check.detail


@pytest.mark.parametrize("name", list(gpu_checks.QLORA_RUNS))
def test_qlora_throughput_is_measured(name: str) -> None:
    check = gpu_checks.qlora_throughput(name, CUDA)
    assert check.figures["tokens_per_s"] > 0 and check.figures["peak_bytes"] > 0, check.detail
    assert check.figures["loss"] is not None and check.figures["loss"] < 20, check.detail
