"""Cost-aware drafting: skip the drafter on steps where speculation cannot pay.

The prefix scheduler chooses how many drafts to verify once they exist, when the drafter
pass is already paid for. Where a verify token is expensive (a CPU, or a GPU at a large
batch) and the drafter is weak, even verifying nothing loses, because every step still pays
the drafter. Before each step the gate compares the expected output rate of

    a drafted step:  R + A tokens  in  draft_time(R) + step_time(R + V)
    a plain step:    R tokens      in  step_time(R)

for R running requests, where A and V estimate the drafts accepted and verified per
request on drafted steps. When only n of a step's B rows are the gate's to draft (the hybrid
engine leaves rows whose suffix proposal already wins to the suffix proposer), the other rows
ride in the same step and wait for the same drafter pass:

    a drafted step:  B + n A tokens  in  draft_time(n) + step_time(B + n V)
    a plain step:    B tokens        in  step_time(B)

so a pass that pays for one request alone can cost a batch more than it gains. ``step_time``
is the SPS table's, for a step of that many rows where the table prices by rows
(``engine/sps.py``). When P prompt tokens of newly admitted requests ride in the same target
pass (fused prefill), the prompt's time is paid either way: the plain step counts as
``step_time(B)`` and the drafted one adds ``step_time(B + n V + P) - step_time(B + P)``, what its
verify tokens add to the longer pass. A and V
come from realised counts, so the gate also works for
drafters without a confidence head, and both are averages over request-steps (rows), not
over steps: a 64-row step says more than a 4-row probe. Old rows fade with a horizon of
``horizon`` rows. A is shrunk towards zero by ``prior_rows`` imaginary rows that accepted
nothing: a few lucky rows (a short probe that hit a predictable stretch) must not switch
the whole batch to drafting, because every wrongly drafted step pays the drafter for
nothing, while a wrongly skipped one only forgoes a small gain.

The first drafted step, before any history, is a probe too: at batch 64 on a 2-core CPU a
whole-batch first draft verifies 512 tokens in a step that costs seven plain ones.

When the plain step wins, the engine runs a target-only step. Every ``probe``-th skipped
step drafts anyway, so the averages follow the text (a response can turn predictable
halfway through). A probe drafts only ``probe_rows`` of the running requests (the engine
picks those that drafted least recently): the averages are per request, so a few rows
measure them, and at a large batch a full drafter pass is a large share of a step. The
probe interval grows ``probe_growth``-fold after each probe that does not pay, up to the
interval at which probing a drafter that never pays costs ``probe_budget`` of the run: a probe's extra time
over a plain step (from the SPS table, in plain steps) divided by the budget, kept within
``[min_probe, max_probe]``. That extra time includes the probed rows' context catch-up
(``catchup_time``): a row the gate has skipped rebuilds its drafter cache from a window of
recent positions before drafting, which at 4 rows can cost as much as the pass itself.
The budget is 0.5% of the run by the table's prices, which a probe can exceed in practice:
the drafter runs on caches the target step just evicted, and a draft for a rejection-sampled
request keeps its distribution over the whole vocabulary, which the greedy pass the table
times does not (a sampled draft judged by the coupled rule races among its likeliest tokens
only and costs about a greedy one). A probe that costs a drafter pass plus a 7-token verify
at batch 1 on a 2-core CPU is worth about 1.4 plain steps and comes every 280 steps.

Lossless: the decision uses only committed history (past accepted counts), never the
drafts it gates, so skipping is a verify length of 0 chosen before the drafts exist.
Deterministic: the inputs are the SPS table and token counts, not wall time, so a seeded
run repeats exactly.
"""
from __future__ import annotations

import math
from typing import Callable, Sequence

from .sps import SpsTable, StepCosts, seconds_at

__all__ = ["DraftGate", "gated_rows", "least_recent"]


