"""Invariants of the verify-length policies in dspark.engine.scheduler."""
from __future__ import annotations

import pytest
import torch

from dspark.engine.scheduler import (
    SCHEDULERS,
    Algorithm1Scheduler,
    AsyncScheduler,
    FixedLength,
    NoSlowdownScheduler,
    StaticThreshold,
    UnknownSchedulerError,
    expected_throughput,
    first_draft_survival,
    guarded_schedule_prefix,
    make_scheduler,
    step_time,
    top_capacity_lens,
    walk_draft_bound,
)
from dspark.engine.sps import SpsTable
from dspark.plugins.reference import prefix_survival, schedule_prefix

K = 7


def _sps(n: int, slope: float) -> torch.Tensor:
    """Steps/s for batch tokens 0..n with step time 1 + slope * B."""
    b = torch.arange(n + 1, dtype=torch.float64)
    return 1.0 / (1.0 + slope * b)


def _random_case(seed: int, R: int = 6) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    conf = torch.rand(R, K, generator=g) ** 0.3  # mostly confident, some low
    conf[conf < 0.15] = 0.0  # some hard zeros
    cap = torch.randint(0, K + 1, (R,), generator=g)
    return conf, cap


def _policies(n: int):
    sps = _sps(n, 0.05)
    return [FixedLength(), FixedLength(3), StaticThreshold(0.5), Algorithm1Scheduler(sps), NoSlowdownScheduler(sps),
            AsyncScheduler(sps)]


@pytest.mark.parametrize("seed", range(8))
def test_every_policy_returns_int64_lengths_between_zero_and_cap(seed):
    conf, cap = _random_case(seed)
    for policy in _policies(n=conf.shape[0] * (K + 1)):
        for _ in range(3):  # async: sync steps then async steps
            lens = policy(conf, cap)
            assert lens.dtype == torch.int64 and lens.shape == cap.shape, policy.name
            assert bool((lens >= 0).all() and (lens <= cap).all()), f"{policy.name}: lens {lens} outside [0, {cap}]"


def test_policies_without_max_lens_cap_at_K():
    conf = torch.full((3, K), 0.99)
    for policy in _policies(n=3 * (K + 1)):
        assert bool((policy(conf) <= K).all()), policy.name


def test_fixed_length_verifies_exactly_min_of_k_and_cap():
    conf = torch.rand(4, K)
    cap = torch.tensor([0, 2, 5, 7])
    assert FixedLength()(conf, cap).tolist() == [0, 2, 5, 7], "FixedLength() verifies every available draft"
    assert FixedLength(3)(conf, cap).tolist() == [0, 2, 3, 3], "FixedLength(3) verifies min(3, cap)"
    assert FixedLength(3)(conf).tolist() == [3, 3, 3, 3]


def test_static_threshold_verifies_while_cumulative_confidence_reaches_threshold():
    conf = torch.tensor([[0.9, 0.9, 0.9, 0.9, 0.9, 0.9, 0.9],   # a = .9 .81 .729 .656 .59 .53 .478
                         [0.4, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0],   # a = .4 ...
                         [1.0, 1.0, 0.5, 1.0, 1.0, 1.0, 1.0]])  # a = 1 1 .5 .5 ...
    assert StaticThreshold(0.6)(conf).tolist() == [4, 0, 2]
    assert StaticThreshold(0.5)(conf).tolist() == [6, 0, 7], "a == threshold is still verified"
    assert StaticThreshold(0.5)(conf, torch.tensor([2, 7, 3])).tolist() == [2, 0, 3]


@pytest.mark.parametrize("seed", range(5))
def test_threshold_and_async_lengths_are_prefixes_of_the_survival_order(seed):
    """Every verified draft has a >= every unverified candidate of the same request (prefix rule)."""
    conf, cap = _random_case(seed)
    a = prefix_survival(conf)
    for lens in (StaticThreshold(0.4)(conf, cap), top_capacity_lens(conf, cap, capacity=9)):
        for r in range(conf.shape[0]):
            l = int(lens[r])
            assert bool((a[r, :l] > 0).all()), "never verify a draft with zero survival probability"
            if 0 < l < int(cap[r]):
                assert float(a[r, l - 1]) >= float(a[r, l])


