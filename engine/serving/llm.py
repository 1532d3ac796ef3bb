"""``LLMService``: one GenerationEngine serving a stream of requests (in-flight batching).

The engine runs its step loop in its own thread and admits a submitted request between
two steps, so a request arriving while others decode joins the running batch. Triton's
``execute`` only parses and submits, then returns; the engine's callbacks are queued
and a sender thread turns them into responses, so the step loop never waits on IPC.

A poll thread asks every live request's channel whether the client has cancelled (or
disconnected) and cancels it in the engine; the request then ends with a CANCELLED error,
or, if it already streamed, with a final response whose finish_reason is "cancelled".
Behind a Triton ensemble that is not enough: Triton does not mark a running step's
request as cancelled, only the requests of later steps. So every response carries a
``request_key``; postprocessing, which does see the cancellation, sends a ``stop``
request with that key back to this model (``stop()`` here). A ``stop`` request without
a key stops the live requests with the same Triton request id (as in TensorRT-LLM).

The Triton side is behind ``ResponseChannel``; model.py implements it over the
python backend's response sender. Once a request's final response is sent, Triton frees its
response factory, and asking that request ``is_cancelled()`` then crashes the whole server
(a segfault in ``TRITONBACKEND_ResponseFactoryIsCancelled``). So each live request's sends
and cancellation checks hold its own lock, and nothing touches its channel after the final
response.
"""
from __future__ import annotations

import collections
import itertools
import logging
import queue
import threading
from dataclasses import dataclass, field
from typing import Any, Mapping, Protocol

import numpy as np

from dspark.engine.api import GenerationEngine, RequestOutput, RequestValidationError

from . import tensors as T
from .detokenizer import PREFIX_WINDOW, prefix_window
from .metrics import ServingMetrics
from .requests import parse_llm_request

log = logging.getLogger(__name__)

INVALID_ARG, CANCELLED, INTERNAL, UNAVAILABLE = "invalid_arg", "cancelled", "internal", "unavailable"


class ResponseChannel(Protocol):
    def send(self, tensors: dict[str, np.ndarray] | None, final: bool,
             error: str | None = None, code: str = INTERNAL) -> None:
        """Send one response; ``error`` makes it an error response of class ``code``;
        no tensors and no error sends only the final flag."""

    def is_cancelled(self) -> bool:
        """Whether the client cancelled the request or went away."""


@dataclass
class _Live:
    channel: ResponseChannel
    streaming: bool
    client_id: str = ""
    tokens: list[int] = field(default_factory=list)
    sent: int = 0  # responses already sent
    steps: int = 0
    drafts: int = 0
    accepted: int = 0
    cancel_requested: bool = False
    # sends and is_cancelled() of this request, serialised; closed once the final response is out
    lock: threading.Lock = field(default_factory=threading.Lock)
    closed: bool = False

    def send(self, tensors: dict[str, np.ndarray] | None, final: bool, error: str | None = None,
             code: str = INTERNAL) -> None:
        """Send on the channel unless the final response already went out."""
        with self.lock:
            if self.closed:
                log.warning("dropped a response after the final one")
                return
            if final:
                self.closed = True
            _safe_send(self.channel, tensors, final, error, code)

    def cancelled(self) -> bool:
        """Whether the client cancelled or went away; a closed request is not asked (see above)."""
        with self.lock:
            if self.closed:
                return False
            try:
                return self.channel.is_cancelled()
            except Exception:  # noqa: BLE001 - a request already released counts as gone
                return True


def engine_vocab_size(engine: GenerationEngine) -> int | None:
    """The engine's vocabulary size (``engine.vocab_size``, else its target's), or None if it
    tells neither; it bounds the token ids a request may name (prompt, ``end_id``)."""
    for owner in (engine, getattr(engine, "target", None)):
        size = getattr(owner, "vocab_size", None)
        if isinstance(size, int) and size > 0:
            return size
    return None


def response_tensors(new_ids: list[int], prefix_ids: list[int], final: bool, total: int,
                     out: RequestOutput, finish_reason: str | None) -> dict[str, np.ndarray]:
    accept_len = out.accept_len
    rate = out.num_accepted_tokens / out.num_draft_tokens if out.num_draft_tokens else 0.0
    return {
        T.REQUEST_KEY: T.bytes_tensor([out.request_id]),
        T.OUTPUT_IDS: T.int_tensor(new_ids),
        T.PREFIX_IDS: T.int_tensor(prefix_ids),
        T.IS_FINAL: T.scalar_tensor(final, np.bool_),
        T.SEQUENCE_LENGTH: T.scalar_tensor(total, np.int32),
        T.FINISH_REASON: T.bytes_tensor([finish_reason or ""]),
        T.ACCEPT_LEN: T.scalar_tensor(accept_len if accept_len is not None else 0.0, np.float32),
        T.ACCEPTANCE_RATE: T.scalar_tensor(rate, np.float32),
        T.NUM_STEPS: T.scalar_tensor(out.num_steps, np.int32),
        T.NUM_DRAFT_TOKENS: T.scalar_tensor(out.num_draft_tokens, np.int32),
        T.NUM_ACCEPTED_TOKENS: T.scalar_tensor(out.num_accepted_tokens, np.int32),
    }


