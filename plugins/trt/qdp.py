"""Optional: DSparkVerify / DSparkSchedule as TensorRT Python plugins (``tensorrt.plugin``).

An alternative to the C++ plugin library for hosts that run TensorRT from Python: the same
plugin ids and attributes as plugins/contract.py (``dspark::DSparkVerify`` and
``dspark::DSparkSchedule``, version "1"), executed by the PyTorch op of
``dspark.plugins.ops`` on TensorRT's stream. Register either this or the C++ library, not
both (same names). Only the sampled 7-input form of DSparkVerify is offered here (a Python
plugin has one fixed signature); ``greedy=1`` still works with it, the sampling inputs are
then ignored. Not run in this repository's CI (no TensorRT there).

    from dspark.plugins.trt import qdp
    qdp.register()          # before parsing the ONNX model / building the engine
"""
# No `from __future__ import annotations`: tensorrt.plugin reads the annotations as types.
from typing import Tuple

import numpy as np
import numpy.typing as npt

from dspark.plugins import contract

try:  # TensorRT is optional
    import tensorrt as trt
    import tensorrt.plugin as trtp
except ImportError:  # pragma: no cover - depends on the host
    trt = None
    trtp = None

__all__ = ["available", "register"]

_registered = False


def available() -> bool:
    """True when ``tensorrt.plugin`` can be imported here."""
    return trtp is not None


class _Cai:
    """A __cuda_array_interface__ view with another element type (bf16 has none of its own)."""

    def __init__(self, t, typestr: str, itemsize: int) -> None:
        self.__cuda_array_interface__ = {
            "shape": tuple(t.shape), "typestr": typestr, "version": 3, "data": (t.data_ptr, False),
            "strides": tuple(s * itemsize for s in t.strides),
        }


def _as_torch(t):
    """A zero-copy torch view of a tensorrt.plugin Tensor."""
    import torch

    if t.dtype == trt.DataType.BF16:
        return torch.as_tensor(_Cai(t, "<i2", 2), device="cuda").view(torch.bfloat16)
    return torch.as_tensor(t, device="cuda")


def register() -> None:
    """Register both plugins with TensorRT's plugin registry (once per process)."""
    global _registered
    if _registered:
        return
    if trtp is None:
        raise RuntimeError("tensorrt.plugin is not importable: install TensorRT 10.x with its Python package")
    import torch

    from dspark.plugins import ops

    if not ops.load_extension():
        raise RuntimeError(f"the dspark CUDA extension is unavailable: {ops._state['error']}")
    verify_id = f"{contract.PLUGIN_NAMESPACE}::{contract.OP_VERIFY}"
    schedule_id = f"{contract.PLUGIN_NAMESPACE}::{contract.OP_SCHEDULE}"

    @trtp.register(verify_id)
    def _verify_desc(draft_tokens: trtp.TensorDesc, draft_probs: trtp.TensorDesc, target_logits: trtp.TensorDesc,
                     verify_lens: trtp.TensorDesc, temperature: trtp.TensorDesc, seed: trtp.TensorDesc,
                     offset: trtp.TensorDesc, block_size: int, vocab_size: int,
                     greedy: int) -> Tuple[trtp.TensorDesc, trtp.TensorDesc]:
        R = draft_tokens.shape_expr[0]
        return (trtp.from_shape_expr((R,), dtype=trt.int64),
                trtp.from_shape_expr((R, block_size + 1), dtype=trt.int64))

    @trtp.impl(verify_id)
    def _verify_impl(draft_tokens: trtp.Tensor, draft_probs: trtp.Tensor, target_logits: trtp.Tensor,
                     verify_lens: trtp.Tensor, temperature: trtp.Tensor, seed: trtp.Tensor, offset: trtp.Tensor,
                     block_size: int, vocab_size: int, greedy: int, outputs: Tuple[trtp.Tensor],
                     stream: int) -> None:
        with torch.cuda.stream(torch.cuda.ExternalStream(stream)):
            tokens = _as_torch(draft_tokens)
            temp = torch.zeros_like(_as_torch(temperature)) if greedy else _as_torch(temperature)
            n, out, _ = torch.ops.dspark.verify(tokens, None if greedy else _as_torch(draft_probs),
                                                _as_torch(target_logits), _as_torch(verify_lens), temp,
                                                _as_torch(seed), _as_torch(offset))
            _as_torch(outputs[0]).copy_(n)
            _as_torch(outputs[1]).copy_(out)

    @trtp.register(schedule_id)
    def _schedule_desc(confidence: trtp.TensorDesc, block_size: int,
                       sps_table: npt.NDArray[np.float32]) -> trtp.TensorDesc:
        return trtp.from_shape_expr((confidence.shape_expr[0],), dtype=trt.int64)

    @trtp.impl(schedule_id)
    def _schedule_impl(confidence: trtp.Tensor, block_size: int, sps_table: npt.NDArray[np.float32],
                       outputs: Tuple[trtp.Tensor], stream: int) -> None:
        with torch.cuda.stream(torch.cuda.ExternalStream(stream)):
            table = torch.as_tensor(np.asarray(sps_table, dtype=np.float64)).to("cuda", non_blocking=True)
            lens = torch.ops.dspark.schedule_prefix(_as_torch(confidence), table, None, True)
            _as_torch(outputs[0]).copy_(lens)

    _registered = True
