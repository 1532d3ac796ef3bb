"""The training recipe a checkpoint was made with, so a resume cannot silently change it.

Resuming promises the result of one uninterrupted run. That only holds if the run continues
with the settings it started with: a changed learning rate, loss weight, step count (the
cosine schedule spans it), batch or seed would give a checkpoint that no single command
produces, and a changed architecture would be silently ignored (the checkpoint's wins). The
recipe is saved in ``train_state.pt`` and compared before a resume; settings that do not
change the weights (logging, checkpoint and evaluation cadence, device, dtype, the
bench-train time budget that only planned ``steps``) are left out.
"""
from __future__ import annotations

import dataclasses
from typing import Any

from .config import ConfigError

# train.* fields that decide the weights; the rest (cadence, device, dtype, distributed,
# budget_seconds) may change between the interrupted run and its resume
_TRAIN_KEYS = ("steps", "batch_size", "blocks_per_seq", "lr", "warmup_steps", "min_lr_ratio", "weight_decay",
               "grad_clip", "init_layers", "seed")
_DATA_KEYS = ("max_prompts", "holdout_fraction")


class ResumeMismatch(ConfigError):
    """A resume asked for other settings than the checkpoint was trained with."""


def training_recipe(run_cfg, drafter_cfg) -> dict[str, Any]:
    """Flat ``{"section.key": value}`` of what decides the trained weights."""
    out: dict[str, Any] = {f"drafter.{k}": v for k, v in dataclasses.asdict(drafter_cfg).items()}
    # algo.kind follows from algo.algo (the registry refuses any other), so it decides nothing more
    out.update({k: v for k, v in _flat("algo", dataclasses.asdict(run_cfg.algo)).items() if k != "algo.kind"})
    out.update({f"train.{k}": getattr(run_cfg.train, k) for k in _TRAIN_KEYS})
    out.update({f"data.{k}": getattr(run_cfg.data, k) for k in _DATA_KEYS})
    return out


def _flat(prefix: str, d: dict) -> dict[str, Any]:
    out = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(_flat(f"{prefix}.{k}", v))
        else:
            out[f"{prefix}.{k}"] = v
    return out


def check_resume(saved: dict[str, Any], now: dict[str, Any], where: str) -> None:
    """Refuse to resume ``where`` under a recipe other than the one it was trained with."""
    diff = [k for k in sorted(set(saved) | set(now)) if saved.get(k) != now.get(k)]
    if not diff:
        return
    shown = ", ".join(f"{k}: {saved.get(k)!r} -> {now.get(k)!r}" for k in diff[:4])
    more = f" (and {len(diff) - 4} more)" if len(diff) > 4 else ""
    raise ResumeMismatch(
        f"{where} was trained with other settings than this run asks for: {shown}{more}. Rerun with the "
        "checkpoint's settings to resume it, or use a new run name (name=...) to train with the new ones")
