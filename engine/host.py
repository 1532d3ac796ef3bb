"""What machine a benchmark ran on, for its report: CPU results differ between CPU models
(the fastest small-row product, the bandwidth a step streams at, the vector units)."""
from __future__ import annotations

import platform
from pathlib import Path


def cpu_model() -> str:
    """The CPU's model name (``/proc/cpuinfo`` on Linux), else the machine type."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def cpu_label(threads: int) -> str:
    """``cpu: <model> (<threads> threads)``, the device field of CPU benchmark reports."""
    return f"cpu: {cpu_model()} ({threads} threads)"
