"""The engine directory manifest (``engine.json``) and its validation on load.

``dspark build`` writes one ``engine.json`` per engine directory. The runtime reads four
keys from it (``target_profile``, ``drafter_dir``, ``sps``, ``sts``); everything else is the
manifest, there to refuse an engine that does not fit what is being loaded::

    {
      "format": "dspark-engine", "manifest_version": 1, "kit_version": "0.1.0",
      "created_at": "...",
      "target_profile": {TargetProfile fields},          # runtime
      "drafter_dir": "drafter", "sps": "sps.json" | null, "sts": "sts.json" | null,  # runtime
      "target": {"identity": {Target.identity()},        # hidden size, vocab, layer ids, tokenizer hash
                 "source": "...", "weights": [{"path": name, "bytes": n, "sha256": hex}]},
      "drafter": {DrafterConfig fields}, "drafter_step": int,
      "shapes": {"max_batch", "max_context", "block_size", "vocab_size", "hidden_size", "aux_width"},
      "dtypes": {"build": "float32|float16|bfloat16", "onnx": "float32", "hf": ...},
      "built": {"onnx": {...}, "hf": {...}, "trtllm": {...}, "trt": {...}},   # what, with which tools
      "tools": {"torch": "...", "onnx": "...", ...},
      "files": {"relative/path": {"bytes": n, "sha256": hex}, ...}           # every other file
    }

:func:`validate_engine_dir` checks, in order: the manifest version, every file's size and
sha256 (a truncated or edited file), the target identity against the loaded target, and the
loaded target's weight files against ``target.weights`` (another checkpoint of the same
architecture and tokenizer; hashed once and cached, see ``weights.py``).
Each failure is one typed exception with a one-line reason.
"""
from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any, Iterable

__all__ = [
    "MANIFEST_FORMAT", "MANIFEST_VERSION", "KNOWN_MANIFEST_VERSIONS", "IDENTITY_KEYS",
    "EngineDirError", "ManifestVersionError", "IntegrityError", "TargetMismatchError",
    "sha256_file", "file_entry", "hash_files", "read_engine_json", "read_manifest", "validate_engine_dir",
]

MANIFEST_FORMAT = "dspark-engine"
MANIFEST_VERSION = 1
KNOWN_MANIFEST_VERSIONS = (1,)
# What a drafter depends on in its target; a mismatch in any of them makes the drafts garbage.
IDENTITY_KEYS = ("hidden_size", "vocab_size", "num_layers", "layer_ids", "tokenizer_hash")


class EngineDirError(RuntimeError):
    """An engine directory that cannot be used; the message is one line naming the cause."""


class ManifestVersionError(EngineDirError):
    """engine.json is missing, unreadable, not ours, or of a manifest version this kit does not know."""


class IntegrityError(EngineDirError):
    """A file listed in the manifest is missing, truncated or modified."""


class TargetMismatchError(EngineDirError):
    """The engine's drafter was built for another target."""


def sha256_file(path: Path, chunk: int = 1 << 20) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while True:
            block = f.read(chunk)
            if not block:
                break
            h.update(block)
    return h.hexdigest()


def file_entry(path: Path) -> dict[str, Any]:
    path = Path(path)
    return {"bytes": path.stat().st_size, "sha256": sha256_file(path)}


def hash_files(root: Path, exclude: Iterable[str] = ("engine.json",)) -> dict[str, dict[str, Any]]:
    """{relative posix path: {bytes, sha256}} for every regular file under ``root``."""
    root = Path(root)
    skip = set(exclude)
    out = {}
    for p in sorted(root.rglob("*")):
        rel = p.relative_to(root).as_posix()
        if p.is_file() and rel not in skip:
            out[rel] = file_entry(p)
    return out


