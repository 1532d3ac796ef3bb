"""Verify-length policies: how many of each request's drafts the target checks this step.

Every policy maps per-position confidences ``c [R, K]`` (calibrated, see ``engine/sts.py``)
and per-request caps ``max_lens [R]`` to verify lengths ``l [R]`` in ``0..max_lens``; the
verify step (``dspark.plugins.reference.verify``) then ignores drafts past ``l``.
``a[r, j] = prod_{i<=j} c[r, i]`` is the probability that drafts ``0..j`` all survive.

- ``FixedLength(k)``: always ``min(k, cap)``; the classic fixed-block baseline.
- ``StaticThreshold(t)``: verify draft j while ``a[r, j] >= t``; ignores system load.
- ``Algorithm1Scheduler(sps)``: the report's Algorithm 1. Candidates (r, j) are visited in
  descending ``a``; each adds one batch token and ``a[r, j]`` expected accepts; the walk
  keeps going while ``Theta = tau * SPS(B)`` strictly improves and stops at the first
  candidate that does not improve it.
- ``NoSlowdownScheduler(sps)``: Algorithm 1 under a per-request guard: drafts are verified
  only while no request of the batch falls more than a step behind decoding without them.
- ``AsyncScheduler(sps)``: the report's production variant (Section 5.2). The total number
  of draft tokens to verify (the capacity, the K of a top-K) is found by an unconstrained
  global search of Theta over the confidences of two steps earlier; this step's candidates
  are ranked by their current ``a`` and the top ``capacity`` are admitted.

``draft_budget(rows, prompt_tokens)``: the most drafts a policy can verify in a step of that
many rows whatever the confidences (``walk_draft_bound`` for the two walks, None for the
others); the engine proposes nothing in a step whose budget is 0 (docs/runtime.md).

Registry names (``make_scheduler``): ``fixed``, ``threshold``, ``algorithm1``, ``no_slowdown``, ``async``.

Why these are lossless. Drafts are ``x_0..x_{K-1}``. Speculative sampling stays exact when
the decision to verify draft ``x_j`` is made without looking at ``x_j`` itself (it may
depend on the drafts before it: that is just a drafter that chooses its length as it goes). With the Markov confidence head,
``c_{j+1}`` depends on the sampled ``x_j``, so ``a[r, j+1]`` carries information about ``x_j``.

* Algorithm 1's early stop: the decision about (r, j) is taken when the walk reaches it,
  from the candidates already visited, which all have ``a >= a[r, j]``; with ties broken
  by lower j, request r's own visited candidates are positions before j, and ``a[r, j]``
  itself depends only on ``x_0..x_{j-1}``. Other requests' drafts are independent of
  request r's. Stopping at the first non-improvement means no later candidate such as
  ``a[r, j+1]`` can change whether ``x_j`` is verified. Searching on for a later maximum
  (a retrospective global search) lets ``x_j`` decide its own admission and biases the
  output (report Appendix A; ``tests/semantic/test_scheduler_lossless.py`` shows it).
* Async top-K: the capacity is a function of confidences from two steps ago, fixed before
  this step's drafts exist, so the global search cannot see them. Draft (r, j) is admitted
  iff fewer than ``capacity`` candidates rank above it; those are other requests'
  candidates and request r's positions before j, never r's later ones, so again ``x_j``
  plays no part in its own admission.
* Fixed and threshold policies decide draft j from ``a[r, j]`` alone.

Prices. The hardware-aware policies price a step of R rows and B tokens from the SPS table's
curve for R rows where the table has a by-rows grid (``StepCosts``, ``engine/sps.py``): a draft
beside 64 one-token rows costs what it costs there, not what the 1-D curve's rows of K+1
tokens say. A table without the grid, or a dense array, prices every R alike.

Requests join and leave between steps, so ``AsyncScheduler`` keeps its history per request
id (``request_ids``). A request with no confidences from two steps ago is assumed to look
like the mean of those that have them; when no current request has any (the first two
steps, or a fresh batch), the step falls back to synchronous Algorithm 1.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from collections import deque
from types import MappingProxyType
from typing import Any, Mapping, Sequence

import torch

from dspark.engine.sps import SpsLike, StepCosts, dense_sps
from dspark.plugins import ops
from dspark.plugins.reference import prefix_survival, ranked_candidates, schedule_prefix, verify_lens_of

__all__ = [
    "VerifyLengthPolicy",
    "FixedLength",
    "StaticThreshold",
    "Algorithm1Scheduler",
    "AsyncScheduler",
    "NoSlowdownScheduler",
    "guarded_schedule_prefix",
    "step_time",
    "walk_draft_bound",
    "first_draft_survival",
    "UnknownSchedulerError",
    "SCHEDULERS",
    "SPS_SCHEDULERS",
    "make_scheduler",
    "expected_throughput",
    "top_capacity_lens",
]

def _check(confidence: torch.Tensor, max_lens: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """-> (confidence [R, K], cap [R] int64 on CPU clamped to [0, K])."""
    if confidence.dim() != 2:
        raise ValueError(f"confidence must be [R, K], got shape {tuple(confidence.shape)}")
    R, K = confidence.shape
    if max_lens is None:
        return confidence, torch.full((R,), K, dtype=torch.long)
    max_lens = torch.as_tensor(max_lens)
    if max_lens.shape != (R,):
        raise ValueError(f"max_lens must be [R]={R}, got shape {tuple(max_lens.shape)}")
    if bool((max_lens < 0).any()):
        raise ValueError("max_lens must be >= 0")
    return confidence, max_lens.long().cpu().clamp(0, K)


def expected_throughput(confidence: torch.Tensor, lens: torch.Tensor, sps: SpsLike) -> float:
    """``Theta = tau * SPS(B)`` of a choice of verify lengths; 0 when B exceeds the table."""
    a = prefix_survival(confidence).cpu()
    R, K = a.shape
    sps_t = StepCosts(sps)(R)
    lens = torch.as_tensor(lens).long().cpu()
    mask = torch.arange(K).unsqueeze(0) < lens.unsqueeze(1)
    tau = R + float((a * mask).sum())
    batch = R + int(lens.sum())
    return tau * float(sps_t[batch]) if batch < sps_t.numel() else 0.0


def top_capacity_lens(confidence: torch.Tensor, cap: torch.Tensor, capacity: int) -> torch.Tensor:
    """Admit the ``capacity`` candidates with the highest ``a`` (ties: lower r, then lower j).

    Only candidates with ``a > 0`` and ``j < cap[r]`` compete. ``a`` never grows along j and
    ties go to lower j, so the admitted set is a prefix of every request. -> [R] int64 (CPU).
    """
    a = prefix_survival(confidence).cpu()
    R, K = a.shape
    flat = a.flatten()
    r_idx = torch.arange(R).repeat_interleave(K)
    j_idx = torch.arange(K).repeat(R)
    valid = (flat > 0) & (j_idx < cap[r_idx])
    order = torch.sort(-flat[valid], stable=True).indices[: max(int(capacity), 0)]
    lens = torch.zeros(R, dtype=torch.long)
    lens.index_add_(0, r_idx[valid][order], torch.ones(order.numel(), dtype=torch.long))
    return lens


class VerifyLengthPolicy(ABC):
    """``policy(confidence [R, K], max_lens [R] | None, request_ids) -> verify_lens [R] int64``.

    Output is on ``confidence``'s device, each entry in ``0..min(K, max_lens[r])``.
    ``request_ids`` (one str per row) matters only to stateful policies.
    """

    name: str = ""

    def __call__(self, confidence: torch.Tensor, max_lens: torch.Tensor | None = None,
                 request_ids: Sequence[str] | None = None, prompt_tokens: int = 0) -> torch.Tensor:
        """``prompt_tokens``: prompt tokens that ride in the same target pass (fused prefill); the
        hardware-aware policies price the step with them (``StepCosts``), the others ignore them."""
        confidence, cap = _check(confidence, max_lens)
        if request_ids is not None and len(request_ids) != confidence.shape[0]:
            raise ValueError(f"request_ids has {len(request_ids)} entries for {confidence.shape[0]} rows")
        if prompt_tokens < 0:
            raise ValueError(f"prompt_tokens must be >= 0, got {prompt_tokens}")
        lens = self._lens(confidence, cap, request_ids, prompt_tokens)
        return lens.to(device=confidence.device, dtype=torch.long)

    @abstractmethod
    def _lens(self, confidence: torch.Tensor, cap: torch.Tensor,
              request_ids: Sequence[str] | None, prompt_tokens: int = 0) -> torch.Tensor:
        """Checked inputs -> verify lengths [R]."""

    def draft_budget(self, rows: int, prompt_tokens: int = 0, limit: int | None = None) -> int | None:
        """The most drafts this policy can verify in a step of ``rows`` rows (and ``prompt_tokens``
        fused prompt tokens), whatever the drafts' confidences; None where it has no such bound
        (the load-blind policies, the async capacity search). The engine drafts nothing in a step
        whose budget is 0 and tells the drafting gates the budget of the others. ``limit``: the
        most drafts the step could hold (rows times K), where the search stops."""
        return None

    def reset(self) -> None:
        """Forget any state (e.g. between benchmark runs). Stateless policies do nothing."""

    def observe(self, request_ids: Sequence[str], accepted: Sequence[int]) -> None:
        """The outcome of the step just scheduled: accepted drafts per row. Most policies ignore it."""


class FixedLength(VerifyLengthPolicy):
    """Always verify ``min(k, K, max_lens[r])`` drafts (``k=None``: all K)."""

    name = "fixed"

    def __init__(self, k: int | None = None) -> None:
        if k is not None and k < 0:
            raise ValueError(f"k must be >= 0, got {k}")
        self.k = k

    def _lens(self, confidence, cap, request_ids, prompt_tokens=0):
        return cap if self.k is None else cap.clamp(max=self.k)


class StaticThreshold(VerifyLengthPolicy):
    """Verify draft j while the cumulative confidence ``a[r, j] >= threshold`` (load-blind)."""

    name = "threshold"

    def __init__(self, threshold: float) -> None:
        if not 0.0 <= threshold <= 1.0:
            raise ValueError(f"threshold must be in [0, 1], got {threshold}")
        self.threshold = float(threshold)

    def _lens(self, confidence, cap, request_ids, prompt_tokens=0):
        a = prefix_survival(confidence).cpu()
        keep = a >= self.threshold  # a prefix along j, since a never grows
        n = torch.cumprod(keep.long(), dim=-1).sum(-1)
        return torch.minimum(n, cap)


class Algorithm1Scheduler(VerifyLengthPolicy):
    """Report Algorithm 1 with its early stop (synchronous): maximise ``tau * SPS(B)``.

    Runs ``dspark.plugins.ops.schedule_prefix``: the CUDA kernel for CUDA tensors, the
    reference (``dspark.plugins.reference.schedule_prefix``) otherwise.
    """

    name = "algorithm1"

    def __init__(self, sps: SpsLike, max_tokens: int | None = None) -> None:
        self.sps = StepCosts(sps, max_tokens)

    def _lens(self, confidence, cap, request_ids, prompt_tokens=0):
        device = confidence.device
        sps = self.sps(confidence.shape[0], prompt_tokens)
        return ops.schedule_prefix(confidence, sps.to(device), cap.to(device), early_stop=True)

    def draft_budget(self, rows: int, prompt_tokens: int = 0, limit: int | None = None) -> int | None:
        return _cached_walk_bound(self, rows, prompt_tokens, limit)


def _cached_walk_bound(policy: VerifyLengthPolicy, rows: int, prompt_tokens: int, limit: int | None) -> int:
    """``walk_draft_bound`` of ``policy.sps`` for (rows, prompt_tokens, limit), remembered on the
    policy: the engine asks every step, and a step's price array costs more than the answer."""
    memo = policy.__dict__.setdefault("_budgets", {})
    key = (rows, prompt_tokens, limit)
    if key not in memo:
        if len(memo) >= 4096:  # prompt chunk sizes vary: keep the memo bounded
            memo.clear()
        memo[key] = walk_draft_bound(policy.sps(rows, prompt_tokens), rows, limit)
    return memo[key]


