"""Bad inputs, cancellation and disconnects: each ends in a clear error or a clean stop,
and the server keeps serving afterwards."""
from __future__ import annotations

import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest

from dspark.engine.serving.client import StreamClient, make_inputs

pytestmark = [pytest.mark.server, pytest.mark.slow]


def tensor(name, arr, dtype):
    import tritonclient.grpc as grpcclient

    t = grpcclient.InferInput(name, list(arr.shape), dtype)
    t.set_data_from_numpy(arr)
    return t


def text(s):
    return tensor("text_input", np.array([[s.encode()]], dtype=object), "BYTES")


def max_tokens(n, dtype=np.int32, name="INT32"):
    return tensor("max_tokens", np.array([[n]], dtype=dtype), name)


BAD = {
    "empty prompt": ([text(""), max_tokens(4)], "text_input is empty"),
    "prompt longer than the context": ([text("word " * 3000), max_tokens(4)], "context"),
    "negative max_tokens": ([text("hi"), max_tokens(-3)], "positive"),
    "zero max_tokens": ([text("hi"), max_tokens(0)], "positive"),
    "huge max_tokens": ([text("hi"), max_tokens(2**31 - 1)], "exceeds the engine context"),
    "float max_tokens": ([text("hi"), max_tokens(4.0, np.float32, "FP32")], "data-type is 'FP32'"),
    "two strings in one row": ([tensor("text_input", np.array([[b"a", b"b"]], dtype=object), "BYTES"),
                                max_tokens(4)], "unexpected shape"),
    "batch of two": ([tensor("text_input", np.array([[b"a"], [b"b"]], dtype=object), "BYTES"),
                      tensor("max_tokens", np.array([[4], [4]], np.int32), "INT32")], "batch size 2"),
    "invalid utf-8": ([tensor("text_input", np.array([[b"\xff\xfe"]], dtype=object), "BYTES"), max_tokens(4)],
                      "UTF-8"),
    "unknown input": ([text("hi"), max_tokens(4), tensor("beam_width", np.array([[2]], np.int32), "INT32")],
                      "unexpected inference input 'beam_width'"),
    "top_p zero": ([text("hi"), max_tokens(4), tensor("top_p", np.array([[0.0]], np.float32), "FP32")], "top_p"),
    "negative temperature": ([text("hi"), max_tokens(4),
                              tensor("temperature", np.array([[-1.0]], np.float32), "FP32")], "temperature"),
    "bad_words": ([text("hi"), max_tokens(4), tensor("bad_words", np.array([[b"x"]], dtype=object), "BYTES")],
                  "bad_words is not supported"),
}


def assert_still_serves(server):
    with StreamClient(server.url) as c:
        res = c.generate("Say yes.", max_tokens=3, stream=True, timeout=120)
    assert res.error is None and res.tokens >= 1


@pytest.mark.parametrize("case", list(BAD))
def test_bad_input_gets_a_clear_error(server, case):
    inputs, message = BAD[case]
    with StreamClient(server.url) as c:
        res = c.submit(inputs)
        assert res.done.wait(60)
    assert res.error is not None and message in res.error, res.error


def test_unknown_request_parameter_gets_a_clear_error(server):
    with StreamClient(server.url) as c:
        res = c.submit([text("hi"), max_tokens(4)], parameters={"temprature": 0.5})
        assert res.done.wait(60)
    assert res.error is not None and "unknown request parameter(s) temprature" in res.error


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
    inputs = [tensor("input_ids", np.array([[1, 504, 3058, 282]], np.int32), "INT32"),
              tensor("request_output_len", np.array([[400]], np.int32), "INT32"),
              tensor("streaming", np.array([[True]]), "BOOL")]
    res = c.submit(inputs, model="dspark_llm_target_only")
    deadline = time.time() + 120
    while res.tokens == 0 and not res.done.is_set() and time.time() < deadline:
        time.sleep(0.05)
    c.close(cancel=True)
    assert _wait_cancelled(server, "dspark_llm_target_only", before)


CLIENT = textwrap.dedent("""
    import sys, time
    from dspark.engine.serving.client import StreamClient, make_inputs
    c = StreamClient(sys.argv[1])
    res = c.submit(make_inputs("Write a long poem about the sea.", 400, True))
    while len(res.chunks) < 2:
        time.sleep(0.05)
    print("streaming", flush=True)
    time.sleep(600)
""")


def test_client_disconnect_mid_stream_stops_the_engine_request(server):
    before = server.metric("dspark_requests_total", model="dspark_llm", reason="cancelled")
    proc = subprocess.Popen([sys.executable, "-c", CLIENT, server.url], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "streaming"
    finally:
        proc.kill()
        proc.wait()
    assert _wait_cancelled(server, "dspark_llm", before), "the engine kept generating for a gone client"
    assert_still_serves(server)


def _stop_by_request_id(server, request_id):
    with StreamClient(server.url, "dspark_llm") as c:
        res = c.submit([tensor("stop", np.array([[True]]), "BOOL")], request_id=request_id)
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