@pytest.mark.parametrize("seed", range(5))
def test_algorithm1_policy_equals_reference_schedule_prefix_with_early_stop(seed):
    conf, cap = _random_case(seed)
    sps = _sps(conf.shape[0] * (K + 1), 0.08)
    want = schedule_prefix(conf, sps, cap, early_stop=True)
    assert torch.equal(Algorithm1Scheduler(sps)(conf, cap), want)


@pytest.mark.parametrize("seed", range(10))
def test_algorithm1_is_never_worse_than_verifying_nothing(seed):
    conf, cap = _random_case(seed)
    sps = _sps(conf.shape[0] * (K + 1), [0.01, 0.1, 1.0][seed % 3])
    lens = Algorithm1Scheduler(sps)(conf, cap)
    zero = torch.zeros_like(lens)
    assert expected_throughput(conf, lens, sps) >= expected_throughput(conf, zero, sps) - 1e-12


@pytest.mark.parametrize("seed", range(6))
def test_algorithm1_beats_fixed_full_verification_on_high_load_tables(seed):
    g = torch.Generator().manual_seed(seed)
    R = 32
    conf = torch.rand(R, K, generator=g) * 0.5 + 0.45  # mediocre drafts
    sps = _sps(R * (K + 1), 0.2)  # each extra token costs a lot
    ours = expected_throughput(conf, Algorithm1Scheduler(sps)(conf), sps)
    fixed = expected_throughput(conf, FixedLength()(conf), sps)
    assert ours > fixed, f"Algorithm 1 ({ours:.4g}) should beat verifying all K drafts ({fixed:.4g}) under load"


def test_algorithm1_verifies_more_drafts_when_verification_is_cheap():
    conf = torch.full((16, K), 0.8)
    n = 16 * (K + 1)
    cheap = Algorithm1Scheduler(_sps(n, 0.001))(conf).sum()
    costly = Algorithm1Scheduler(_sps(n, 0.5))(conf).sum()
    assert cheap > costly


def test_algorithm1_takes_an_sps_table_object():
    table = SpsTable(tokens=[1, 16, 64], steps_per_s=[100.0, 90.0, 40.0])
    conf = torch.full((4, K), 0.9)
    lens = Algorithm1Scheduler(table)(conf)
    assert torch.equal(lens, schedule_prefix(conf, table.as_tensor(), early_stop=True))
    policy = AsyncScheduler(table, max_tokens=128)
    assert policy.sps(4).shape == (129,), "max_tokens extends the table past its last profiled count"
    with pytest.raises(ValueError, match="max_tokens"):
        Algorithm1Scheduler(table.as_tensor(), max_tokens=128)


def test_make_scheduler_error_lists_the_known_names():
    with pytest.raises(UnknownSchedulerError) as err:
        make_scheduler("dynamic-magic")
    msg = str(err.value)
    assert "dynamic-magic" in msg
    for name in SCHEDULERS:
        assert name in msg, f"error should list {name!r}: {msg}"


def test_make_scheduler_builds_each_registered_policy():
    sps = _sps(64, 0.05)
    kwargs = {"fixed": {"k": 2}, "threshold": {"threshold": 0.5},
              "algorithm1": {"sps": sps}, "no_slowdown": {"sps": sps}, "async": {"sps": sps}}
    assert set(kwargs) == set(SCHEDULERS), "update this test when the registry changes"
    for name, kw in kwargs.items():
        policy = make_scheduler(name, **kw)
        assert policy.name == name and isinstance(policy, SCHEDULERS[name])
    with pytest.raises(TypeError, match="algorithm1"):
        make_scheduler("algorithm1")  # missing sps: the message names the policy


