"""Vocabulary-sized projections (LM head, Markov bias) for inference on CPU.

``x [..., d] @ W[V, d]^T`` with a 49k-row ``W`` and a handful of rows in ``x`` is what a
decode step, a verify step and every draft position end in. Through ``F.linear`` MKL
runs it as a small-M sgemm that streams the vocabulary side badly on the AMD EPYC hosts
this kit is developed on; the same product written as ``W @ x^T`` (the vocabulary as the
long side) measured about 2x faster at 2-64 rows (``scripts/bench_vocab_projection.py``,
``docs/benchmarks/vocab_projection.md``). GPUs, autograd and ONNX export keep ``F.linear``.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F


def vocab_logits(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``x [..., d]``, ``weight [V, d]`` -> ``[..., V]``, contiguous."""
    if (torch.onnx.is_in_onnx_export() or torch.jit.is_tracing() or x.device.type != "cpu"
            or (torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad))):
        return F.linear(x, weight)
    rows = x.numel() // max(x.shape[-1], 1)
    if rows < 2:  # a matrix-vector product either way
        return F.linear(x, weight)
    flat = x.reshape(rows, x.shape[-1])
    return (weight @ flat.t()).t().contiguous().view(*x.shape[:-1], weight.shape[0])
