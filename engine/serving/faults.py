"""The fault catalogue: bad requests the served kit refuses, and what to look at around a fault.

One home for the probes that ``scripts/fault_suite.py`` runs (and writes to
``docs/benchmarks/faults.{json,md}``) and that the e2e tests assert on:

- ``BAD_INPUTS``: one request each, sent to a model of ``triton_repo`` over the gRPC stream
  API, with the substring its one-line error must contain. ``kind`` groups them: a missing
  or unknown ``tensor``, a wrong data ``type``, a wrong ``shape``, a value out of ``range``,
  a bad ``encoding``, an unsupported ``parameter``.
- :func:`send_once`: one request on a fresh stream, waiting for its error or final response
  (optionally without ``enable_empty_final_response``, to catch requests that never end).
- :func:`snapshot`: the server's RSS (server + its stubs), its stubs, the orphaned stubs of
  the repository, and the shared-memory regions of its prefix, to compare before and after.
- :func:`kill_mid_stream`: ``kill -9`` of the server while a stream runs, then what is left.
- :func:`start_abandoning_client`: a client process that streams and is then killed mid-stream.
- :func:`wait_until`: poll a condition until it holds or a timeout passes.

Needs ``tritonclient[grpc]`` (the ``serve`` extra), imported when a probe is built.
"""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import numpy as np

from . import stubs

VOCAB = 49152  # the embedded SmolLM2 target's vocabulary (the range probes use it)


def free_ports(n: int) -> list[int]:
    """``n`` distinct TCP ports free on 127.0.0.1 right now (for a test or fault-suite server)."""
    socks = [socket.socket() for _ in range(n)]
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def tensor(name: str, arr: np.ndarray, dtype: str):
    """A gRPC input tensor."""
    import tritonclient.grpc as grpcclient

    t = grpcclient.InferInput(name, list(arr.shape), dtype)
    t.set_data_from_numpy(arr)
    return t


def text(s: str | bytes, name: str = "text_input"):
    b = s if isinstance(s, bytes) else s.encode("utf-8")
    return tensor(name, np.array([[b]], dtype=object), "BYTES")


def i32(name: str, *values: int):
    return tensor(name, np.array([list(values)], np.int32), "INT32")


def f32(name: str, value: float):
    return tensor(name, np.array([[value]], np.float32), "FP32")


def flag(name: str, value: bool):
    return tensor(name, np.array([[value]]), "BOOL")


@dataclass(frozen=True)
class BadInput:
    name: str
    kind: str  # tensor | type | shape | range | encoding | parameter
    model: str
    inputs: Callable[[], list]
    expect: str  # substring of the error
    parameters: dict | None = None
    empty_final: bool = True  # enable_empty_final_response


def _ens(*extra):
    return lambda: [text("hi"), i32("max_tokens", 4), *[e() for e in extra]]