def test_registry_is_read_only():
    with pytest.raises(TypeError):
        SCHEDULERS["mine"] = FixedLength  # type: ignore[index]


def test_async_first_two_steps_fall_back_to_synchronous_algorithm1():
    conf, cap = _random_case(3)
    sps = _sps(conf.shape[0] * (K + 1), 0.05)
    policy = AsyncScheduler(sps)
    for step in range(2):
        lens = policy(conf, cap)
        assert policy.last_mode == "sync" and policy.last_capacity is None, f"step {step}"
        assert torch.equal(lens, schedule_prefix(conf, sps, cap, early_stop=True))
    policy(conf, cap)
    assert policy.last_mode == "async"


def test_async_capacity_comes_from_confidences_two_steps_old():
    R = 8
    sps = _sps(R * (K + 1), 0.02)
    high = torch.full((R, K), 0.97)
    low = torch.full((R, K), 0.05)
    cap_from = {name: int(schedule_prefix(c, sps, early_stop=False).sum()) for name, c in
                (("high", high), ("low", low))}
    assert cap_from["high"] > cap_from["low"], "test setup: the two histories must give different capacities"
    policy = AsyncScheduler(sps)
    current = torch.rand(R, K, generator=torch.Generator().manual_seed(0)) * 0.5 + 0.5
    policy(high)  # step 0
    policy(low)  # step 1
    lens = policy(current)  # step 2: capacity from step 0
    assert policy.last_capacity == cap_from["high"]
    assert int(lens.sum()) == min(cap_from["high"], R * K)
    assert torch.equal(lens, top_capacity_lens(current, torch.full((R,), K), cap_from["high"]))
    policy(current)  # step 3: capacity from step 1
    assert policy.last_capacity == cap_from["low"]


def test_async_capacity_does_not_depend_on_this_steps_confidences():
    R = 6
    sps = _sps(R * (K + 1), 0.05)
    g = torch.Generator().manual_seed(1)
    history = [torch.rand(R, K, generator=g) for _ in range(2)]
    caps = []
    for current in (torch.full((R, K), 0.99), torch.full((R, K), 0.01), torch.rand(R, K, generator=g)):
        policy = AsyncScheduler(sps)
        for h in history:
            policy(h)
        policy(current)
        caps.append(policy.last_capacity)
    assert caps[0] == caps[1] == caps[2], f"capacity must be fixed before this step's drafts exist: {caps}"


def test_async_admits_the_most_confident_current_candidates():
    conf = torch.tensor([[0.9, 0.9, 0.9], [0.99, 0.2, 0.9], [0.5, 0.5, 0.5]])
    # a: r0 .9 .81 .729 | r1 .99 .198 .178 | r2 .5 .25 .125 -> top 4: (1,0) (0,0) (0,1) (0,2)
    lens = top_capacity_lens(conf, torch.full((3,), 3), capacity=4)
    assert lens.tolist() == [3, 1, 0]
    assert top_capacity_lens(conf, torch.tensor([1, 3, 3]), capacity=4).tolist() == [1, 1, 2]
    assert top_capacity_lens(conf, torch.full((3,), 3), capacity=100).tolist() == [3, 3, 3]
    assert top_capacity_lens(torch.zeros(2, 3), torch.full((2,), 3), capacity=5).tolist() == [0, 0], \
        "candidates with zero survival probability are never admitted"


def test_async_history_is_per_request_id_across_joins_and_leaves():
    sps = _sps(8 * (K + 1), 0.02)
    high, low = torch.full((1, K), 0.97), torch.full((1, K), 0.05)
    policy = AsyncScheduler(sps)
    policy(torch.cat([high, low]), request_ids=["a", "b"])  # step 0
    policy(torch.cat([low, low]), request_ids=["b", "c"])  # step 1: a left, c joined
    # step 2: b and a newcomer d; b's step-0 row was low, d has no step-0 row -> mean of known (low)
    policy(torch.cat([high, high]), request_ids=["d", "b"])
    want = int(schedule_prefix(torch.cat([low, low]), sps, early_stop=False).sum())
    assert policy.last_mode == "async" and policy.last_capacity == want
    # step 3: nobody present was there at step 1 -> synchronous fallback
    policy(torch.cat([high]), request_ids=["e"])
    assert policy.last_mode == "sync"


