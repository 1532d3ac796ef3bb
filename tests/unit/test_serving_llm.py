"""LLMService over a fake engine: responses, in-flight admission, cancellation, errors, metrics."""
from __future__ import annotations

import threading
import time

import numpy as np
import pytest

from dspark.engine.api import RequestOutput, RequestValidationError
from dspark.engine.serving import llm
from dspark.engine.serving.metrics import InMemoryFamily, ServingMetrics


class FakeEngine:
    """Emits `per_step` tokens (prompt[-1]+1, +2, ...) per step for every active request."""

    max_context = 64

    def __init__(self, per_step=2, step_s=0.005, fail_on=None):
        self.per_step, self.step_s, self.fail_on = per_step, step_s, fail_on
        self.pending, self.active, self.cancels = [], {}, set()
        self.batch_sizes = []
        self.lock = threading.Lock()
        self.running = False

    def submit(self, rid, prompt, params, cb):
        params.validate(self.max_context)
        if prompt[0] == 999:
            raise RequestValidationError("token 999 is not in the vocabulary")
        with self.lock:
            self.pending.append([rid, prompt[-1], params, cb, 0, 0])

    def cancel(self, rid):
        with self.lock:
            self.cancels.add(rid)

    def start(self):
        self.running = True
        self.thread = threading.Thread(target=self.loop, daemon=True)
        self.thread.start()

    def stop(self):
        self.running = False
        self.thread.join()
        for r in [*self.pending, *self.active.values()]:
            r[3](RequestOutput(r[0], [], True, "cancelled"))

    def loop(self):
        while self.running:
            with self.lock:
                for r in self.pending:
                    self.active[r[0]] = r
                self.pending = []
                cancels, self.cancels = self.cancels, set()
            for rid in cancels:
                r = self.active.pop(rid, None)
                if r:
                    r[3](RequestOutput(rid, [], True, "cancelled", None, r[5], r[5] * 3, r[5] * (self.per_step - 1)))
            if self.active:
                self.batch_sizes.append(len(self.active))
            for rid, r in list(self.active.items()):
                _, last, params, cb, n, steps = r
                if self.fail_on is not None and last == self.fail_on:
                    del self.active[rid]
                    cb(RequestOutput(rid, [], True, "error", "boom"))
                    continue
                k = min(self.per_step, params.max_tokens - n)
                new = [last + n + i + 1 for i in range(k)]
                r[4], r[5] = n + k, steps + 1
                done = r[4] >= params.max_tokens
                if done:
                    del self.active[rid]
                cb(RequestOutput(rid, new, done, "length" if done else None, None,
                                 r[5], r[5] * 3, r[5] * (self.per_step - 1)))
            time.sleep(self.step_s)


class Channel:
    def __init__(self):
        self.sent, self.cancelled = [], False
        self.done = threading.Event()

    def send(self, tensors, final, error=None, code=llm.INTERNAL):
        self.sent.append((tensors, final, error, code))
        if final:
            self.done.set()

    def is_cancelled(self):
        return self.cancelled

    def ids(self):
        return [int(i) for t, *_ in self.sent if t is not None for i in t["output_ids"][0]]


def inputs(prompt=(10,), max_tokens=6, stream=True):
    return {"input_ids": np.array([list(prompt)], np.int32),
            "request_output_len": np.array([[max_tokens]], np.int32),
            "streaming": np.array([[stream]], bool)}


@pytest.fixture
def service():
    families = {}

    def family(name, desc, kind):
        families[name] = InMemoryFamily(name, desc, kind)
        return families[name]

    svc = llm.LLMService(FakeEngine(), ServingMetrics(family, {"model": "m"}), cancel_poll_s=0.01,
                         prefix_window_tokens=3)
    svc.families = families
    svc.start()
    yield svc
    svc.close()


def test_streaming_sends_deltas_with_prefix_context_and_a_final_flag(service):
    ch = Channel()
    service.submit(ch, inputs(max_tokens=6))
    assert ch.done.wait(5)
    assert ch.ids() == [11, 12, 13, 14, 15, 16]
    assert [f for _, f, *_ in ch.sent] == [False, False, True]
    assert ch.sent[1][0]["prefix_ids"][0].tolist() == [11, 12]
    assert ch.sent[2][0]["prefix_ids"][0].tolist() == [12, 13, 14]  # window of 3
    last = ch.sent[-1][0]
    assert last["finish_reason"][0, 0] == b"length" and last["sequence_length"][0, 0] == 6
    assert last["num_steps"][0, 0] == 3 and last["accept_len"][0, 0] == pytest.approx(2.0)


