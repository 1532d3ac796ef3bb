"""``dspark build``: a drafter checkpoint + a target -> an engine directory.

    <output>/
      engine.json        runtime keys (target_profile, drafter_dir, sps, sts, proposers, suffix) + manifest (manifest.py)
      drafter/           copy of the checkpoint (model.safetensors, drafter.json)
      sps.json sts.json  copied in when given (--sps / --sts)
      onnx/              dspark_draft.onnx: drafter step + DSparkSchedule plugin node
      hf/                the drafter as engines load it (config.json + model.safetensors): the DSpark
                         layout (vLLM / TensorRT-LLM / DeepSpec, hf_export.py) for dspark and dflash,
                         the EAGLE-3 layout (vLLM / SGLang, eagle3_export.py) for eagle3
      trtllm/            llm_api_options.yaml (+ sps_cost_table.json in that loader's format)
      trt/               dspark_draft.plan (only with --what ...,trt on a TensorRT host)

Targets in ``what``: onnx, hf, trtllm, trt (default onnx,hf,trtllm; trtllm implies hf).
A target the drafter cannot be expressed in (onnx / trtllm / trt for an eagle3 drafter, hf for
a drafter whose layers no engine builds) is refused with the reason when asked for, and
skipped with the reason recorded under ``built`` by the default ``what``; the check runs before
anything is written. When ``trt`` is asked for and TensorRT is missing, everything else is
still built and recorded, then :class:`~.trt_build.TensorRTUnavailable` is raised (the CLI exits 3).
"""
from __future__ import annotations

import dataclasses
import json
import platform
import shutil
from datetime import datetime, timezone
from importlib import metadata
from pathlib import Path
from typing import Sequence

from . import manifest as mf
from .weights import target_weight_files, weight_entry

__all__ = ["BuildError", "WHAT_ALL", "WHAT_DEFAULT", "parse_what", "normalise_dtype", "target_weight_files",
           "tool_versions", "build_engine"]

WHAT_ALL = ("onnx", "hf", "trtllm", "trt")
WHAT_DEFAULT = ("onnx", "hf", "trtllm")
_DTYPE_ALIASES = {"float32": "float32", "fp32": "float32", "float16": "float16", "fp16": "float16",
                  "half": "float16", "bfloat16": "bfloat16", "bf16": "bfloat16"}


class BuildError(RuntimeError):
    """A build that cannot proceed; one line saying why."""


def parse_what(what: str | Sequence[str] | None) -> list[str]:
    items = list(WHAT_DEFAULT) if what is None else (
        [w.strip() for w in what.split(",") if w.strip()] if isinstance(what, str) else list(what))
    bad = [w for w in items if w not in WHAT_ALL]
    if bad or not items:
        raise BuildError(f"--what: unknown target(s) {bad or items}; choose from {','.join(WHAT_ALL)}")
    if "trtllm" in items and "hf" not in items:
        items.append("hf")  # the TensorRT-LLM options point at the HF-layout drafter
    return [w for w in WHAT_ALL if w in items]


def normalise_dtype(dtype: str) -> str:
    try:
        return _DTYPE_ALIASES[dtype.lower()]
    except KeyError:
        raise BuildError(f"--dtype {dtype!r}: choose float32, float16 or bfloat16") from None


