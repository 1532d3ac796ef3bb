"""The engine's intra-op thread count and pinning: chosen once, stated in every report.

A CPU step is a chain of small matrix products and attention loops on torch's intra-op
(OpenMP) threads; how many there are decides the speed as much as any kernel, and a peer
engine compared at another thread budget is not the same comparison. ``configure`` sets
the count (``EngineConfig.threads``; 0 keeps torch's own choice, one thread per core the
process may run on) and ``describe`` gives what benchmark rows record: threads, cores
usable, and the OpenMP pinning in force (set through ``OMP_PROC_BIND`` / ``OMP_PLACES`` /
``KMP_AFFINITY`` before the process starts: torch's thread pool cannot be re-pinned later).
"""
from __future__ import annotations

import os

import torch

__all__ = ["usable_cores", "configure", "describe"]

_PIN_VARS = ("OMP_PROC_BIND", "OMP_PLACES", "KMP_AFFINITY", "GOMP_CPU_AFFINITY")


def usable_cores() -> int:
    """Cores this process may run on (its affinity mask), else the machine's count."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def configure(threads: int = 0) -> int:
    """Set torch's intra-op thread count to ``threads`` (0: leave torch's choice); -> the count in force."""
    if threads < 0:
        raise ValueError(f"threads must be >= 0 (0: torch's default), got {threads}")
    if threads and threads != torch.get_num_threads():
        torch.set_num_threads(threads)
    return torch.get_num_threads()


def describe() -> dict:
    """``{"threads", "cores", "pinning"}`` for a benchmark row or a log line."""
    pins = [f"{v}={os.environ[v]}" for v in _PIN_VARS if os.environ.get(v)]
    return {"threads": torch.get_num_threads(), "cores": usable_cores(),
            "pinning": ", ".join(pins) if pins else "none (the OS places the threads)"}
