"""Eagle3 drafters in the EAGLE-3 checkpoint layout vLLM and SGLang load, and back.

Layout written (``eagle3/``), as vLLM's ``llama_eagle3.py`` / ``qwen3_eagle3.py`` and SGLang's
``llama_eagle3.py`` read it:

- ``config.json``: the target's HF config, then ``architectures: ["LlamaForCausalLMEagle3"]``
  (``layer_style=llama``; both engines) or ``["Eagle3Qwen3ForCausalLM"]`` (``qwen3``: q/k norms,
  vLLM only), ``num_hidden_layers: 1``, ``draft_vocab_size``, ``target_hidden_size``,
  ``eagle_aux_hidden_state_layer_ids`` (top level for vLLM, inside ``eagle_config`` for SGLang):
  the kit's ``layer_ids`` + 1, since those loaders capture a layer's *input* (the previous
  layer's output, which is what the kit fuses); ``tie_word_embeddings: false``; ``dspark_kit``.
- ``model.safetensors``: ``fc``, ``midlayer.*`` (the :class:`~dspark.training.models.layers.Eagle3Layer`:
  ``self_attn.{q,k,v,o}_proj`` with q/k/v over ``[norm(embedding) ; norm(feature)]``,
  ``input_layernorm``, ``hidden_norm``, ``post_attention_layernorm``, ``mlp.*``, q/k norms for
  qwen3), ``norm``, ``lm_head`` (the drafter's, draft-sized with a draft vocabulary), the
  target's ``embed_tokens``, and ``d2t`` / ``t2d`` for a draft vocabulary (layout.py).

Refused with the reason, nothing written: an Eagle3 drafter of ``layer_style=target`` (the
kit's earlier combine-then-decoder entry has no EAGLE-3 counterpart), more than one draft layer
(the layout has one midlayer), a block drafter (hf_export.py).
"""
from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file

from dspark.training.algorithms import algorithm

from .layout import ExportError, d2t_t2d, draft_ids_from_d2t, export_checkpoint, load_imported, target_config

__all__ = ["EAGLE3_ARCHITECTURES", "Eagle3ImportError", "check_eagle3_exportable", "to_eagle3_state",
           "eagle3_config", "export_eagle3", "import_eagle3"]

EAGLE3_ARCHITECTURES = {"llama": "LlamaForCausalLMEagle3", "qwen3": "Eagle3Qwen3ForCausalLM"}
_FROZEN = ("embed_tokens.weight", "lm_head.weight", "d2t", "t2d")


class Eagle3ImportError(RuntimeError):
    pass


def _rename(name: str, to_eagle3: bool = True) -> str | None:
    """Kit name <-> EAGLE-3 name (layer 0 is the midlayer); None when it has no counterpart."""
    if name in ("fc.weight", "norm.weight"):
        return name
    src, dst = (r"layers\.0\.", "midlayer.") if to_eagle3 else (r"midlayer\.", "layers.0.")
    m = re.fullmatch(src + r"(.+)", name)
    if not m:
        return None
    rest = m.group(1)
    attn = r"(q_proj|k_proj|v_proj|o_proj|q_norm|k_norm)\.weight"
    if to_eagle3 and re.fullmatch(attn, rest):
        rest = "self_attn." + rest
    elif not to_eagle3 and rest.startswith("self_attn."):
        rest = rest[len("self_attn."):]
        if not re.fullmatch(attn, rest):
            return None
    return dst + rest


def check_eagle3_exportable(drafter) -> None:
    cfg = drafter.cfg
    if not algorithm(cfg.algo).supports("eagle3-hf"):
        raise ExportError(f"the EAGLE-3 layout holds eagle3 drafters, not {cfg.algo!r} (block drafters export "
                          "in the DSpark layout)")
    if cfg.layer_style not in EAGLE3_ARCHITECTURES:
        raise ExportError(f"an eagle3 drafter of layer_style={cfg.layer_style!r} (a combine layer before a plain "
                          "decoder layer) has no counterpart in the EAGLE-3 layout; train with layer_style llama "
                          "(configs/algos/eagle3.yaml) or qwen3")
    if cfg.num_layers != 1:
        raise ExportError(f"the EAGLE-3 layout has one draft layer (midlayer); this drafter has {cfg.num_layers}")


