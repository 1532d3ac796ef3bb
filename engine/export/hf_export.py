"""The DSpark checkpoint layout vLLM, TensorRT-LLM and DeepSpec load, for DSpark and DFlash drafters.

Layout written (``hf/``), following the DeepSpec reference checkpoints (the format a
``save_pretrained`` of its DSpark draft model produces, commit recorded in docs/engine.md)
and the loaders that read them (vLLM ``qwen3_dspark.py``, TensorRT-LLM ``_torch/speculative/dspark*``):

- ``config.json``: the target's HF config, then the draft keys: ``architectures:
  ["Qwen3DSparkModel"]`` and ``model_type: qwen3`` (the draft layers are Qwen3 decoder layers
  with per-head q/k RMSNorm whatever the target family, ``layer_style=qwen3``),
  ``num_hidden_layers`` (draft layers), ``num_target_layers``, ``block_size``, ``mask_token_id``,
  ``target_layer_ids`` (the decoder layers whose *outputs* are fused; vLLM adds 1 to capture
  them at the next layer's input), ``num_anchors`` (training-only), ``markov_rank``,
  ``markov_head_type``, ``enable_confidence_head``,
  ``confidence_head_with_markov``, ``draft_vocab_size``, ``tie_word_embeddings: false``,
  ``layer_types``; plus ``dspark_kit`` (our DrafterConfig, for an exact import back);
- ``model.safetensors`` with the reference tensor names (:data:`NAME_PAIRS`), the target's frozen
  ``embed_tokens`` and the LM head the drafter predicts with (``lm_head``: the target's, or its
  rows at the draft ids). A draft vocabulary of ``n`` ids adds ``d2t`` / ``t2d`` (layout.py);
  ``markov_head.markov_w1`` is then an embedding over the *full* target vocabulary (the loaders
  embed the previous target id) and ``markov_w2`` has ``n`` rows. The kit's ``W1`` has ``n + 1``
  rows (the draft ids, then one shared row for every id outside them), so row ``t`` of the
  export is the kit's row ``to_draft(t)``: the same bias for every previous token, exactly.

DFlash (no Markov head) is written as a Markov head of rank :data:`NULL_MARKOV_RANK` with
all-zero weights, whose bias is exactly 0: vLLM's DSpark model always builds a Markov head, and a
rank of 0 (DeepSpec's spelling of "none") makes its CPU GEMM set-up die with SIGFPE on the
``[n, 0]`` weight. The import maps such a head back to DFlash when the ``dspark_kit`` record says so.

Refused with the reason (nothing written): an Eagle3 drafter (eagle3_export.py), draft layers
without q/k norms (``layer_style`` llama, or ``target`` on a family without them: the loaders
build Qwen3 layers), an RNN Markov head (parameterised differently from the reference's).
"""
from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import torch

from dspark.training.algorithms import algorithm

from .layout import DTYPES, ExportError, d2t_t2d, export_checkpoint, target_config

__all__ = ["ExportError", "NULL_MARKOV_RANK", "NAME_PAIRS", "rename_tensor", "to_deepspec_state", "deepspec_config", "export_hf",
           "check_exportable", "DTYPES", "DSPARK_ARCHITECTURE"]

DSPARK_ARCHITECTURE = "Qwen3DSparkModel"
NULL_MARKOV_RANK = 1  # the all-zero Markov head a DFlash drafter is exported with

# (our name, reference name) of every drafter tensor; "{i}" is a layer index
_ATTN = ("q_proj", "k_proj", "v_proj", "o_proj", "q_norm", "k_norm")
NAME_PAIRS: tuple[tuple[str, str], ...] = (
    ("fc.weight", "fc.weight"),
    ("ctx_norm.weight", "hidden_norm.weight"),
    ("norm.weight", "norm.weight"),
    *((f"layers.{{i}}.{p}.weight", f"layers.{{i}}.self_attn.{p}.weight") for p in _ATTN),
    *((f"layers.{{i}}.{n}.weight",) * 2 for n in ("input_layernorm", "post_attention_layernorm")),
    *((f"layers.{{i}}.mlp.{n}.weight",) * 2 for n in ("gate_proj", "up_proj", "down_proj")),
    ("markov.w1.weight", "markov_head.markov_w1.weight"),
    ("markov.w2.weight", "markov_head.markov_w2.weight"),
    ("confidence.proj.weight", "confidence_head.proj.weight"),
    ("confidence.proj.bias", "confidence_head.proj.bias"),
)
FROZEN = ("embed_tokens.weight", "lm_head.weight")  # the target's (lm_head: at the draft ids), frozen
VOCAB_MAPS = ("d2t", "t2d")


