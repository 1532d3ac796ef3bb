"""ONNX export of one DSpark drafter step, with the DSparkSchedule plugin node.

The exported graph, for R requests (dynamic) over T context positions (dynamic):

====================  ================  =====================================================
input                 shape             meaning
====================  ================  =====================================================
aux                   [R, T, m*d] f32   target features of the context (layer_ids, pre final norm)
ctx_lens              [R] int64         valid context length; the block sees positions < ctx_lens
anchor                [R] int64         last committed token (block slot 0)
anchor_pos            [R] int64         its position (usually == ctx_lens)
temperature           [R] f32           ``sampled=True`` only: the draft temperature (0 = greedy row)
noise                 [R, K, N] f32     ``sampled=True`` only: race noise E of each draft position
                                        and draft column (``dspark.plugins.coupled.race_noise``)
====================  ================  =====================================================

====================  ================  =====================================================
output                shape             meaning
====================  ================  =====================================================
draft_tokens          [R, K] int64      drafts (target ids), left to right through the Markov head:
                                        argmax, or ``argmax(softmax(logits / T) / E_k)`` when sampled
draft_logits          [R, K, N] f32     corrected logits U_k + W2(W1[x_{k-1}]) the drafts came from
                                        (draft probabilities = softmax(draft_logits / T)); N = V,
                                        or the draft vocabulary's size: entry i is target id
                                        ``draft_ids[i]`` (the checkpoint's tensor, in the manifest)
conf_logits           [R, K] f32        confidence-head logits (before STS)
confidence            [R, K] f32        sigmoid(conf_logits / sts_temperature_k)
verify_lens           [R] int64         DSparkSchedule plugin node (report Alg. 1) on ``confidence``
====================  ================  =====================================================

The step is the drafter's own ``BlockDrafter.draft_block``, the engine's path: fc + RMSNorm
on the context, the block layout of ``block_inputs``, draft layers over [context K/V ; block
K/V], LM head, then ``sample_sequential`` through the heads (``training/heads.py``) choosing
by argmax (or the race against ``noise``); confidences through ``engine.sts.apply_sts``.
DFlash drafters (no heads) export without ``conf_logits``/``confidence``/``verify_lens``;
Eagle3 is not a block drafter.

``DSparkSchedule`` follows ``dspark.plugins.contract`` (op_type, domain ``trt.plugins``,
``plugin_version``, ``plugin_namespace``, ``block_size``, ``sps_table`` FLOATS): that is what
TensorRT's ONNX parser maps to the C++/Python plugin. ONNX Runtime's Python custom-op
bridge (onnxruntime-extensions) only registers ops in its own domain (``ai.onnx.contrib``)
and reads scalar attributes only, so :func:`ort_session` runs an in-memory copy whose
plugin node is moved to that domain with ``sps_table`` carried as a JSON string; the file on
disk keeps the TensorRT contract.
"""
from __future__ import annotations

import json
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import torch
from torch import nn

from dspark.plugins import contract
from dspark.training.algorithms import algorithm
from dspark.training.models.block_drafter import draft_distribution

from ..sts import apply_sts

__all__ = [
    "DraftStep", "OnnxExportError", "INPUT_NAMES", "export_onnx", "append_schedule_node", "flat_sps_table",
    "ort_session", "register_ort_ops", "ort_compatible", "ParityCase", "parity_case",
]

INPUT_NAMES = ["aux", "ctx_lens", "anchor", "anchor_pos"]
SAMPLED_INPUT_NAMES = ["temperature", "noise"]  # the inputs of a graph exported with sampled=True
ORT_CONTRIB_DOMAIN = "ai.onnx.contrib"


class OnnxExportError(RuntimeError):
    pass


