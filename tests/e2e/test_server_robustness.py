"""Bad inputs, cancellation and disconnects: each ends in a clear error or a clean stop,
and the server keeps serving afterwards. The bad inputs are the fault catalogue
(dspark.engine.serving.faults.BAD_INPUTS) that scripts/fault_suite.py also runs."""
from __future__ import annotations

import time

import pytest

from dspark.engine.serving import faults as F
from dspark.engine.serving.client import StreamClient, make_inputs

pytestmark = [pytest.mark.server, pytest.mark.slow]


def assert_still_serves(server):
    with StreamClient(server.url) as c:
        res = c.generate("Say yes.", max_tokens=3, stream=True, timeout=120)
    assert res.error is None and res.tokens >= 1


@pytest.mark.parametrize("probe", F.BAD_INPUTS, ids=lambda p: f"{p.kind}: {p.name}")
def test_bad_input_gets_a_clear_one_line_error(server, probe):
    ans = F.send_once(server.url, probe.model, probe.inputs(), probe.parameters, probe.empty_final, timeout=60)
    assert not ans.timed_out, "no answer: the request hangs"
    assert ans.error is not None, f"served instead of refused ({ans.responses} responses)"
    assert probe.expect in ans.error and F.is_one_line(ans.error), ans.error


def test_server_still_serves_after_bad_inputs(server):
    assert_still_serves(server)


def _wait_cancelled(server, model, before, timeout=60.0):
    deadline = time.time() + timeout
    while time.time() < deadline:
        if server.metric("dspark_requests_total", model=model, reason="cancelled") > before and \
                server.metric("dspark_inflight_requests", model=model) == 0:
            return True
        time.sleep(0.2)
    return False


def _stream_until_chunks(c, inputs, model, n=2, timeout=120.0):
    res = c.submit(inputs, model=model)
    deadline = time.time() + timeout
    while len(res.chunks) < n and time.time() < deadline and not res.done.is_set():
        time.sleep(0.05)
    assert len(res.chunks) >= n and not res.done.is_set(), "stream did not start"
    return res


def test_cancelling_a_stream_stops_the_engine_request(server):
    before = server.metric("dspark_requests_total", model="dspark_llm", reason="cancelled")
    c = StreamClient(server.url)
    _stream_until_chunks(c, make_inputs("Tell me a long story about a dragon.", 400, True), "ensemble")
    c.close(cancel=True)
    assert _wait_cancelled(server, "dspark_llm", before), "the engine kept generating after the cancel"
    assert_still_serves(server)


def test_cancelling_a_direct_llm_model_stream_stops_the_engine_request(server):
    before = server.metric("dspark_requests_total", model="dspark_llm_target_only", reason="cancelled")
    c = StreamClient(server.url)
    inputs = [F.i32("input_ids", 1, 504, 3058, 282), F.i32("request_output_len", 400), F.flag("streaming", True)]
    res = c.submit(inputs, model="dspark_llm_target_only")
    deadline = time.time() + 120
    while res.tokens == 0 and not res.done.is_set() and time.time() < deadline:
        time.sleep(0.05)
    c.close(cancel=True)
    assert _wait_cancelled(server, "dspark_llm_target_only", before)


def test_client_disconnect_mid_stream_stops_the_engine_request(server):
    before = server.metric("dspark_requests_total", model="dspark_llm", reason="cancelled")
    proc = F.start_abandoning_client(server.url)
    try:
        assert proc.stdout.readline().strip() == "streaming"
    finally:
        proc.kill()
        proc.wait()
    assert _wait_cancelled(server, "dspark_llm", before), "the engine kept generating for a gone client"
    assert_still_serves(server)


def _stop_by_request_id(server, request_id):
    with StreamClient(server.url, "dspark_llm") as c:
        res = c.submit([F.flag("stop", True)], request_id=request_id)
        assert res.done.wait(60) and res.error is None


def test_stop_by_request_id_ends_a_stream_cleanly(server):
    with StreamClient(server.url) as c:
        res = _stream_until_chunks(c, make_inputs("Tell me a long story about a dragon.", 400, True), "ensemble")
        _stop_by_request_id(server, res.request_id)
        assert res.done.wait(60)
    assert res.error is None and res.finish_reason == "cancelled" and res.tokens < 400


def test_stop_by_request_id_before_any_response_is_a_cancelled_error(server):
    with StreamClient(server.url) as c:
        res = c.submit(make_inputs("Tell me a long story about a dragon.", 400, False), request_id="nonstream-stop")
        time.sleep(1.0)
        _stop_by_request_id(server, "nonstream-stop")
        assert res.done.wait(60)
    assert res.error is not None and "request cancelled" in res.error
    assert_still_serves(server)