def walk_draft_bound(sps: torch.Tensor, rows: int, limit: int | None = None) -> int:
    """The most candidates Algorithm 1's walk with its early stop can admit beside ``rows`` rows
    under the dense steps/s array ``sps``, whatever their confidences (at most ``limit``).

    Admitting a candidate of survival ``a`` at batch B + 1 needs ``(tau + a) SPS(B + 1) > tau
    SPS(B)``, i.e. ``1 + a / tau > t(B + 1) / t(B)`` (``t = 1 / SPS``). As ``a <= 1`` and
    ``tau >= rows``, no candidate passes a count where ``t(B + 1) / t(B) >= 1 + 1 / rows``, and
    the walk stops at the first that does not pass. On a table where the 65th token beside 64
    one-token rows costs nothing and the 66th as much as a token, that is one draft, so a step
    needs one proposal, not 64. A function of the table and the row count only, so it is
    fixed before any draft exists and cannot bias the output."""
    n = sps.numel() - 1
    cap = n - rows if limit is None else min(int(limit), n - rows)
    if rows < 1 or cap <= 0:
        return 0
    t = 1.0 / sps[rows: rows + cap + 1].double()
    # a hair of slack on the bound: float rounding may admit what exact arithmetic would not
    blocked = (t[1:] / t[:-1] >= (1.0 + 1.0 / rows) * (1.0 + 1e-9)).nonzero()
    return int(blocked[0]) if blocked.numel() else cap


