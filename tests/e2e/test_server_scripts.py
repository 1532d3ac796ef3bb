"""scripts/start_server.sh fails loudly: a model that cannot load stops the start with its error."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

from dspark.engine.serving.faults import free_ports

from .conftest import ROOT

pytestmark = [pytest.mark.server, pytest.mark.slow]


def test_start_fails_with_the_model_error_when_the_engine_dir_is_missing(tmp_path):
    http, grpc, metrics = free_ports(3)
    env = dict(os.environ, PYTHON=sys.executable, DSPARK_NUM_THREADS="1")
    run = subprocess.run(
        [str(ROOT / "scripts" / "start_server.sh"), "--http-port", str(http), "--grpc-port", str(grpc),
         "--metrics-port", str(metrics), "--state-dir", str(tmp_path), "--timeout", "300",
         "--engine-dir", str(tmp_path / "no-such-engine"), "--load-model", "ensemble"],
        env=env, cwd=ROOT, capture_output=True, text=True, timeout=400)
    assert run.returncode != 0
    assert "no engine.json" in run.stderr and "dspark_llm" in run.stderr
    assert not (tmp_path / "server.pid").exists()


def test_stop_without_a_server_is_a_no_op(tmp_path):
    run = subprocess.run([str(ROOT / "scripts" / "stop_server.sh"), "--state-dir", str(tmp_path)],
                         capture_output=True, text=True)
    assert run.returncode == 0 and "nothing to stop" in run.stdout
