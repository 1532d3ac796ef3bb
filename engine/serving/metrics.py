"""Custom Prometheus metrics of the LLM model, served on Triton's metrics port.

``ServingMetrics`` takes a family factory with the shape of the python backend's
``pb_utils.MetricFamily(name, description, kind)`` (families hand out ``Metric(labels,
buckets=...)`` objects with ``increment`` / ``set`` / ``observe``), so the same code runs
against Triton and against ``InMemoryFamily`` in unit tests.

Per-round statistics (verify length, accepted tokens per draft position) come from the
differences between consecutive updates of a request; they are exact when the engine
reports every verify round (one update per request per step), and rounds merged into one
update are counted in the totals but not attributed to a position.
"""
from __future__ import annotations

import threading
from typing import Callable

COUNTER, GAUGE, HISTOGRAM = "counter", "gauge", "histogram"
VERIFY_LEN_BUCKETS = [float(x) for x in range(0, 17)]
ACCEPT_LEN_BUCKETS = [1.0, 1.5, 2.0, 2.5, 3.0, 3.5, 4.0, 5.0, 6.0, 7.0, 8.0]
BATCH_BUCKETS = [1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 64.0, 128.0, 256.0]
MAX_POSITION = 16

FamilyFactory = Callable[[str, str, str], object]

# name -> (kind, description, extra label or None, buckets)
METRICS = {
    "dspark_requests_total": (COUNTER, "Finished requests by finish reason (length, stop, cancelled, error, rejected)", "reason", None),
    "dspark_output_tokens_total": (COUNTER, "Tokens generated", None, None),
    "dspark_draft_rounds_total": (COUNTER, "Verify rounds (one draft block each) over all requests", None, None),
    "dspark_draft_tokens_total": (COUNTER, "Draft tokens sent to verification", None, None),
    "dspark_accepted_tokens_total": (COUNTER, "Draft tokens accepted (bonus tokens not counted)", None, None),
    "dspark_accepted_tokens_by_position_total": (COUNTER, "Rounds whose draft at this position (1-based) was accepted", "position", None),
    "dspark_verify_len": (HISTOGRAM, "Draft tokens verified per round", None, VERIFY_LEN_BUCKETS),
    "dspark_request_accept_len": (HISTOGRAM, "accept_len (tokens per verify round) of each finished request", None, ACCEPT_LEN_BUCKETS),
    "dspark_inflight_requests": (GAUGE, "Requests submitted to the engine and not finished", None, None),
    "dspark_batch_size": (HISTOGRAM, "In-flight requests, sampled while the engine is busy", None, BATCH_BUCKETS),
    # the engine's rounds by the proposer that drafted them ("none": rounds without drafts);
    # accept_len of a proposer = (accepted + rounds) / rounds over any window of these counters
    "dspark_proposer_rounds_total": (COUNTER, "Verify rounds by the proposer that drafted them", "proposer", None),
    "dspark_proposer_draft_tokens_total": (COUNTER, "Draft tokens verified, by proposer", "proposer", None),
    "dspark_proposer_accepted_tokens_total": (COUNTER, "Draft tokens accepted, by proposer", "proposer", None),
    # where the engine's time goes (EngineStats.seconds): ms per step by phase over any window
    "dspark_engine_seconds_total": (COUNTER, "Engine host seconds by phase (step: whole steps; prefill, neural, suffix, verify: parts of them)", "phase", None),
    "dspark_engine_steps_total": (COUNTER, "Engine steps", None, None),
    "dspark_engine_decode_steps_total": (COUNTER, "Engine steps that verified a decode batch", None, None),
}
PROPOSER_COUNTERS = (("dspark_proposer_rounds_total", "rounds"), ("dspark_proposer_draft_tokens_total", "drafted"),
                     ("dspark_proposer_accepted_tokens_total", "accepted"))