class LLMService:
    def __init__(self, engine: GenerationEngine, metrics: ServingMetrics | None = None,
                 default_max_tokens: int = 64, cancel_poll_s: float = 0.1,
                 prefix_window_tokens: int = PREFIX_WINDOW, name: str = "dspark_llm",
                 vocab_size: int | None = None):
        self.engine = engine
        self.vocab_size = vocab_size if vocab_size is not None else engine_vocab_size(engine)
        self.metrics = metrics
        self.default_max_tokens = default_max_tokens
        self.cancel_poll_s = cancel_poll_s
        self.window = prefix_window_tokens
        self.name = name
        self._live: dict[str, _Live] = {}
        self._lock = threading.Lock()
        self._ids = itertools.count()
        self._outbox: queue.Queue[RequestOutput | None] = queue.Queue()
        self._closing = threading.Event()
        self._sender = threading.Thread(target=self._send_loop, name=f"{name}-sender", daemon=True)
        self._poller = threading.Thread(target=self._poll_loop, name=f"{name}-cancel-poll", daemon=True)
        self._started = False

    # lifecycle -----------------------------------------------------------------------
    def start(self) -> None:
        self.engine.start()
        self._sender.start()
        self._poller.start()
        self._started = True

    def close(self, timeout: float = 30.0) -> None:
        """Stop the engine (it cancels what is pending), deliver the last updates, stop threads."""
        if not self._started:
            return
        self._closing.set()
        try:
            self.engine.stop()
        except Exception:  # noqa: BLE001 - shutting down anyway
            log.exception("engine.stop() failed")
        self._outbox.put(None)
        self._sender.join(timeout)
        self._poller.join(timeout)
        with self._lock:
            orphans, self._live = list(self._live.values()), {}
        for live in orphans:  # the engine did not finish them: tell the clients
            live.send(None, True, "the model is shutting down", UNAVAILABLE)
        self._started = False

    @property
    def num_live(self) -> int:
        return len(self._live)

    # requests --------------------------------------------------------------------------
    def submit(self, channel: ResponseChannel, inputs: Mapping[str, np.ndarray],
               parameters: str | Mapping[str, Any] | None = None, client_id: str = "") -> str | None:
        """Validate and submit one request; errors go to the channel. Returns the engine id
        (which is also the ``request_key`` of its responses)."""
        if self._closing.is_set():
            _safe_send(channel, None, True, "the model is shutting down", UNAVAILABLE)
            return None
        try:
            if T.scalar(inputs, T.STOP, "bool", default=False):
                self._stop_request(channel, inputs, client_id)
                return None
            req = parse_llm_request(inputs, self.engine.max_context, self.default_max_tokens, parameters,
                                    vocab_size=self.vocab_size)
        except (RequestValidationError, ValueError) as e:  # ValueError: malformed parameters JSON
            self._reject(channel, str(e))
            return None
        rid = f"{self.name}/{next(self._ids)}"
        live = _Live(channel, req.streaming, client_id)
        with self._lock:
            self._live[rid] = live
            n = len(self._live)
        try:
            self.engine.submit(rid, req.prompt_ids, req.params, self._outbox.put)
        except RequestValidationError as e:
            self._forget(rid)
            self._reject(live, str(e))
            return None
        except Exception as e:  # noqa: BLE001 - report, keep serving
            log.exception("engine.submit failed")
            self._forget(rid)
            live.send(None, True, f"engine error: {e}", INTERNAL)
            if self.metrics:
                self.metrics.finished("error", None)
            return None
        if self.metrics:
            self.metrics.inflight(n)
        return rid

    def stop(self, key: str) -> bool:
        """Cancel the live request with this engine id; False if it is not (or no longer) live."""
        with self._lock:
            live = self._live.get(key)
        if live is None or live.cancel_requested:
            return False
        live.cancel_requested = True
        self.engine.cancel(key)
        return True

    def _stop_request(self, channel: ResponseChannel, inputs: Mapping[str, np.ndarray], client_id: str) -> None:
        key = T.scalar(inputs, T.REQUEST_KEY, "str", default="")
        if key:
            self.stop(key)
        elif client_id:
            with self._lock:
                keys = [k for k, live in self._live.items() if live.client_id == client_id]
            for k in keys:
                self.stop(k)
        else:
            raise RequestValidationError("stop=true needs a request_key input or the request id of the request to stop")
        _safe_send(channel, None, True)  # just the final flag

    def _reject(self, channel: ResponseChannel | _Live, message: str) -> None:
        _safe_send(channel, None, True, message, INVALID_ARG)
        if self.metrics:
            self.metrics.finished("rejected", None)

    def _forget(self, rid: str) -> _Live | None:
        with self._lock:
            live = self._live.pop(rid, None)
            n = len(self._live)
        if self.metrics:
            self.metrics.inflight(n)
        return live

    # engine updates -> responses ---------------------------------------------------------
    def _send_loop(self) -> None:
        while True:
            out = self._outbox.get()
            if out is None:
                # drain what the engine delivered while stopping, then exit
                while True:
                    try:
                        out = self._outbox.get_nowait()
                    except queue.Empty:
                        return
                    if out is not None:
                        self._deliver(out)
            try:
                self._deliver(out)
            except Exception:  # noqa: BLE001 - one bad update must not stop the sender
                log.exception("delivering an update of %s failed", out.request_id)

    def _deliver(self, out: RequestOutput) -> None:
        with self._lock:
            live = self._live.get(out.request_id)
        if live is None:
            return
        new = list(out.new_token_ids)
        if self.metrics:
            self.metrics.progress(out.num_steps - live.steps, out.num_draft_tokens - live.drafts,
                                  out.num_accepted_tokens - live.accepted, len(new))
        live.steps, live.drafts, live.accepted = out.num_steps, out.num_draft_tokens, out.num_accepted_tokens
        if not out.finished:
            if live.streaming and new:
                prefix = prefix_window(live.tokens, self.window)
                live.tokens.extend(new)
                live.send(response_tensors(new, prefix, False, len(live.tokens), out, None), False)
                live.sent += 1
            else:
                live.tokens.extend(new)
            return

        self._forget(out.request_id)
        reason = out.finish_reason or "stop"
        if self.metrics:
            self.metrics.finished(reason, out.accept_len)
        # An error response after streamed ones leaves a Triton 2.51 ensemble request in
        # flight forever (it never completes, and shutdown waits for it). So errors are
        # sent as errors only before the first response; later, the final response carries
        # finish_reason "error" / "cancelled" instead (the engine's message is logged).
        if reason == "error":
            log.error("%s failed in the engine: %s", out.request_id, out.error)
            if not live.sent:
                live.send(None, True, f"engine error: {out.error or 'unknown'}", INTERNAL)
                return
        if reason == "cancelled" and live.cancel_requested and not live.sent:
            live.send(None, True, "request cancelled", CANCELLED)
            return
        if live.streaming:
            prefix = prefix_window(live.tokens, self.window)
            live.tokens.extend(new)
            tensors = response_tensors(new, prefix, True, len(live.tokens), out, reason)
        else:
            live.tokens.extend(new)
            tensors = response_tensors(live.tokens, [], True, len(live.tokens), out, reason)
        live.send(tensors, True)

    # cancellation ------------------------------------------------------------------------
    def _poll_loop(self) -> None:
        while not self._closing.wait(self.cancel_poll_s):
            with self._lock:
                items = list(self._live.items())
            if self.metrics:
                self.metrics.batch_sample(len(items))
                stats = getattr(self.engine, "stats", None)  # SpecEngine's EngineStats; other engines have none
                if stats is not None and hasattr(stats, "by_proposer"):
                    self.metrics.proposer_totals(stats.by_proposer)
                    self.metrics.engine_totals(stats)
            for rid, live in items:
                if live.cancel_requested:
                    continue
                if live.cancelled():
                    live.cancel_requested = True
                    try:
                        self.engine.cancel(rid)
                    except Exception:  # noqa: BLE001
                        log.exception("engine.cancel(%s) failed", rid)


def _safe_send(channel: ResponseChannel, tensors, final: bool, error: str | None = None,
               code: str = INTERNAL) -> None:
    try:
        channel.send(tensors, final, error, code)
    except Exception as e:  # noqa: BLE001 - the client may be gone; keep serving the others
        log.warning("could not send a response: %s", e)


class CancelRelay:
    """Postprocessing's half of ensemble cancellation: the first time a cancelled chunk of a
    request arrives, ask the LLM model that produced it to stop (once per request_key)."""

    def __init__(self, send_stop, remember: int = 4096):
        self.send_stop = send_stop  # (model_name, request_key) -> None
        self._seen: collections.OrderedDict[str, None] = collections.OrderedDict()
        self._remember = remember

    def cancelled(self, key: str) -> bool:
        """Relay a cancellation; False if already relayed or the key names no model."""
        if not key or "/" not in key or key in self._seen:
            return False
        self._seen[key] = None
        while len(self._seen) > self._remember:
            self._seen.popitem(last=False)
        self.send_stop(key.rsplit("/", 1)[0], key)
        return True