def test_non_streaming_sends_one_response_with_everything(service):
    ch = Channel()
    service.submit(ch, inputs(max_tokens=5, stream=False))
    assert ch.done.wait(5)
    assert len(ch.sent) == 1 and ch.sent[0][1] is True
    assert ch.ids() == [11, 12, 13, 14, 15] and ch.sent[0][0]["prefix_ids"].size == 0


def test_requests_join_the_running_batch(service):
    first, second = Channel(), Channel()
    service.submit(first, inputs(max_tokens=40))
    time.sleep(0.03)
    service.submit(second, inputs(prompt=(100,), max_tokens=4))
    assert second.done.wait(5)
    assert not first.done.is_set()  # the short request finished while the long one ran
    assert first.done.wait(5)
    assert max(service.engine.batch_sizes) == 2


@pytest.mark.parametrize("bad, message", [
    ({**inputs(), "request_output_len": np.array([[-1]], np.int32)}, "positive"),
    ({**inputs(), "input_ids": np.array([[999]], np.int32)}, "vocabulary"),  # refused by the engine
])
def test_invalid_requests_get_one_invalid_arg_error(service, bad, message):
    ch = Channel()
    assert service.submit(ch, bad) is None
    [(tensors, final, error, code)] = ch.sent
    assert tensors is None and final and code == llm.INVALID_ARG and message in error
    assert service.num_live == 0


def test_end_id_is_checked_against_the_engine_target_vocabulary():
    engine = FakeEngine()
    engine.target = type("T", (), {"vocab_size": 500})()  # SpecEngine keeps its vocabulary on .target
    svc = llm.LLMService(engine, cancel_poll_s=0.01)
    assert svc.vocab_size == 500
    svc.start()
    try:
        for end_id in (500, 10**6, -7):
            ch = Channel()
            assert svc.submit(ch, {**inputs(), "end_id": np.array([[end_id]], np.int32)}) is None
            assert ch.sent[0][3] == llm.INVALID_ARG and f"end_id={end_id} is not a token id" in ch.sent[0][2]
        ch = Channel()
        svc.submit(ch, {**inputs(max_tokens=2), "end_id": np.array([[499]], np.int32)})
        assert ch.done.wait(5) and ch.sent[-1][2] is None
    finally:
        svc.close()


def test_unknown_parameter_is_refused(service):
    ch = Channel()
    service.submit(ch, inputs(), parameters='{"beam_width": 4}')
    assert ch.sent[0][3] == llm.INVALID_ARG and "beam_width" in ch.sent[0][2]


def test_client_cancellation_cancels_the_engine_request(service):
    ch = Channel()
    service.submit(ch, inputs(max_tokens=60))
    time.sleep(0.03)
    ch.cancelled = True
    assert ch.done.wait(5)
    tensors, final, error, code = ch.sent[-1]
    # it had streamed already: a clean final response (an error now would hang a Triton ensemble)
    assert final and error is None and tensors["finish_reason"][0, 0] == b"cancelled"
    assert len(ch.ids()) < 60
    assert service.num_live == 0


def test_cancelling_before_any_response_gives_a_cancelled_error(service):
    ch = Channel()
    service.submit(ch, inputs(max_tokens=60, stream=False))
    time.sleep(0.03)
    ch.cancelled = True
    assert ch.done.wait(5)
    [(tensors, final, error, code)] = ch.sent
    assert final and code == llm.CANCELLED and tensors is None


def test_engine_error_after_streaming_ends_with_finish_reason_error():
    engine = FakeEngine()
    svc = llm.LLMService(engine, cancel_poll_s=0.01)
    svc.start()
    try:
        ch = Channel()
        svc.submit(ch, inputs(prompt=(20,), max_tokens=60))
        time.sleep(0.03)
        engine.fail_on = 20
        assert ch.done.wait(5)
        tensors, final, error, _ = ch.sent[-1]
        assert final and error is None and tensors["finish_reason"][0, 0] == b"error"
    finally:
        svc.close()


def test_engine_error_reaches_the_client_and_the_service_keeps_serving():
    svc = llm.LLMService(FakeEngine(fail_on=7), cancel_poll_s=0.01)
    svc.start()
    try:
        bad, good = Channel(), Channel()
        svc.submit(bad, inputs(prompt=(7,)))
        svc.submit(good, inputs(prompt=(8,), max_tokens=2))
        assert bad.done.wait(5) and good.done.wait(5)
        assert bad.sent[-1][3] == llm.INTERNAL and "boom" in bad.sent[-1][2]
        assert good.ids() == [9, 10]
    finally:
        svc.close()


