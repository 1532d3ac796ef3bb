"""Reading small JSON side files (checkpoint metadata, SPS tables, STS calibrations) with one-line errors."""
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
