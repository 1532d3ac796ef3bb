"""The layers depend one way only: plugins <- training <- engine <- serving / scripts / CLI.

Every module of a layer is parsed (not imported: an import inside a function counts too) and
each of its imports of the kit is resolved to the layer it names; an import of a layer above
its own fails with the file and line.
"""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
# folder -> (package it installs as, rank); a module may import only ranks <= its own
LAYERS = {"plugins": ("dspark.plugins", 0), "training": ("dspark.training", 1), "engine": ("dspark.engine", 2)}
TOP = 3  # dspark.cli, triton_repo, scripts


def _rank_of(module: str) -> int | None:
    for package, rank in LAYERS.values():
        if module == package or module.startswith(package + "."):
            return rank
    return TOP if module == "dspark" or module.startswith("dspark.") else None


def _imports(path: Path, package: str, layer_dir: Path):
    """(line, absolute module) of every import in ``path``, a module of ``package`` (``layer_dir``)."""
    tree = ast.parse(path.read_text(), filename=str(path))
    here = package.split(".") + list(path.relative_to(layer_dir).parent.parts)
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield node.lineno, alias.name
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = here[: len(here) - node.level + 1]
                yield node.lineno, ".".join(base + ([node.module] if node.module else []))
            elif node.module:
                yield node.lineno, node.module


def _upward_imports(folder: str, repo: Path = REPO) -> list[str]:
    package, rank = LAYERS[folder]
    bad = []
    for path in sorted((repo / folder).rglob("*.py")):
        for line, module in _imports(path, package, repo / folder):
            r = _rank_of(module)
            if r is not None and r > rank:
                bad.append(f"{path.relative_to(repo)}:{line} imports {module}")
    return bad


@pytest.mark.parametrize("folder", list(LAYERS))
def test_no_layer_imports_a_layer_above_it(folder):
    assert _upward_imports(folder) == []


def test_the_check_sees_relative_and_deferred_imports(tmp_path):
    fake = tmp_path / "training"
    (fake / "models").mkdir(parents=True)
    (fake / "models" / "m.py").write_text("def f():\n    from ...engine import runtime\n")
    (fake / "ok.py").write_text("from . import data\nfrom dspark.plugins import reference\n")
    (fake / "bad.py").write_text("import dspark.engine.api\n")
    assert _upward_imports("training", tmp_path) == ["training/bad.py:1 imports dspark.engine.api",
                                                     "training/models/m.py:2 imports dspark.engine"]
