"""C++ extension builds: a build killed midway must not hang every later process."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from dspark.plugins.build_lock import build_directory, exclusive_build


def test_build_directory_follows_torch_extensions_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    assert build_directory("ext_x") == tmp_path / "ext_x"


def test_exclusive_build_removes_the_lock_a_dead_build_left(tmp_path):
    directory = tmp_path / "ext"
    directory.mkdir()
    (directory / "lock").write_text("")
    (directory / "main.cpp").write_text("kept")
    with exclusive_build(directory):
        assert not (directory / "lock").exists()
    assert (directory / "main.cpp").read_text() == "kept"


def test_exclusive_build_keeps_a_second_builder_waiting_until_the_first_is_done(tmp_path):
    directory = tmp_path / "ext"
    done = tmp_path / "second-built"
    child = textwrap.dedent(f"""
        from pathlib import Path
        from dspark.plugins.build_lock import exclusive_build
        with exclusive_build(Path({str(directory)!r})):
            Path({str(done)!r}).write_text("yes")
    """)
    with exclusive_build(directory):
        proc = subprocess.Popen([sys.executable, "-c", child])
        time.sleep(1.5)
        assert proc.poll() is None and not done.exists()
    assert proc.wait(timeout=60) == 0 and done.read_text() == "yes"


@pytest.mark.slow
def test_an_extension_builds_past_the_lock_of_a_killed_build(tmp_path):
    """torch waits forever on a ``lock`` file left in the build directory; ours is removed first.
    The build runs in a child process with a timeout, so a regression fails instead of hanging."""
    child = textwrap.dedent("""
        from dspark.plugins.build_lock import build_directory
        from dspark.plugins.cpu_build import CpuExtension, cpu_tag
        ext = CpuExtension("dspark_lock_probe", lambda: "int answer() { return 42; }\\n"
                           "PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) { m.def(\\"answer\\", &answer); }",
                           fallback="none", python_module=True)
        d = build_directory(f"dspark_lock_probe_{cpu_tag()}")
        d.mkdir(parents=True, exist_ok=True)
        (d / "lock").write_text("")  # what a build killed midway leaves
        print(ext.load().answer())
    """)
    env = {**os.environ, "TORCH_EXTENSIONS_DIR": str(tmp_path)}
    out = subprocess.run([sys.executable, "-c", child], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == "42"
    assert not any(Path(tmp_path).rglob("lock"))
