"""ONNX export of one DSpark drafter step, with the DSparkSchedule plugin node.

The exported graph, for R requests (dynamic) over T context positions (dynamic):

====================  ================  =====================================================
input                 shape             meaning
====================  ================  =====================================================
aux                   [R, T, m*d] f32   target features of the context (layer_ids, pre final norm)
ctx_lens              [R] int64         valid context length; the block sees positions < ctx_lens
anchor                [R] int64         last committed token (block slot 0)
anchor_pos            [R] int64         its position (usually == ctx_lens)
====================  ================  =====================================================

====================  ================  =====================================================
output                shape             meaning
====================  ================  =====================================================
draft_tokens          [R, K] int64      greedy drafts (target ids), left to right through the Markov head
draft_logits          [R, K, N] f32     corrected logits U_k + W2(W1[x_{k-1}]) the drafts came from
                                        (draft probabilities = softmax(draft_logits / T)); N = V,
                                        or the draft vocabulary's size: entry i is target id
                                        ``draft_ids[i]`` (the checkpoint's tensor, in the manifest)
conf_logits           [R, K] f32        confidence-head logits (before STS)
confidence            [R, K] f32        sigmoid(conf_logits / sts_temperature_k)
verify_lens           [R] int64         DSparkSchedule plugin node (report Alg. 1) on ``confidence``
====================  ================  =====================================================

The block runs as in ``BlockDrafter.propose``: fc + RMSNorm on the context, draft layers
over [context K/V ; block K/V], LM head, then K unrolled steps of argmax through the
Markov head (``training/heads.py``, the same modules). DFlash drafters (no heads) export
without ``conf_logits``/``confidence``/``verify_lens``; Eagle3 is not a block drafter.

``DSparkSchedule`` follows ``dspark.plugins.contract`` (op_type, domain ``trt.plugins``,
``plugin_version``, ``plugin_namespace``, ``block_size``, ``sps_table`` FLOATS): that is what
TensorRT's ONNX parser maps to the C++/Python plugin. ONNX Runtime's Python custom-op
bridge (onnxruntime-extensions) only registers ops in its own domain (``ai.onnx.contrib``)
and reads scalar attributes only, so :func:`ort_session` runs an in-memory copy whose
plugin node is moved to that domain with ``sps_table`` carried as a JSON string; the file on
disk keeps the TensorRT contract.
"""
from __future__ import annotations

import contextlib
import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import torch
from torch import nn

from dspark.plugins import contract

__all__ = [
    "DraftStep", "OnnxExportError", "INPUT_NAMES", "export_onnx", "append_schedule_node", "flat_sps_table",
    "ort_session", "register_ort_ops", "ort_compatible", "ParityCase", "parity_case",
]

INPUT_NAMES = ["aux", "ctx_lens", "anchor", "anchor_pos"]
ORT_CONTRIB_DOMAIN = "ai.onnx.contrib"


class OnnxExportError(RuntimeError):
    pass


class DraftStep(nn.Module):
    """One drafter step as a pure function of tensors (what the ONNX graph computes)."""

    def __init__(self, drafter: nn.Module, sts_temperatures: Sequence[float] | None = None):
        super().__init__()
        cfg = drafter.cfg
        if cfg.algo not in ("dspark", "dflash"):
            raise OnnxExportError(f"ONNX export covers block drafters (dspark, dflash), not {cfg.algo!r}")
        self.drafter = drafter
        self.K = cfg.block_size
        self.has_conf = getattr(drafter, "confidence", None) is not None
        temps = torch.ones(self.K) if sts_temperatures is None else torch.as_tensor(sts_temperatures, dtype=torch.float32)
        if temps.shape != (self.K,) or not bool((temps > 0).all()):
            raise OnnxExportError(f"STS temperatures must be {self.K} positive numbers, got {temps.tolist()}")
        self.register_buffer("inv_sts", 1.0 / temps, persistent=False)

    def forward(self, aux: torch.Tensor, ctx_lens: torch.Tensor, anchor: torch.Tensor, anchor_pos: torch.Tensor):
        d, K = self.drafter, self.K
        # positions 0..T-1 without a Python-side shape (keeps T dynamic in the trace)
        pos = torch.cumsum(torch.ones_like(aux[..., 0], dtype=torch.long), dim=1) - 1  # [R, T]
        h_ctx = d.context(aux)  # [R, T, d]
        ctx_kv = d.context_kv(h_ctx, pos)
        valid = pos < ctx_lens.unsqueeze(-1)  # [R, T]
        offs = torch.arange(K, dtype=torch.long)
        blk = torch.where(offs == 0, anchor.unsqueeze(-1), torch.full_like(anchor.unsqueeze(-1), d.cfg.mask_token_id))  # [R, K]
        bpos = anchor_pos.unsqueeze(-1) + offs  # [R, K]
        own = torch.ones_like(bpos, dtype=torch.bool).unsqueeze(-1).expand(-1, -1, K)  # [R, K, K]
        mask = torch.cat([valid.unsqueeze(1).expand(-1, K, -1), own], dim=-1)  # [R, K, T+K]
        hidden = d.block_hidden(blk, bpos, ctx_kv, mask)  # [R, K, d]
        base = d.draft_head(hidden).float()  # [R, K, N]
        prev, state = d.to_draft(anchor), None
        tokens, logits, confs = [], [], []
        for k in range(K):
            step = base[:, k]
            if d.markov is not None:
                feat, emb = d.markov.features(prev.unsqueeze(-1), hidden[:, k:k + 1], state)
                feat, emb = feat[:, 0], emb[:, 0]
                state = feat if d.markov.kind == "rnn" else None
                step = step + d.markov.bias(feat).float()
            else:
                emb = hidden.new_zeros(hidden.shape[0], 0)
            if self.has_conf:
                confs.append(d.confidence(hidden[:, k], emb).float())
            x = step.argmax(dim=-1)
            tokens.append(x)
            logits.append(step)
            prev = x
        out = (d.to_target(torch.stack(tokens, 1)), torch.stack(logits, 1))
        if self.has_conf:
            conf_logits = torch.stack(confs, 1)
            out = out + (conf_logits, torch.sigmoid(conf_logits * self.inv_sts))
        return out


