"""Hugging Face-style export of a DSpark drafter, and the TensorRT-LLM options around it.

Layout written (``hf/``), following the DeepSpec reference checkpoints (the format a
``save_pretrained`` of its DSpark draft model produces, commit recorded in docs/engine.md):

- ``config.json``: the target's HF config, then the draft keys: ``architectures``
  (``["<Family>DSparkModel"]``), ``num_hidden_layers`` (draft layers), ``num_target_layers``,
  ``block_size``, ``mask_token_id``, ``target_layer_ids``, ``num_anchors`` (training-only),
  ``markov_rank`` (0 = no Markov head), ``markov_head_type``, ``enable_confidence_head``,
  ``confidence_head_with_markov``, ``tie_word_embeddings: false``, ``layer_types``; plus
  ``dspark_kit`` (our DrafterConfig, for an exact import back);
- ``model.safetensors`` with the reference tensor names (:data:`NAME_PAIRS`), including the
  target's frozen ``embed_tokens`` and ``lm_head`` (the reference checkpoint carries them).

``trtllm/`` holds ``llm_api_options.yaml`` (``speculative_config`` with ``decoding_type:
DSpark``, ``max_draft_len``, ``speculative_model``, ``enable_confidence_scheduling``,
``confidence_sts_path``, ``confidence_sps_table_path``), ``sts.json`` as-is (the STS loader
there reads ``sts_temperatures``) and ``sps_cost_table.json``: our SPS table converted to
that loader's interpolated curve (``token_counts`` = batch tokens incl. the bonus token,
``step_time_ms`` = 1000 / steps_per_s, whole-step times so ``fixed_overhead_ms`` = 0).
"""
from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path

import torch
from safetensors.torch import save_file

__all__ = ["ExportError", "NAME_PAIRS", "rename_tensor", "to_deepspec_state", "deepspec_config", "export_hf", "sps_to_trtllm",
           "write_trtllm_options", "DTYPES"]

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}

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
FROZEN = ("embed_tokens.weight", "lm_head.weight")  # the target's, shared and frozen


def rename_tensor(name: str, to_reference: bool = True) -> str | None:
    """Our tensor name -> the reference one (or back); None when the name has no counterpart."""
    for ours, ref in NAME_PAIRS:
        src, dst = (ours, ref) if to_reference else (ref, ours)
        m = re.fullmatch(re.escape(src).replace(re.escape("{i}"), r"(\d+)"), name)
        if m:
            return dst.replace("{i}", m.group(1)) if m.groups() else dst
    return None


class ExportError(RuntimeError):
    pass


def _to_reference(name: str) -> str:
    ref = rename_tensor(name)
    if ref is None:
        raise ExportError(f"tensor {name!r} has no counterpart in the reference DSpark layout")
    return ref


def _check_exportable(cfg) -> None:
    if cfg.algo not in ("dspark", "dflash"):
        raise ExportError(f"the reference layout holds block drafters (dspark, dflash), not {cfg.algo!r}")
    if getattr(cfg, "draft_vocab_size", 0):
        raise ExportError("a drafter over a draft vocabulary has no counterpart in the reference layout "
                          "(it drafts over the full vocabulary); train with target.draft_vocab=0")
    if cfg.markov_head not in ("vanilla", "none"):
        raise ExportError(f"markov_head={cfg.markov_head!r} has no counterpart in the reference layout "
                          "(its RNN head is parameterised differently); export vanilla or none")