class ServingMetrics:
    def __init__(self, make_family: FamilyFactory, labels: dict[str, str]):
        self.labels = dict(labels)
        self._families = {name: make_family(name, desc, kind) for name, (kind, desc, _, _) in METRICS.items()}
        self._metrics: dict[tuple[str, str | None], object] = {}
        self._lock = threading.Lock()
        self._proposer_seen: dict[str, dict[str, int]] = {}  # proposer -> totals already counted
        self._engine_seen: dict[tuple[str, str | None], float] = {}  # (metric, phase) -> total already counted

    def _metric(self, name: str, extra: str | None = None):
        key = (name, extra)
        m = self._metrics.get(key)
        if m is None:
            with self._lock:
                m = self._metrics.get(key)
                if m is None:
                    _, _, label, buckets = METRICS[name]
                    labels = dict(self.labels)
                    if label is not None:
                        labels[label] = str(extra)
                    family = self._families[name]
                    m = family.Metric(labels=labels, buckets=buckets) if buckets else family.Metric(labels=labels)
                    self._metrics[key] = m
        return m

    def progress(self, d_steps: int, d_drafts: int, d_accepted: int, d_tokens: int) -> None:
        """One update of one request: the differences since its previous update."""
        if d_tokens > 0:
            self._metric("dspark_output_tokens_total").increment(d_tokens)
        if d_steps <= 0:
            return
        self._metric("dspark_draft_rounds_total").increment(d_steps)
        if d_drafts > 0:
            self._metric("dspark_draft_tokens_total").increment(d_drafts)
        if d_accepted > 0:
            self._metric("dspark_accepted_tokens_total").increment(d_accepted)
        if d_steps == 1:
            self._metric("dspark_verify_len").observe(float(d_drafts))
            for pos in range(1, min(d_accepted, MAX_POSITION) + 1):
                self._metric("dspark_accepted_tokens_by_position_total", str(pos)).increment(1)

    def finished(self, reason: str, accept_len: float | None) -> None:
        self._metric("dspark_requests_total", reason).increment(1)
        if accept_len is not None:
            self._metric("dspark_request_accept_len").observe(float(accept_len))

    def inflight(self, n: int) -> None:
        self._metric("dspark_inflight_requests").set(float(n))

    def batch_sample(self, n: int) -> None:
        if n > 0:
            self._metric("dspark_batch_size").observe(float(n))

    def proposer_totals(self, by_proposer: dict) -> None:
        """The engine's running totals by proposer (``EngineStats.by_proposer``: objects with
        ``rounds``, ``drafted``, ``accepted``): the counters advance by what is new since the last call."""
        seen = self._proposer_seen
        for name, st in list(by_proposer.items()):
            last = seen.get(name, {})
            for metric, field in PROPOSER_COUNTERS:
                now = int(getattr(st, field))
                if now > last.get(field, 0):
                    self._metric(metric, name).increment(now - last.get(field, 0))
            seen[name] = {field: int(getattr(st, field)) for _, field in PROPOSER_COUNTERS}


    def engine_totals(self, stats) -> None:
        """The engine's running step counts and phase seconds (an ``EngineStats``): the counters
        advance by what is new since the last call."""
        seen = self._engine_seen
        now = {("dspark_engine_steps_total", None): stats.steps,
               ("dspark_engine_decode_steps_total", None): stats.decode_steps}
        now.update({("dspark_engine_seconds_total", phase): sec for phase, sec in stats.seconds.items()})
        for key, value in now.items():
            if value > seen.get(key, 0):
                self._metric(*key).increment(value - seen.get(key, 0))
                seen[key] = value


class InMemoryFamily:
    """A stand-in for pb_utils.MetricFamily that records values (for tests)."""

    def __init__(self, name: str, description: str, kind: str):
        self.name, self.description, self.kind = name, description, kind
        self.metrics: list[InMemoryMetric] = []

    def Metric(self, labels: dict[str, str], buckets: list[float] | None = None):  # noqa: N802 (pb_utils API)
        if (buckets is not None) != (self.kind == HISTOGRAM):
            raise ValueError(f"{self.name}: buckets are for histograms only")
        m = InMemoryMetric(labels, buckets)
        self.metrics.append(m)
        return m


class InMemoryMetric:
    def __init__(self, labels: dict[str, str], buckets: list[float] | None):
        self.labels, self.buckets = labels, buckets
        self.value = 0.0
        self.observations: list[float] = []

    def increment(self, v: float) -> None:
        self.value += v

    def set(self, v: float) -> None:
        self.value = v

    def observe(self, v: float) -> None:
        self.observations.append(v)
