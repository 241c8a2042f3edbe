"""The C allocator's threshold above which freed memory goes back to the system.

On CPU, tensors live in memory from glibc's ``malloc``. A request above its *mmap
threshold* gets pages of its own, returned to the system when the tensor is freed; a
smaller one is carved from the heap, and what the heap frees is kept for later requests.
glibc raises the threshold each time it frees such a mapping (up to 32 MiB on 64-bit
systems), so after the first step of training the activations of a long row (a few MiB
to tens of MiB each) all come from the heap. Recomputation frees and allocates them
again block after block in sizes that do not fit the holes left, and the heap grows well
past what is live: the chat recipe at 2,048-token rows holds 1.07 GB of live tensors at
its peak and 3.3 GiB of RSS.

:func:`set_mmap_threshold` fixes the threshold (``mallopt(M_MMAP_THRESHOLD, n)``, which
also stops glibc from raising it): every request of ``n`` bytes or more is mapped and
unmapped on its own. The cost is the kernel zeroing each new page: at 8 MiB the chat
recipe peaks at 1.8 GiB and takes 1.12x as long (docs/benchmarks/packed_attention.md).
Importing this module imports neither torch nor Lightning.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import platform

M_MMAP_THRESHOLD = -3
"""glibc's ``mallopt`` parameter number of the mmap threshold (``malloc.h``)."""
MAX_MMAP_THRESHOLD = 32 * 2**20
"""glibc's ceiling on the threshold on 64-bit systems (``HEAP_MAX_SIZE / 2``):
``mallopt`` refuses a larger value."""


def glibc() -> ctypes.CDLL | None:
    """The running process's C library when it is glibc (it has ``mallopt``), else None
    (macOS, musl, Windows)."""
    if platform.system() != "Linux":
        return None
    name = ctypes.util.find_library("c") or "libc.so.6"
    try:
        libc = ctypes.CDLL(name)
    except OSError:
        return None
    return libc if hasattr(libc, "mallopt") and hasattr(libc, "gnu_get_libc_version") else None


def set_mmap_threshold(threshold: int) -> bool:
    """Map every allocation of ``threshold`` bytes or more on its own, so that freeing it
    returns its pages to the system; True if the C library took the setting, False where
    it is not glibc.

    Raises:
        ValueError: If ``threshold`` is outside 0..``MAX_MMAP_THRESHOLD``.
    """
    if not 0 <= threshold <= MAX_MMAP_THRESHOLD:
        raise ValueError(
            f"mmap threshold {threshold} bytes: glibc takes 0 to {MAX_MMAP_THRESHOLD}"
            f" ({MAX_MMAP_THRESHOLD // 2**20} MiB); pass a value in that range"
        )
    libc = glibc()
    if libc is None:
        return False
    return bool(libc.mallopt(ctypes.c_int(M_MMAP_THRESHOLD), ctypes.c_int(threshold)))