def test_close_finishes_pending_requests():
    svc = llm.LLMService(FakeEngine(step_s=0.05), cancel_poll_s=0.01)
    svc.start()
    ch = Channel()
    svc.submit(ch, inputs(max_tokens=60))
    time.sleep(0.1)
    svc.close()
    assert ch.done.is_set() and ch.sent[-1][1]
    late = Channel()
    svc.submit(late, inputs())
    assert late.sent[0][3] == llm.UNAVAILABLE


def test_metrics_count_rounds_drafts_and_accepted_positions(service):
    ch = Channel()
    service.submit(ch, inputs(max_tokens=6))
    assert ch.done.wait(5)
    fam = service.families
    value = lambda name: sum(m.value for m in fam[name].metrics)  # noqa: E731
    assert value("dspark_output_tokens_total") == 6
    assert value("dspark_draft_rounds_total") == 3
    assert value("dspark_draft_tokens_total") == 9
    assert value("dspark_accepted_tokens_total") == 3
    by_pos = {m.labels["position"]: m.value for m in fam["dspark_accepted_tokens_by_position_total"].metrics}
    assert by_pos == {"1": 3}
    assert fam["dspark_verify_len"].metrics[0].observations == [3.0, 3.0, 3.0]
    assert fam["dspark_request_accept_len"].metrics[0].observations == [2.0]
    reasons = {m.labels["reason"]: m.value for m in fam["dspark_requests_total"].metrics}
    assert reasons == {"length": 1}


def test_stop_request_by_key_cancels_the_named_request(service):
    ch, ctl = Channel(), Channel()
    service.submit(ch, inputs(max_tokens=60))
    time.sleep(0.03)
    key = ch.sent[0][0]["request_key"][0, 0].decode()
    service.submit(ctl, {"stop": np.array([[True]]), "request_key": np.array([[key.encode()]], dtype=object)})
    assert ctl.sent == [(None, True, None, llm.INTERNAL)]  # only the final flag
    assert ch.done.wait(5) and ch.sent[-1][0]["finish_reason"][0, 0] == b"cancelled"


def test_stop_request_by_request_id_like_tensorrt_llm(service):
    ch, ctl = Channel(), Channel()
    service.submit(ch, inputs(max_tokens=60, stream=False), client_id="abc")
    service.submit(ctl, {"stop": np.array([[True]])}, client_id="abc")
    assert ch.done.wait(5) and ch.sent[-1][3] == llm.CANCELLED
    bad = Channel()
    service.submit(bad, {"stop": np.array([[True]])})
    assert bad.sent[0][3] == llm.INVALID_ARG


def test_cancel_relay_stops_each_request_once():
    calls = []
    relay = llm.CancelRelay(lambda model, key: calls.append((model, key)), remember=2)
    assert relay.cancelled("dspark_llm/3") and not relay.cancelled("dspark_llm/3")
    assert not relay.cancelled("") and not relay.cancelled("nokey")
    assert calls == [("dspark_llm", "dspark_llm/3")]


class TritonLikeChannel(Channel):
    """Triton frees a request's response factory with its final response: asking is_cancelled()
    after it (or while it is being sent) crashed the real server. Records each such call."""

    violations: list[str]

    def __init__(self, violations):
        super().__init__()
        self.violations = violations
        self.final_sent = False
        self.busy = threading.Lock()

    def send(self, tensors, final, error=None, code=llm.INTERNAL):
        if not self.busy.acquire(blocking=False):
            self.violations.append("final response sent during is_cancelled()")
            self.busy.acquire()
        try:
            super().send(tensors, final, error, code)
            self.final_sent = self.final_sent or final
        finally:
            self.busy.release()

    def is_cancelled(self):
        with self.busy:
            if self.final_sent:
                self.violations.append("is_cancelled() after the final response")
            time.sleep(0.001)  # an IPC round trip to the server: widens the window the poll races in
            return False


def test_no_cancellation_check_touches_a_request_after_its_final_response():
    violations: list[str] = []
    svc = llm.LLMService(FakeEngine(per_step=1, step_s=0.001), cancel_poll_s=0.0005)
    svc.start()
    try:
        channels = []
        for wave in range(6):
            batch = [TritonLikeChannel(violations) for _ in range(16)]
            for i, ch in enumerate(batch):
                svc.submit(ch, inputs(max_tokens=1 + (i + wave) % 4, stream=bool(i % 2)))
            channels += batch
        assert all(ch.done.wait(10) for ch in channels)
        time.sleep(0.05)  # a few more polls over whatever is still listed
    finally:
        svc.close()
    assert violations == []
    assert all(sum(final for _, final, *_ in ch.sent) == 1 for ch in channels)