def output_names(has_conf: bool) -> list[str]:
    return ["draft_tokens", "draft_logits"] + (["conf_logits", "confidence"] if has_conf else [])


def flat_sps_table(n_tokens: int) -> list[float]:
    """Placeholder when no SPS table is given: every batch size equally fast, so the
    schedule verifies every draft with non-zero survival (documented in the manifest)."""
    return [1.0] * (n_tokens + 1)


def _example_inputs(drafter, R: int = 2, T: int = 8):
    g = torch.Generator().manual_seed(0)
    cfg = drafter.cfg
    aux = torch.randn(R, T, cfg.num_aux_layers * cfg.hidden_size, generator=g)
    lens = torch.full((R,), T, dtype=torch.long)
    anchor = torch.randint(0, cfg.vocab_size, (R,), generator=g)
    return aux, lens, anchor, lens.clone()


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


class _SdpaBoolGqa:
    """torch.nn.functional with ``enable_gqa`` coerced to a Python bool: under tracing the
    drafter's ``k.shape[1] != q.shape[1]`` is a tensor, which SDPA's signature refuses."""

    def __getattr__(self, name):
        return getattr(torch.nn.functional, name)

    @staticmethod
    def scaled_dot_product_attention(*args, enable_gqa=False, **kwargs):
        return torch.nn.functional.scaled_dot_product_attention(*args, enable_gqa=bool(enable_gqa), **kwargs)


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


@contextlib.contextmanager
def _export_shims():
    global _SYMBOLICS_DONE
    if not _SYMBOLICS_DONE:
        torch.onnx.register_custom_op_symbolic("aten::rms_norm", _rms_norm_symbolic, 17)
        _SYMBOLICS_DONE = True
    from dspark.training.models import layers

    saved = layers.F
    layers.F = _SdpaBoolGqa()
    try:
        yield
    finally:
        layers.F = saved


def export_onnx(drafter: nn.Module, path: str | Path, *, sps_table: Sequence[float] | None = None,
                sts_temperatures: Sequence[float] | None = None, opset: int = 17, max_tokens: int = 64 * 8) -> dict:
    """Export the drafter step (+ DSparkSchedule when the drafter has a confidence head) to ``path``.

    Weights go to ``<path>.data`` (external data) when the model exceeds protobuf's 2 GB limit
    is a risk; small models stay in one file. Returns a summary for the manifest.
    """
    import onnx

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    step = DraftStep(drafter, sts_temperatures).eval()
    names_out = output_names(step.has_conf)
    dyn = {"aux": {0: "R", 1: "T"}, "ctx_lens": {0: "R"}, "anchor": {0: "R"}, "anchor_pos": {0: "R"},
           "draft_tokens": {0: "R"}, "draft_logits": {0: "R"}}
    if step.has_conf:
        dyn.update({"conf_logits": {0: "R"}, "confidence": {0: "R"}})
    tmp = path.with_name(path.name + ".raw")
    with torch.no_grad(), _export_shims():
        torch.onnx.export(step, _example_inputs(drafter), str(tmp), input_names=INPUT_NAMES, output_names=names_out,
                          dynamic_axes=dyn, opset_version=opset, dynamo=False, do_constant_folding=True)
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
    return {"file": path.name, "opset": opset, "inputs": INPUT_NAMES,
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
    greedy_draft_match: float
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
                anchor_pos: torch.Tensor, sps_table: Sequence[float] | None = None, repeats: int = 3) -> ParityCase:
    """Run the same inputs through PyTorch (eager ``DraftStep``) and ONNX Runtime; compare."""
    from dspark.plugins.reference import schedule_prefix

    feeds = {"aux": aux.float().numpy(), "ctx_lens": ctx_lens.long().numpy(), "anchor": anchor.long().numpy(),
             "anchor_pos": anchor_pos.long().numpy()}
    names = [o.name for o in session.get_outputs()]
    with torch.inference_mode():
        ref = step(aux, ctx_lens, anchor, anchor_pos)
        torch_ms = _median_ms(lambda: step(aux, ctx_lens, anchor, anchor_pos), repeats)
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