def rename_tensor(name: str, to_reference: bool = True) -> str | None:
    """Our tensor name -> the reference one (or back); None when the name has no counterpart."""
    for ours, ref in NAME_PAIRS:
        src, dst = (ours, ref) if to_reference else (ref, ours)
        m = re.fullmatch(re.escape(src).replace(re.escape("{i}"), r"(\d+)"), name)
        if m:
            return dst.replace("{i}", m.group(1)) if m.groups() else dst
    return None


def _to_reference(name: str) -> str:
    ref = rename_tensor(name)
    if ref is None:
        raise ExportError(f"tensor {name!r} has no counterpart in the reference DSpark layout")
    return ref


def check_exportable(drafter) -> None:
    """Raise ExportError naming why ``drafter`` has no DSpark-layout counterpart; None when it has."""
    cfg = drafter.cfg
    if not algorithm(cfg.algo).supports("dspark-hf"):
        raise ExportError(f"the DSpark layout holds block drafters (dspark, dflash), not {cfg.algo!r} "
                          "(an eagle3 drafter exports in the EAGLE-3 layout)")
    if cfg.markov_head not in ("vanilla", "none"):
        raise ExportError(f"markov_head={cfg.markov_head!r} has no counterpart in the DSpark layout "
                          "(its RNN head is parameterised differently); export vanilla or none")
    if not drafter.shape.qk_norm:
        raise ExportError(f"the draft layers have no per-head q/k RMSNorm (layer_style={cfg.layer_style!r} on a "
                          "target family without them); vLLM's and TensorRT-LLM's DSpark models build Qwen3 layers "
                          "with q_norm/k_norm: train with algo.layer_style=qwen3")


def to_deepspec_state(drafter, dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    """Our drafter (+ the target's frozen embedding and the drafter's LM head) under reference names."""
    check_exportable(drafter)
    state = {k: v.detach().cpu() for k, v in drafter.state_dict().items()}
    V = drafter.lm_head.weight.shape[0]
    out: dict[str, torch.Tensor] = {}
    ids = state.pop("draft_ids", None)
    if ids is not None:
        out.update(d2t_t2d(ids, V))
        w1 = state.get("markov.w1.weight")
        if w1 is not None:  # draft index (n+1 rows) -> every target id (V rows)
            state["markov.w1.weight"] = w1.index_select(0, drafter.to_draft(torch.arange(V, device=ids.device)).cpu())
    for k, v in state.items():
        out[_to_reference(k)] = v.to(dtype).contiguous()
    if drafter.markov is None:  # DFlash: a zero head, bias exactly 0
        out["markov_head.markov_w1.weight"] = torch.zeros(V, NULL_MARKOV_RANK, dtype=dtype)
        out["markov_head.markov_w2.weight"] = torch.zeros(drafter.draft_vocab_size, NULL_MARKOV_RANK, dtype=dtype)
    out["embed_tokens.weight"] = drafter.embed.weight.detach().to(dtype).contiguous().cpu().clone()
    out["lm_head.weight"] = drafter.draft_head.weight.detach().to(dtype).contiguous().cpu().clone()
    return out


def deepspec_config(drafter, target, dtype: str = "float32", num_anchors: int = 512) -> dict:
    cfg = drafter.cfg
    check_exportable(drafter)
    conf = target_config(target)
    conf.update({
        "architectures": [DSPARK_ARCHITECTURE],
        "model_type": "qwen3",
        "num_target_layers": int(target.num_layers),
        "num_hidden_layers": int(cfg.num_layers),
        "block_size": int(cfg.block_size),
        "tie_word_embeddings": False,
        "layer_types": ["full_attention"] * int(cfg.num_layers),
        "mask_token_id": int(cfg.mask_token_id),
        "target_layer_ids": [int(i) for i in target.profile.layer_ids],
        "num_anchors": int(num_anchors),
        "enable_confidence_head": bool(cfg.confidence_head),
        "markov_rank": int(cfg.markov_rank) if cfg.markov_head != "none" else NULL_MARKOV_RANK,
        "markov_head_type": "vanilla",
        "draft_vocab_size": int(drafter.draft_vocab_size),
        "torch_dtype": dtype,
        "dspark_kit": {"drafter": dataclasses.asdict(cfg), "target_identity": target.identity()},
    })
    if cfg.confidence_head:
        conf["confidence_head_with_markov"] = cfg.markov_head != "none"
    return conf


def export_hf(drafter, target, out_dir: str | Path, dtype: str = "float32") -> dict:
    """Write ``config.json`` + ``model.safetensors`` in the DSpark layout; return a summary.
    Everything is checked and built before the directory appears (atomically)."""
    return export_checkpoint(drafter, target, out_dir, dtype, "deepspec-dspark", to_deepspec_state, deepspec_config)