BAD_INPUTS: tuple[BadInput, ...] = (
    # tensor: missing or unknown
    BadInput("missing text_input", "tensor", "ensemble",
             lambda: [i32("max_tokens", 32), flag("stream", False)], "text_input is required"),
    BadInput("missing text_input, no empty final response", "tensor", "ensemble",
             lambda: [i32("max_tokens", 32), flag("stream", False)], "text_input is required", empty_final=False),
    BadInput("missing text_input, only temperature", "tensor", "ensemble",
             lambda: [f32("temperature", 0.5)], "text_input is required"),
    BadInput("no inputs at all", "tensor", "ensemble", lambda: [], "0 inputs"),
    BadInput("unknown input", "tensor", "ensemble",
             _ens(lambda: i32("beam_width", 2)), "unexpected inference input 'beam_width'"),
    BadInput("preprocessing without text_input", "tensor", "preprocessing",
             lambda: [i32("end_id", 2)], "text_input is required"),
    BadInput("dspark_llm without input_ids", "tensor", "dspark_llm",
             lambda: [i32("request_output_len", 4)], "input_ids is required"),
    BadInput("postprocessing without output_ids", "tensor", "postprocessing",
             lambda: [flag("is_final", True)], "output_ids is required"),
    # type
    BadInput("float max_tokens", "type", "ensemble",
             lambda: [text("hi"), f32("max_tokens", 4.0)], "data-type is 'FP32'"),
    BadInput("integer text_input", "type", "ensemble",
             lambda: [i32("text_input", 7), i32("max_tokens", 4)], "data-type is 'INT32'"),
    BadInput("integer temperature", "type", "ensemble",
             _ens(lambda: i32("temperature", 1)), "data-type is 'INT32'"),
    BadInput("float input_ids", "type", "dspark_llm",
             lambda: [tensor("input_ids", np.array([[1.5]], np.float32), "FP32")], "data-type is 'FP32'"),
    # shape
    BadInput("two strings in one row", "shape", "ensemble",
             lambda: [tensor("text_input", np.array([[b"a", b"b"]], dtype=object), "BYTES"), i32("max_tokens", 4)],
             "unexpected shape"),
    BadInput("batch of two", "shape", "ensemble",
             lambda: [tensor("text_input", np.array([[b"a"], [b"b"]], dtype=object), "BYTES"),
                      tensor("max_tokens", np.array([[4], [4]], np.int32), "INT32")], "batch size 2"),
    BadInput("two max_tokens values", "shape", "ensemble",
             lambda: [text("hi"), i32("max_tokens", 4, 5)], "unexpected shape"),
    # range
    BadInput("empty prompt", "range", "ensemble", lambda: [text(""), i32("max_tokens", 4)], "text_input is empty"),
    BadInput("prompt longer than the context", "range", "ensemble",
             lambda: [text("word " * 3000), i32("max_tokens", 4)], "context"),
    BadInput("negative max_tokens", "range", "ensemble", lambda: [text("hi"), i32("max_tokens", -3)], "positive"),
    BadInput("zero max_tokens", "range", "ensemble", lambda: [text("hi"), i32("max_tokens", 0)], "positive"),
    BadInput("huge max_tokens", "range", "ensemble",
             lambda: [text("hi"), i32("max_tokens", 2**31 - 1)], "exceeds the engine context"),
    BadInput("top_p zero", "range", "ensemble", _ens(lambda: f32("top_p", 0.0)), "top_p"),
    BadInput("top_p above one", "range", "ensemble", _ens(lambda: f32("top_p", 1.5)), "top_p"),
    BadInput("negative temperature", "range", "ensemble", _ens(lambda: f32("temperature", -1.0)), "temperature"),
    BadInput("NaN temperature", "range", "ensemble", _ens(lambda: f32("temperature", float("nan"))), "finite"),
    BadInput("negative top_k", "range", "ensemble", _ens(lambda: i32("top_k", -1)), "top_k"),
    BadInput("end_id 10**6", "range", "ensemble", _ens(lambda: i32("end_id", 10**6)), "end_id=1000000 is not a token id"),
    BadInput("end_id = vocabulary size", "range", "ensemble", _ens(lambda: i32("end_id", VOCAB)),
             f"end_id={VOCAB} is not a token id"),
    BadInput("end_id -7", "range", "ensemble", _ens(lambda: i32("end_id", -7)), "end_id=-7 is not a token id"),
    BadInput("end_id 10**6 to dspark_llm", "range", "dspark_llm",
             lambda: [i32("input_ids", 1, 504), i32("end_id", 10**6)], "end_id=1000000 is not a token id"),
    BadInput("input_ids outside the vocabulary", "range", "dspark_llm",
             lambda: [i32("input_ids", 1, VOCAB)], "outside the vocabulary"),
    BadInput("negative input_ids", "range", "dspark_llm", lambda: [i32("input_ids", 1, -3)], "negative token id"),
    BadInput("input_lengths past input_ids", "range", "dspark_llm",
             lambda: [i32("input_ids", 1, 504, 3058), i32("input_lengths", 7)], "input_lengths"),
    BadInput("postprocessing ids out of range", "range", "postprocessing",
             lambda: [i32("output_ids", 1000000, -5)], "outside the tokenizer's range"),
    BadInput("exclude_input_in_output false", "range", "ensemble",
             _ens(lambda: flag("exclude_input_in_output", False)), "exclude_input_in_output"),
    # encoding
    BadInput("invalid UTF-8 text_input", "encoding", "ensemble",
             lambda: [text(b"\xff\xfe"), i32("max_tokens", 4)], "UTF-8"),
    BadInput("invalid UTF-8 stop_words", "encoding", "ensemble",
             _ens(lambda: tensor("stop_words", np.array([[b"\xc3("]], dtype=object), "BYTES")), "UTF-8"),
    # parameter: valid tensors, unsupported request
    BadInput("bad_words", "parameter", "ensemble",
             _ens(lambda: tensor("bad_words", np.array([[b"x"]], dtype=object), "BYTES")),
             "bad_words is not supported"),
    BadInput("unknown request parameter", "parameter", "ensemble", _ens(),
             "unknown request parameter(s) temprature", parameters={"temprature": 0.5}),
)