def test_async_reset_forgets_history():
    sps = _sps(4 * (K + 1), 0.05)
    policy = AsyncScheduler(sps)
    conf = torch.full((4, K), 0.8)
    for _ in range(3):
        policy(conf)
    assert policy.last_mode == "async"
    policy.reset()
    policy(conf)
    assert policy.last_mode == "sync" and policy.last_capacity is None


def test_async_refuses_duplicate_request_ids_and_lag_zero():
    policy = AsyncScheduler(_sps(16, 0.05))
    with pytest.raises(ValueError, match="unique"):
        policy(torch.full((2, K), 0.5), request_ids=["x", "x"])
    with pytest.raises(ValueError, match="lag"):
        AsyncScheduler(_sps(16, 0.05), lag=0)


def test_policies_check_shapes():
    policy = FixedLength()
    with pytest.raises(ValueError, match=r"\[R, K\]"):
        policy(torch.rand(K))
    with pytest.raises(ValueError, match="max_lens"):
        policy(torch.rand(3, K), torch.tensor([1, 2]))
    with pytest.raises(ValueError, match="request_ids"):
        policy(torch.rand(3, K), request_ids=["a"])


def test_async_history_ignores_rows_held_at_cap_zero():
    """Rows that did not draft (cap 0, zero confidence) on an old step stand in as the mean of
    the rows that did, instead of counting as requests whose drafts never survive."""
    R = 4
    sps = _sps(R * (K + 1), 0.02)
    high = torch.full((R, K), 0.97)
    probe = high.clone()
    probe[2:] = 0.0
    cap = torch.tensor([K, K, 0, 0])
    policy = AsyncScheduler(sps)
    ids = ["a", "b", "c", "d"]
    policy(probe, cap, ids)  # step 0: c and d did not draft
    policy(high, None, ids)
    policy(high, None, ids)  # step 2: capacity from step 0
    assert policy.last_capacity == int(schedule_prefix(high, sps, early_stop=False).sum())


# -- the no-slowdown guard -----------------------------------------------------------------------

def _step(policy: NoSlowdownScheduler, conf: torch.Tensor, cap: torch.Tensor, ids: list[str],
          g: torch.Generator) -> torch.Tensor:
    """One scheduled step whose drafts survive with their confidences; reports the outcome."""
    lens = policy(conf, cap, ids)
    survive = torch.rand(conf.shape, generator=g, dtype=torch.float64) < conf.double()
    run = torch.cumprod(survive.long(), dim=1)
    accepted = [int(run[i, : int(lens[i])].sum()) for i in range(len(ids))]
    policy.observe(ids, accepted)
    return lens


@pytest.mark.parametrize("seed", range(6))
def test_no_slowdown_equals_algorithm1_for_one_fresh_request(seed):
    conf, cap = _random_case(seed, R=1)
    sps = _sps(16, 0.05)
    assert torch.equal(NoSlowdownScheduler(sps)(conf, cap), Algorithm1Scheduler(sps)(conf, cap))


@pytest.mark.parametrize("seed", range(6))
def test_no_slowdown_is_algorithm1_when_drafts_cost_nothing(seed):
    conf, cap = _random_case(seed, R=6)
    flat = torch.ones(6 * (K + 1) + 1, dtype=torch.float64)
    flat[0] = 0.0
    ns, a1 = NoSlowdownScheduler(flat, max_debt=0.0), Algorithm1Scheduler(flat)
    g = torch.Generator().manual_seed(seed)
    for _ in range(5):  # credits never fall: t(B) - t(R) = 0
        ids = [f"r{i}" for i in range(6)]
        assert torch.equal(_step(ns, conf, cap, ids, g), a1(conf, cap))


