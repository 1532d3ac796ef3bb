"""The python backend's stub processes: ending them with their server, reclaiming what a crash left.

Triton's python backend runs every model instance in a ``triton_python_backend_stub``
process that the server forks, with a shared-memory region ``/dev/shm/<prefix><uuid>`` for
the tensors. A server stopped normally unloads its models, the stubs exit and the server
unlinks the regions. A server killed with SIGKILL does neither: a stub whose model runs
threads of its own (the LLM model's engine loop keeps generating) stays alive, reparented
to init, ignoring SIGTERM (the stub handles it), with its region mapped, and a region
stays in /dev/shm even after its stub is gone, since nobody unlinks it.

Two parts, used at two places:

- :func:`watch_server`, called first in every model's ``initialize``: a daemon thread polls
  the stub's parent pid; once it changes (the server died and the stub was reparented) it
  unlinks the stub's own region and ends the process with ``os._exit``, which no model
  thread can hold up. A poll of the parent pid is used rather than
  ``prctl(PR_SET_PDEATHSIG)``: Linux sends that signal when the *thread* that forked the
  child ends, not the process, and Triton forks stubs from its model-loading threads.
- :func:`reclaim` (``python -m dspark.engine.serving.stubs reclaim``, run by
  ``scripts/start_server.sh`` and ``scripts/stop_server.sh``): kills the orphaned stubs of
  this model repository (their server is gone) and unlinks the regions with this server's
  prefix that no live process maps, for whatever the watchdog could not do (a stub killed
  too, a model that never reached ``initialize``).

A stub's command line (python backend r24.xx) is
``stub <model.py> <shm region> <shm size> <shm growth> <server pid> <backend dir> ...``.
"""
from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterable, Sequence

log = logging.getLogger(__name__)

STUB_NAME = "triton_python_backend_stub"
SHM_DIR = Path("/dev/shm")
DEFAULT_SHM_PREFIX = "triton_python_backend_shm_region_"
POLL_S = 0.5


@dataclass(frozen=True)
class StubCommand:
    """What a stub's command line says about it."""

    model_path: str  # <repo>/<model>/1/model.py
    shm_region: str  # name under /dev/shm
    server_pid: int  # the tritonserver that started it


def parse_stub_cmdline(argv: Sequence[str]) -> StubCommand | None:
    """A stub's argv -> StubCommand; None for any other process."""
    if len(argv) < 6 or os.path.basename(argv[0]) != STUB_NAME:
        return None
    try:
        server_pid = int(argv[5])
    except ValueError:
        return None
    return StubCommand(argv[1], argv[2], server_pid)


def _cmdline(pid: int | str) -> list[str]:
    try:
        raw = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return []
    return [a.decode("utf-8", "replace") for a in raw.split(b"\0") if a]


def _ppid(pid: int) -> int | None:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return int(stat.rsplit(")", 1)[1].split()[1])  # fields after "(comm)": state, ppid, ...