class DraftStep(nn.Module):
    """One drafter step as a pure function of tensors (what the ONNX graph computes): the
    drafter's own ``draft_block`` (block layout, draft layers, ``sample_sequential``) choosing
    each draft by argmax, or with ``sampled`` by the exponential race against fed noise, and the
    confidences through ``engine.sts.apply_sts``."""

    def __init__(self, drafter: nn.Module, sts_temperatures: Sequence[float] | None = None, sampled: bool = False):
        super().__init__()
        cfg = drafter.cfg
        if not algorithm(cfg.algo).supports("onnx"):
            raise OnnxExportError(f"ONNX export covers block drafters (dspark, dflash), not {cfg.algo!r}")
        self.drafter = drafter
        self.K = cfg.block_size
        self.sampled = sampled
        self.has_conf = getattr(drafter, "confidence", None) is not None
        temps = [1.0] * self.K if sts_temperatures is None else [float(t) for t in sts_temperatures]
        if len(temps) != self.K or not all(t > 0 for t in temps):
            raise OnnxExportError(f"STS temperatures must be {self.K} positive numbers, got {temps}")
        self.sts_temperatures = temps

    def forward(self, aux: torch.Tensor, ctx_lens: torch.Tensor, anchor: torch.Tensor, anchor_pos: torch.Tensor,
                temperature: torch.Tensor | None = None, noise: torch.Tensor | None = None):
        """The graph's inputs (module docstring); with ``sampled``: temperature [R] (0 = greedy row)
        and noise [R, K, N], the race noise ``E`` of every draft position and draft column."""
        d = self.drafter
        # positions 0..T-1 without a Python-side shape (keeps T dynamic in the trace)
        pos = torch.cumsum(torch.ones_like(aux[..., 0], dtype=torch.long), dim=1) - 1  # [R, T]
        ctx_kv = d.context_kv(d.context(aux), pos)
        valid = pos < ctx_lens.unsqueeze(-1)  # [R, T]
        choose = race_chooser(temperature, noise) if self.sampled else argmax_chooser
        draft = d.draft_block(anchor, anchor_pos, ctx_kv, valid, choose)
        out = (d.to_target(draft.tokens), draft.kept)
        if self.has_conf:
            out = out + (draft.conf_logits, apply_sts(draft.conf_logits, self.sts_temperatures))
        return out


