"""Python backend stubs end with their server, and reclaim() removes what a crashed server left,
with real processes standing in for tritonserver and its stubs (no server needed)."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import uuid
from pathlib import Path

import pytest

from dspark.engine.serving import stubs
from dspark.engine.serving.faults import wait_until

pytestmark = pytest.mark.skipif(not Path("/proc/self/cmdline").exists() or not stubs.SHM_DIR.is_dir(),
                                reason="needs Linux /proc and /dev/shm")

# a stub-like process: ignores SIGTERM (as the real stub does), maps its region, keeps a busy thread
STUB = textwrap.dedent("""
    import mmap, os, signal, site, sys, threading, time
    # argv[0] is not the interpreter, so Python does not find the venv by itself
    for d in os.environ["STUB_SITE_DIRS"].split(os.pathsep):
        site.addsitedir(d)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    fd = os.open("/dev/shm/" + sys.argv[1], os.O_RDWR)  # sys.argv drops argv[0]
    region = mmap.mmap(fd, 4096)
    if sys.argv[6] == "watch":
        from dspark.engine.serving.stubs import watch_server
        watch_server(poll_s=0.05)
    threading.Thread(target=lambda: [time.sleep(0.01) for _ in iter(int, 1)], daemon=True).start()
    print("ready", flush=True)
    while True:
        time.sleep(1)
""")

# a server-like process: starts one stub naming its own pid, prints the stub's pid, waits
SERVER = textwrap.dedent("""
    import os, subprocess, sys, time
    stub_path, model, region, mode = sys.argv[1:5]
    p = subprocess.Popen([stub_path, model, region, "4096", "4096", str(os.getpid()), "backend", mode],
                         executable=sys.executable, stdout=subprocess.PIPE, text=True)
    assert p.stdout.readline().strip() == "ready"
    print(p.pid, flush=True)
    time.sleep(600)
""")


@pytest.fixture
def fake(tmp_path):
    repo = tmp_path / "repo" / "llm" / "1"
    repo.mkdir(parents=True)
    model = repo / "model.py"
    model.write_text(STUB)
    stub_path = tmp_path / stubs.STUB_NAME  # only argv[0]'s name matters; python runs model.py
    prefix = f"dspark_test_{uuid.uuid4().hex[:8]}_"
    made, procs = [], []

    def region(name=None):
        name = name or prefix + uuid.uuid4().hex
        (stubs.SHM_DIR / name).write_bytes(b"\0" * 4096)
        made.append(name)
        return name

    def server(mode, name):
        import site
        env = dict(os.environ, STUB_SITE_DIRS=os.pathsep.join(site.getsitepackages()))
        p = subprocess.Popen([sys.executable, "-c", SERVER, str(stub_path), str(model), name, mode],
                             stdout=subprocess.PIPE, text=True, start_new_session=True, env=env)
        procs.append(p)
        stub_pid = int(p.stdout.readline())
        return p, stub_pid

    yield type("Fake", (), dict(repo=tmp_path / "repo", prefix=prefix, region=staticmethod(region),
                                server=staticmethod(server)))
    for p in procs:
        try:
            os.killpg(p.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        p.wait()
    for name in made:
        (stubs.SHM_DIR / name).unlink(missing_ok=True)


def test_stub_command_line_is_parsed_as_the_python_backend_writes_it():
    argv = ["/tmp/s/backends/python/triton_python_backend_stub", "/r/triton_repo/dspark_llm/1/model.py",
            "dspark_123_67adcd51", "1048576", "1048576", "5030", "/tmp/s/backends/python", "336",
            "dspark_llm_0_0", "DEFAULT"]
    assert stubs.parse_stub_cmdline(argv) == stubs.StubCommand("/r/triton_repo/dspark_llm/1/model.py",
                                                               "dspark_123_67adcd51", 5030)
    assert stubs.parse_stub_cmdline(["/usr/bin/python3", "x.py"]) is None
    assert stubs.parse_stub_cmdline([*argv[:5], "not-a-pid"]) is None


def test_a_stub_exits_and_unlinks_its_region_when_its_server_is_killed(fake):
    name = fake.region()
    server, stub_pid = fake.server("watch", name)
    assert stubs.pid_alive(stub_pid)
    server.send_signal(signal.SIGKILL)  # what kill -9 of tritonserver does: the stub is reparented
    server.wait()
    assert wait_until(lambda: not stubs.pid_alive(stub_pid), 10.0, interval=0.05), "the stub outlived its server"
    assert not (stubs.SHM_DIR / name).exists(), "the stub left its shared-memory region"


def test_reclaim_kills_orphans_of_the_repo_and_unlinks_only_unmapped_regions_of_the_prefix(fake):
    orphan_region, live_region = fake.region(), fake.region()
    stale = fake.region()  # left by a stub that is already gone
    foreign = fake.region("dspark_other_" + uuid.uuid4().hex)
    orphan_server, orphan = fake.server("nowatch", orphan_region)
    live_server, live = fake.server("nowatch", live_region)
    orphan_server.send_signal(signal.SIGKILL)
    orphan_server.wait()
    assert wait_until(lambda: stubs._ppid(orphan) != orphan_server.pid, 10.0, interval=0.05)
    assert [p for p, _ in stubs.orphaned_stubs(fake.repo, fake.prefix)] == [orphan]

    done = stubs.reclaim(fake.repo, fake.prefix)

    assert done.killed == [orphan] and not stubs.pid_alive(orphan), "a stub ignoring SIGTERM must still go"
    assert sorted(done.removed) == sorted([orphan_region, stale])
    assert stubs.pid_alive(live) and (stubs.SHM_DIR / live_region).exists(), "a live server's stub was touched"
    assert (stubs.SHM_DIR / foreign).exists(), "another prefix's region was touched"
    assert "killed 1 orphaned stub" in done.summary()
    assert stubs.reclaim(fake.repo, fake.prefix).summary() == "nothing left by a crashed server"


def test_a_stub_whose_server_died_before_initialize_exits_at_once(tmp_path, monkeypatch):
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    name = f"dspark_test_{uuid.uuid4().hex}"
    (stubs.SHM_DIR / name).write_bytes(b"\0")
    monkeypatch.setattr(stubs, "_watching", False)
    exits = []
    try:
        argv = [f"/x/{stubs.STUB_NAME}", "/r/m/1/model.py", name, "1", "1", str(gone.pid), "/x"]
        assert stubs.watch_server(argv=argv, on_death=lambda: exits.append(1))
        assert exits == [1] and not (stubs.SHM_DIR / name).exists()
    finally:
        (stubs.SHM_DIR / name).unlink(missing_ok=True)
