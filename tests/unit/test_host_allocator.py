"""``ReleaseFreedMemory`` / ``set_mmap_threshold``: a freed allocation above the threshold
goes back to the system (the process's resident pages, read from ``/proc``), and glibc's
default keeps it; run in fresh interpreters (the threshold is process-wide)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from plugintrain.callbacks import ReleaseFreedMemory
from plugintrain.core.host_allocator import glibc

PROBE = """
import sys
from plugintrain.core.host_allocator import set_mmap_threshold

def resident():
    return int(open("/proc/self/statm").read().split()[1]) * 4096

if sys.argv[1] == "set":
    assert set_mmap_threshold(8 * 2**20)
size = 12 * 2**20  # above 8 MiB, below glibc's 32 MiB ceiling on its own threshold
for _ in range(3):  # glibc raises its threshold past 12 MiB on the first free
    block = bytearray(size)
    del block
block = bytearray(size)
held = resident()
del block
print((held - resident()) / 2**20)
"""


def _returned_mib(mode: str) -> float:
    done = subprocess.run(
        [sys.executable, "-c", PROBE, mode], capture_output=True, text=True, check=True
    )
    return float(done.stdout)


@pytest.mark.skipif(glibc() is None, reason="the C library is not glibc")
def test_a_freed_block_above_the_threshold_goes_back_to_the_system() -> None:
    assert _returned_mib("set") >= 11.9
    assert _returned_mib("default") < 1.0  # glibc's default heap keeps it


def test_a_threshold_glibc_refuses_is_one_line_naming_the_value() -> None:
    with pytest.raises(ValueError, match=r"threshold_mib=64: glibc takes 0 to 32; pass"):
        ReleaseFreedMemory(threshold_mib=64)
