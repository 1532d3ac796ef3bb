"""Import a DeepSpec-layout DSpark checkpoint (``config.json`` + ``*.safetensors``) as our drafter.

The inverse of :mod:`.hf_export`: tensor names are mapped back (:func:`.hf_export.rename_tensor`), the
draft config keys become a ``DrafterConfig``, and the result is checked against the loaded
target (hidden size, vocabulary, target layer ids, and that the file's frozen embedding /
LM head have the target's shapes). Export then import reproduces our drafter bit for bit.

A draft vocabulary comes back from ``d2t`` (``draft_ids = arange(n) + d2t``); the full-vocabulary
``markov_w1`` goes back to the kit's ``n + 1`` rows (the draft ids, then the one row every other
target id shares), which exists only when all those other rows are equal: an export of ours always
has them equal, a checkpoint trained elsewhere may not and is refused. The imported drafter has
Qwen3 layers (``layer_style=qwen3``), the layout's.

Refused, each with a one-line ``DeepSpecImportError``: a Markov head other than ``vanilla``
(``gated``/``rnn`` are parameterised differently from ours), a confidence head that does
not read the Markov embedding while a Markov head exists, layer id -1 (embedding output),
a reduced vocabulary without ``d2t``, a checkpoint for another target.
"""
from __future__ import annotations

import dataclasses
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file

from dspark.training.jsonfile import read_json_file
from dspark.training.models import DrafterConfig

from .hf_export import FROZEN, VOCAB_MAPS, rename_tensor
from .layout import draft_ids_from_d2t, load_imported

__all__ = ["DeepSpecImportError", "from_deepspec_state", "config_from_deepspec", "import_deepspec"]

class DeepSpecImportError(RuntimeError):
    pass