def pid_alive(pid: int) -> bool:
    """Whether ``pid`` is a live (not zombie) process."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state not in ("Z", "X")


# -- inside a stub: end with the server -----------------------------------------------------
_watching = False


def watch_server(poll_s: float = POLL_S, argv: Sequence[str] | None = None,
                 on_death: Callable[[], None] | None = None) -> bool:
    """In a stub: exit as soon as the server that started it is gone. Idempotent.

    The server is the parent pid at the time of the call (the stub's command line must name
    the same pid when it is a stub's). ``on_death`` replaces the exit (tests). Returns
    whether a watchdog runs.
    """
    global _watching
    if _watching:
        return True
    argv = _cmdline("self") if argv is None else list(argv)  # the process's own argv, not sys.argv
    stub = parse_stub_cmdline(argv)
    parent = os.getppid()
    if stub is not None and stub.server_pid != parent and not pid_alive(stub.server_pid):
        _server_gone(stub, on_death)  # the server died before this model initialised
        return True
    _watching = True

    def loop() -> None:
        while os.getppid() == parent:
            time.sleep(poll_s)
        _server_gone(stub, on_death)

    threading.Thread(target=loop, name="dspark-server-watchdog", daemon=True).start()
    return True


def _server_gone(stub: StubCommand | None, on_death: Callable[[], None] | None) -> None:
    region = stub.shm_region if stub is not None else None
    if region and "/" not in region:
        try:
            (SHM_DIR / region).unlink()
        except OSError:
            pass  # already gone, or another stub of the same server removed it
    print(f"dspark: the Triton server is gone; exiting this python backend stub (pid {os.getpid()})",
          file=sys.stderr, flush=True)
    if on_death is not None:
        on_death()
    else:
        os._exit(0)


# -- outside: reclaim what a crashed server left -------------------------------------------
@dataclass
class Reclaimed:
    killed: list[int] = field(default_factory=list)  # orphaned stub pids
    removed: list[str] = field(default_factory=list)  # unlinked /dev/shm names

    def summary(self) -> str:
        if not self.killed and not self.removed:
            return "nothing left by a crashed server"
        return (f"killed {len(self.killed)} orphaned stub(s) {self.killed or ''}, "
                f"removed {len(self.removed)} shared-memory region(s)")


def _proc_pids() -> Iterable[int]:
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            yield int(entry.name)


def _under(path: str, root: Path) -> bool:
    try:
        Path(path).resolve().relative_to(root)
        return True
    except (ValueError, OSError):
        return False


def find_stubs() -> list[tuple[int, StubCommand]]:
    """Every live python backend stub on this machine, with its command line."""
    out = []
    for pid in _proc_pids():
        stub = parse_stub_cmdline(_cmdline(pid))
        if stub is not None and pid_alive(pid):
            out.append((pid, stub))
    return out


def orphaned_stubs(repo: str | Path | None = None, shm_prefix: str | None = None) -> list[tuple[int, StubCommand]]:
    """Stubs whose server is gone, of models under ``repo`` or with regions named ``shm_prefix``*."""
    root = Path(repo).resolve() if repo is not None else None
    out = []
    for pid, stub in find_stubs():
        ours = (root is not None and _under(stub.model_path, root)) or \
               (shm_prefix is not None and stub.shm_region.startswith(shm_prefix))
        if ours and (not pid_alive(stub.server_pid) or _ppid(pid) != stub.server_pid):
            out.append((pid, stub))
    return out


def mapped_shm() -> set[str]:
    """Names under /dev/shm that some live process maps."""
    names = set()
    prefix = str(SHM_DIR) + "/"
    for pid in _proc_pids():
        try:
            maps = Path(f"/proc/{pid}/maps").read_text()
        except OSError:
            continue
        for line in maps.splitlines():
            i = line.find(prefix)
            if i >= 0:
                names.add(line[i + len(prefix):].split()[0])
    return names


def shm_regions(prefix: str) -> list[str]:
    """The names under /dev/shm starting with ``prefix``."""
    try:
        return sorted(p.name for p in SHM_DIR.iterdir() if p.name.startswith(prefix))
    except OSError:
        return []


def reclaim(repo: str | Path | None, shm_prefix: str, wait_s: float = 5.0) -> Reclaimed:
    """Kill the orphaned stubs of ``repo`` (or of regions ``shm_prefix``*), then unlink the
    regions ``shm_prefix``* that no live process maps. Live servers' stubs are not touched."""
    done = Reclaimed()
    orphans = orphaned_stubs(repo, shm_prefix)
    for pid, _ in orphans:
        try:
            os.kill(pid, signal.SIGKILL)  # a stub ignores SIGTERM
            done.killed.append(pid)
        except ProcessLookupError:
            pass
    deadline = time.time() + wait_s
    while any(pid_alive(p) for p in done.killed) and time.time() < deadline:
        time.sleep(0.05)
    mapped = mapped_shm()
    for name in shm_regions(shm_prefix):
        if name in mapped:
            continue
        try:
            (SHM_DIR / name).unlink()
            done.removed.append(name)
        except OSError:
            pass
    return done


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m dspark.engine.serving.stubs",
                                 description="Reclaim the stubs and shared memory a crashed Triton server left.")
    sub = ap.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("reclaim", help="kill orphaned stubs of a model repository, unlink unmapped regions")
    r.add_argument("--repo", help="the model repository whose orphaned stubs to kill")
    r.add_argument("--shm-prefix", required=True, help="the server's shm-region-prefix-name")
    ls = sub.add_parser("list", help="print the orphaned stubs and unmapped regions, change nothing")
    ls.add_argument("--repo")
    ls.add_argument("--shm-prefix", required=True)
    args = ap.parse_args(argv)
    if args.cmd == "reclaim":
        print(reclaim(args.repo, args.shm_prefix).summary())
        return 0
    mapped = mapped_shm()
    for pid, stub in orphaned_stubs(args.repo, args.shm_prefix):
        print(f"orphaned stub {pid} (server {stub.server_pid} gone): {stub.model_path}")
    for name in shm_regions(args.shm_prefix):
        print(f"region {name}{' (mapped)' if name in mapped else ' (unmapped)'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
