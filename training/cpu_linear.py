"""``linear``: ``x @ W^T + b`` for inference on the CPU, through the packed kernel where it runs.

Inference products on the CPU (the target's LM head, the drafters' layers, LM head and
Markov ``W2``) go through ``cpu_gemm``: each weight is packed on its first use and the packed
copy kept while the weight lives (repacked if the weight is modified in place); every row of
the result is the same bits whatever else is in the call. Everything else (GPUs, other
dtypes, autograd in training, ONNX export, tracing) uses ``F.linear``.
``scripts/bench_cpu_linear.py`` measures the two side by side (``docs/benchmarks/cpu_linear.md``).

``DSPARK_CPU_LINEAR=flinear`` makes every product ``F.linear`` (bit-for-bit agreement with
a plain PyTorch forward, as the export parity check wants, and no packed copies); the
default ``kernel`` uses the kernel where it builds and ``F.linear`` where it does not.
"""
from __future__ import annotations

import os
import weakref

import torch
import torch.nn.functional as F

from . import cpu_gemm

MODES = ("kernel", "flinear")

# id(weight) -> (weak reference to it, its version when packed, the packed copy)
_packed: dict[int, tuple[weakref.ref, int, cpu_gemm.PackedWeight]] = {}


def mode() -> str:
    """The product in force: ``DSPARK_CPU_LINEAR`` (default ``kernel``), checked."""
    value = os.environ.get("DSPARK_CPU_LINEAR", "kernel")
    if value not in MODES:
        raise ValueError(f"DSPARK_CPU_LINEAR={value!r}: expected one of {', '.join(MODES)}")
    return value


def uses_kernel(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether ``linear(x, weight)`` runs on the packed kernel."""
    if (x.device.type != "cpu" or x.dtype != torch.float32 or weight.dtype != torch.float32 or weight.dim() != 2
            or torch.onnx.is_in_onnx_export() or torch.jit.is_tracing()
            or (torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad))):
        return False
    return mode() == "kernel" and cpu_gemm.available()


def packed(weight: torch.Tensor) -> cpu_gemm.PackedWeight:
    """The packed copy of ``weight``, made on first use and again after an in-place change."""
    key = id(weight)
    hit = _packed.get(key)
    if hit is not None and hit[0]() is weight and hit[1] == weight._version:
        return hit[2]
    p = cpu_gemm.pack(weight)
    _packed[key] = (weakref.ref(weight, lambda _, key=key: _packed.pop(key, None)), weight._version, p)
    return p


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` for ``x [..., d]``, ``weight [n, d]``; the result is contiguous."""
    if not uses_kernel(x, weight):
        return F.linear(x, weight, bias)
    d = x.shape[-1]
    out = cpu_gemm.gemm(x.reshape(-1, d), packed(weight), bias)
    return out.view(*x.shape[:-1], weight.shape[0])


def project(module: torch.nn.Linear, x: torch.Tensor) -> torch.Tensor:
    """``module(x)`` for an ``nn.Linear`` (its weight and bias) through ``linear``."""
    return linear(x, module.weight, module.bias)
