"""The target cache is built once when several processes load a cold cache at the same time
(the Triton models of one server start in parallel)."""
from __future__ import annotations

import multiprocessing as mp
import time
from pathlib import Path

from dspark.training.target import build_cached_dir


def _build(out: str, log: str) -> str:
    def write(tmp: Path) -> None:
        tmp.mkdir(parents=True)
        with open(log, "a") as f:
            f.write("built\n")
        (tmp / "a.json").write_text("{}")
        time.sleep(0.3)  # a slow build: the others arrive while it runs
        (tmp / "b.json").write_text("{}")
    return str(build_cached_dir(Path(out), write, ("a.json", "b.json")))


def test_parallel_processes_on_a_cold_cache_build_it_once_and_all_get_it(tmp_path):
    out, log = tmp_path / "cache" / "target", tmp_path / "builds.log"
    with mp.get_context("spawn").Pool(4) as pool:
        got = pool.starmap(_build, [(str(out), str(log))] * 4)
    assert got == [str(out)] * 4
    assert log.read_text().count("built") == 1
    assert sorted(p.name for p in out.iterdir()) == ["a.json", "b.json"]
    assert not list(out.parent.glob("*.partial-*"))


def test_a_build_that_fails_leaves_no_folder_behind_and_the_next_one_builds(tmp_path):
    out = tmp_path / "target"

    def broken(tmp: Path) -> None:
        tmp.mkdir()
        (tmp / "a.json").write_text("{}")
        raise RuntimeError("disk full")
    try:
        build_cached_dir(out, broken, ("a.json",))
    except RuntimeError:
        pass
    assert not out.exists() and not list(tmp_path.glob("*.partial-*"))

    def good(tmp: Path) -> None:
        tmp.mkdir()
        (tmp / "a.json").write_text("{}")
    assert build_cached_dir(out, good, ("a.json",)) == out and (out / "a.json").is_file()
