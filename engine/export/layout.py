"""Pieces shared by the engine-facing checkpoint layouts (DSpark in hf_export.py, EAGLE-3 in
eagle3_export.py, and their importers): the draft-vocabulary maps, the target config they start
from, a directory write that is either complete or absent (:func:`export_checkpoint`), and the
last step of an import (:func:`load_imported`).

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
from typing import Callable, Iterator

import torch
from safetensors.torch import save_file
from torch import nn

from dspark.training.checkpoint import drafter_for_state
from dspark.training.draft_vocab import DraftVocabError

__all__ = ["ExportError", "DTYPES", "d2t_t2d", "draft_ids_from_d2t", "target_config", "atomic_dir",
           "write_checkpoint_dir", "export_checkpoint", "load_imported"]

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


def export_checkpoint(drafter, target, out_dir: str | Path, dtype: str, layout: str,
                      to_state: Callable[[nn.Module, torch.dtype], dict[str, torch.Tensor]],
                      make_config: Callable[[nn.Module, object, str], dict]) -> dict:
    """Write one layout's ``config.json`` + ``model.safetensors`` for ``drafter`` into ``out_dir``.

    ``to_state(drafter, torch dtype)`` gives the tensors and ``make_config(drafter, target, dtype
    name)`` the config; both run (and may refuse) before anything is written, and the write is
    atomic. Returns the summary the engine directory's manifest records."""
    if dtype not in DTYPES:
        raise ExportError(f"dtype must be one of {sorted(DTYPES)}, got {dtype!r}")
    state = to_state(drafter, DTYPES[dtype])
    conf = make_config(drafter, target, dtype)
    write_checkpoint_dir(out_dir, state, conf)
    return {"layout": layout, "architectures": conf["architectures"], "dtype": dtype,
            "draft_vocab_size": conf["draft_vocab_size"], "tensors": len(state),
            "files": ["config.json", "model.safetensors"]}


def load_imported(cfg, target, ours: dict[str, torch.Tensor], frozen: dict[str, torch.Tensor], where: str,
                  error: type[Exception]) -> tuple[nn.Module, dict[str, float]]:
    """The last step of an import: a drafter for ``cfg`` and ``target`` loaded from ``ours`` (its own
    tensor names, cast to the drafter's dtypes), in eval mode.

    ``frozen`` holds the file's copies of the target's embedding / LM head (``embed_tokens.weight``,
    ``lm_head.weight``), which the drafter takes from ``target`` instead: each present one must have
    the drafter's shape, and its largest difference from the drafter's is returned
    (``<name>_max_abs_diff_vs_target``). Every refusal raises ``error`` naming ``where``."""
    model = drafter_for_state(cfg, target, ours, where, error)
    expected = model.state_dict()
    try:
        model.load_state_dict({k: v.to(expected[k].dtype) for k, v in ours.items()})
    except DraftVocabError as exc:
        raise error(f"{where}: d2t does not give a usable draft vocabulary ({exc})") from None
    info = {}
    for name, mine in (("embed_tokens.weight", model.embed.weight), ("lm_head.weight", model.draft_head.weight)):
        if name in frozen:
            if tuple(frozen[name].shape) != tuple(mine.shape):
                raise error(f"{where}: {name} has shape {tuple(frozen[name].shape)}, the drafter built for this "
                            f"target has {tuple(mine.shape)}")
            info[f"{name.split('.')[0]}_max_abs_diff_vs_target"] = float(
                (frozen[name].float() - mine.detach().float()).abs().max())
    return model.eval(), info
