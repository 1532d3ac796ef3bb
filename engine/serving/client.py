"""A small gRPC client for the ensembles (benchmarks, soak runs and the e2e tests).

One ``StreamClient`` holds one bidirectional gRPC stream and multiplexes any number of
concurrent requests over it, routing responses by request id. Streaming and non-streaming
requests both use the stream (the LLM step is decoupled); ``stream=False`` yields a
single response. Needs ``tritonclient[grpc]`` (the ``serve`` extra).
"""
from __future__ import annotations

import itertools
import threading
import time
from dataclasses import dataclass, field

import numpy as np


@dataclass
class Result:
    request_id: str
    t_submit: float
    chunks: list[str] = field(default_factory=list)
    chunk_times: list[float] = field(default_factory=list)
    # (arrival time, sequence_length so far) of every response that carried outputs
    token_times: list[tuple[float, int]] = field(default_factory=list)
    tokens: int = 0  # sequence_length of the last response
    finish_reason: str = ""
    accept_len: float = 0.0
    num_steps: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    error: str | None = None
    t_done: float | None = None
    done: threading.Event = field(default_factory=threading.Event, repr=False)

    @property
    def text(self) -> str:
        return "".join(self.chunks)

    @property
    def ttft(self) -> float | None:
        return self.chunk_times[0] - self.t_submit if self.chunk_times else None

    @property
    def e2e(self) -> float | None:
        return None if self.t_done is None else self.t_done - self.t_submit

    @property
    def itl(self) -> float | None:
        """Mean time between output tokens after the first chunk (time per output token)."""
        if len(self.chunk_times) < 2 or self.tokens < 2:
            return None
        return (self.chunk_times[-1] - self.chunk_times[0]) / (self.tokens - 1)

    def tokens_by(self, t: float) -> int:
        """Output tokens received up to time ``t`` (``time.perf_counter()``)."""
        return max((n for when, n in self.token_times if when <= t), default=0)


def make_inputs(text: str, max_tokens: int, stream: bool, temperature: float | None = None,
                top_p: float | None = None, top_k: int | None = None, seed: int | None = None,
                end_id: int | None = None, stop_words: list[str] | None = None):
    import tritonclient.grpc as grpcclient

    def tensor(name, arr, dtype):
        t = grpcclient.InferInput(name, list(arr.shape), dtype)
        t.set_data_from_numpy(arr)
        return t

    inputs = [tensor("text_input", np.array([[text.encode("utf-8")]], dtype=np.object_), "BYTES"),
              tensor("max_tokens", np.array([[max_tokens]], dtype=np.int32), "INT32"),
              tensor("stream", np.array([[stream]], dtype=np.bool_), "BOOL")]
    if temperature is not None:
        inputs.append(tensor("temperature", np.array([[temperature]], dtype=np.float32), "FP32"))
    if top_p is not None:
        inputs.append(tensor("top_p", np.array([[top_p]], dtype=np.float32), "FP32"))
    if top_k is not None:
        inputs.append(tensor("top_k", np.array([[top_k]], dtype=np.int32), "INT32"))
    if seed is not None:
        inputs.append(tensor("random_seed", np.array([[seed]], dtype=np.uint64), "UINT64"))
    if end_id is not None:
        inputs.append(tensor("end_id", np.array([[end_id]], dtype=np.int32), "INT32"))
    if stop_words:
        inputs.append(tensor("stop_words", np.array([[s.encode() for s in stop_words]], dtype=np.object_), "BYTES"))
    return inputs


def _first(result, name):
    arr = result.as_numpy(name)
    return None if arr is None else arr.reshape(-1)[0]


class StreamClient:
    _ids = itertools.count()

    def __init__(self, url: str, model: str = "ensemble"):
        import tritonclient.grpc as grpcclient

        self.url, self.model = url, model
        self.client = grpcclient.InferenceServerClient(url)
        self._pending: dict[str, Result] = {}
        self._lock = threading.Lock()
        self.client.start_stream(callback=self._on_response)
        self._closed = False

    def submit(self, inputs, model: str | None = None, request_id: str | None = None,
               parameters: dict | None = None) -> Result:
        rid = request_id or f"c{next(self._ids)}"
        res = Result(rid, time.perf_counter())
        with self._lock:
            self._pending[rid] = res
        self.client.async_stream_infer(model or self.model, inputs, request_id=rid,
                                       enable_empty_final_response=True, parameters=parameters)
        return res

    def generate(self, text: str, max_tokens: int = 32, stream: bool = True, model: str | None = None,
                 timeout: float = 300.0, **kw) -> Result:
        res = self.submit(make_inputs(text, max_tokens, stream, **kw), model)
        if not res.done.wait(timeout):
            raise TimeoutError(f"no final response within {timeout}s for {res.request_id}")
        return res

    def _on_response(self, result, error):
        now = time.perf_counter()
        if error is not None:
            rid = getattr(error, "request_id", None)
            # errors carry no request id in some client versions: fail the oldest pending request
            with self._lock:
                if rid is None or rid not in self._pending:
                    rid = next(iter(self._pending), None)
                res = self._pending.pop(rid, None) if rid is not None else None
            if res is not None:
                res.error = str(error.message() if hasattr(error, "message") else error)
                res.t_done = now
                res.done.set()
            return
        response = result.get_response()
        with self._lock:
            res = self._pending.get(response.id)
        if res is None:
            return
        if response.outputs:
            text = _first(result, "text_output")
            if text is not None:
                res.chunks.append(text.decode("utf-8") if isinstance(text, bytes) else str(text))
                res.chunk_times.append(now)
            n = _first(result, "sequence_length")
            if n is not None:
                res.tokens = int(n)
                res.token_times.append((now, res.tokens))
            reason = _first(result, "finish_reason")
            if reason:
                res.finish_reason = reason.decode() if isinstance(reason, bytes) else str(reason)
            for name in ("accept_len", "num_steps", "num_draft_tokens", "num_accepted_tokens"):
                v = _first(result, name)
                if v is not None:
                    setattr(res, name, type(getattr(res, name))(v))
        final = response.parameters.get("triton_final_response")
        if final is not None and final.bool_param:
            with self._lock:
                self._pending.pop(response.id, None)
            res.t_done = now
            res.done.set()

    def close(self, cancel: bool = False) -> None:
        if not self._closed:
            self._closed = True
            self.client.stop_stream(cancel_requests=cancel)
            self.client.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
