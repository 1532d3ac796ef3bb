"""The README's configuration table names every configuration field a user can set.

Fields are read from the typed run configuration (``training/config.py``), recursively; a
row covers a field by naming it (`` `train.lr` ``) or its section with a wildcard
(`` `algo.loss.*` ``). A field added to the dataclasses without a README row fails here.
"""
from __future__ import annotations

import dataclasses
import re
from pathlib import Path

from dspark.training.config import RunConfig

README = Path(__file__).resolve().parents[2] / "README.md"


def config_keys(cls=RunConfig, prefix: str = "") -> list[str]:
    keys = []
    for f in dataclasses.fields(cls):
        key = prefix + f.name
        default = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
        if dataclasses.is_dataclass(default):
            keys += config_keys(type(default), key + ".")
        else:
            keys.append(key)
    return keys


def documented_keys(text: str) -> set[str]:
    section = text.split("## Configuration reference", 1)[1].split("\n## ", 1)[0]
    keys = set()
    for line in section.splitlines():
        if line.startswith("| `"):
            first_cell = line.split("|")[1]
            keys.update(re.findall(r"`([a-z_][a-z0-9_.*]*)`", first_cell))
    return keys


def covered(key: str, documented: set[str]) -> bool:
    parts = key.split(".")
    return key in documented or any(".".join(parts[:i]) + ".*" in documented for i in range(1, len(parts)))


def test_every_config_field_has_a_readme_row():
    documented = documented_keys(README.read_text())
    assert [k for k in config_keys() if not covered(k, documented)] == []


def test_the_check_notices_a_missing_row():
    documented = documented_keys("## Configuration reference\n\n| key | meaning |\n|---|---|\n"
                                 "| `train.lr`, `train.steps` | x |\n| `algo.loss.*` | y |\n\n## Next\n| `data.seed` | z |\n")
    assert covered("train.lr", documented) and covered("algo.loss.gamma", documented)
    assert not covered("data.seed", documented)  # rows of another section do not count
    assert not covered("train.seed", documented)
