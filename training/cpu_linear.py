"""``linear``: ``F.linear`` for inference on CPU, with small batches computed as ``W @ x^T``.

Decode and verify steps multiply a few rows (one per request and draft position) by every
weight of the target, and draft positions end in a 49k-row LM head and Markov ``W2``.
Through ``F.linear`` MKL runs these as small-M sgemms, which on the AMD EPYC hosts this kit
is developed on took 2x the time of a single row already at 2 rows. Written as
``W @ x^T`` (the weight's output dimension as the long side) the same products measured,
in the same runs:

- the LM head ``[49152, 576]``: faster at every row count up to 64 (1.1-3.3x), mixed at 128;
- the 30 decoder layers' projections of the SmolLM2 target (inner dim 576 and 1536,
  425 MB streamed from memory per call): 1.5-1.6x at 2-4 rows in every run; at 1 row and
  from 7 rows on, runs disagreed (0.9-1.3x);
- ``W2 [49152, 128]``: 1.5-2.8x faster at 1-7 rows, even or slower from 8 rows on

(``scripts/bench_cpu_linear.py``, ``docs/benchmarks/cpu_linear.md``). Hence the row limits
below. A single row goes through the same product with the row duplicated: MKL's
matrix-vector path was slower than a two-row product (the rows-1 lines of the table).
GPUs, autograd (training) and ONNX export keep ``F.linear``.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F


def transposed_pays(rows: int, inner: int, outer: int) -> bool:
    """Where ``W @ x^T`` measured faster than ``F.linear`` in every run of the benchmark."""
    if inner < 512:  # the Markov head's W2
        return rows < 8
    if outer >= 16384:  # an LM head
        return rows <= 64
    return 2 <= rows <= 4  # a decoder layer's projection: elsewhere within the noise


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` for ``x [..., d]``, ``weight [n, d]``; the result is contiguous."""
    if (torch.onnx.is_in_onnx_export() or torch.jit.is_tracing() or x.device.type != "cpu"
            or (torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad))):
        return F.linear(x, weight, bias)
    rows = x.numel() // max(x.shape[-1], 1)
    if rows == 0 or not transposed_pays(rows, x.shape[-1], weight.shape[0]):
        return F.linear(x, weight, bias)
    return transposed_linear(x, weight, bias)


def project(module: torch.nn.Linear, x: torch.Tensor) -> torch.Tensor:
    """``module(x)`` for an ``nn.Linear`` (its weight and bias) through ``linear``."""
    return linear(x, module.weight, module.bias)


def transposed_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """The same product as ``W @ x^T`` (one row duplicated to two), whatever the row count."""
    d = x.shape[-1]
    rows = x.numel() // max(d, 1)
    flat = x.reshape(rows, d)
    if rows == 1:
        flat = flat.expand(2, d).contiguous()
    out = weight @ flat.t()
    if bias is not None:
        out = out + bias.unsqueeze(1)
    return out[:, :rows].t().contiguous().view(*x.shape[:-1], weight.shape[0])