def first_draft_survival(sps: torch.Tensor, rows: int) -> float:
    """The least survival probability at which Algorithm 1 verifies one draft beside ``rows``
    one-token rows, under the dense steps/s array ``sps``: ``rows * (t(rows + 1) / t(rows) - 1)``
    (``walk_draft_bound``'s test for the first candidate, ``t = 1 / SPS``). Above 1 no draft can
    pay there. A function of the table alone: what a user reads to see where speculation can pay
    on a host (``dspark profile`` prints it per row count), before any drafter is trained."""
    if rows < 1 or rows + 1 >= sps.numel():
        raise ValueError(f"rows must lie in [1, {sps.numel() - 2}] for this table, got {rows}")
    return rows * (step_time(sps, rows + 1) / step_time(sps, rows) - 1.0)


def step_time(sps: torch.Tensor, tokens: int) -> float:
    """Seconds of a step of ``tokens`` batch tokens by the SPS table (inf past its end)."""
    rate = float(sps[tokens]) if tokens < sps.numel() else 0.0
    return 1.0 / rate if rate > 0 else float("inf")


def guarded_schedule_prefix(confidence: torch.Tensor, sps: torch.Tensor, cap: torch.Tensor,
                            slack: torch.Tensor) -> torch.Tensor:
    """Algorithm 1 with the early stop, under a per-row time budget -> verify lengths [R].

    The walk visits Algorithm 1's candidates in its order and admits one while ``Theta``
    strictly improves *and* the step's extra time over a step of the R rows alone, ``t(B) -
    t(R)`` (``t = step_time``), stays within every row's ``slack[r]`` (seconds), each row's
    slack growing by ``a * t(R)`` for each of its own admitted drafts (the time they are
    expected to save it). It stops at the first candidate failing either test, so, as in
    Algorithm 1, the decision about draft j rests on confidences that do not depend on ``x_j``.
    """
    R = confidence.shape[0]
    sps = sps.double().cpu()
    lens = torch.zeros(R, dtype=torch.long)
    if R == 0 or R >= sps.numel():
        return lens
    sps_l = sps.tolist()
    times = [1.0 / x if x > 0 else float("inf") for x in sps_l]  # step_time of every count, once
    t_rows = times[R]
    cand_r, cand_q = ranked_candidates(confidence, cap)
    room = slack.double().tolist()
    floor = min(room)
    batch, tau = R, float(R)
    best = tau * sps_l[batch]
    admitted = 0
    for i, (r, ar) in enumerate(zip(cand_r, cand_q)):
        batch += 1
        if batch >= len(sps_l):
            break
        tau += ar
        theta = tau * sps_l[batch]
        was_floor = room[r] == floor
        room[r] += ar * t_rows
        if was_floor:
            floor = min(room)
        if not (theta > best and times[batch] - t_rows <= floor):
            break
        best = theta
        admitted = i + 1
    return verify_lens_of(cand_r, admitted, R)


