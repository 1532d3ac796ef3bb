"""Keep the C allocator's freed memory in the process, so that a decode step does not fault it in again.

A CPU decode step allocates and frees the same buffers every step: the logits (``[rows, V]``, 12.6 MB
at 64 rows of a 49,152-id vocabulary), the activations, the verify rule's work. glibc's malloc
serves an allocation above its mmap threshold with a fresh mapping that ``free`` hands back to the
kernel, and it trims a free heap top above its trim threshold; the threshold adapts to the sizes
freed, but not to every size a step uses. Each time, the next step's writes fault every 4 KiB page
in again, zero-filled by the kernel: thousands of minor faults per 64-row step of the embedded
SmolLM2 on 2 cores (``docs/benchmarks/host_memory.md``).

``retain_freed_memory`` sets, through ``mallopt``, the mmap threshold to glibc's largest (32 MiB on
a 64-bit build) and the trim threshold to 1 GiB: allocations under 32 MiB come from the heap, and
what a step frees stays there for the next one. The price is resident memory held at the steps'
high-water mark (up to 1 GiB of freed heap kept), the trade that server allocators such as jemalloc
and tcmalloc make too. It is process-wide, so the engine applies it once
(``EngineConfig.retain_host_memory``) and only on the CPU. Under a C library without ``mallopt``
(not glibc) it changes nothing and says so.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import logging

__all__ = ["retain_freed_memory", "MMAP_THRESHOLD", "TRIM_THRESHOLD"]

log = logging.getLogger(__name__)

_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # <malloc.h>
MMAP_THRESHOLD = 32 << 20  # glibc's ceiling for M_MMAP_THRESHOLD on 64-bit (DEFAULT_MMAP_THRESHOLD_MAX)
TRIM_THRESHOLD = 1 << 30

_applied: bool | None = None


def retain_freed_memory() -> bool:
    """Apply the two ``mallopt`` settings once per process; -> whether they are in force."""
    global _applied
    if _applied is None:
        _applied = _apply()
    return _applied


def _apply() -> bool:
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name)
        mallopt = libc.mallopt
    except (OSError, AttributeError, TypeError):
        log.info("host memory: no mallopt in the C library (%s); freed memory goes back to the system", name)
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    ok = mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD) == 1 and mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD) == 1
    if ok:
        log.info("host memory: freed memory kept in the heap (mmap threshold %d MiB, trim threshold %d MiB)",
                 MMAP_THRESHOLD >> 20, TRIM_THRESHOLD >> 20)
    else:
        log.info("host memory: mallopt refused the thresholds; freed memory goes back to the system")
    return ok