def test_no_slowdown_admits_a_prefix_of_algorithm1s_choice_and_keeps_waiting_rows_within_the_debt():
    """Rows without drafts (cap 0) pay for every step's extra time and gain nothing: none of
    them falls further behind than ``max_debt`` steps, and drafting stops once one is there."""
    R, sps, g = 8, _sps(8 * (K + 1), 0.05), torch.Generator().manual_seed(1)
    ns, a1 = NoSlowdownScheduler(sps, max_debt=2.0), Algorithm1Scheduler(sps)
    ids = [f"r{i}" for i in range(R)]
    cap = torch.tensor([K if i % 2 == 0 else 0 for i in range(R)])
    bound = -2.0 * step_time(ns.sps(R), R) - 1e-12
    verified = []
    for _ in range(40):
        conf = torch.rand(R, K, generator=g, dtype=torch.float64) ** 0.3
        want = a1(conf, cap)
        lens = _step(ns, conf, cap, ids, g)
        assert bool((lens <= want).all())
        verified.append(int(lens.sum()))
        waiting = [ns.credit[rid] for rid, c in zip(ids, cap.tolist()) if c == 0]
        assert min(waiting) >= bound
    assert verified[0] > 0 and verified[-1] == 0, f"the guard should bind once the debt is spent: {verified}"


def test_no_slowdown_credit_is_the_time_accepted_drafts_saved_minus_the_extra_step_time():
    sps = _sps(64, 0.05)
    ns = NoSlowdownScheduler(sps, max_debt=10.0)
    conf = torch.tensor([[0.9, 0.9, 0.9], [0.0, 0.0, 0.0]], dtype=torch.float64)
    lens = ns(conf, None, ["a", "b"])
    n = int(lens.sum())
    assert n > 0 and int(lens[1]) == 0
    ns.observe(["a", "b"], [2, 0])
    extra = step_time(ns.sps(2), 2 + n) - step_time(ns.sps(2), 2)
    assert ns.credit["a"] == pytest.approx(2 * step_time(ns.sps(2), 2) - extra)
    assert ns.credit["b"] == pytest.approx(-extra)
    ns(conf[:1], None, ["a"])  # b has left: its credit goes
    assert set(ns.credit) == {"a"}


def test_no_slowdown_observe_must_match_the_step_it_reports():
    ns = NoSlowdownScheduler(_sps(32, 0.05))
    ns.observe(["x"], [1])  # nothing scheduled yet: nothing to settle
    assert ns.credit == {}
    ns(torch.full((2, 3), 0.8), None, ["a", "b"])
    with pytest.raises(ValueError, match="same request_ids"):
        ns.observe(["b", "a"], [0, 0])
    with pytest.raises(ValueError, match="max_debt"):
        NoSlowdownScheduler(_sps(8, 0.05), max_debt=-1.0)


def test_guarded_walk_stops_where_a_row_runs_out_of_slack():
    sps = _sps(64, 0.05)
    conf = torch.tensor([[0.95, 0.95, 0.95], [0.0, 0.0, 0.0]], dtype=torch.float64)
    cap = torch.tensor([3, 0])
    t2 = step_time(sps, 2)
    for tokens in range(4):  # slack for exactly ``tokens`` drafts of the other row
        slack = torch.tensor([0.0, step_time(sps, 2 + tokens) - t2 + 1e-12], dtype=torch.float64)
        lens = guarded_schedule_prefix(conf, sps, cap, slack)
        assert lens.tolist() == [tokens, 0], tokens


def _rows_priced_table() -> SpsTable:
    """A 1-D curve on which drafts look nearly free, and a by-rows grid on which, beside 4 one-token
    rows, a draft costs as much as a row (a compute-bound batch)."""
    table = SpsTable(tokens=[1, 8, 64], steps_per_s=[10.0, 9.9, 9.0])
    table.set_rows_grid([1, 4], [[0, 4, 8], [0, 4, 16]],
                        [[10.0, 9.9, 9.8], [1 / 0.4, 1 / 0.8, 1 / 2.0]])
    return table