def tool_versions() -> dict[str, str | None]:
    out: dict[str, str | None] = {"python": platform.python_version()}
    for dist in ("torch", "transformers", "safetensors", "onnx", "onnxruntime", "onnxruntime-extensions", "tensorrt",
                 "tensorrt_llm"):
        try:
            out[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            out[dist] = None
    return out


def _dspark_layout():
    from .hf_export import check_exportable, export_hf
    return check_exportable, export_hf


def _eagle3_layout():
    from .eagle3_export import check_eagle3_exportable, export_eagle3
    return check_eagle3_exportable, export_eagle3


# the hf/ checkpoint layouts by export format (training/algorithms.py): () -> (check, export)
HF_LAYOUTS = {"dspark-hf": _dspark_layout, "eagle3-hf": _eagle3_layout}


def _skip(items: list[str], which: Sequence[str], reason: str, asked: bool, skipped: dict[str, dict]) -> list[str]:
    """Drop the build targets ``which`` from ``items`` with ``reason``: a BuildError when the user
    asked for them (``asked``), else recorded in ``skipped``."""
    hit = [w for w in which if w in items]
    if hit and asked:
        raise BuildError(f"--what {','.join(hit)}: {reason}")
    skipped.update({w: {"status": "skipped", "reason": reason} for w in hit})
    return [w for w in items if w not in hit]


def _copy_checkpoint(src: Path, dst: Path) -> None:
    dst.mkdir(parents=True, exist_ok=True)
    for name in ("model.safetensors", "drafter.json"):
        shutil.copy2(src / name, dst / name)


def build_engine(*, drafter_dir: str | Path, output: str | Path, target_profile=None, target=None,
                 target_source: str | None = None, dtype: str = "float32", max_batch: int = 64,
                 max_context: int = 2048, block_size: int | None = None, what: str | Sequence[str] | None = None,
                 sps: str | Path | None = None, sts: str | Path | None = None, plugin_lib: str | None = None,
                 force: bool = False, trtllm_version: str | None = None, proposers: str = "neural",
                 suffix: dict | None = None) -> dict:
    """Build an engine directory; returns the manifest written to ``engine.json``.

    ``target_profile``: a profile name, a YAML path or a ``TargetProfile``; or pass an already
    loaded ``target`` (tests, notebooks). ``target_source`` overrides the profile's source.
    ``trtllm_version``: the TensorRT-LLM whose option spelling ``trtllm/`` uses (trtllm_options.py).
    ``proposers`` / ``suffix``: the engine's default drafting methods (``EngineConfig.proposers``)
    and suffix-proposer settings (``SuffixConfig`` fields), which ``load_engine`` and the Triton
    model read (a request-time parameter may override them).
    """
    from .trtllm_options import TrtllmVersionError, resolve_version
    from dspark.training.checkpoint import KIT_VERSION, read_meta
    from dspark.training.config import TargetProfile, load_target_profile
    from dspark.training.algorithms import algorithm
    from dspark.training.models import DrafterConfig

    from dspark.engine.proposers import SuffixConfig
    from dspark.engine.runtime import parse_proposers
    try:
        parse_proposers(proposers)
        suffix = dataclasses.asdict(SuffixConfig(**{"max_drafts": 3, **(suffix or {})}))
    except (TypeError, ValueError) as exc:
        raise BuildError(f"--proposers / suffix settings: {exc}") from None
    items = parse_what(what)
    dtype = normalise_dtype(dtype)
    if max_batch < 1 or max_context < 2:
        raise BuildError(f"need --max-batch >= 1 and --max-context >= 2, got {max_batch}, {max_context}")
    drafter_dir, out = Path(drafter_dir), Path(output)
    meta = read_meta(drafter_dir)  # CheckpointError on a bad checkpoint, before any heavy loading
    dcfg = DrafterConfig(**meta["drafter"])
    if block_size is not None and int(block_size) != dcfg.block_size:
        raise BuildError(f"--block-size {block_size} does not match the drafter's block_size {dcfg.block_size} "
                         f"({drafter_dir}/drafter.json); the block size is fixed at training time")
    try:
        trtllm_version = resolve_version(trtllm_version)
    except TrtllmVersionError as exc:
        raise BuildError(str(exc)) from None
    skipped: dict[str, dict] = {}
    algo = algorithm(dcfg.algo)
    hf_layout = next((f for f in HF_LAYOUTS if algo.supports(f)), None)
    unsupported = [w for w in ("onnx", "trtllm", "trt") if not algo.supports(w)] + ([] if hf_layout else ["hf"])
    if unsupported:
        reason = (f"a {dcfg.algo} drafter exports {', '.join(algo.exports) or 'nothing'} only "
                  "(training/algorithms.py); an autoregressive drafter has no block-drafter ONNX / TensorRT graph "
                  "and no TensorRT-LLM DSpark options")
        items = _skip(items, unsupported, reason, what is not None, skipped)
    if (out / "engine.json").exists() and not force:
        raise BuildError(f"{out} already holds an engine (engine.json); pass --force to overwrite")
    sps_table = sts_cal = None
    if sps:
        from dspark.engine.sps import load_sps_table
        sps_table = load_sps_table(sps)
    if sts:
        from dspark.engine.sts import StsCalibration
        sts_cal = StsCalibration.load(sts)
        if len(sts_cal.temperatures) != dcfg.block_size:
            raise BuildError(f"{sts}: {len(sts_cal.temperatures)} STS temperatures for a block of {dcfg.block_size}")

    # -- target ----------------------------------------------------------------------------------
    if target is None:
        if isinstance(target_profile, TargetProfile):
            profile = dataclasses.replace(target_profile)
        else:
            profile = load_target_profile(target_profile or "smollm2-135m")
        if target_source:
            profile.source = target_source
        from dspark.training.target import load_target
        target = load_target(profile)
    profile = target.profile
    from dspark.training.checkpoint import load_checkpoint
    drafter, dcfg, dmeta = load_checkpoint(drafter_dir, target)  # refuses a drafter for another target
    if "hf" in items:
        from .layout import ExportError
        try:
            HF_LAYOUTS[hf_layout]()[0](drafter)
        except ExportError as exc:
            items = _skip(items, ("hf", "trtllm"), str(exc), what is not None, skipped)
    weights = []
    if profile.source:
        for f in target_weight_files(profile.source):
            weights.append(weight_entry(f))  # hashed once: the load-time check reuses the digest

    if force and out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True, exist_ok=True)
    _copy_checkpoint(drafter_dir, out / "drafter")
    if sps_table is not None:
        sps_table.save(out / "sps.json")
    if sts_cal is not None:
        sts_cal.save(out / "sts.json")

    K = dcfg.block_size
    n_tokens = max_batch * (K + 1)
    built: dict[str, dict] = dict(skipped)
    failure: BaseException | None = None
    if "onnx" in items:
        from .onnx_export import export_onnx
        dense = sps_table.as_tensor(max_tokens=n_tokens).tolist() if sps_table is not None else None
        built["onnx"] = export_onnx(drafter, out / "onnx" / "dspark_draft.onnx", sps_table=dense,
                                    sts_temperatures=sts_cal.temperatures if sts_cal else None, max_tokens=n_tokens)
    if "hf" in items:
        built["hf"] = HF_LAYOUTS[hf_layout]()[1](drafter, target, out / "hf", dtype)
    if "trtllm" in items:
        from .trtllm_options import sps_to_trtllm, write_trtllm_options
        sps_rel = None
        if sps_table is not None:
            (out / "trtllm").mkdir(parents=True, exist_ok=True)
            (out / "trtllm" / "sps_cost_table.json").write_text(json.dumps(sps_to_trtllm(sps_table), indent=2) + "\n")
            sps_rel = "trtllm/sps_cost_table.json"
        built["trtllm"] = write_trtllm_options(out / "trtllm", hf_dir="hf", block_size=K, max_batch=max_batch,
                                               max_context=max_context, dtype=dtype,
                                               sts_file="sts.json" if sts_cal else None, sps_file=sps_rel,
                                               has_confidence=dcfg.confidence_head, version=trtllm_version)
    if "trt" in items:
        from .trt_build import TensorRTUnavailable, build_trt_engine
        if "onnx" not in built:
            raise BuildError("--what trt needs the ONNX export too (add onnx)")
        try:
            built["trt"] = build_trt_engine(out / "onnx" / "dspark_draft.onnx", out / "trt", dtype=dtype,
                                            max_batch=max_batch, max_context=max_context,
                                            aux_width=dcfg.num_aux_layers * dcfg.hidden_size, plugin_lib=plugin_lib)
        except TensorRTUnavailable as exc:
            built["trt"] = {"status": "not built", "reason": str(exc)}
            failure = exc

    manifest = {
        "format": mf.MANIFEST_FORMAT, "manifest_version": mf.MANIFEST_VERSION, "kit_version": KIT_VERSION,
        "created_at": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "target_profile": dataclasses.asdict(profile), "drafter_dir": "drafter",
        "sps": "sps.json" if sps_table is not None else None, "sts": "sts.json" if sts_cal is not None else None,
        "proposers": proposers, "suffix": suffix,
        "target": {"identity": target.identity(), "source": profile.source, "weights": weights},
        "drafter": dataclasses.asdict(dcfg), "drafter_step": dmeta.get("step"),
        "shapes": {"max_batch": max_batch, "max_context": max_context, "block_size": K, "vocab_size": dcfg.vocab_size,
                   "draft_vocab_size": dcfg.draft_vocab_size or dcfg.vocab_size,
                   "hidden_size": dcfg.hidden_size, "aux_width": dcfg.num_aux_layers * dcfg.hidden_size,
                   "schedule_max_tokens": n_tokens},
        "dtypes": {"build": dtype, "onnx": "float32", "hf": dtype if "hf" in items else None,
                   "trt": dtype if "trt" in items else None},
        "what": items, "built": built, "tools": tool_versions(),
        "files": mf.hash_files(out),
    }
    (out / "engine.json").write_text(json.dumps(manifest, indent=2) + "\n")
    if failure is not None:
        raise failure
    return manifest
