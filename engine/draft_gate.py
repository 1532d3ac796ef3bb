"""Cost-aware drafting: skip the drafter on steps where speculation cannot pay.

The prefix scheduler chooses how many drafts to verify once they exist, when the drafter
pass is already paid for. Where a verify token is expensive (a CPU, or a GPU at a large
batch) and the drafter is weak, even verifying nothing loses, because every step still pays
the drafter. Before each step the gate compares the expected output rate of

    a drafted step:  R + A tokens  in  draft_time(R) + step_time(R + V)
    a plain step:    R tokens      in  step_time(R)

for R running requests, where A and V are moving averages of the drafts accepted and
verified per request on past drafted steps. They are realised counts, so the gate also
works for drafters without a confidence head. When the plain step wins, the engine runs a
target-only step. Every ``probe``-th skipped step drafts anyway, so the averages follow
the text (a response can turn predictable halfway through). A probe drafts only
``probe_rows`` of the running requests (the engine picks those that drafted least
recently): the averages are per request, so a few rows measure them, and at a large batch
a full drafter pass costs more than a plain step. The probe interval doubles after each
probe that does not pay, up to ``max_probe``, which keeps the cost of probing for a
drafter that never pays under a few percent.

Lossless: the decision uses only committed history (past accepted counts), never the
drafts it gates, so skipping is a verify length of 0 chosen before the drafts exist.
Deterministic: the inputs are the SPS table and token counts, not wall time, so a seeded
run repeats exactly.
"""
from __future__ import annotations

from .sps import SpsTable

__all__ = ["DraftGate"]


class DraftGate:
    """Per-step decision: run the drafter or a plain target step (see the module docstring)."""

    def __init__(self, table: SpsTable, max_tokens: int, min_probe: int = 4, max_probe: int = 64,
                 smoothing: float = 0.25, probe_rows: int = 4) -> None:
        if not table.has_draft_cost:
            raise ValueError(f"{table.source}: the SPS table has no drafter cost; profile it with the drafter "
                             "(dspark profile --checkpoint ...)")
        if not 1 <= min_probe <= max_probe:
            raise ValueError(f"need 1 <= min_probe <= max_probe, got {min_probe}, {max_probe}")
        if probe_rows < 1:
            raise ValueError(f"probe_rows must be >= 1, got {probe_rows}")
        if not 0.0 < smoothing <= 1.0:
            raise ValueError(f"smoothing must be in (0, 1], got {smoothing}")
        self.table = table
        self.step_seconds = (1.0 / table.as_tensor(max(max_tokens, table.tokens[-1]))).tolist()
        self.min_probe, self.max_probe, self.smoothing = min_probe, max_probe, smoothing
        self.probe_rows = probe_rows
        self.reset()

    def reset(self) -> None:
        self.accepted: float | None = None  # moving average, accepted drafts per request per drafted step
        self.verified: float | None = None  # moving average, verified drafts per request per drafted step
        self.probe = self.min_probe
        self.skipped = 0
        self.drafted_steps = 0
        self.skipped_steps = 0

    def _step_time(self, tokens: int) -> float:
        last = len(self.step_seconds) - 1
        if tokens <= last:
            return self.step_seconds[tokens]
        return self.step_seconds[last] * tokens / last  # compute bound beyond the table

    def expected_gain(self, requests: int) -> float:
        """Predicted output rate of a drafted step over a plain one at ``requests`` rows (>=1: draft)."""
        if self.accepted is None:
            return float("inf")
        t_plain = self._step_time(requests)
        t_drafted = self.table.draft_time(requests) + self._step_time(requests + round(requests * self.verified))
        return (1.0 + self.accepted) * t_plain / t_drafted

    def rows_to_draft(self, requests: int) -> int:
        """How many of ``requests`` rows draft this step: all when drafting is predicted to pay,
        none when it is not, ``min(probe_rows, requests)`` on a probe step."""
        if self.expected_gain(requests) >= 1.0:  # ties draft: nothing to lose
            self.skipped = 0
            self.probe = self.min_probe
            rows = requests
        else:
            self.skipped += 1
            rows = 0
            if self.skipped >= self.probe:  # a probe: if it does not pay either, wait longer for the next one
                self.skipped = 0
                self.probe = min(2 * self.probe, self.max_probe)
                rows = min(self.probe_rows, requests)
        if rows:
            self.drafted_steps += 1
        else:
            self.skipped_steps += 1
        return rows

    def observe(self, requests: int, verified: int, accepted: int) -> None:
        """Record a drafted step: totals over its ``requests`` rows."""
        if requests <= 0:
            return
        a, v = accepted / requests, verified / requests
        if self.accepted is None:
            self.accepted, self.verified = a, v
        else:
            s = self.smoothing
            self.accepted += s * (a - self.accepted)
            self.verified += s * (v - self.verified)