@pytest.mark.parametrize("name", ["algorithm1", "no_slowdown", "async"])
def test_hardware_aware_policies_price_a_step_by_its_rows(name):
    table = _rows_priced_table()
    flat = SpsTable(tokens=table.tokens, steps_per_s=table.steps_per_s)  # the same 1-D curve, no grid
    conf = torch.full((4, K), 0.9)
    by_rows = make_scheduler(name, sps=table, max_tokens=64)
    assert int(by_rows(conf).sum()) == 0, "beside 4 rows a 0.9 draft costs more than the 0.9 row it saves"
    assert int(make_scheduler(name, sps=flat, max_tokens=64)(conf).sum()) > 0, "the 1-D curve prices drafts free"
    one = make_scheduler(name, sps=table, max_tokens=64)
    assert int(one(conf[:1]).sum()) > 0, "one row: the 1-row curve, on which drafts are cheap"


@pytest.mark.parametrize("name", ["algorithm1", "no_slowdown", "async"])
def test_hardware_aware_policies_price_prompt_tokens_in_the_same_pass(name):
    """1 ms per token up to 4 (the rows), a 3 ms jump at the first draft, then 0.1 ms per token: beside
    the 4 rows alone a 0.5 draft costs 3 ms for half a 1 ms token; beside 100 prompt tokens the pass
    is on its gentle slope, and the same draft costs 0.1 ms."""
    ms = [0.0] + [float(b) if b <= 4 else 7.0 + 0.1 * (b - 5) for b in range(1, 201)]
    sps = torch.tensor([0.0] + [1000.0 / t for t in ms[1:]], dtype=torch.float64)
    conf = torch.full((4, K), 0.5)
    policy = make_scheduler(name, sps=sps)
    assert int(policy(conf).sum()) == 0
    assert int(make_scheduler(name, sps=sps)(conf, prompt_tokens=100).sum()) > 0
    linear = torch.tensor([0.0] + [1000.0 / b for b in range(1, 201)], dtype=torch.float64)
    assert int(make_scheduler(name, sps=linear)(conf, prompt_tokens=100).sum()) == 0, \
        "on a straight line a prompt beside the rows changes no draft's price"
    with pytest.raises(ValueError, match="prompt_tokens"):
        policy(conf, prompt_tokens=-1)


def test_expected_throughput_reads_the_curve_of_the_batch_rows():
    table = _rows_priced_table()
    conf = torch.full((4, K), 0.9)
    lens = torch.tensor([1, 1, 1, 1])
    assert expected_throughput(conf, lens, table) == pytest.approx((4 + 4 * 0.9) / 0.8)


def _bumpy_sps(seed: int, n: int = 160) -> torch.Tensor:
    """Steps/s of a step time that grows by random increments, flat stretches and cliffs included."""
    g = torch.Generator().manual_seed(seed)
    inc = torch.rand(n, generator=g, dtype=torch.float64) * 0.08
    inc[torch.rand(n, generator=g) < 0.3] = 0.0  # tokens that cost nothing
    inc[torch.rand(n, generator=g) < 0.05] += 0.5  # cliffs
    t = torch.cat([torch.zeros(1, dtype=torch.float64), 1.0 + torch.cumsum(inc, 0)])
    sps = 1.0 / t
    sps[0] = 0.0
    return sps


@pytest.mark.parametrize("seed", range(12))
def test_the_draft_budget_bounds_what_the_walks_admit_whatever_the_confidences(seed):
    """``walk_draft_bound`` looks at the table only; Algorithm 1 and the no-slowdown walk never
    verify more drafts than it allows, on bumpy tables and confidences up to exactly 1."""
    g = torch.Generator().manual_seed(100 + seed)
    sps = _bumpy_sps(seed)
    for R in (1, 2, 5, 12, 30):
        bound = walk_draft_bound(sps, R, limit=R * K)
        assert 0 <= bound <= R * K
        for trial in range(4):
            conf = torch.rand(R, K, generator=g, dtype=torch.float64) ** 0.2
            if trial == 0:
                conf = torch.ones(R, K, dtype=torch.float64)
            assert int(schedule_prefix(conf, sps).sum()) <= bound
            slack = torch.full((R,), 1e9, dtype=torch.float64)
            assert int(guarded_schedule_prefix(conf, sps, torch.full((R,), K), slack).sum()) <= bound