def argmax_chooser(logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Greedy drafts, keeping the corrected logits (the graph's ``draft_logits``)."""
    return logits.argmax(dim=-1), logits


def race_chooser(temperature: torch.Tensor, noise: torch.Tensor):
    """Sampled drafts as tensors only: ``argmax(softmax(logits / T) / E_k)`` per row with race
    noise ``E`` [R, K, N] (``dspark.plugins.coupled``; the engine's ``RaceNoise`` draws the same
    values from its hash), the argmax for rows at temperature 0."""
    def choose(logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        probs = draft_distribution(logits, temperature)
        raced = (probs / noise[:, k]).argmax(dim=-1)
        return torch.where(temperature > 0, raced, logits.argmax(dim=-1)), logits
    return choose


def output_names(has_conf: bool) -> list[str]:
    return ["draft_tokens", "draft_logits"] + (["conf_logits", "confidence"] if has_conf else [])


def flat_sps_table(n_tokens: int) -> list[float]:
    """Placeholder when no SPS table is given: every batch size equally fast, so the
    schedule verifies every draft with non-zero survival (documented in the manifest)."""
    return [1.0] * (n_tokens + 1)


def input_names(sampled: bool) -> list[str]:
    return INPUT_NAMES + (SAMPLED_INPUT_NAMES if sampled else [])


def _example_inputs(drafter, R: int = 2, T: int = 8, sampled: bool = False):
    g = torch.Generator().manual_seed(0)
    cfg = drafter.cfg
    aux = torch.randn(R, T, cfg.num_aux_layers * cfg.hidden_size, generator=g)
    lens = torch.full((R,), T, dtype=torch.long)
    anchor = torch.randint(0, cfg.vocab_size, (R,), generator=g)
    if not sampled:
        return aux, lens, anchor, lens.clone()
    noise = torch.empty(R, cfg.block_size, drafter.draft_vocab_size).exponential_(generator=g)
    return aux, lens, anchor, lens.clone(), torch.ones(R), noise


def append_schedule_node(model, block_size: int, sps_table: Sequence[float], confidence: str = "confidence"):
    """Append the DSparkSchedule plugin node (plugins/contract.py) reading ``confidence``."""
    from onnx import TensorProto, helper

    spec = contract.schedule_node(block_size, sps_table)
    node = helper.make_node(spec["op_type"], [confidence], spec["outputs"], name="dspark_schedule",
                            domain=spec["domain"], **spec["attributes"])
    model.graph.node.append(node)
    model.graph.output.append(helper.make_tensor_value_info(spec["outputs"][0], TensorProto.INT64, ["R"]))
    if not any(o.domain == spec["domain"] for o in model.opset_import):
        model.opset_import.append(helper.make_opsetid(spec["domain"], contract.ONNX_DOMAIN_VERSION))
    return model


def _rms_norm_symbolic(g, x, normalized_shape, weight, eps):
    """aten::rms_norm over the last axis for opsets without RMSNormalization:
    x * 1/sqrt(mean(x^2) + eps) * weight (the drafter's RMSNorms all have a weight and eps)."""
    from torch.onnx import symbolic_helper as sh

    eps_val = sh._maybe_get_const(eps, "f")
    if eps_val is None or sh._is_value(eps_val):
        eps_val = float(torch.finfo(torch.float32).eps)
    ms = g.op("ReduceMean", g.op("Mul", x, x), axes_i=[-1], keepdims_i=1)
    denom = g.op("Sqrt", g.op("Add", ms, g.op("Constant", value_t=torch.tensor(float(eps_val)))))
    y = g.op("Div", x, denom)
    return y if sh._is_none(weight) else g.op("Mul", y, weight)


_SYMBOLICS_DONE = False


def register_symbolics() -> None:
    """Register the ONNX symbolic of ``aten::rms_norm`` (``_rms_norm_symbolic``) once per process:
    opset 17 has no RMSNormalization, and the drafter's norms are ``nn.RMSNorm``. The exporter's
    documented hook; nothing of the model is replaced."""
    global _SYMBOLICS_DONE
    if not _SYMBOLICS_DONE:
        torch.onnx.register_custom_op_symbolic("aten::rms_norm", _rms_norm_symbolic, 17)
        _SYMBOLICS_DONE = True


def export_onnx(drafter: nn.Module, path: str | Path, *, sps_table: Sequence[float] | None = None,
                sts_temperatures: Sequence[float] | None = None, opset: int = 17, max_tokens: int = 64 * 8,
                sampled: bool = False) -> dict:
    """Export the drafter step (+ DSparkSchedule when the drafter has a confidence head) to ``path``.
    ``sampled``: the graph also takes ``temperature`` and ``noise`` and samples its drafts
    (``DraftStep``); the default graph drafts greedily.

    Weights go to ``<path>.data`` (external data) when the model exceeds protobuf's 2 GB limit
    is a risk; small models stay in one file. Returns a summary for the manifest.
    """
    import onnx

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    step = DraftStep(drafter, sts_temperatures, sampled=sampled).eval()
    names_in, names_out = input_names(sampled), output_names(step.has_conf)
    dyn = {"aux": {0: "R", 1: "T"}, "ctx_lens": {0: "R"}, "anchor": {0: "R"}, "anchor_pos": {0: "R"},
           "draft_tokens": {0: "R"}, "draft_logits": {0: "R"}}
    if sampled:
        dyn.update({"temperature": {0: "R"}, "noise": {0: "R"}})
    if step.has_conf:
        dyn.update({"conf_logits": {0: "R"}, "confidence": {0: "R"}})
    tmp = path.with_name(path.name + ".raw")
    register_symbolics()
    with torch.no_grad(), warnings.catch_warnings():
        # the STS temperatures become constants of the graph, which is what the tracer warns of
        warnings.filterwarnings("ignore", category=torch.jit.TracerWarning, module=r"dspark\.engine\.sts")
        torch.onnx.export(step, _example_inputs(drafter, sampled=sampled), str(tmp), input_names=names_in,
                          output_names=names_out, dynamic_axes=dyn, opset_version=opset, dynamo=False,
                          do_constant_folding=True)
    model = onnx.load(str(tmp))
    tmp.unlink()
    table = list(sps_table) if sps_table is not None else flat_sps_table(max_tokens)
    if step.has_conf:
        append_schedule_node(model, drafter.cfg.block_size, table)
    model.producer_name = "dspark-kit"
    external = model.ByteSize() > (1 << 31) - (1 << 26)
    if external:
        onnx.save_model(model, str(path), save_as_external_data=True, all_tensors_to_one_file=True,
                        location=path.name + ".data")
    else:
        onnx.save_model(model, str(path))
    onnx.checker.check_model(str(path))  # the plugin domain is unknown to the checker; it only checks structure
    return {"file": path.name, "opset": opset, "inputs": names_in,
            "outputs": names_out + (["verify_lens"] if step.has_conf else []),
            "plugin_nodes": [contract.OP_SCHEDULE] if step.has_conf else [], "external_data": external,
            "sps_table_entries": len(table), "sps_table_placeholder": sps_table is None,
            "sts_applied": sts_temperatures is not None}


# -- ONNX Runtime (CPU) -------------------------------------------------------------------------
_SPS_CACHE: dict[str, torch.Tensor] = {}
_REGISTERED = False


def register_ort_ops() -> str:
    """Register DSparkSchedule with onnxruntime-extensions (idempotent); return its library path."""
    global _REGISTERED
    from onnxruntime_extensions import PyCustomOpDef, get_library_path, onnx_op

    if not _REGISTERED:
        from dspark.plugins.reference import schedule_prefix

        @onnx_op(op_type=contract.OP_SCHEDULE, inputs=[PyCustomOpDef.dt_float], outputs=[PyCustomOpDef.dt_int64],
                 attrs={"block_size": PyCustomOpDef.dt_int64, "sps_table_json": PyCustomOpDef.dt_string,
                        "plugin_version": PyCustomOpDef.dt_string, "plugin_namespace": PyCustomOpDef.dt_string})
        def _dspark_schedule(confidence, block_size=0, sps_table_json="[]", plugin_version="", plugin_namespace=""):
            sps = _SPS_CACHE.get(sps_table_json)
            if sps is None:
                sps = _SPS_CACHE.setdefault(sps_table_json, torch.tensor(json.loads(sps_table_json), dtype=torch.float64))
            conf = torch.from_numpy(confidence).reshape(-1, int(block_size))
            return schedule_prefix(conf, sps).numpy().astype("int64")

        _REGISTERED = True
    return get_library_path()


def ort_compatible(model):
    """A copy whose plugin nodes use onnxruntime-extensions' domain and scalar attributes."""
    import onnx
    from onnx import helper

    m = onnx.ModelProto()
    m.CopyFrom(model)
    for node in m.graph.node:
        if node.domain == contract.ONNX_DOMAIN and node.op_type == contract.OP_SCHEDULE:
            attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
            del node.attribute[:]
            node.domain = ORT_CONTRIB_DOMAIN
            node.attribute.extend([
                helper.make_attribute("block_size", int(attrs["block_size"])),
                helper.make_attribute("sps_table_json", json.dumps([float(x) for x in attrs["sps_table"]])),
                helper.make_attribute("plugin_version", attrs["plugin_version"].decode() if isinstance(attrs["plugin_version"], bytes) else attrs["plugin_version"]),
                helper.make_attribute("plugin_namespace", attrs["plugin_namespace"].decode() if isinstance(attrs["plugin_namespace"], bytes) else attrs["plugin_namespace"]),
            ])
    if not any(o.domain == ORT_CONTRIB_DOMAIN for o in m.opset_import):
        m.opset_import.append(helper.make_opsetid(ORT_CONTRIB_DOMAIN, 1))
    return m


def ort_session(path: str | Path, threads: int = 1):
    """An ONNX Runtime CPU session for an exported drafter step (plugin node included)."""
    import onnx
    import onnxruntime as ort

    lib = register_ort_ops()
    model = ort_compatible(onnx.load(str(path)))
    so = ort.SessionOptions()
    so.register_custom_ops_library(lib)
    so.intra_op_num_threads = threads
    so.inter_op_num_threads = 1
    return ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])


# -- parity: ORT vs PyTorch -----------------------------------------------------------------------
@dataclass
class ParityCase:
    batch: int
    context: int
    max_abs_logit_diff: float
    greedy_draft_match: float  # share of drafts identical (greedy, or sampled with the same noise)
    ort_ms: float
    torch_ms: float
    conf_max_abs_diff: float | None = None
    verify_lens_match: float | None = None

    def row(self) -> dict:
        return {"batch": self.batch, "context": self.context, "max_abs_logit_diff": self.max_abs_logit_diff,
                "greedy_draft_match": self.greedy_draft_match, "ort_ms": self.ort_ms, "torch_ms": self.torch_ms,
                "conf_max_abs_diff": self.conf_max_abs_diff, "verify_lens_match": self.verify_lens_match}


def _median_ms(fn, repeats: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1000.0)
    times.sort()
    return times[len(times) // 2]


def parity_case(step: DraftStep, session, aux: torch.Tensor, ctx_lens: torch.Tensor, anchor: torch.Tensor,
                anchor_pos: torch.Tensor, sps_table: Sequence[float] | None = None, repeats: int = 3,
                temperature: torch.Tensor | None = None, noise: torch.Tensor | None = None) -> ParityCase:
    """Run the same inputs through PyTorch (eager ``DraftStep``) and ONNX Runtime; compare.
    A sampled step (``DraftStep(sampled=True)``) takes ``temperature`` and ``noise`` too, fed to both."""
    from dspark.plugins.reference import schedule_prefix

    args = (aux, ctx_lens, anchor, anchor_pos) + ((temperature, noise) if step.sampled else ())
    feeds = {"aux": aux.float().numpy(), "ctx_lens": ctx_lens.long().numpy(), "anchor": anchor.long().numpy(),
             "anchor_pos": anchor_pos.long().numpy()}
    if step.sampled:
        feeds.update({"temperature": temperature.float().numpy(), "noise": noise.float().numpy()})
    names = [o.name for o in session.get_outputs()]
    with torch.inference_mode():
        ref = step(*args)
        torch_ms = _median_ms(lambda: step(*args), repeats)
    got = dict(zip(names, session.run(names, feeds)))
    ort_ms = _median_ms(lambda: session.run(names, feeds), repeats)
    tokens = torch.from_numpy(got["draft_tokens"])
    case = ParityCase(batch=aux.shape[0], context=aux.shape[1],
                      max_abs_logit_diff=float((torch.from_numpy(got["draft_logits"]) - ref[1]).abs().max()),
                      greedy_draft_match=float((tokens == ref[0]).float().mean()),
                      ort_ms=round(ort_ms, 3), torch_ms=round(torch_ms, 3))
    if step.has_conf:
        case.conf_max_abs_diff = float((torch.from_numpy(got["confidence"]) - ref[3]).abs().max())
        if "verify_lens" in got and sps_table is not None:
            want = schedule_prefix(ref[3], torch.tensor(list(sps_table), dtype=torch.float64))
            case.verify_lens_match = float((torch.from_numpy(got["verify_lens"]) == want).float().mean())
    return case
