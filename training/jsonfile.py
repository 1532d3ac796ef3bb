"""Small JSON side files (checkpoint metadata, SPS tables, STS calibrations): one reader with
one-line errors, one writer (indented UTF-8, trailing newline, parent folders created)."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def read_json_file(path: Path, what: str, error: type[Exception]) -> Any:
    """Parse ``path``; an unreadable file or invalid JSON raises ``error`` naming the file and ``what`` it is."""
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as e:
        raise error(f"{path}: cannot read {what} ({e.strerror or e})") from e
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise error(f"{path}: not valid JSON ({e.msg} at line {e.lineno} column {e.colno})") from e


def write_json_file(path: str | Path, data: Any) -> Path:
    """Write ``data`` to ``path`` as indented UTF-8 JSON with a trailing newline; returns the path."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=2) + "\n", encoding="utf-8")
    return path