def is_one_line(message: str | None) -> bool:
    """A client-facing error: one line, no traceback, no server file paths."""
    return bool(message) and "\n" not in message and "Traceback" not in message and ".py(" not in message


@dataclass
class Answer:
    error: str | None = None
    responses: int = 0
    final: bool = False
    timed_out: bool = False


def send_once(url: str, model: str, inputs: list, parameters: dict | None = None,
              empty_final: bool = True, timeout: float = 60.0, request_id: str = "probe") -> Answer:
    """One request on its own gRPC stream; waits for an error, the final response, or the timeout.

    Without ``empty_final`` a request that ends with a flag-only final response cannot be
    told from one that never ends, so the first response with outputs counts as the end.
    """
    import tritonclient.grpc as grpcclient

    ans, done = Answer(), threading.Event()

    def callback(result, error):
        if done.is_set():
            return  # e.g. the local cancellation of a timed-out request when the stream stops
        if error is not None:
            ans.error = str(error.message() if hasattr(error, "message") else error)
            done.set()
            return
        ans.responses += 1
        response = result.get_response()
        final = response.parameters.get("triton_final_response")
        if (final is not None and final.bool_param) or (not empty_final and response.outputs):
            ans.final = True
            done.set()

    client = grpcclient.InferenceServerClient(url)
    try:
        client.start_stream(callback=callback)
        client.async_stream_infer(model, inputs, request_id=request_id, enable_empty_final_response=empty_final,
                                  parameters=parameters)
        ans.timed_out = not done.wait(timeout)
    finally:
        client.stop_stream(cancel_requests=ans.timed_out)
        client.close()
    return ans


def wait_until(cond: Callable[[], bool], timeout: float, interval: float = 0.1) -> bool:
    """Poll ``cond`` every ``interval`` seconds for up to ``timeout`` seconds; -> whether it held
    (checked once more at the deadline)."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        if cond():
            return True
        time.sleep(interval)
    return cond()


def stream_and_hang(url: str, max_tokens: int = 400) -> None:
    """Open a long stream to the ensemble at ``url``, print ``streaming`` once two chunks have come,
    then hang: the body of :func:`start_abandoning_client`'s process."""
    from .client import StreamClient, make_inputs

    c = StreamClient(url)
    res = c.submit(make_inputs("Write a long poem about the sea.", max_tokens, True))
    while len(res.chunks) < 2:
        time.sleep(0.05)
    print("streaming", flush=True)
    time.sleep(600)


