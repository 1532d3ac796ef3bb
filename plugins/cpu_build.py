"""C++ extensions for CPU inference, built on first use.

The kit's CPU kernels (``cpu_gemm``, the engine's varlen attention and fused decoder
stack) are C++ compiled with ``-O3 -march=native`` by ``torch.utils.cpp_extension.load_inline``:
once per process, cached on disk under torch's extensions directory, the build's name keyed
by the CPU's feature flags (a ``-march=native`` build belongs to one kind of CPU). Where a
build fails (no compiler, no headers) the caller's fallback runs and the log says why, once.

A build killed midway does not hang later processes: builds run under
``build_lock.exclusive_build``.
"""
from __future__ import annotations

import hashlib
import logging
import threading
from typing import Callable

from .build_lock import build_directory, exclusive_build

log = logging.getLogger(__name__)

__all__ = ["cpu_tag", "CpuExtension"]

FLAGS = ["-O3", "-march=native", "-fopenmp"]


def cpu_tag() -> str:
    """Short hash of the CPU's feature flags."""
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((ln for ln in f if ln.startswith("flags")), "")
    except OSError:
        flags = ""
    return hashlib.sha256(flags.encode()).hexdigest()[:8]


class CpuExtension:
    """One extension, built on the first ``load()``.

    ``sources`` gives the C++ text (called at build time, so it may join other extensions'
    kernel sources); ``python_module``: the source defines its own pybind11 module, which
    ``load()`` returns (else the source registers torch ops and ``load()`` returns True).
    ``check(loaded)`` runs once after the build: it returns why the build cannot be used on
    this machine (the extension is then treated as unavailable), or None.
    """

    def __init__(self, name: str, sources: Callable[[], str], fallback: str, python_module: bool = False,
                 check: Callable[[object], str | None] | None = None):
        self.name, self.sources, self.fallback = name, sources, fallback
        self.python_module, self.check = python_module, check
        self._lock = threading.Lock()
        self._loaded: object = None
        self._done = False

    def load(self) -> object:
        """The built extension (module or True), or None where it cannot be built or used."""
        if self._done:  # the hot path: callers ask on every use
            return self._loaded
        with self._lock:
            if not self._done:
                self._loaded = self._build()
                self._done = True
        return self._loaded

    def _build(self) -> object:
        try:
            from torch.utils.cpp_extension import load_inline
            name = f"{self.name}_{cpu_tag()}"
            directory = build_directory(name)
            with exclusive_build(directory):
                loaded = load_inline(name=name, cpp_sources=self.sources(), functions=None, extra_cflags=FLAGS,
                                     is_python_module=self.python_module, verbose=False,
                                     build_directory=str(directory))
        except Exception as exc:  # no compiler, no headers
            log.warning("%s could not be built (%s): %s", self.name, exc, self.fallback)
            return None
        loaded = loaded if self.python_module else True
        why = self.check(loaded) if self.check is not None else None
        if why is not None:
            log.warning("%s is not usable here (%s): %s", self.name, why, self.fallback)
            return None
        return loaded
