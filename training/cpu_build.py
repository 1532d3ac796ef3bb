"""C++ extensions for CPU inference, built on first use.

The kit's CPU kernels (``cpu_gemm``, the engine's varlen attention and fused decoder
stack) are C++ compiled with ``-O3 -march=native`` by ``torch.utils.cpp_extension.load_inline``:
once per process, cached on disk under torch's extensions directory, the build's name keyed
by the CPU's feature flags (a ``-march=native`` build belongs to one kind of CPU). Where a
build fails (no compiler, no headers) the caller's fallback runs and the log says why, once.

A build killed midway (Ctrl-C, a timeout) leaves torch's ``lock`` file in the build directory,
and torch then waits for it forever: every later process that needs the extension hangs
without a word. So builds of one extension are serialised by an ``fcntl`` lock of our own,
which the kernel releases when its holder dies; whoever holds it knows that a ``lock`` file
left in the directory belongs to a dead build, and removes it before building.
"""
from __future__ import annotations

import fcntl
import hashlib
import logging
import os
import sys
import threading
from contextlib import contextmanager
from pathlib import Path
from typing import Callable, Iterator

log = logging.getLogger(__name__)

__all__ = ["cpu_tag", "CpuExtension", "build_directory", "exclusive_build"]

FLAGS = ["-O3", "-march=native", "-fopenmp"]


def cpu_tag() -> str:
    """Short hash of the CPU's feature flags."""
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((ln for ln in f if ln.startswith("flags")), "")
    except OSError:
        flags = ""
    return hashlib.sha256(flags.encode()).hexdigest()[:8]


def build_directory(name: str) -> Path:
    """Where torch builds and caches extension ``name``: ``$TORCH_EXTENSIONS_DIR/name``, else
    ``<torch's default root>/py<version>_<cpu|cuXYZ>/name`` (torch's own layout, so builds made
    before are found)."""
    import torch
    from torch.utils.cpp_extension import get_default_build_root

    root = os.environ.get("TORCH_EXTENSIONS_DIR")
    if root is None:
        accel = f"cu{torch.version.cuda.replace('.', '')}" if torch.version.cuda else "cpu"
        root = os.path.join(get_default_build_root(),
                            f"py{sys.version_info.major}{sys.version_info.minor}{sys.abiflags}_{accel}")
    return Path(root) / name


@contextmanager
def exclusive_build(directory: Path) -> Iterator[None]:
    """Hold the build of ``directory`` alone (an ``fcntl`` lock, released if this process dies);
    a torch ``lock`` file found there on entry was left by a build that died, and is removed."""
    directory.mkdir(parents=True, exist_ok=True)
    with open(directory.parent / f".{directory.name}.build-lock", "w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            stale = directory / "lock"
            if stale.exists():
                log.warning("%s: removing the lock of a build that did not finish", directory)
                stale.unlink(missing_ok=True)
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


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
