"""Drafter checkpoints: ``model.safetensors`` + ``drafter.json`` (+ ``train_state.pt`` to resume).

``drafter.json``::

    {"format": "dspark-drafter", "version": 1, "kit_version": "...",
     "drafter": {DrafterConfig fields}, "target": {Target.identity()}, "step": int}

Loading checks the format, the target identity (hidden size, vocab, layer ids, tokenizer
hash) and every tensor's name and shape, and turns any failure into a one-line
``CheckpointError`` instead of a traceback from deep inside torch.
"""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file
from torch import nn

from .draft_vocab import DraftVocabError
from .jsonfile import read_json_file
from .models import DrafterConfig, build_drafter

CKPT_FORMAT = "dspark-drafter"
CKPT_VERSION = 1
KIT_VERSION = "0.1.0"


class CheckpointError(RuntimeError):
    pass


def drafter_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """Trainable drafter weights only (the frozen target embedding/LM head are not saved)."""
    return {k: v.detach().contiguous().cpu() for k, v in model.state_dict().items()}


def save_checkpoint(path: Path, model: nn.Module, cfg: DrafterConfig, target_identity: dict, step: int,
                    train_state: dict | None = None) -> None:
    path = Path(path)
    tmp = path.with_name(path.name + ".partial")
    tmp.mkdir(parents=True, exist_ok=True)
    save_file(drafter_state(model), str(tmp / "model.safetensors"))
    meta = {"format": CKPT_FORMAT, "version": CKPT_VERSION, "kit_version": KIT_VERSION,
            "drafter": dataclasses.asdict(cfg), "target": target_identity, "step": step}
    (tmp / "drafter.json").write_text(json.dumps(meta, indent=2))
    if train_state is not None:
        torch.save(train_state, tmp / "train_state.pt")
    if path.exists():
        import shutil
        shutil.rmtree(path)
    tmp.rename(path)  # a checkpoint directory is either complete or absent


def read_meta(path: Path) -> dict:
    path = Path(path)
    meta_path = path / "drafter.json"
    if not meta_path.is_file():
        raise CheckpointError(f"{path}: not a drafter checkpoint (no drafter.json)")
    meta = read_json_file(meta_path, "checkpoint metadata", CheckpointError)
    if meta.get("format") != CKPT_FORMAT:
        raise CheckpointError(f"{meta_path}: format {meta.get('format')!r} is not {CKPT_FORMAT!r}")
    if meta.get("version") != CKPT_VERSION:
        raise CheckpointError(f"{meta_path}: checkpoint version {meta.get('version')!r} unknown to this kit (knows {CKPT_VERSION})")
    return meta


def check_target(meta: dict, identity: dict, where: str) -> None:
    """Refuse a drafter trained for another target, naming the first mismatching field."""
    want = meta.get("target", {})
    for key in ("hidden_size", "vocab_size", "layer_ids", "num_layers", "tokenizer_hash"):
        if key in want and want[key] != identity.get(key):
            raise CheckpointError(f"{where}: drafter was trained for a target with {key}={want[key]!r}, "
                                  f"but the loaded target has {key}={identity.get(key)!r}")


def load_checkpoint(path: Path, target) -> tuple[nn.Module, DrafterConfig, dict]:
    """Build the drafter for ``target`` from a checkpoint directory; validates everything."""
    path = Path(path)
    meta = read_meta(path)
    check_target(meta, target.identity(), str(path))
    try:
        cfg = DrafterConfig(**meta["drafter"])
    except TypeError as exc:
        raise CheckpointError(f"{path}/drafter.json: bad drafter config ({exc})") from None
    weights = path / "model.safetensors"
    if not weights.is_file():
        raise CheckpointError(f"{path}: model.safetensors is missing")
    try:
        state = load_file(str(weights))
    except (SafetensorError, OSError, ValueError) as exc:
        raise CheckpointError(f"{weights}: unreadable or truncated safetensors file ({exc})") from None
    model = drafter_for_state(cfg, target, state, str(weights), CheckpointError)
    try:
        model.load_state_dict(state)
    except DraftVocabError as exc:
        raise CheckpointError(f"{weights}: bad draft_ids ({exc})") from None
    return model.eval(), cfg, meta


def drafter_for_state(cfg: DrafterConfig, target, state: dict[str, torch.Tensor], where: str,
                      error: type[Exception]) -> nn.Module:
    """A fresh drafter for ``cfg`` after checking that ``state`` has exactly its tensor names
    and shapes; a mismatch raises ``error`` naming ``where``."""
    model = build_drafter(cfg, target)
    expected = model.state_dict()
    missing = sorted(set(expected) - set(state))
    extra = sorted(set(state) - set(expected))
    if missing or extra:
        raise error(f"{where}: tensor names do not match a {cfg.algo} drafter for this target "
                    f"(missing {missing[:3]}, unexpected {extra[:3]})")
    for k, v in state.items():
        if tuple(v.shape) != tuple(expected[k].shape):
            raise error(f"{where}: tensor {k} has shape {tuple(v.shape)}, expected {tuple(expected[k].shape)}")
    return model