def from_deepspec_state(state: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """-> (our drafter state dict, the frozen tensors and vocabulary maps found: embed_tokens /
    lm_head / d2t / t2d). The Markov ``W1`` is still over the full vocabulary here."""
    ours, frozen = {}, {}
    for name, t in state.items():
        if name in FROZEN or name in VOCAB_MAPS:
            frozen[name] = t
            continue
        mine = rename_tensor(name, to_reference=False)
        if mine is None:
            raise DeepSpecImportError(f"tensor {name!r} is not part of a DSpark drafter this kit can load")
        ours[mine] = t
    return ours, frozen


def config_from_deepspec(conf: dict, where: str = "config.json") -> DrafterConfig:
    try:
        rank = int(conf.get("markov_rank", 0))
        kind = str(conf.get("markov_head_type", "vanilla")).lower() if rank > 0 else "none"
        conf_head = bool(conf.get("enable_confidence_head", False))
        layer_ids = [int(i) for i in conf["target_layer_ids"]]
        cfg = DrafterConfig(
            algo="dspark" if (rank > 0 or conf_head) else "dflash",
            hidden_size=int(conf["hidden_size"]), vocab_size=int(conf["vocab_size"]),
            num_aux_layers=len(layer_ids), num_layers=int(conf["num_hidden_layers"]),
            block_size=int(conf["block_size"]), mask_token_id=int(conf["mask_token_id"]),
            markov_head=kind, markov_rank=rank, confidence_head=conf_head,
            draft_vocab_size=_draft_vocab(conf), layer_style="qwen3")
    except (KeyError, TypeError, ValueError) as exc:
        raise DeepSpecImportError(f"{where}: missing or bad DSpark key ({exc})") from None
    if kind not in ("vanilla", "none"):
        raise DeepSpecImportError(f"{where}: markov_head_type={kind!r} is not supported (only vanilla)")
    if conf_head and rank > 0 and not conf.get("confidence_head_with_markov", False):
        raise DeepSpecImportError(f"{where}: confidence_head_with_markov=false with a Markov head is not supported")
    if -1 in layer_ids:
        raise DeepSpecImportError(f"{where}: target_layer_ids contains -1 (embedding output), not supported")
    kit = (conf.get("dspark_kit") or {}).get("drafter") or {}
    if kind == "none" and kit.get("markov_head") == "none" and isinstance(kit.get("markov_rank"), int):
        # the reference encodes "no Markov head" as rank 0; our config keeps the profile's rank
        cfg = dataclasses.replace(cfg, markov_rank=kit["markov_rank"])
    return cfg


def _draft_vocab(conf: dict) -> int:
    """The kit's draft_vocab_size: 0 when the checkpoint drafts over the whole vocabulary."""
    n = int(conf.get("draft_vocab_size") or conf["vocab_size"])
    return 0 if n >= int(conf["vocab_size"]) else n


def _markov_w1_to_kit(w1: torch.Tensor, ids: torch.Tensor, where: str) -> torch.Tensor:
    """Full-vocabulary W1 [V, r] -> the kit's [n + 1, r]: the draft ids' rows, then the one row
    shared by every other id (refused when those rows differ)."""
    outside = torch.ones(w1.shape[0], dtype=torch.bool)
    outside[ids] = False
    rest = w1[outside]
    if rest.shape[0] and not bool((rest == rest[:1]).all()):
        raise DeepSpecImportError(f"{where}: markov_w1 rows of target ids outside the draft vocabulary differ; "
                                  "the kit's Markov head has one row for all of them")
    return torch.cat([w1.index_select(0, ids), rest[:1] if rest.shape[0] else torch.zeros_like(w1[:1])])


def import_deepspec(path: str | Path, target):
    """Load a reference-layout checkpoint directory for ``target`` -> (drafter, DrafterConfig, info)."""
    path = Path(path)
    conf_path = path / "config.json"
    if not conf_path.is_file():
        raise DeepSpecImportError(f"{path}: no config.json")
    conf = read_json_file(conf_path, "drafter config", DeepSpecImportError)
    cfg = config_from_deepspec(conf, str(conf_path))
    if cfg.hidden_size != target.hidden_size or cfg.vocab_size != target.vocab_size:
        raise DeepSpecImportError(f"{conf_path}: drafter for hidden_size={cfg.hidden_size}, vocab={cfg.vocab_size}; "
                                  f"the target has {target.hidden_size}, {target.vocab_size}")
    ids = [int(i) for i in conf["target_layer_ids"]]
    if ids != list(target.profile.layer_ids):
        raise DeepSpecImportError(f"{conf_path}: target_layer_ids={ids}, the target profile uses "
                                  f"{list(target.profile.layer_ids)}")
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise DeepSpecImportError(f"{path}: no *.safetensors weights")
    state = {}
    for f in files:
        try:
            state.update(load_file(str(f)))
        except (SafetensorError, OSError, ValueError) as exc:
            raise DeepSpecImportError(f"{f}: unreadable or truncated safetensors file ({exc})") from None
    ours, frozen = from_deepspec_state(state)
    kit = (conf.get("dspark_kit") or {}).get("drafter") or {}
    w1, w2 = ours.get("markov.w1.weight"), ours.get("markov.w2.weight")
    if (kit.get("markov_head") == "none" and cfg.markov_head == "vanilla" and not cfg.confidence_head
            and w1 is not None and w2 is not None and not bool(w1.any()) and not bool(w2.any())):
        # our DFlash export: the all-zero Markov head engines need (hf_export.NULL_MARKOV_RANK)
        del ours["markov.w1.weight"], ours["markov.w2.weight"]
        cfg = dataclasses.replace(cfg, algo=kit.get("algo", cfg.algo), markov_head="none",
                                  markov_rank=int(kit.get("markov_rank", cfg.markov_rank)))
    if cfg.draft_vocab_size:
        if "d2t" not in frozen:
            raise DeepSpecImportError(f"{path}: draft_vocab_size={cfg.draft_vocab_size} but no d2t tensor maps "
                                      "draft ids to target ids")
        ids = draft_ids_from_d2t(frozen["d2t"])
        ours["draft_ids"] = ids
        if "markov.w1.weight" in ours:
            if ours["markov.w1.weight"].shape[0] != cfg.vocab_size:
                raise DeepSpecImportError(f"{path}: markov_w1 has {ours['markov.w1.weight'].shape[0]} rows, expected "
                                          f"the target vocabulary ({cfg.vocab_size})")
            ours["markov.w1.weight"] = _markov_w1_to_kit(ours["markov.w1.weight"], ids, str(path))
    model, info = load_imported(cfg, target, ours, frozen, str(path), DeepSpecImportError)
    return model, cfg, {"source_dtype": str(next(iter(ours.values())).dtype).replace("torch.", ""), **info}