class DraftGate:
    """Per-step decision: run the drafter or a plain target step (see the module docstring)."""

    def __init__(self, table: SpsTable, max_tokens: int, min_probe: int = 4, max_probe: int = 1024,
                 horizon: float = 16.0, prior_rows: float = 4.0, probe_rows: int = 4,
                 probe_budget: float = 0.005, probe_growth: float = 2.0,
                 draft_time: Callable[[int], float] | None = None,
                 free_share: float = 0.0, catchup_time: Callable[[int], float] | None = None,
                 row_drafts: int | None = None) -> None:
        """``draft_time(rows)``: seconds of the gated proposer's pass (``Proposer.cost().seconds``);
        default the table's profiled drafter pass. ``catchup_time(rows)``: seconds that ``rows``
        rows which skipped drafting for a while spend catching up their context first
        (``ProposerCost.catchup_seconds``), part of a probe's price; default none. ``free_share``: a pass that costs less than this
        share of a plain step always runs (skipping it could save no more than that, and a cheap
        proposer, such as suffix lookups, whose matches come and go, loses more by a wrong skip).
        ``row_drafts``: the most drafts the gated proposer makes for one row (``could_pay``'s best
        case); None: no bound but the step's budget."""
        if draft_time is None and not table.has_draft_cost:
            raise ValueError(f"{table.source}: the SPS table has no drafter cost; profile it with the drafter "
                             "(dspark profile --checkpoint ...)")
        if not 1 <= min_probe <= max_probe:
            raise ValueError(f"need 1 <= min_probe <= max_probe, got {min_probe}, {max_probe}")
        if probe_rows < 1:
            raise ValueError(f"probe_rows must be >= 1, got {probe_rows}")
        if not horizon > 1.0:
            raise ValueError(f"horizon must be > 1 row, got {horizon}")
        if not prior_rows >= 0.0:
            raise ValueError(f"prior_rows must be >= 0, got {prior_rows}")
        if not 0.0 <= free_share < 1.0:
            raise ValueError(f"free_share must be in [0, 1), got {free_share}")
        if not probe_growth > 1.0:
            raise ValueError(f"probe_growth must be > 1, got {probe_growth}")
        if not 0.0 < probe_budget <= 1.0:
            raise ValueError(f"probe_budget must be in (0, 1], got {probe_budget}")
        if row_drafts is not None and row_drafts < 1:
            raise ValueError(f"row_drafts must be >= 1, got {row_drafts}")
        self.table = table
        self.draft_time = draft_time if draft_time is not None else table.draft_time
        self.catchup_time = catchup_time if catchup_time is not None else (lambda rows: 0.0)
        self._costs = StepCosts(table, max(max_tokens, table.tokens[-1]))
        self._seconds: dict[int, list[float]] = {}  # steps/s by tokens, per row count
        self.min_probe, self.max_probe = min_probe, max_probe
        self.keep_per_row = 1.0 - 1.0 / horizon  # weight left to old rows after each new row
        self.prior_rows = prior_rows
        self.probe_rows = probe_rows
        self.probe_budget = probe_budget
        self.probe_growth = probe_growth
        self.free_share = free_share
        self.row_drafts = row_drafts
        self._could_pay: dict[tuple[int, int, int, int | None], bool] = {}  # by its arguments: asked every step
        self.reset()

    def reset(self) -> None:
        self._verdicts: dict[tuple[int, int, int, int | None], str] = {}  # _verdict's, until the estimates move
        # decayed sums over drafted request-steps: rows, drafts accepted, drafts verified
        self._rows = self._accepted = self._verified = 0.0
        self.probe = self.min_probe
        self.skipped = 0
        self.drafted_steps = 0
        self.skipped_steps = 0
        self.skipping = False  # the latest decision left some of the rows undrafted (a skip or a probe)
        self.futile = False  # the latest decision found that drafting could not pay at all (could_pay)

    @property
    def accepted(self) -> float | None:
        """Estimated drafts accepted per request on a drafted step (shrunk towards 0); None before any."""
        return None if self._rows == 0.0 else self._accepted / (self._rows + self.prior_rows)

    @property
    def verified(self) -> float | None:
        """Estimated drafts verified per request on a drafted step; None before any."""
        return None if self._rows == 0.0 else self._verified / self._rows

    def _step_time(self, rows: int, tokens: int | None = None, prompt_tokens: int = 0) -> float:
        """Seconds of a step of ``rows`` rows and ``tokens`` tokens (default one per row). With
        ``prompt_tokens`` prompt tokens in the same pass, the rows' plain step plus what the tokens
        past the rows add to that longer pass (``beside_prompt_sps``): the prompt's own time is
        paid whatever is drafted."""
        seconds = self._seconds.get(rows)
        if seconds is None:
            seconds = self._seconds[rows] = self._costs(rows).tolist()  # list lookups: this runs every step
        tokens = rows if tokens is None else tokens
        if prompt_tokens <= 0:
            return seconds_at(seconds, tokens)
        return seconds_at(seconds, rows) + seconds_at(seconds, tokens + prompt_tokens) - seconds_at(
            seconds, rows + prompt_tokens)

    def _verified_and_accepted(self, requests: int, budget: int | None) -> tuple[float, float]:
        """Drafts verified and accepted in a step drafting ``requests`` rows: the per-row averages
        times the rows, the verified ones capped at the step's ``budget`` (the scheduler verifies
        no more, ``VerifyLengthPolicy.draft_budget``), the accepted ones scaled down with them."""
        verified, accepted = requests * (self.verified or 0.0), requests * (self.accepted or 0.0)
        if budget is not None and verified > budget:
            accepted *= budget / verified
            verified = float(budget)
        return verified, accepted

    def expected_gain(self, requests: int, batch_rows: int | None = None, prompt_tokens: int = 0,
                      budget: int | None = None) -> float:
        """Predicted output rate of a step that drafts ``requests`` rows over a plain one (>=1: draft),
        in a step of ``batch_rows`` rows (default: those rows alone) and ``prompt_tokens`` prompt tokens
        that verifies at most ``budget`` drafts (None: no bound)."""
        if self.accepted is None:
            return float("inf")
        batch = _step_rows(requests, batch_rows)
        verified, accepted = self._verified_and_accepted(requests, budget)
        t_plain = self._step_time(batch, prompt_tokens=prompt_tokens)
        t_drafted = self.draft_time(requests) + self._step_time(batch, batch + round(verified), prompt_tokens)
        return (batch + accepted) / batch * t_plain / t_drafted

    def probe_cost(self, requests: int, rows: int, batch_rows: int | None = None, budget: int | None = None) -> float:
        """Predicted extra time of a probe drafting ``rows`` of ``requests`` in a step of ``batch_rows``
        rows (default ``requests``), in plain steps: the rows' context catch-up, the drafter pass
        and the verify tokens it adds, at most ``budget`` (its accepted tokens are not counted)."""
        batch = _step_rows(requests, batch_rows)
        t_plain = self._step_time(batch)
        verified = round(self._verified_and_accepted(rows, budget)[0])
        extra = self.catchup_time(rows) + self.draft_time(rows) + self._step_time(batch, batch + verified) - t_plain
        return extra / t_plain

    def probe_cap(self, requests: int, rows: int, batch_rows: int | None = None, budget: int | None = None) -> int:
        """The longest probe interval needed to keep probing within ``probe_budget`` of the run."""
        needed = math.ceil(self.probe_cost(requests, rows, batch_rows, budget) / self.probe_budget - 1e-9)  # 0.6 / 0.05 is 12
        return max(self.min_probe, min(needed, self.max_probe))

    @property
    def steps_to_probe(self) -> int:
        """Skipped steps left before the next probe, while the gate skips (its probe interval less
        the steps skipped since the last one): how soon a skipped proposer's rows may draft again;
        ``max_probe`` while drafting cannot pay at all (``could_pay``)."""
        return self.max_probe if self.futile else max(0, self.probe - self.skipped)

    def could_pay(self, requests: int, batch_rows: int | None = None, prompt_tokens: int = 0,
                  budget: int | None = None) -> bool:
        """Whether drafting could pay in this step at best: every draft verified is accepted, drafted
        by one of the ``requests`` rows or by all of them (the pass's price per row falls with the
        rows), with ``v`` drafts each, up to ``row_drafts`` per row and ``budget`` in all, for the
        best ``v``. Without either bound, assumed so. Where it cannot (a drafter pass beside a large
        batch on a host where a verified draft costs about a row's token), the gate neither drafts
        nor probes: no acceptance a probe could measure would change the decision."""
        batch = _step_rows(requests, batch_rows)
        return _remembered(self._could_pay, (requests, batch, prompt_tokens, budget),
                           lambda: self._pays_at_best(requests, batch, prompt_tokens, budget))

    def _pays_at_best(self, requests: int, batch: int, prompt_tokens: int, budget: int | None) -> bool:
        """``could_pay`` without the memo. Only the two ends of the row count are tried: where the pass's
        price is concave in the rows and a step's price linear in its drafts (the profiled tables),
        "n rows' drafts pay" is a convex condition in n, so if neither end meets it no count between does."""
        if budget is None and self.row_drafts is None:
            return True
        t_plain = self._step_time(batch, prompt_tokens=prompt_tokens)
        per_row = self.row_drafts if self.row_drafts is not None else budget
        for n in sorted({1, requests}):
            most = n * per_row if budget is None else min(budget, n * per_row)
            draft = self.draft_time(n)
            for total in range(n, most + 1, n):  # v = total / n drafts on each of the n rows
                if (batch + total) / batch * t_plain >= draft + self._step_time(batch, batch + total, prompt_tokens):
                    return True
        return False

    def expects_skipping(self, requests: int) -> bool:
        """Whether the coming step at ``requests`` rows is expected to leave some undrafted, before it
        is decided: the latest decision's answer, and before the first one, whether the first probe
        (drafted with no history) is smaller than the batch. The engine keeps a skipped drafter's
        context to a window from then on (``NeuralProposer.idle``), prompts included."""
        if self.drafted_steps == 0 and self.skipped_steps == 0:
            cheap = self.draft_time(requests) < self.free_share * self._step_time(requests)
            return not cheap and min(self.probe_rows, requests) < requests
        return self.skipping

    def rows_to_draft(self, requests: int, batch_rows: int | None = None, prompt_tokens: int = 0,
                      budget: int | None = None) -> int:
        """How many of ``requests`` rows draft this step, in a step of ``batch_rows`` rows (default
        ``requests``; the others ride along) and ``prompt_tokens`` prompt tokens that verifies at most
        ``budget`` drafts: all when drafting is predicted to pay, none when it is not,
        ``min(probe_rows, requests)`` on a probe step."""
        verdict = self._verdict(requests, batch_rows, prompt_tokens, budget)
        self.futile = False
        if verdict == "cheap":
            rows = requests  # too cheap to gate
        elif verdict == "futile":
            self.skipped, self.futile = 0, True  # no probe either: nothing it measured would change this
            rows = 0
        elif verdict == "unmeasured":  # no history yet: measure with a probe's rows, not the whole batch
            rows = min(self.probe_rows, requests)
        elif verdict == "pays":
            self.skipped = 0
            self.probe = self.min_probe
            rows = requests
        else:
            self.skipped += 1
            rows = 0
            if self.skipped >= self.probe:  # a probe: if it does not pay either, wait longer for the next one
                self.skipped = 0
                rows = min(self.probe_rows, requests)
                grown = math.ceil(self.probe_growth * self.probe)
                self.probe = min(grown, self.probe_cap(requests, rows, batch_rows, budget))
        self.skipping = rows < requests
        if rows:
            self.drafted_steps += 1
        else:
            self.skipped_steps += 1
        return rows

    def _verdict(self, requests: int, batch_rows: int | None, prompt_tokens: int, budget: int | None) -> str:
        """What ``rows_to_draft`` weighs, before its probe countdown: ``cheap`` (a pass under
        ``free_share`` of a plain step), ``futile`` (``could_pay`` says no), ``unmeasured`` (no history
        yet), ``pays`` (``expected_gain`` >= 1; ties draft: nothing to lose) or ``loses``. A function of
        the arguments and the estimates, remembered until ``observe`` moves the estimates: a gate
        that skips is asked the same question every step."""
        batch = _step_rows(requests, batch_rows)

        def weigh() -> str:
            if self.draft_time(requests) < self.free_share * self._step_time(batch, prompt_tokens=prompt_tokens):
                return "cheap"
            if not self.could_pay(requests, batch_rows, prompt_tokens, budget):
                return "futile"
            if self.accepted is None:
                return "unmeasured"
            return "pays" if self.expected_gain(requests, batch_rows, prompt_tokens, budget) >= 1.0 else "loses"
        return _remembered(self._verdicts, (requests, batch, prompt_tokens, budget), weigh)

    def skip_step(self, requests: int, batch_rows: int | None = None, prompt_tokens: int = 0,
                  budget: int | None = None) -> None:
        """A step in which none of the gate's ``requests`` rows could draft (none had context to
        draft from), priced as ``rows_to_draft`` prices one: it counts towards the next probe as a
        skipped decision would, so that the rows a coming probe will draft start keeping context
        (``steps_to_probe``), unless drafting could not pay at all in it (``could_pay``, asked
        again every step: a batch that drains below the budget's bound wakes the drafter); a
        probe that falls due is taken by the next step with rows that can draft."""
        self._skipped_step(futile=not self.could_pay(requests, batch_rows, prompt_tokens, budget))

    def skip_if_futile(self, batch_rows: int, prompt_tokens: int = 0, budget: int | None = None) -> bool:
        """Whether drafting could not pay at all in a step of ``batch_rows`` rows (``could_pay``); if
        so the step is recorded as a skipped one, as ``rows_to_draft`` would record it, so that the
        caller need not look at any row's proposal or context."""
        if self.could_pay(batch_rows, batch_rows, prompt_tokens, budget):
            return False
        self._skipped_step(futile=True)
        return True

    def _skipped_step(self, futile: bool) -> None:
        """Record a step that drafted none of the gate's rows outside ``rows_to_draft``: a futile one
        resets the probe countdown, any other counts towards the next probe."""
        self.futile = futile
        self.skipped = 0 if futile else min(self.skipped + 1, self.probe)
        self.skipped_steps += 1
        self.skipping = True

    def observe(self, requests: int, verified: int, accepted: int) -> None:
        """Record a drafted step: totals over its ``requests`` rows."""
        if requests <= 0:
            return
        self._verdicts.clear()  # they weighed the old estimates
        keep = self.keep_per_row ** requests
        self._rows = keep * self._rows + requests
        self._accepted = keep * self._accepted + accepted
        self._verified = keep * self._verified + verified


