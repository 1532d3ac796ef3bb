"""Pieces shared by the engine-facing checkpoint layouts (DSpark in hf_export.py, EAGLE-3 in
eagle3_export.py): the draft-vocabulary maps, the target config they start from, and a
directory write that is either complete or absent.

Draft vocabulary (the EAGLE-3 convention, which vLLM's DSpark loader reads as well):
``d2t`` int64 ``[n]`` with ``target id = i + d2t[i]`` for draft index ``i``; ``t2d`` bool ``[V]``,
True at the target ids inside the draft vocabulary (loaders ignore it; kept for SpecForge /
SGLang tooling). The kit's ``draft_ids`` are ``arange(n) + d2t``.
"""
from __future__ import annotations

import contextlib
import json
import shutil
import tempfile
from pathlib import Path
from typing import Iterator

import torch
from safetensors.torch import save_file

__all__ = ["ExportError", "DTYPES", "d2t_t2d", "draft_ids_from_d2t", "target_config", "atomic_dir",
           "write_checkpoint_dir"]

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


class ExportError(RuntimeError):
    """An export the target engine's layout cannot express; one line saying why."""


def d2t_t2d(draft_ids: torch.Tensor, vocab_size: int) -> dict[str, torch.Tensor]:
    """Sorted draft ids [n] -> {"d2t": [n] int64 offsets, "t2d": [V] bool}."""
    ids = draft_ids.detach().to("cpu", torch.long)
    t2d = torch.zeros(vocab_size, dtype=torch.bool)
    t2d[ids] = True
    return {"d2t": (ids - torch.arange(ids.numel())).contiguous(), "t2d": t2d}


def draft_ids_from_d2t(d2t: torch.Tensor) -> torch.Tensor:
    """The inverse of :func:`d2t_t2d`: d2t [n] -> target ids [n]."""
    return torch.arange(d2t.numel()) + d2t.to(torch.long)


def target_config(target) -> dict:
    """The target's HF config as a dict, without what a drafter checkpoint must not claim."""
    conf = target.config.to_dict()
    for key in ("quantization_config", "_name_or_path", "transformers_version", "auto_map"):
        conf.pop(key, None)
    return conf


@contextlib.contextmanager
def atomic_dir(out: str | Path) -> Iterator[Path]:
    """Yield an empty sibling temp directory; on success it replaces ``out`` in one rename, on any
    error it is removed and ``out`` is left as it was (never a half-written export)."""
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.partial-", dir=out.parent))
    try:
        yield tmp
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if out.exists():
        shutil.rmtree(out)
    tmp.rename(out)


def write_checkpoint_dir(out: str | Path, state: dict[str, torch.Tensor], config: dict) -> None:
    """``config.json`` + ``model.safetensors`` into ``out``, atomically."""
    with atomic_dir(out) as tmp:
        save_file({k: v.contiguous() for k, v in state.items()}, str(tmp / "model.safetensors"),
                  metadata={"format": "pt"})
        (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")