class NoSlowdownScheduler(VerifyLengthPolicy):
    """Algorithm 1 under a per-request guard: no request falls more than ``max_debt`` steps
    behind where it would be decoding without drafts.

    In a batch, one request's drafts lengthen every request's step. Algorithm 1 maximises the
    batch's tokens per second, so a request whose drafts rarely survive (chat beside math) can
    decode slower than without speculation while the batch as a whole decodes faster. This
    policy keeps a credit per request id, in seconds against plain one-token steps of the same
    rows: each verified step adds ``accepted * t(R)`` (the steps its accepted drafts saved it)
    and subtracts ``t(B) - t(R)`` (what the step's drafts, anyone's, cost it), both from the
    SPS table, so the same history gives the same lengths. A step verifies drafts only within
    every request's credit plus ``max_debt * t(R)`` (``guarded_schedule_prefix``): a request
    that gains spends its gains on the others' drafts, one that does not stops them once it is
    ``max_debt`` steps behind, until it gains. With one request the guard binds only after its
    own drafts lost, and then for the next ``max_debt`` steps' worth. Lossless as Algorithm 1
    is (module docstring): the guard is a stop test on the same visited candidates, and the
    credits come from rounds already verified.

    The engine reports each step's accepted drafts with ``observe``; ``request_ids`` key the
    credits, and a request absent from a step has left (its credit is dropped).
    """

    name = "no_slowdown"

    def __init__(self, sps: SpsLike, max_debt: float = 1.0, max_tokens: int | None = None) -> None:
        if max_debt < 0:
            raise ValueError(f"max_debt must be >= 0 (steps), got {max_debt}")
        self.sps = StepCosts(sps, max_tokens)
        self.max_debt = float(max_debt)
        self.credit: dict[str, float] = {}
        self._pending: tuple[list[str], float, float] | None = None  # ids, t(R), t(B) - t(R) of the last step

    def reset(self) -> None:
        self.credit.clear()
        self._pending = None

    def _lens(self, confidence, cap, request_ids, prompt_tokens=0):
        R = confidence.shape[0]
        ids = [str(i) for i in range(R)] if request_ids is None else [str(r) for r in request_ids]
        self.credit = {rid: self.credit.get(rid, 0.0) for rid in ids}
        sps = self.sps(R, prompt_tokens)
        if R == 0 or R >= sps.numel():
            self._pending = None
            return torch.zeros(R, dtype=torch.long)
        t_rows = step_time(sps, R)
        slack = torch.tensor([self.credit[rid] for rid in ids], dtype=torch.float64) + self.max_debt * t_rows
        lens = guarded_schedule_prefix(confidence, sps, cap, slack)
        self._pending = (ids, t_rows, step_time(sps, R + int(lens.sum())) - t_rows)
        return lens

    def draft_budget(self, rows: int, prompt_tokens: int = 0, limit: int | None = None) -> int | None:
        return _cached_walk_bound(self, rows, prompt_tokens, limit)  # its walk admits a subset of Algorithm 1's

    def observe(self, request_ids: Sequence[str], accepted: Sequence[int]) -> None:
        """The last step's accepted drafts per request (the rows of its ``request_ids``)."""
        if self._pending is None:
            return
        ids, t_rows, extra = self._pending
        self._pending = None
        if [str(r) for r in request_ids] != ids:
            raise ValueError("observe() must follow the step it reports, with the same request_ids")
        for rid, n in zip(ids, accepted):
            self.credit[rid] += n * t_rows - extra


