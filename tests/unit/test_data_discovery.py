"""The prompt data ships with the kit and is found without anything beside the checkout.

These tests copy the checkout into a temporary folder (nothing named ``shared`` around it),
import the kit from that copy and check that the training prompts and eval sets resolve to
the clone's own ``data/``, and that the overrides still win and fail loudly when wrong.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from dspark.training import data as data_mod
from dspark.training.config import DataConfig

REPO = Path(__file__).resolve().parents[2]

PROBE = """
import json, dspark
from dspark.training.config import DataConfig
from dspark.training.data import find_data_root, load_eval_prompts, load_training_prompts
root = find_data_root()
print(json.dumps({
    "dspark": dspark.__file__,
    "root": str(root),
    "train": len(load_training_prompts(DataConfig(max_prompts=50))),
    "eval": {t: len(load_eval_prompts(t, data_root=None)) for t in ("math", "code", "chat")},
}))
"""


def _clone_without_shared(tmp_path: Path) -> Path:
    """A copy of the checkout's working tree (tracked and untracked, not ignored: what a clone
    of it would hold once committed) in a folder with no ``shared/`` anywhere above it."""
    if shutil.which("git") is None or not (REPO / ".git").exists():
        pytest.skip("needs git and a git checkout of the kit")
    files = subprocess.run(["git", "ls-files", "-co", "--exclude-standard", "-z"], cwd=REPO, check=True,
                           capture_output=True, text=True).stdout.split("\0")
    clone = tmp_path / "fresh" / "dspark-kit"
    for rel in filter(None, files):
        src = REPO / rel
        if src.is_file() and not src.is_symlink():
            (clone / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, clone / rel)
    for d in ("training", "engine", "plugins", "configs"):  # the package-dir layout, as scripts/source_tree_path.sh makes it
        (clone / "dspark" / d).symlink_to(Path("..") / d)
    assert not any((p / "shared").exists() for p in [clone, *clone.parents][:4])
    return clone


def test_a_fresh_clone_finds_its_own_prompt_data(tmp_path):
    clone = _clone_without_shared(tmp_path)
    env = {k: v for k, v in os.environ.items() if k != "DSPARK_DATA"}
    env["PYTHONPATH"] = str(clone)
    out = subprocess.run([sys.executable, "-c", PROBE], cwd=clone, env=env, check=True,
                         capture_output=True, text=True).stdout
    found = json.loads(out.strip().splitlines()[-1])
    assert Path(found["dspark"]).resolve().is_relative_to(clone.resolve())
    assert Path(found["root"]).resolve() == (clone / "data").resolve()
    assert found["train"] == 50
    assert found["eval"] == {"math": 1319, "code": 164, "chat": 80}


def test_every_source_and_its_license_ships():
    root = data_mod.PACKAGED_DATA
    for rel in ("README.md", "gsm8k/train.jsonl", "gsm8k/LICENSE", "mbpp/sanitized-mbpp.train.json",
                "mbpp/README.md", "chat/arena-hard-v0.1_question.jsonl", "chat/LICENSE.arena-hard-auto",
                "chat/LICENSE.GPTeacher", "eval/gsm8k.jsonl", "eval/humaneval.jsonl", "eval/mt-bench.jsonl",
                "eval/LICENSE.DeepSpec"):
        assert (root / rel).is_file(), rel
    cfg = DataConfig(max_prompts=10_000, sources=["gsm8k", "mbpp", "chat"])
    prompts = data_mod.load_training_prompts(cfg)
    assert len(prompts) == 10_000 and all(p.strip() for p in prompts)


def test_overrides_win_and_a_wrong_one_is_an_error(tmp_path, monkeypatch):
    (tmp_path / "mine" / "eval").mkdir(parents=True)
    (tmp_path / "mine" / "eval" / "gsm8k.jsonl").write_text('{"turns": ["only one"]}\n')
    monkeypatch.setenv("DSPARK_DATA", str(tmp_path / "mine"))
    assert data_mod.find_data_root() == tmp_path / "mine"
    assert data_mod.load_eval_prompts("math") == ["only one"]
    assert data_mod.find_data_root(str(data_mod.PACKAGED_DATA)) == data_mod.PACKAGED_DATA  # data.data_root beats the env
    monkeypatch.setenv("DSPARK_DATA", str(tmp_path / "nowhere"))
    with pytest.raises(data_mod.DataError, match="DSPARK_DATA=.*nowhere holds no eval/"):
        data_mod.find_data_root()
    with pytest.raises(data_mod.DataError, match="data.data_root=.*typo holds no eval/"):
        data_mod.find_data_root(str(tmp_path / "typo"))