def read_engine_json(path: Path) -> dict[str, Any]:
    """Parse ``<engine_dir>/engine.json`` (any format, also from before manifests) or raise
    ManifestVersionError naming the file."""
    meta_path = Path(path) / "engine.json"
    if not meta_path.is_file():
        raise ManifestVersionError(f"{path}: no engine.json (build the engine with scripts/build_engine.sh)")
    try:
        meta = json.loads(meta_path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ManifestVersionError(f"{meta_path}: not valid JSON ({exc})") from None
    if not isinstance(meta, dict):
        raise ManifestVersionError(f"{meta_path}: expected a JSON object")
    return meta


def read_manifest(path: Path) -> dict[str, Any]:
    """Parse ``<engine_dir>/engine.json`` and check its format and version."""
    meta_path = Path(path) / "engine.json"
    meta = read_engine_json(path)
    if meta.get("format") != MANIFEST_FORMAT:
        raise ManifestVersionError(f"{meta_path}: format {meta.get('format')!r} is not {MANIFEST_FORMAT!r} "
                                   "(an engine directory from before manifests, or not an engine)")
    version = meta.get("manifest_version")
    if version not in KNOWN_MANIFEST_VERSIONS:
        raise ManifestVersionError(f"{meta_path}: manifest_version {version!r} unknown to this kit "
                                   f"(knows {list(KNOWN_MANIFEST_VERSIONS)}); rebuild the engine or upgrade the kit")
    return meta


def _check_files(root: Path, files: dict[str, Any], only: tuple[str, ...] | None) -> None:
    for rel, want in sorted(files.items()):
        if only is not None and not any(rel == o or rel.startswith(o.rstrip("/") + "/") for o in only):
            continue
        p = root / rel
        if not p.is_file():
            raise IntegrityError(f"{p}: listed in engine.json but missing")
        size = p.stat().st_size
        if size != want.get("bytes"):
            raise IntegrityError(f"{p}: {size} bytes, engine.json says {want.get('bytes')} (truncated or replaced)")
        digest = sha256_file(p)
        if digest != want.get("sha256"):
            raise IntegrityError(f"{p}: sha256 {digest[:12]}... does not match engine.json "
                                 f"({str(want.get('sha256'))[:12]}...): the file was modified")


def _check_target(meta: dict[str, Any], identity: dict[str, Any], where: str) -> None:
    want = (meta.get("target") or {}).get("identity") or {}
    for key in IDENTITY_KEYS:
        if key in want and want[key] != identity.get(key):
            raise TargetMismatchError(f"{where}: engine was built for a target with {key}={want[key]!r}, "
                                      f"but the loaded target has {key}={identity.get(key)!r}")


def validate_engine_dir(path: str | Path, target=None, files: str | tuple[str, ...] = "all") -> dict[str, Any]:
    """Check an engine directory before loading it; return its manifest.

    ``target``: a loaded ``Target`` (or anything with ``identity()``, or an identity dict);
    ``None`` skips the identity check. ``files``: ``"all"`` hashes every file listed,
    ``"runtime"`` only what the runtime loads (drafter/, sps, sts), or a tuple of
    relative paths/folders. A ``target`` with a ``profile`` (a loaded Target) also has its
    weight files checked against ``target.weights``.
    Raises ManifestVersionError, IntegrityError or TargetMismatchError.
    """
    root = Path(path)
    meta = read_manifest(root)
    listed = meta.get("files")
    if not isinstance(listed, dict) or not listed:
        raise ManifestVersionError(f"{root / 'engine.json'}: no 'files' table to check the engine against")
    if files == "all":
        only = None
    elif files == "runtime":
        only = tuple(x for x in (meta.get("drafter_dir", "drafter"), meta.get("sps"), meta.get("sts")) if x)
    else:
        only = tuple(files)
    _check_files(root, listed, only)
    if target is not None:
        identity = target if isinstance(target, dict) else target.identity()
        _check_target(meta, identity, str(root))
        profile = getattr(target, "profile", None)
        if profile is not None:
            from .weights import check_target_weights

            check_target_weights((meta.get("target") or {}).get("weights"), profile.source, str(root))
    return meta
