"""kill -9 of tritonserver mid-stream: every python backend stub exits with it and its shared
memory goes (no orphaned process, no leftover /dev/shm region), and start_server.sh starts
again on the same state directory. Its own server (only the ensemble and what it uses)."""
from __future__ import annotations

import pytest

from dspark.engine.serving import faults as F
from dspark.engine.serving import stubs
from dspark.engine.serving.client import StreamClient

from .conftest import ROOT, start, start_command, stop

pytestmark = [pytest.mark.server, pytest.mark.slow]

REPO = ROOT / "triton_repo"


def test_kill9_mid_stream_leaves_no_orphaned_stub_or_shared_memory_and_the_restart_serves(tmp_path):
    state = tmp_path / "state"
    args, env, (_, grpc, _) = start_command(state, "real", "--load-model", "ensemble")
    start(args, env)
    try:
        pid = int((state / "server.pid").read_text())
        prefix = (state / "shm_prefix").read_text().strip()
        assert len(stubs.shm_regions(prefix)) == 3, "one region per stub, named with this server's prefix"

        report = F.kill_mid_stream(f"localhost:{grpc}", pid, prefix, responses=3, max_tokens=256, wait_s=20)

        assert report.responses_before_kill >= 3 and report.stubs_at_kill == 3
        assert report.orphans == [], f"stubs outlived their server: {report.orphans}"
        assert report.shm == [], f"shared memory left behind: {report.shm}"
        assert stubs.orphaned_stubs(REPO, prefix) == []

        restarted = start(args, env)
        assert "is gone; reclaiming" in restarted.stdout
        with StreamClient(f"localhost:{grpc}") as c:
            res = c.generate("Say yes.", max_tokens=3, stream=True, timeout=120)
        assert res.error is None and res.tokens >= 1
    finally:
        stop(state)
    assert stubs.orphaned_stubs(REPO, prefix) == [] and stubs.shm_regions(prefix) == []
