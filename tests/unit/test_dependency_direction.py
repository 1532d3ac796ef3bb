"""The layers depend one way only: plugins <- training <- engine <- serving / scripts / CLI.

Two checks. Statically, every module of every layer (``plugins/``, ``training/``,
``engine/``, and the top: ``dspark/``, ``triton_repo/``, ``scripts/``) is parsed, not
imported, so an import inside a function counts too, as does
``importlib.import_module("dspark....")``; each import of the kit is resolved to the layer it
names, and an import of a layer above its own, or of a kit folder by its bare name
(``import engine``, which works only from the repo root), fails with the file and line. At
run time, importing every module of a layer in a fresh interpreter must load no module of a
layer above it. A package that ``pyproject.toml`` installs but no layer here claims fails too,
so a new package cannot slip past the check.
"""
from __future__ import annotations

import ast
import json
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
# folder -> (package it installs as, rank); a module may import only ranks <= its own
LAYERS = {"plugins": ("dspark.plugins", 0), "training": ("dspark.training", 1), "engine": ("dspark.engine", 2)}
TOP = 3  # the CLI (dspark/), triton_repo/, scripts/: may import every layer
TOP_FOLDERS = {"dspark": "dspark", "triton_repo": None, "scripts": None}  # folder -> package (None: not installed)
DATA = ("dspark.configs", "dspark.data")  # data-only packages: any layer may read them
BARE = tuple(LAYERS) + ("triton_repo", "scripts")  # folder names that are not import names


def _under(module: str, package: str) -> bool:
    return module == package or module.startswith(package + ".")


def _rank_of(module: str) -> int | None:
    if any(_under(module, d) for d in DATA):
        return None
    for package, rank in LAYERS.values():
        if _under(module, package):
            return rank
    return TOP if _under(module, "dspark") else None


def _imports(path: Path, package: str | None, layer_dir: Path):
    """(line, absolute module) of every import in ``path``, a module of ``package`` (``layer_dir``);
    also ``importlib.import_module`` / ``__import__`` calls with a literal name."""
    tree = ast.parse(path.read_text(), filename=str(path))
    here = (package.split(".") if package else []) + list(path.relative_to(layer_dir).parent.parts)
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
        elif isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant) \
                and isinstance(node.args[0].value, str):
            f = node.func
            name = f.attr if isinstance(f, ast.Attribute) else f.id if isinstance(f, ast.Name) else ""
            if name in ("import_module", "__import__"):
                yield node.lineno, node.args[0].value


def _bad_imports(folder: str, repo: Path = REPO) -> list[str]:
    """Upward and bare-folder imports in ``folder`` (a layer or a top folder), as ``file:line imports x``."""
    package, rank = LAYERS[folder] if folder in LAYERS else (TOP_FOLDERS[folder], TOP)
    bad = []
    for path in sorted((repo / folder).rglob("*.py")):
        for line, module in _imports(path, package, repo / folder):
            r = _rank_of(module)
            if (r is not None and r > rank) or module.split(".")[0] in BARE:
                bad.append(f"{path.relative_to(repo)}:{line} imports {module}")
    return bad


@pytest.mark.parametrize("folder", [*LAYERS, *TOP_FOLDERS])
def test_no_module_imports_a_layer_above_its_own(folder):
    assert _bad_imports(folder) == []


def test_every_installed_package_belongs_to_a_layer():
    dirs = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"]
    claimed = {p for p, _ in LAYERS.values()} | {p for p in TOP_FOLDERS.values() if p} | set(DATA)
    orphans = [pkg for pkg in dirs if not any(_under(pkg, c) for c in claimed)]
    assert orphans == [], f"packages no layer of this test checks: {orphans}"
    for folder, (package, _) in LAYERS.items():
        assert dirs[package] == folder, f"{package} installs from {dirs[package]!r}, the test reads {folder!r}"


_LOAD_LAYER = """
import importlib, json, pkgutil, sys
pkg = importlib.import_module(sys.argv[1])
for m in pkgutil.walk_packages(pkg.__path__, sys.argv[1] + "."):
    importlib.import_module(m.name)
print(json.dumps(sorted(sys.modules)))
"""


def _loaded_above(layers: dict[str, tuple[str, int]], cwd: Path) -> dict[str, list[str]]:
    """Per layer: the modules of higher layers that importing all its modules (run from ``cwd``) loads."""
    procs = {folder: subprocess.Popen([sys.executable, "-c", _LOAD_LAYER, package], cwd=cwd, text=True,
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE)
             for folder, (package, _) in layers.items()}
    found = {}
    for folder, proc in procs.items():
        out, err = proc.communicate(timeout=120)
        assert proc.returncode == 0, f"importing {folder} failed:\n{err}"
        rank = layers[folder][1]
        # the namespace package ``dspark`` itself is every layer's parent; its submodules are ranked
        found[folder] = [m for m in json.loads(out) if m != "dspark" and (_rank_of(m) or 0) > rank]
    return found


@pytest.mark.slow  # three fresh interpreters import the whole kit (torch, transformers): ~10 s
def test_importing_a_layer_loads_nothing_above_it():
    assert _loaded_above(LAYERS, REPO) == {folder: [] for folder in LAYERS}


@pytest.mark.slow
def test_the_run_time_check_sees_an_import_at_module_level(tmp_path):
    pkg = tmp_path / "dspark"
    for sub in ("plugins", "engine"):
        (pkg / sub).mkdir(parents=True)
        (pkg / sub / "__init__.py").write_text("")
    (pkg / "__init__.py").write_text("")
    (pkg / "engine" / "api.py").write_text("")
    (pkg / "plugins" / "leak.py").write_text("exec('import dspark.engine.api')\n")  # invisible to the parser
    assert _loaded_above({"plugins": LAYERS["plugins"]}, tmp_path) == {"plugins": ["dspark.engine", "dspark.engine.api"]}


def test_the_check_sees_relative_deferred_dynamic_and_bare_imports(tmp_path):
    fake = tmp_path / "training"
    (fake / "models").mkdir(parents=True)
    (fake / "models" / "m.py").write_text("def f():\n    from ...engine import runtime\n")
    (fake / "ok.py").write_text("from . import data\nfrom dspark.plugins import reference\nimport dspark.configs\n")
    (fake / "bad.py").write_text("import dspark.engine.api\n")
    (fake / "dyn.py").write_text("import importlib\nm = importlib.import_module('dspark.engine.sts')\n")
    (fake / "bare.py").write_text("from plugins import ops\n")
    assert _bad_imports("training", tmp_path) == ["training/bad.py:1 imports dspark.engine.api",
                                                  "training/bare.py:1 imports plugins",
                                                  "training/dyn.py:2 imports dspark.engine.sts",
                                                  "training/models/m.py:2 imports dspark.engine"]
    top = tmp_path / "scripts"
    top.mkdir()
    (top / "s.py").write_text("from dspark.engine import runtime\nimport engine.sts\n")
    assert _bad_imports("scripts", tmp_path) == ["scripts/s.py:2 imports engine.sts"]
