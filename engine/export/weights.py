"""The target's weight files: which they are, their sha256 (hashed once), and the check at load.

An engine directory records the sha256 of the target checkpoint its drafter was built
against (``engine.json`` ``target.weights``). Another checkpoint with the same architecture
and tokenizer passes the identity check (``manifest.IDENTITY_KEYS``) but would be served
with a drafter trained for different hidden states, so :func:`check_target_weights` compares
the hashes when an engine is loaded.

Hashing a multi-GB checkpoint at every load would be slow, so digests are cached in
``$DSPARK_CACHE/weight-hashes.json`` (default ``~/.cache/dspark``), keyed by the file's
absolute path and valid while its size and mtime (ns) are unchanged; a rewritten file gets a
new mtime and is hashed again.
"""
from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Any, Iterable

from .manifest import TargetMismatchError, sha256_file

__all__ = ["CACHE_NAME", "target_weight_files", "cached_sha256", "weight_entry", "check_target_weights"]

CACHE_NAME = "weight-hashes.json"


def target_weight_files(source: str | None) -> list[Path]:
    """The file(s) holding the target's weights: the .gguf, or the HF dir's *.safetensors / *.bin."""
    from dspark.training.target import resolve_source

    directory, gguf = resolve_source(source)
    if gguf:
        return [directory / gguf]
    return sorted(directory.glob("*.safetensors")) or sorted(directory.glob("*.bin"))


def _cache_path() -> Path:
    from dspark.training.target import cache_root

    return cache_root() / CACHE_NAME


def _read_cache(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}  # no cache yet, or a damaged one: hash again
    return data if isinstance(data, dict) else {}


def _write_cache(path: Path, data: dict[str, Any]) -> None:
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=path.name + ".", dir=path.parent)
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            json.dump(data, f, indent=1, sort_keys=True)
        os.replace(tmp, path)  # atomic: concurrent loaders never read half a file
    except OSError:
        pass  # a read-only cache only costs a re-hash next time


def cached_sha256(path: str | Path) -> str:
    """sha256 of ``path``, from the cache while the file's size and mtime are unchanged."""
    path = Path(path).resolve()
    st = path.stat()
    key = str(path)
    cache_file = _cache_path()
    cache = _read_cache(cache_file)
    hit = cache.get(key)
    if isinstance(hit, dict) and hit.get("bytes") == st.st_size and hit.get("mtime_ns") == st.st_mtime_ns:
        return str(hit["sha256"])
    digest = sha256_file(path)
    cache = _read_cache(cache_file)  # re-read: another process may have added entries meanwhile
    cache[key] = {"bytes": st.st_size, "mtime_ns": st.st_mtime_ns, "sha256": digest}
    _write_cache(cache_file, cache)
    return digest


def weight_entry(path: Path) -> dict[str, Any]:
    """``{"path": name, "bytes": n, "sha256": hex}`` as engine.json records a weight file."""
    path = Path(path)
    return {"path": path.name, "bytes": path.stat().st_size, "sha256": cached_sha256(path)}


def check_target_weights(recorded: Iterable[dict[str, Any]], source: str | None, where: str) -> None:
    """Refuse a target whose weight files differ from those ``engine.json`` recorded.

    ``recorded``: engine.json's ``target.weights``; ``source``: the loaded target's source
    (a .gguf, an HF directory, ``embedded:<name>``). Raises TargetMismatchError (one line).
    """
    recorded = list(recorded or [])
    if not recorded:
        return
    files = {f.name: f for f in target_weight_files(source)}
    for want in recorded:
        name = want.get("path")
        f = files.get(name)
        if f is None:
            raise TargetMismatchError(
                f"{where}: engine was built against target weights {name!r}, which the loaded target "
                f"({source or 'default'}) does not have (it has {sorted(files) or 'none'})")
        size = f.stat().st_size
        if want.get("bytes") is not None and size != want["bytes"]:
            raise TargetMismatchError(
                f"{where}: target weights {f} are {size} bytes, engine.json says {want['bytes']}: "
                "the drafter was built for another checkpoint")
        digest = cached_sha256(f)
        if digest != want.get("sha256"):
            raise TargetMismatchError(
                f"{where}: target weights {f} have sha256 {digest[:12]}..., engine.json says "
                f"{str(want.get('sha256'))[:12]}...: the drafter was built for another checkpoint")