def to_deepspec_state(drafter, dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    """Our drafter (+ the target's frozen embedding and LM head) under reference names."""
    _check_exportable(drafter.cfg)
    out = {_to_reference(k): v.detach().to(dtype).contiguous().cpu() for k, v in drafter.state_dict().items()}
    out["embed_tokens.weight"] = drafter.embed.weight.detach().to(dtype).contiguous().cpu().clone()
    out["lm_head.weight"] = drafter.lm_head.weight.detach().to(dtype).contiguous().cpu().clone()
    return out


def deepspec_config(drafter, target, dtype: str = "float32", num_anchors: int = 512) -> dict:
    cfg = drafter.cfg
    _check_exportable(cfg)
    conf = target.config.to_dict()
    conf.pop("quantization_config", None)
    family = {"qwen3": "Qwen3", "llama": "Llama", "gemma3": "Gemma3", "gemma3_text": "Gemma3"}.get(
        conf.get("model_type", ""), str(conf.get("model_type", "Unknown")).capitalize())
    conf.update({
        "architectures": [f"{family}DSparkModel"],
        "num_target_layers": int(target.num_layers),
        "num_hidden_layers": int(cfg.num_layers),
        "block_size": int(cfg.block_size),
        "tie_word_embeddings": False,
        "layer_types": ["full_attention"] * int(cfg.num_layers),
        "mask_token_id": int(cfg.mask_token_id),
        "target_layer_ids": [int(i) for i in target.profile.layer_ids],
        "num_anchors": int(num_anchors),
        "enable_confidence_head": bool(cfg.confidence_head),
        "markov_rank": int(cfg.markov_rank) if cfg.markov_head != "none" else 0,
        "torch_dtype": dtype,
        "dspark_kit": {"drafter": dataclasses.asdict(cfg), "target_identity": target.identity()},
    })
    if cfg.markov_head != "none":
        conf["markov_head_type"] = cfg.markov_head
    if cfg.confidence_head:
        conf["confidence_head_with_markov"] = cfg.markov_head != "none"
    return conf


def export_hf(drafter, target, out_dir: str | Path, dtype: str = "float32") -> dict:
    """Write ``config.json`` + ``model.safetensors`` in the reference layout; return a summary."""
    if dtype not in DTYPES:
        raise ExportError(f"dtype must be one of {sorted(DTYPES)}, got {dtype!r}")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    state = to_deepspec_state(drafter, DTYPES[dtype])
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    conf = deepspec_config(drafter, target, dtype)
    (out / "config.json").write_text(json.dumps(conf, indent=2) + "\n")
    return {"layout": "deepspec-dspark", "architectures": conf["architectures"], "dtype": dtype,
            "tensors": len(state), "files": ["config.json", "model.safetensors"]}


def sps_to_trtllm(table) -> dict:
    """Our ``SpsTable`` -> the interpolated cost curve TensorRT-LLM's DSpark planner loads."""
    return {
        "token_counts": [int(t) for t in table.tokens],
        "step_time_ms": [1000.0 / float(s) for s in table.steps_per_s],
        "fixed_overhead_ms": 0.0,
        "_meta": {"lookup": "interp", "encoding": "whole-step", "source": "dspark-sps v1",
                  "device": table.device, "engine": table.engine, "created_at": table.created_at},
    }


def write_trtllm_options(out_dir: str | Path, *, hf_dir: str, block_size: int, max_batch: int, max_context: int,
                         dtype: str, sts_file: str | None, sps_file: str | None, has_confidence: bool) -> dict:
    """Write ``llm_api_options.yaml`` for the LLM API / ``trtllm-serve --extra_llm_api_options``."""
    import yaml

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    spec = {"decoding_type": "DSpark", "max_draft_len": int(block_size), "speculative_model": hf_dir,
            "enable_confidence_scheduling": bool(has_confidence and sps_file)}
    if sts_file:
        spec["confidence_sts_path"] = sts_file
    if sps_file:
        spec["confidence_sps_table_path"] = sps_file
    options = {"backend": "pytorch", "dtype": {"float32": "float32", "float16": "float16", "bfloat16": "bfloat16"}[dtype],
               "max_batch_size": int(max_batch), "max_seq_len": int(max_context), "speculative_config": spec}
    text = ("# TensorRT-LLM LLM-API options for the DSpark drafter in ../hf (paths relative to the engine dir;\n"
            "# make them absolute or run from the engine dir). Written by dspark build.\n")
    (out / "llm_api_options.yaml").write_text(text + yaml.safe_dump(options, sort_keys=False))
    return {"file": "llm_api_options.yaml", "speculative_config": spec}