def start_abandoning_client(url: str) -> subprocess.Popen:
    """:func:`stream_and_hang` in a child process (stdout a text pipe): read its ``streaming`` line,
    then kill it to leave the server a stream whose client is gone."""
    code = "import sys; from dspark.engine.serving.faults import stream_and_hang; stream_and_hang(sys.argv[1])"
    return subprocess.Popen([sys.executable, "-c", code, url], stdout=subprocess.PIPE, text=True)


# -- the server's processes and shared memory -------------------------------------------------
def rss_mb(pid: int) -> float:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024.0
    except OSError:
        pass
    return 0.0


@dataclass
class Snapshot:
    rss_mb: float  # server + its stubs
    stubs: int  # live stubs of the server
    orphans: list[int] = field(default_factory=list)  # stubs of the repository whose server is gone
    shm: list[str] = field(default_factory=list)  # regions of the server's prefix

    def as_dict(self) -> dict[str, Any]:
        return {"rss_mb": round(self.rss_mb, 1), "stubs": self.stubs, "orphans": len(self.orphans),
                "shm_regions": len(self.shm)}


def snapshot(server_pid: int | None, repo: str | Path, shm_prefix: str) -> Snapshot:
    own = [pid for pid, s in stubs.find_stubs() if server_pid is not None and s.server_pid == server_pid]
    alive = server_pid is not None and stubs.pid_alive(server_pid)
    rss = (rss_mb(server_pid) if alive else 0.0) + sum(rss_mb(p) for p in own)
    return Snapshot(rss, len(own), [p for p, _ in stubs.orphaned_stubs(repo, shm_prefix)],
                    stubs.shm_regions(shm_prefix))


@dataclass
class CrashReport:
    responses_before_kill: int
    stubs_at_kill: int
    orphans: list[int]  # stubs of the killed server still alive after the wait
    shm: list[str]  # its regions still in /dev/shm after the wait
    seconds_to_clean: float | None  # until no stub and no region was left (None: not within wait_s)


def kill_mid_stream(url: str, server_pid: int, shm_prefix: str, responses: int = 3, max_tokens: int = 256,
                    wait_s: float = 15.0) -> CrashReport:
    """Start a stream, ``kill -9`` the server after ``responses`` responses, and wait up to
    ``wait_s`` for its stubs to exit and its shared-memory regions to go."""
    from .client import StreamClient, make_inputs

    at_kill = len([p for p, s in stubs.find_stubs() if s.server_pid == server_pid])
    c = StreamClient(url)
    res = c.submit(make_inputs("Tell me a long story about a dragon.", max_tokens, True))
    deadline = time.time() + 120
    while len(res.chunks) < responses and not res.done.is_set() and time.time() < deadline:
        time.sleep(0.01)
    got = len(res.chunks)
    os.kill(server_pid, signal.SIGKILL)
    t0 = time.time()
    left: list[int] = []
    regions: list[str] = []
    cleaned = None
    while time.time() - t0 < wait_s:
        left = [p for p, s in stubs.find_stubs() if s.server_pid == server_pid]
        regions = stubs.shm_regions(shm_prefix)
        if not left and not regions:
            cleaned = time.time() - t0
            break
        time.sleep(0.1)
    try:
        c.close()
    except Exception:  # noqa: BLE001 - the server is gone; the stream may already be broken
        pass
    return CrashReport(got, at_kill, left, regions, cleaned)


def metric(metrics_url: str, name: str, **labels: str) -> float:
    """Sum of a Prometheus metric's samples whose labels include ``labels`` (``host:port``)."""
    import urllib.request

    body = urllib.request.urlopen(f"http://{metrics_url}/metrics", timeout=10).read().decode()
    total = 0.0
    for line in body.splitlines():
        if not (line.startswith(name + "{") or line.startswith(name + " ")):
            continue
        head, value = line.rsplit(" ", 1)
        if all(f'{k}="{v}"' in head for k, v in labels.items()):
            total += float(value)
    return total
