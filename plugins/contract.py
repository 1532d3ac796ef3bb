"""The ONNX node contract of the DSpark TensorRT plugins, written down once.

The converter (engine/export) imports this module to emit plugin nodes; the C++ plugin
(plugins/trt/dspark_plugin.{h,cpp}) implements it; tests check the two agree.

TensorRT's ONNX parser maps a node it does not know to the plugin whose name equals the
node's ``op_type``, looked up with the node attributes ``plugin_version`` and
``plugin_namespace``; every other attribute becomes a plugin field of the same name
(ONNX ``INT`` -> ``kINT32``, ``FLOATS`` -> ``kFLOAT32`` array). The parser ignores the
node's domain; we use :data:`ONNX_DOMAIN` (declare it in the model's ``opset_import``).

``DSparkVerify`` (speculative verification, semantics of ``reference.verify`` with
temperature; no top-k/top-p):

====================  =========================  ==============================================
input (greedy = 0)    shape                      dtype
====================  =========================  ==============================================
draft_tokens          [R, K]                     int64
draft_probs           [R, K, V]                  float32 | float16 | bfloat16 (fp32 or = logits)
target_logits         [R, K+1, V]                float32 | float16 | bfloat16
verify_lens           [R]                        int64, in [0, K] (clamped)
temperature           [R]                        float32, <= 0 = greedy row
seed                  [R]                        int64
offset                [R]                        int64
====================  =========================  ==============================================

With ``greedy = 1`` the inputs are only ``draft_tokens, target_logits, verify_lens``.
Outputs: ``num_accepted`` [R] int64 (accepted drafts n) and ``output_tokens`` [R, K+1]
int64 (accepted drafts, then the recovered or bonus token, then -1). Attributes:
``block_size`` = K, ``vocab_size`` = V, ``greedy`` in {0, 1}.

``DSparkSchedule`` (report Algorithm 1 with the early stop, as ``reference.schedule_prefix``):
inputs ``confidence`` [R, K] float32 and optionally ``max_lens`` [R] int64; output
``verify_lens`` [R] int64; attributes ``block_size`` = K and ``sps_table`` (float32 list,
steps/s indexed by batch tokens B, entry 0 unused). R * K <= :data:`SCHEDULE_MAX_CANDIDATES`.

The kernel sources take that limit from here as a compile-time define
(:func:`kernel_define_flags`: ``plugins/ops.py`` passes them to torch's JIT build,
``plugins/CMakeLists.txt`` reads the constant from this file), so the Python fallback, the
ONNX contract and the compiled kernel cannot disagree.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

__all__ = [
    "OP_TYPE", "OP_VERIFY", "OP_SCHEDULE", "PLUGIN_VERSION", "PLUGIN_NAMESPACE", "ONNX_DOMAIN",
    "ONNX_DOMAIN_VERSION", "SCHEDULE_MAX_CANDIDATES", "AttrSpec", "TensorSpec", "VERIFY_ATTRS",
    "VERIFY_INPUTS", "VERIFY_INPUTS_GREEDY", "VERIFY_OUTPUTS", "SCHEDULE_ATTRS", "SCHEDULE_INPUTS",
    "SCHEDULE_OUTPUTS", "KERNEL_DEFINES", "kernel_define_flags", "verify_inputs", "verify_attributes",
    "schedule_attributes", "verify_node", "schedule_node",
]

OP_VERIFY = "DSparkVerify"
OP_SCHEDULE = "DSparkSchedule"
OP_TYPE = OP_VERIFY  # the main node
PLUGIN_VERSION = "1"
PLUGIN_NAMESPACE = "dspark"
ONNX_DOMAIN = "trt.plugins"
ONNX_DOMAIN_VERSION = 1
# R * K the one-block scheduler kernel takes; at most its largest launch (1024 threads x 16
# items, static_assert in csrc/schedule.cuh). CMakeLists.txt parses this line: keep it a literal.
SCHEDULE_MAX_CANDIDATES = 16384

# Compile-time values the CUDA sources take from this contract (-D name=value).
KERNEL_DEFINES: dict[str, int] = {"DSPARK_SCHEDULE_MAX_CANDIDATES": SCHEDULE_MAX_CANDIDATES}


def kernel_define_flags() -> list[str]:
    """``-DNAME=value`` compiler flags for :data:`KERNEL_DEFINES` (nvcc and the host compiler alike)."""
    return [f"-D{name}={value}" for name, value in KERNEL_DEFINES.items()]


@dataclass(frozen=True)
class AttrSpec:
    name: str
    onnx_type: str  # ONNX AttributeProto type: "INT" or "FLOATS"
    trt_field_type: str  # the PluginFieldType the parser hands the creator
    doc: str


@dataclass(frozen=True)
class TensorSpec:
    name: str
    shape: tuple[str, ...]  # symbolic: R requests, K = block_size, V = vocab_size
    dtypes: tuple[str, ...]  # ONNX element type names accepted
    doc: str
    optional: bool = False


_FLOATS = ("float32", "float16", "bfloat16")

VERIFY_ATTRS: tuple[AttrSpec, ...] = (
    AttrSpec("block_size", "INT", "kINT32", "K, draft slots per request"),
    AttrSpec("vocab_size", "INT", "kINT32", "V, vocabulary size"),
    AttrSpec("greedy", "INT", "kINT32", "1: every row greedy (3 inputs), 0: per-row temperature (7 inputs)"),
)

VERIFY_INPUTS: tuple[TensorSpec, ...] = (
    TensorSpec("draft_tokens", ("R", "K"), ("int64",), "drafted tokens, left to right"),
    TensorSpec("draft_probs", ("R", "K", "V"), _FLOATS, "probabilities the drafts were sampled from "
               "(float32 or the logits' dtype)"),
    TensorSpec("target_logits", ("R", "K+1", "V"), _FLOATS, "target logits; [r, j] judges draft j, [r, l] is the bonus"),
    TensorSpec("verify_lens", ("R",), ("int64",), "drafts verified per request, in [0, K]"),
    TensorSpec("temperature", ("R",), ("float32",), "sampling temperature, <= 0 = greedy row"),
    TensorSpec("seed", ("R",), ("int64",), "Philox key per request"),
    TensorSpec("offset", ("R",), ("int64",), "Philox counter offset per request (e.g. its step counter)"),
)
VERIFY_INPUTS_GREEDY: tuple[TensorSpec, ...] = tuple(
    t for t in VERIFY_INPUTS if t.name in ("draft_tokens", "target_logits", "verify_lens"))
VERIFY_OUTPUTS: tuple[TensorSpec, ...] = (
    TensorSpec("num_accepted", ("R",), ("int64",), "accepted drafts n (bonus/recovered not counted)"),
    TensorSpec("output_tokens", ("R", "K+1"), ("int64",), "n accepted drafts, the recovered or bonus token, -1 padding"),
)

SCHEDULE_ATTRS: tuple[AttrSpec, ...] = (
    AttrSpec("block_size", "INT", "kINT32", "K, draft slots per request"),
    AttrSpec("sps_table", "FLOATS", "kFLOAT32", "steps/s by batch tokens B (index 0 unused), N+1 entries"),
)
SCHEDULE_INPUTS: tuple[TensorSpec, ...] = (
    TensorSpec("confidence", ("R", "K"), ("float32",), "per-position confidences c in [0, 1]"),
    TensorSpec("max_lens", ("R",), ("int64",), "cap per request (drafts available)", optional=True),
)
SCHEDULE_OUTPUTS: tuple[TensorSpec, ...] = (
    TensorSpec("verify_lens", ("R",), ("int64",), "drafts to verify per request"),
)


def verify_inputs(greedy: bool) -> tuple[TensorSpec, ...]:
    """The DSparkVerify inputs, in order, for the greedy or the sampled variant."""
    return VERIFY_INPUTS_GREEDY if greedy else VERIFY_INPUTS


def _plugin_ids() -> dict[str, Any]:
    return {"plugin_version": PLUGIN_VERSION, "plugin_namespace": PLUGIN_NAMESPACE}


def verify_attributes(block_size: int, vocab_size: int, greedy: bool) -> dict[str, Any]:
    """ONNX attributes of a DSparkVerify node (plugin ids + fields)."""
    if block_size < 0 or vocab_size < 1:
        raise ValueError(f"need block_size >= 0 and vocab_size >= 1, got {block_size}, {vocab_size}")
    return {**_plugin_ids(), "block_size": int(block_size), "vocab_size": int(vocab_size), "greedy": int(bool(greedy))}


def schedule_attributes(block_size: int, sps_table: Sequence[float]) -> dict[str, Any]:
    """ONNX attributes of a DSparkSchedule node; ``sps_table[B]`` = steps/s at B batch tokens."""
    table = [float(x) for x in sps_table]
    if block_size < 1 or len(table) < 2:
        raise ValueError(f"need block_size >= 1 and at least 2 SPS entries, got {block_size}, {len(table)}")
    return {**_plugin_ids(), "block_size": int(block_size), "sps_table": table}


def verify_node(block_size: int, vocab_size: int, greedy: bool) -> dict[str, Any]:
    """Everything a converter needs for one DSparkVerify node, as plain data:
    ``{"op_type", "domain", "inputs", "outputs", "attributes"}`` (names in order)."""
    return {
        "op_type": OP_VERIFY,
        "domain": ONNX_DOMAIN,
        "inputs": [t.name for t in verify_inputs(greedy)],
        "outputs": [t.name for t in VERIFY_OUTPUTS],
        "attributes": verify_attributes(block_size, vocab_size, greedy),
    }


def schedule_node(block_size: int, sps_table: Sequence[float], with_max_lens: bool = False) -> dict[str, Any]:
    """Everything a converter needs for one DSparkSchedule node (see :func:`verify_node`)."""
    inputs = [t.name for t in SCHEDULE_INPUTS if with_max_lens or not t.optional]
    return {
        "op_type": OP_SCHEDULE,
        "domain": ONNX_DOMAIN,
        "inputs": inputs,
        "outputs": [t.name for t in SCHEDULE_OUTPUTS],
        "attributes": schedule_attributes(block_size, sps_table),
    }
