"""``linear``: ``x @ W^T + b`` for inference on the CPU, through the small-row kernel where it fits.

Decode and verify steps multiply a few rows (one per request and draft position) by every
weight of the target, and draft positions end in a 49k-row LM head and Markov ``W2``. At
those row counts a general BLAS pays for packing the weight (``F.linear`` at 4-8 rows cost
about twice its 1-row time on this kit's Xeon), so inference products of up to
``MAX_ROWS`` rows go through ``small_gemm`` (one pass over the weight, and each output row
independent of the others in the call: see that module); larger products (prompt
prefill) and everything else (GPUs, autograd in training, ONNX export, tracing) use
``F.linear``. ``scripts/bench_cpu_linear.py`` measures the two side by side
(``docs/benchmarks/cpu_linear.md``).

``DSPARK_CPU_LINEAR=flinear`` makes every product ``F.linear`` (bit-for-bit agreement with
a plain PyTorch forward, as the export parity check wants); the default ``kernel`` uses
the kernel where it builds and ``F.linear`` where it does not.
"""
from __future__ import annotations

import os

import torch
import torch.nn.functional as F

from . import small_gemm

MAX_ROWS = 64  # above this the kernel's row tiles lose to the large-M sgemm (cpu_linear.md)
MODES = ("kernel", "flinear")


def mode() -> str:
    """The product in force: ``DSPARK_CPU_LINEAR`` (default ``kernel``), checked."""
    value = os.environ.get("DSPARK_CPU_LINEAR", "kernel")
    if value not in MODES:
        raise ValueError(f"DSPARK_CPU_LINEAR={value!r}: expected one of {', '.join(MODES)}")
    return value


def uses_kernel(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether ``linear(x, weight)`` runs on the small-row kernel."""
    if (x.device.type != "cpu" or x.dtype != torch.float32 or weight.dtype != torch.float32
            or torch.onnx.is_in_onnx_export() or torch.jit.is_tracing()
            or (torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad))):
        return False
    rows = x.numel() // max(x.shape[-1], 1)
    return 0 < rows <= MAX_ROWS and weight.is_contiguous() and mode() == "kernel" and small_gemm.available()


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` for ``x [..., d]``, ``weight [n, d]``; the result is contiguous."""
    if not uses_kernel(x, weight):
        return F.linear(x, weight, bias)
    d = x.shape[-1]
    out = small_gemm.small_gemm(x.reshape(-1, d), weight, bias)
    return out.view(*x.shape[:-1], weight.shape[0])


def project(module: torch.nn.Linear, x: torch.Tensor) -> torch.Tensor:
    """``module(x)`` for an ``nn.Linear`` (its weight and bias) through ``linear``."""
    return linear(x, module.weight, module.bias)
