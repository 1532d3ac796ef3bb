"""A real tritonserver on free ports for the e2e tests, started by scripts/start_server.sh.

Environment:
- DSPARK_E2E_URL=host:port (+ DSPARK_E2E_METRICS=host:port): use a running server instead.
- DSPARK_E2E_ENGINE=real (default) | hf: the engine behind the models. ``real`` is
  ``dspark.engine.runtime.load_engine`` on DSPARK_E2E_ENGINE_DIR, or else on an engine
  directory with an untrained drafter built once (tests/e2e/engine_dir.py); ``hf`` is the
  stand-in in tests/e2e/hf_engine.py.
"""
from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from dspark.engine.serving.faults import free_ports

ROOT = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().parent


@dataclass
class Server:
    url: str
    metrics_url: str
    engine: str
    log: Path | None = None

    def metrics(self) -> str:
        import urllib.request

        return urllib.request.urlopen(f"http://{self.metrics_url}/metrics", timeout=10).read().decode()

    def metric(self, name: str, **labels) -> float:
        """Sum of a metric's samples whose labels include ``labels``."""
        total = 0.0
        for line in self.metrics().splitlines():
            if not line.startswith(name + "{") and not line.startswith(name + " "):
                continue
            head, value = line.rsplit(" ", 1)
            if all(f'{k}="{v}"' in head for k, v in labels.items()):
                total += float(value)
        return total


def start_command(state: Path, engine: str, *extra: str) -> tuple[list[str], dict[str, str], tuple[int, int, int]]:
    """scripts/start_server.sh on free ports (http, grpc, metrics) with the engine of ``engine``."""
    http, grpc, metrics = free_ports(3)
    env = dict(os.environ, DSPARK_NUM_THREADS=os.environ.get("DSPARK_NUM_THREADS", "1"), PYTHON=sys.executable)
    args = [str(ROOT / "scripts" / "start_server.sh"), "--http-port", str(http), "--grpc-port", str(grpc),
            "--metrics-port", str(metrics), "--state-dir", str(state), "--timeout", "420", *extra]
    if engine == "hf":
        env["DSPARK_ENGINE_FACTORY"] = f"{HERE / 'hf_engine.py'}:load_engine"
        env["DSPARK_TOKENIZER_FACTORY"] = f"{HERE / 'hf_engine.py'}:load_tokenizer"
    else:
        engine_dir = os.environ.get("DSPARK_E2E_ENGINE_DIR")
        if not engine_dir:
            from .engine_dir import build_untrained_engine_dir

            engine_dir = str(build_untrained_engine_dir())
        args += ["--engine-dir", engine_dir]
    return args, env, (http, grpc, metrics)


def start(args: list[str], env: dict[str, str]) -> subprocess.CompletedProcess:
    started = subprocess.run(args, env=env, cwd=ROOT, capture_output=True, text=True)
    if started.returncode != 0:
        pytest.fail(f"start_server.sh failed:\n{started.stdout[-3000:]}\n{started.stderr[-5000:]}")
    return started


def stop(state: Path) -> subprocess.CompletedProcess:
    return subprocess.run([str(ROOT / "scripts" / "stop_server.sh"), "--state-dir", str(state)],
                          cwd=ROOT, capture_output=True, text=True)


@pytest.fixture(scope="session")
def server(tmp_path_factory) -> Server:
    engine = os.environ.get("DSPARK_E2E_ENGINE", "real")
    if os.environ.get("DSPARK_E2E_URL"):
        yield Server(os.environ["DSPARK_E2E_URL"], os.environ.get("DSPARK_E2E_METRICS", "localhost:8002"), engine)
        return
    state = tmp_path_factory.mktemp("triton")
    args, env, (_, grpc, metrics) = start_command(state, engine)
    start(args, env)
    log = state / "server.log"
    try:
        yield Server(f"localhost:{grpc}", f"localhost:{metrics}", engine, log)
    finally:
        stop(state)
    # every request must have completed: a stuck one (e.g. an ensemble request whose LLM
    # step ended with an error mid-stream) shows up as in-flight at shutdown
    stuck = [line for line in log.read_text().splitlines() if "in-flight inferences\"" in line and " has " in line]
    if stuck:
        pytest.fail("requests still in flight at shutdown:\n" + "\n".join(stuck[:3]))


@pytest.fixture
def client(server):
    from dspark.engine.serving.client import StreamClient

    c = StreamClient(server.url)
    yield c
    c.close()
