"""reference.schedule_prefix (report Algorithm 1): properties, edge cases, Appendix A."""
from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from dspark.plugins import ops
from dspark.plugins.reference import TAU_GRID, prefix_survival, schedule_prefix

# Appendix A: R = 1, K = 2, a1 = 0.8, SPS(1) = 1, SPS(2) = 0.5, SPS(3) = 0.45 (index = batch tokens).
APPENDIX_SPS = torch.tensor([0.0, 1.0, 0.5, 0.45], dtype=torch.float64)


@pytest.mark.parametrize("c2", [0.9, 0.0])
def test_appendix_a_early_stop_verifies_nothing_whatever_c2(c2: float) -> None:
    lens = schedule_prefix(torch.tensor([[0.8, c2]]), APPENDIX_SPS)
    assert lens.tolist() == [0], "Theta1 = 0.9 < Theta0 = 1.0: stop before looking at c2"


def test_appendix_a_without_early_stop_the_choice_depends_on_c2() -> None:
    high = schedule_prefix(torch.tensor([[0.8, 0.9]]), APPENDIX_SPS, early_stop=False)
    low = schedule_prefix(torch.tensor([[0.8, 0.0]]), APPENDIX_SPS, early_stop=False)
    assert high.tolist() == [2], "Theta2 = (1 + 0.8 + 0.72) * 0.45 = 1.134 is the global maximum"
    assert low.tolist() == [0], "a2 = 0 is no candidate: max stays Theta0 = 1.0"


# --------------------------------------------------------------------------------------
# Strategies
# --------------------------------------------------------------------------------------
conf_values = st.one_of(st.sampled_from([0.0, 0.25, 0.5, 1.0]), st.floats(0.0, 1.0, width=32))


@st.composite
def batches(draw, max_r: int = 6, max_k: int = 5):
    R = draw(st.integers(1, max_r))
    K = draw(st.integers(1, max_k))
    conf = torch.tensor(draw(st.lists(conf_values, min_size=R * K, max_size=R * K)), dtype=torch.float32).reshape(R, K)
    n_max = draw(st.integers(R, R * (K + 1) + 2))
    # a decreasing-ish profile with noise: the shapes seen on real engines
    vals = draw(st.lists(st.floats(0.05, 1.0), min_size=n_max, max_size=n_max))
    sps = torch.tensor([0.0] + sorted(vals, reverse=draw(st.booleans())), dtype=torch.float64)
    caps = None
    if draw(st.booleans()):
        caps = torch.tensor(draw(st.lists(st.integers(-1, K + 1), min_size=R, max_size=R)))
    return conf, sps, caps


def _order(conf: torch.Tensor, caps: torch.Tensor | None) -> list[tuple[float, int, int]]:
    """Candidates (a, r, j) in the scheduler's visiting order."""
    R, K = conf.shape
    a = prefix_survival(conf)
    cap = [K] * R if caps is None else [min(max(int(c), 0), K) for c in caps]
    cands = [(float(a[r, j]), r, j) for r in range(R) for j in range(K) if a[r, j] > 0 and j < cap[r]]
    return sorted(cands, key=lambda t: (-t[0], t[1], t[2]))


# --------------------------------------------------------------------------------------
# Properties
# --------------------------------------------------------------------------------------
@settings(max_examples=150, deadline=None)
@given(batches())
def test_lengths_respect_caps_and_the_sps_table(batch) -> None:
    conf, sps, caps = batch
    R, K = conf.shape
    lens = schedule_prefix(conf, sps, caps)
    cap = torch.full((R,), K) if caps is None else caps.clamp(0, K)
    assert lens.dtype == torch.int64 and lens.shape == (R,)
    assert ((lens >= 0) & (lens <= cap)).all(), "0 <= l_r <= min(cap_r, K)"
    assert R + int(lens.sum()) <= sps.numel() - 1, "batch tokens B never exceed the profiled table"