def to_eagle3_state(drafter, dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    check_eagle3_exportable(drafter)
    state = {k: v.detach().cpu() for k, v in drafter.state_dict().items()}
    out: dict[str, torch.Tensor] = {}
    ids = state.pop("draft_ids", None)
    if ids is not None:
        out.update(d2t_t2d(ids, drafter.lm_head.weight.shape[0]))
    for k, v in state.items():
        name = _rename(k)
        if name is None:
            raise ExportError(f"tensor {k!r} has no counterpart in the EAGLE-3 layout")
        out[name] = v.to(dtype).contiguous()
    out["embed_tokens.weight"] = drafter.embed.weight.detach().to(dtype).contiguous().cpu().clone()
    out["lm_head.weight"] = drafter.draft_head.weight.detach().to(dtype).contiguous().cpu().clone()
    return out


def eagle3_config(drafter, target, dtype: str = "float32") -> dict:
    cfg = drafter.cfg
    check_eagle3_exportable(drafter)
    aux_ids = [int(i) + 1 for i in target.profile.layer_ids]
    conf = target_config(target)
    conf.update({
        "architectures": [EAGLE3_ARCHITECTURES[cfg.layer_style]],
        "model_type": "qwen3" if cfg.layer_style == "qwen3" else "llama",
        "num_hidden_layers": 1,
        "draft_vocab_size": int(drafter.draft_vocab_size),
        "target_hidden_size": int(cfg.hidden_size),
        "num_aux_hidden_states": len(aux_ids),
        "eagle_aux_hidden_state_layer_ids": aux_ids,
        "eagle_config": {"eagle_aux_hidden_state_layer_ids": aux_ids, "use_aux_hidden_state": True},
        "tie_word_embeddings": False,
        "torch_dtype": dtype,
        "dspark_kit": {"drafter": dataclasses.asdict(cfg), "target_identity": target.identity()},
    })
    return conf


def export_eagle3(drafter, target, out_dir: str | Path, dtype: str = "float32") -> dict:
    """Write ``config.json`` + ``model.safetensors`` in the EAGLE-3 layout, atomically."""
    return export_checkpoint(drafter, target, out_dir, dtype, "eagle3", to_eagle3_state, eagle3_config)


def import_eagle3(path: str | Path, target, block_size: int | None = None):
    """Load an EAGLE-3 checkpoint directory for ``target`` -> (drafter, DrafterConfig, info).

    The draft length is not part of the layout: it comes from ``block_size`` or the kit's own
    ``dspark_kit`` record (an export of ours); the mask token and Markov rank, unused by an
    eagle3 drafter, from the record or the target profile."""
    from dspark.training.jsonfile import read_json_file
    from dspark.training.models import DrafterConfig

    path = Path(path)
    conf = read_json_file(path / "config.json", "EAGLE-3 config", Eagle3ImportError)
    kit = (conf.get("dspark_kit") or {}).get("drafter") or {}
    try:
        V, n = int(conf["vocab_size"]), int(conf.get("draft_vocab_size") or conf["vocab_size"])
        aux = conf.get("eagle_aux_hidden_state_layer_ids") or (conf.get("eagle_config") or {})[
            "eagle_aux_hidden_state_layer_ids"]
        layer_ids = [int(i) - 1 for i in aux]
        arch = list(conf["architectures"])[0]
        if int(conf["num_hidden_layers"]) != 1:
            raise ValueError(f"num_hidden_layers={conf['num_hidden_layers']}, the layout has one midlayer")
    except (KeyError, TypeError, ValueError, IndexError) as exc:
        raise Eagle3ImportError(f"{path}/config.json: missing or bad EAGLE-3 key ({exc})") from None
    style = {v: k for k, v in EAGLE3_ARCHITECTURES.items()}.get(arch)
    if style is None:
        raise Eagle3ImportError(f"{path}/config.json: architecture {arch!r} is not one of "
                                f"{', '.join(EAGLE3_ARCHITECTURES.values())}")
    if layer_ids != list(target.profile.layer_ids):
        raise Eagle3ImportError(f"{path}/config.json: aux layers {aux} are target layers {layer_ids}; the target "
                                f"profile uses {list(target.profile.layer_ids)}")
    K = block_size if block_size is not None else kit.get("block_size")
    if not isinstance(K, int):
        raise Eagle3ImportError(f"{path}: an EAGLE-3 checkpoint does not record the draft length; pass block_size")
    cfg = DrafterConfig(algo="eagle3", hidden_size=int(conf["hidden_size"]), vocab_size=V,
                        num_aux_layers=len(layer_ids), num_layers=1, block_size=K,
                        mask_token_id=int(kit.get("mask_token_id", target.profile.mask_token_id)),
                        markov_head="none", markov_rank=int(kit.get("markov_rank", target.profile.markov_rank)),
                        confidence_head=False, draft_vocab_size=0 if n >= V else n, layer_style=style)
    if cfg.hidden_size != target.hidden_size or V != target.vocab_size:
        raise Eagle3ImportError(f"{path}: drafter for hidden_size={cfg.hidden_size}, vocab={V}; the target has "
                                f"{target.hidden_size}, {target.vocab_size}")
    try:
        state = load_file(str(path / "model.safetensors"))
    except (SafetensorError, OSError, ValueError) as exc:
        raise Eagle3ImportError(f"{path}/model.safetensors: unreadable or truncated ({exc})") from None
    ours = {}
    for name, t in state.items():
        if name in _FROZEN:
            continue
        mine = _rename(name, to_eagle3=False)
        if mine is None:
            raise Eagle3ImportError(f"{path}: tensor {name!r} is not part of an EAGLE-3 drafter this kit can load")
        ours[mine] = t
    if cfg.draft_vocab_size:
        if "d2t" not in state:
            raise Eagle3ImportError(f"{path}: draft_vocab_size={n} but no d2t tensor")
        ours["draft_ids"] = draft_ids_from_d2t(state["d2t"])
    model, info = load_imported(cfg, target, ours, state, str(path), Eagle3ImportError)
    return model, cfg, info
