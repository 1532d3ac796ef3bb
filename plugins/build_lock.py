"""Builds of torch C++/CUDA extensions that survive a build killed midway.

A build killed midway (Ctrl-C, a timeout) leaves torch's ``lock`` file in the build directory,
and torch then waits for it forever: every later process that needs the extension hangs
without a word. So builds of one extension are serialised by an ``fcntl`` lock of our own,
which the kernel releases when its holder dies; whoever holds it knows that a ``lock`` file
left in the directory belongs to a dead build, and removes it before building. Used by the
CPU kernels (``plugins/cpu_build.py``) and the CUDA plugin (``plugins/ops.py``).
"""
from __future__ import annotations

import fcntl
import logging
import os
import sys
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

log = logging.getLogger(__name__)

__all__ = ["build_directory", "exclusive_build"]


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