@settings(max_examples=150, deadline=None)
@given(batches())
def test_admitted_candidates_are_a_prefix_of_the_global_order(batch) -> None:
    conf, sps, caps = batch
    lens = schedule_prefix(conf, sps, caps)
    order = _order(conf, caps)
    admitted = int(lens.sum())
    chosen = {(r, j) for _, r, j in order[:admitted]}
    expected = {(r, j) for r in range(conf.shape[0]) for j in range(int(lens[r]))}
    assert chosen == expected, "the scheduler admits the first candidates in (-a, r, j) order, per request a prefix"


@settings(max_examples=150, deadline=None)
@given(batches())
def test_early_stop_never_does_worse_than_verifying_nothing(batch) -> None:
    conf, sps, caps = batch
    R = conf.shape[0]
    lens = schedule_prefix(conf, sps, caps)
    a = prefix_survival(conf)
    tau = R + sum(float(a[r, : int(lens[r])].sum()) for r in range(R))
    B = R + int(lens.sum())
    assert tau * float(sps[B]) >= R * float(sps[R]) - 1e-12


@settings(max_examples=100, deadline=None)
@given(batches(), st.integers(-3, 3))
def test_scaling_the_sps_table_by_a_power_of_two_changes_nothing(batch, e: int) -> None:
    conf, sps, caps = batch
    assert torch.equal(schedule_prefix(conf, sps, caps), schedule_prefix(conf, sps * 2.0**e, caps))


@settings(max_examples=100, deadline=None)
@given(batches(), st.data())
def test_a_steeper_sps_curve_never_verifies_more(batch, data) -> None:
    conf, sps, caps = batch
    # multiply SPS(B) by 2^-m(B) with m non-decreasing in B: throughput falls faster with load
    steps = data.draw(st.lists(st.integers(0, 2), min_size=sps.numel(), max_size=sps.numel()))
    m = torch.tensor(steps, dtype=torch.float64).cumsum(0)
    steeper = sps * torch.pow(2.0, -m)
    assert (schedule_prefix(conf, steeper, caps) <= schedule_prefix(conf, sps, caps)).all()


@settings(max_examples=100, deadline=None)
@given(batches())
def test_flat_sps_admits_every_candidate_with_survival_on_the_tau_grid(batch) -> None:
    conf, _, caps = batch
    R, K = conf.shape
    sps = torch.ones(R * (K + 1) + 1, dtype=torch.float64)
    lens = schedule_prefix(conf, sps, caps)
    a = prefix_survival(conf)
    cap = torch.full((R,), K) if caps is None else caps.clamp(0, K)
    expected = [sum(1 for j in range(int(cap[r])) if round(float(a[r, j]) * TAU_GRID) >= 1) for r in range(R)]
    assert lens.tolist() == expected, "flat SPS: Theta improves exactly when tau grows"


@settings(max_examples=100, deadline=None)
@given(batches())
def test_ops_schedule_prefix_on_cpu_is_the_reference(batch) -> None:
    conf, sps, caps = batch
    for early in (True, False):
        assert torch.equal(ops.schedule_prefix(conf, sps, caps, early), schedule_prefix(conf, sps, caps, early))


# --------------------------------------------------------------------------------------
# Edge cases
# --------------------------------------------------------------------------------------
def test_single_request() -> None:
    sps = torch.tensor([0.0, 1.0, 0.9, 0.85, 0.5], dtype=torch.float64)
    # Theta0 = 1; +0.9: 1.9*0.9 = 1.71; +0.72: 2.62*0.85 = 2.227; +0.36: 2.98*0.5 = 1.49 -> stop
    assert schedule_prefix(torch.tensor([[0.9, 0.8, 0.5]]), sps).tolist() == [2]


def test_ties_go_to_the_lower_request_then_the_lower_position() -> None:
    conf = torch.full((3, 2), 0.5)
    # room for exactly one extra token: B = 3 -> 4 improves, 4 -> 5 does not
    sps = torch.tensor([0, 1, 1, 1.0, 1.0, 0.1, 0.1, 0.1], dtype=torch.float64)
    assert schedule_prefix(conf, sps).tolist() == [1, 0, 0]
    sps2 = torch.tensor([0, 1, 1, 1.0, 1.0, 1.0, 1.0, 0.1, 0.1, 0.1], dtype=torch.float64)
    assert schedule_prefix(conf, sps2).tolist() == [1, 1, 1], "all a=0.5 first (by r), then a=0.25"


