"""``linear``: ``F.linear`` for inference on CPU, or ``W @ x^T`` where that measured faster here.

Decode and verify steps multiply a few rows (one per request and draft position) by every
weight of the target, and draft positions end in a 49k-row LM head and Markov ``W2``. Which
way of computing such a small-M product is fastest depends on the CPU and its BLAS, in
opposite directions on the two hosts this kit was measured on (``scripts/bench_cpu_linear.py``,
``docs/benchmarks/cpu_linear.md``):

- AMD EPYC, 2 cores: ``W @ x^T`` (the weight's output dimension as the long side) was
  1.1-3.3x faster for the LM head up to 64 rows, 1.5-1.9x for the decoder layers at
  2-4 rows, 1.5-2.8x for ``W2`` at 1-7 rows;
- Intel Xeon, 2 cores: ``F.linear`` was faster at almost every row count (2.5-2.9x for the LM head
  at 1-2 rows, 2.2-2.5x for the layers at 1-2 rows).

So the choice is measured, not hard-coded: the first calls for each (row bucket, inner,
outer) shape alternate between the two forms on the real weights and inputs (so they see the
real cache state: the decoder layers stream 405 MB per step), ``TRIALS`` of each, and the
shape then keeps ``W @ x^T`` only if its median was ``MARGIN`` times faster. The two forms
agree to float32 rounding (about 1e-5 relative), like ``F.linear`` at two row counts.
``DSPARK_CPU_LINEAR=flinear`` or ``=transposed`` fixes the choice (for bit-reproducible runs
across processes); GPUs, autograd (training) and ONNX export always use ``F.linear``.
"""
from __future__ import annotations

import os
import statistics
import time

import torch
import torch.nn.functional as F

TRIALS = 5  # timed calls of each form per shape before choosing
MARGIN = 1.1  # W @ x^T must be this much faster: near ties are noise, F.linear is the default
MAX_ROWS = 64  # beyond this F.linear (large-M sgemm) won on every host
_MODES = ("measure", "flinear", "transposed")

_choice: dict[tuple[int, int, int], bool] = {}  # (row bucket, inner, outer) -> use W @ x^T
_trials: dict[tuple[int, int, int], tuple[list[float], list[float]]] = {}  # -> (F.linear s, W @ x^T s)


def _mode() -> str:
    mode = os.environ.get("DSPARK_CPU_LINEAR", "measure")
    if mode not in _MODES:
        raise ValueError(f"DSPARK_CPU_LINEAR={mode!r}: expected one of {', '.join(_MODES)}")
    return mode


def row_bucket(rows: int) -> int:
    """Row counts that share a measurement: 1, 2, 3-4, 5-8, ... (powers of two)."""
    return 1 << max(rows - 1, 0).bit_length()


def transposed_pays(rows: int, inner: int, outer: int) -> bool | None:
    """The measured choice for this shape: True for ``W @ x^T``, False for ``F.linear``, None
    while it is still being measured."""
    if rows < 1 or rows > MAX_ROWS:
        return False
    return _choice.get((row_bucket(rows), inner, outer))


def reset_choices() -> None:
    """Forget every measurement (tests; a process that moved to other hardware)."""
    _choice.clear()
    _trials.clear()


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
           timer=time.perf_counter) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` for ``x [..., d]``, ``weight [n, d]``; the result is contiguous."""
    if (torch.onnx.is_in_onnx_export() or torch.jit.is_tracing() or x.device.type != "cpu"
            or (torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad))):
        return F.linear(x, weight, bias)
    rows = x.numel() // max(x.shape[-1], 1)
    mode = _mode()
    if rows == 0 or rows > MAX_ROWS or mode == "flinear":
        return F.linear(x, weight, bias)
    if mode == "transposed":
        return transposed_linear(x, weight, bias)
    key = (row_bucket(rows), x.shape[-1], weight.shape[0])
    choice = _choice.get(key)
    if choice is not None:
        return transposed_linear(x, weight, bias) if choice else F.linear(x, weight, bias)
    return _timed_trial(key, x, weight, bias, timer)


def _timed_trial(key: tuple[int, int, int], x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                 timer) -> torch.Tensor:
    """One measured call, alternating the forms; the shape's choice is made after TRIALS of each."""
    plain, transposed = _trials.setdefault(key, ([], []))
    use_transposed = len(transposed) < len(plain)
    t0 = timer()
    out = transposed_linear(x, weight, bias) if use_transposed else F.linear(x, weight, bias)
    (transposed if use_transposed else plain).append(timer() - t0)
    if len(transposed) >= TRIALS:
        # the first call of each form pays one-off costs (allocator, BLAS set-up): not counted
        _choice[key] = statistics.median(plain[1:]) > MARGIN * statistics.median(transposed[1:])
        del _trials[key]
    return out


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