class AsyncScheduler(VerifyLengthPolicy):
    """Report Section 5.2: top-``capacity`` admission, capacity from ``lag``-step-old confidences.

    ``last_capacity`` holds the capacity used by the latest call (None when it fell back to
    synchronous Algorithm 1) and ``last_mode`` is ``"async"`` or ``"sync"``.
    """

    name = "async"

    def __init__(self, sps: SpsLike, lag: int = 2, max_tokens: int | None = None) -> None:
        if lag < 1:
            raise ValueError(f"lag must be >= 1 (capacity must not see this step's drafts), got {lag}")
        self.sps = StepCosts(sps, max_tokens)
        self.lag = lag
        self._sync = Algorithm1Scheduler(self.sps)
        # per step, oldest first: (request id -> row, confidences [R, K] float64 on CPU)
        self._history: deque[tuple[dict[str, int], torch.Tensor]] = deque(maxlen=lag)
        self.last_capacity: int | None = None
        self.last_mode: str = ""

    def reset(self) -> None:
        self._history.clear()
        self.last_capacity = None
        self.last_mode = ""

    def capacity_from_history(self, request_ids: Sequence[str], cap: torch.Tensor, K: int,
                              prompt_tokens: int = 0) -> int | None:
        """Capacity for the current batch from the confidences ``lag`` steps back, or None."""
        if len(self._history) < self.lag:
            return None
        old_index, old_rows = self._history[0]
        where = [old_index.get(rid, -1) for rid in request_ids]
        known = [i for i in where if i >= 0]
        if not known:
            return None
        k_old = old_rows.shape[1]  # old rows may have another K: pad with 0 or truncate
        rows = torch.zeros(old_rows.shape[0] + 1, K, dtype=torch.float64)
        rows[:-1, : min(K, k_old)] = old_rows[:, :K]
        rows[-1] = rows[known].mean(0)  # stand-in for requests that were not there
        proxy = rows[torch.tensor(where)]  # index -1 picks the stand-in
        # unconstrained global search: safe here, none of these confidences are this step's
        return int(schedule_prefix(proxy, self.sps(len(request_ids), prompt_tokens), cap, early_stop=False).sum())

    def _lens(self, confidence, cap, request_ids, prompt_tokens=0):
        R, K = confidence.shape
        ids = [str(i) for i in range(R)] if request_ids is None else [str(r) for r in request_ids]
        index = {rid: i for i, rid in enumerate(ids)}
        if len(index) != len(ids):
            raise ValueError("request_ids must be unique within a step")
        capacity = self.capacity_from_history(ids, cap, K, prompt_tokens)
        if capacity is None:
            lens = self._sync._lens(confidence, cap, ids, prompt_tokens).cpu()
            self.last_mode = "sync"
        else:
            lens = top_capacity_lens(confidence, cap, capacity)
            self.last_mode = "async"
        self.last_capacity = capacity
        # only rows that may verify carry confidences worth remembering: a row held at cap 0
        # (it did not draft this step, or has no room) must not read as a hopeless request later
        live = (cap > 0).cpu()
        kept = [rid for rid, ok in zip(ids, live.tolist()) if ok]
        self._history.append(({rid: i for i, rid in enumerate(kept)},
                              confidence.detach().to("cpu", torch.float64)[live].clone()))
        return lens


class UnknownSchedulerError(ValueError):
    """``make_scheduler`` was given a name that is not registered."""


# the policies that read the SPS table (the hardware-aware ones, built with ``sps=``)
SPS_SCHEDULERS = ("algorithm1", "no_slowdown", "async")

SCHEDULERS: Mapping[str, type[VerifyLengthPolicy]] = MappingProxyType({
    cls.name: cls for cls in (FixedLength, StaticThreshold, Algorithm1Scheduler, NoSlowdownScheduler, AsyncScheduler)
})


def make_scheduler(name: str, **kwargs: Any) -> VerifyLengthPolicy:
    """Build a policy by registry name, e.g. ``make_scheduler("algorithm1", sps=table)``."""
    try:
        cls = SCHEDULERS[name]
    except KeyError:
        raise UnknownSchedulerError(
            f"unknown scheduler {name!r}; known: {', '.join(sorted(SCHEDULERS))}") from None
    try:
        return cls(**kwargs)
    except TypeError as e:
        raise TypeError(f"scheduler {name!r}: {e}") from e