def test_zero_confidence_ends_the_prefix() -> None:
    conf = torch.tensor([[0.9, 0.0, 1.0], [0.0, 1.0, 1.0]])
    sps = torch.ones(9, dtype=torch.float64)
    assert schedule_prefix(conf, sps).tolist() == [1, 0]


def test_all_ones_confidence() -> None:
    conf = torch.ones(4, 3)
    assert schedule_prefix(conf, torch.ones(17, dtype=torch.float64)).tolist() == [3, 3, 3, 3]
    # throughput drops past 8 batch tokens: 4 extra tokens; all a = 1 tie, so they go in
    # (r, j) order: request 0 takes its whole block first
    sps = torch.tensor([0.0] + [1.0] * 8 + [0.4] * 8, dtype=torch.float64)
    assert schedule_prefix(conf, sps).tolist() == [3, 1, 0, 0]


def test_all_zero_confidence_verifies_nothing() -> None:
    assert schedule_prefix(torch.zeros(3, 4), torch.ones(16, dtype=torch.float64)).tolist() == [0, 0, 0]


def test_batch_larger_than_the_table_verifies_nothing() -> None:
    assert schedule_prefix(torch.ones(5, 2), torch.ones(5, dtype=torch.float64)).tolist() == [0] * 5


def test_tau_is_exact_so_summation_order_does_not_matter() -> None:
    conf = torch.rand(64, 7, generator=torch.Generator().manual_seed(0))
    a = prefix_survival(conf).flatten()
    q = torch.round(a * TAU_GRID) / TAU_GRID
    fwd = math.fsum(q.tolist())
    assert float(q.sum()) == fwd and float(q.flip(0).sum()) == fwd and sum(q.tolist()) == fwd


# --------------------------------------------------------------------------------------
# The kernel's parallel formulation (plugins/csrc/schedule.cuh) equals the sequential loop
# --------------------------------------------------------------------------------------
def parallel_schedule(conf: torch.Tensor, sps: torch.Tensor, caps: torch.Tensor | None, early_stop: bool) -> list[int]:
    """Sort keys ~bits(a) stably, scan tau exactly, compare every Theta_k with Theta_{k-1} at once."""
    import numpy as np

    R, K = conf.shape
    n_max = sps.numel() - 1
    if R == 0 or K == 0 or R > n_max:
        return [0] * R
    a = prefix_survival(conf.cpu()).numpy().reshape(-1)  # float64, flat (r, j) order
    cap = np.full(R, K) if caps is None else np.clip(caps.numpy(), 0, K)
    r_idx, j_idx = np.repeat(np.arange(R), K), np.tile(np.arange(K), R)
    valid = (a > 0) & (j_idx < cap[r_idx])
    key = np.where(valid, ~a.view(np.uint64), np.uint64(2**64 - 1))
    order = np.argsort(key, kind="stable")[: int(valid.sum())]
    q = np.round(a[order] * TAU_GRID) / TAU_GRID
    tau = R + np.cumsum(q)  # exact on the grid, any summation order
    B = R + 1 + np.arange(len(order))
    s = sps.numpy()
    theta = np.where(B <= n_max, tau * s[np.minimum(B, n_max)], -np.inf)
    theta0 = R * s[R]
    if early_stop:
        prev = np.concatenate([[theta0], theta[:-1]])
        fails = np.nonzero(~(theta > prev))[0]
        admitted = int(fails[0]) if len(fails) else len(order)
    else:
        t = np.where(np.isnan(theta), -np.inf, theta)
        admitted = int(np.argmax(t)) + 1 if len(t) and t.max() > theta0 else 0
    lens = [0] * R
    for f in order[:admitted]:
        lens[r_idx[f]] = max(lens[r_idx[f]], int(j_idx[f]) + 1)
    return lens


@settings(max_examples=200, deadline=None)
@given(batches(max_r=8, max_k=6), st.booleans())
def test_the_kernels_parallel_formulation_matches_the_sequential_loop(batch, early: bool) -> None:
    conf, sps, caps = batch
    assert parallel_schedule(conf, sps, caps, early) == schedule_prefix(conf, sps, caps, early).tolist()