def _remembered(memo: dict, key: tuple, compute: Callable[[], object]):
    """``memo[key]``, computed by ``compute()`` on a miss. The memo is cleared when it holds 4096 keys:
    the keys carry a step's prompt tokens, and prompt chunk sizes vary."""
    if key not in memo:
        if len(memo) >= 4096:
            memo.clear()
        memo[key] = compute()
    return memo[key]


def _step_rows(requests: int, batch_rows: int | None) -> int:
    """Rows in a step where ``requests`` rows are the gate's to draft: ``batch_rows``, or those rows alone."""
    return max(batch_rows or requests, requests)


def gated_rows(gate: DraftGate | None, rows: list[int], last_drafted: Sequence[int],
               batch_rows: int | None = None, prompt_tokens: int = 0, budget: int | None = None) -> list[int]:
    """The rows of ``rows`` (of a step of ``batch_rows`` rows, default ``len(rows)``, with
    ``prompt_tokens`` prompt tokens, verifying at most ``budget`` drafts) that draft this step: every
    one without a gate, else as many as ``gate.rows_to_draft`` allows, those that drafted least
    recently (``last_drafted[i]``, an engine round) first, ties by row; in row order."""
    if not rows or gate is None:
        return rows
    n = gate.rows_to_draft(len(rows), batch_rows, prompt_tokens, budget)
    if n == len(rows):
        return rows
    if n == 0:  # a skipped step: nothing to pick
        return []
    return sorted(least_recent(rows, last_drafted, n))


def least_recent(rows: Sequence[int], last_drafted: Sequence[int], n: int) -> list[int]:
    """The ``n`` rows of ``rows`` that drafted least recently (``last_drafted[i]``), ties by their order
    in ``rows``: the rows a probe drafts, in the order it picks them."""
    return sorted(rows, key=lambda i: last_drafted[i])[:n]