def test_the_first_draft_survival_is_the_walks_own_admission_threshold():
    """Step time 1 s up to 4 tokens, then 0.1 s more per token: beside 4 rows the 5th token costs a
    tenth, so a draft must survive with probability above 4 x 0.1 = 0.4; Algorithm 1 verifies one of
    0.41 and none of 0.39. Beside 1 row a token is free (survival 0); beside 20 rows one costs
    0.1 / 2.6 of a step, 20 x that: above 0.77."""
    ms = [1.0 if b <= 4 else 1.0 + 0.1 * (b - 4) for b in range(0, 61)]
    sps = torch.tensor([0.0] + [1.0 / t for t in ms[1:]], dtype=torch.float64)
    assert first_draft_survival(sps, 4) == pytest.approx(0.4)
    assert first_draft_survival(sps, 1) == 0.0
    assert first_draft_survival(sps, 20) == pytest.approx(20 * 0.1 / 2.6)
    for conf, verified in ((0.41, 1), (0.39, 0)):
        c = torch.zeros(4, K, dtype=torch.float64)
        c[0, 0] = conf
        assert int(schedule_prefix(c, sps).sum()) == verified
    with pytest.raises(ValueError, match="rows"):
        first_draft_survival(sps, 60)


def test_dspark_profile_says_per_row_count_where_a_draft_can_pay():
    from dspark.cli import break_even_lines

    table = SpsTable(tokens=[1, 8, 64], steps_per_s=[1.0, 0.5, 0.1], device="cpu", engine="toy",
                     draft_requests=[1, 64], draft_seconds=[0.25, 0.25])
    table.set_rows_grid([1, 4], [[0, 1, 2], [0, 1, 2]], [[1.0, 1.0, 0.5], [1.0, 0.5, 0.4]])
    lines = break_even_lines(table)
    assert lines[1] == "rows R=  1  above 0%; drafter pass 25% of a plain step"  # the 2nd token is free
    assert lines[2].startswith("rows R=  4  none")  # beside 4 rows a draft doubles the step
    plain = SpsTable(tokens=[1, 8, 64], steps_per_s=[1.0, 0.5, 0.1], device="cpu", engine="toy")
    assert break_even_lines(plain)[1] == "rows R=  1  above 14%"  # 1-D curve: a token adds 1/7 of a step


def test_the_draft_budget_is_reached_where_drafts_are_free_up_to_a_cliff():
    """4 rows: the 5th and 6th tokens cost nothing, the 7th a whole step. Certain drafts fill the
    two free places and the budget says two; beside 100 prompt tokens the prompt has paid the cliff
    and a draft costs what the gentle slope adds, so the budget runs on."""
    ms = [0.0] + [1.0 if b <= 6 else 2.0 + 0.01 * b for b in range(1, 201)]
    sps = torch.tensor([0.0] + [1.0 / t for t in ms[1:]], dtype=torch.float64)
    assert walk_draft_bound(sps, 4) == 2
    assert int(schedule_prefix(torch.ones(4, K, dtype=torch.float64), sps).sum()) == 2
    assert walk_draft_bound(sps, 4, limit=1) == 1
    policy = Algorithm1Scheduler(sps)
    assert policy.draft_budget(4) == 2 and NoSlowdownScheduler(sps).draft_budget(4) == 2
    assert policy.draft_budget(4, prompt_tokens=100) > 100
    assert FixedLength().draft_budget(4) is None and StaticThreshold(0.5).draft_budget(4) is None
    assert AsyncScheduler(sps).draft_budget(4) is None, "its capacity search is global: no walk bound"
