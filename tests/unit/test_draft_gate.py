"""The cost-aware drafting gate: its throughput model, probing, and that the engine stays lossless with it."""
from __future__ import annotations

import pytest
import torch

from dspark.engine.api import SamplingParams
from dspark.engine.draft_gate import DraftGate, gated_rows
from dspark.engine.runtime import NEURAL_PROBE_ROWS, PROBE_CANDIDATES, EngineConfig, SpecEngine
from dspark.engine.sps import SpsTable
from dspark.training.models import build_drafter, drafter_config_for

from ..conftest import make_tiny_target, record_rows, run_to_completion, tiny_run_config


def _table(draft_seconds: float, verify_slope: float = 0.0) -> SpsTable:
    """Step time 1 s at 1 token, growing by ``verify_slope`` s per extra token; flat drafter cost."""
    tokens = [1, 8, 64]
    return SpsTable(tokens=tokens, steps_per_s=[1.0 / (1.0 + verify_slope * (t - 1)) for t in tokens],
                    device="cpu", engine="toy", draft_requests=[1, 64], draft_seconds=[draft_seconds] * 2)


def test_gain_is_the_ratio_of_output_rates_of_a_drafted_and_a_plain_step():
    gate = DraftGate(_table(draft_seconds=0.5, verify_slope=0.1), max_tokens=64, prior_rows=0.0)
    assert gate.expected_gain(1) == float("inf")  # no history yet: draft to learn
    gate.observe(requests=2, verified=8, accepted=4)  # per request: 4 verified, 2 accepted
    # drafted: 1 + 2 tokens in 0.5 + (1 + 0.1 * 4) s; plain: 1 token in 1 s
    assert gate.expected_gain(1) == pytest.approx(3 * 1.0 / (0.5 + 1.4))


def test_rows_drafting_inside_a_larger_step_pay_the_pass_for_the_whole_batch():
    """One row of a 4-row step: the other three wait for its drafter pass and gain nothing from it."""
    gate = DraftGate(_table(draft_seconds=0.2, verify_slope=0.01), max_tokens=64, prior_rows=0.0)
    gate.observe(requests=2, verified=4, accepted=1)  # per request: 2 verified, 0.5 accepted
    alone = 1.5 * 1.0 / (0.2 + 1.02)  # 1 + 0.5 tokens in 0.2 + step(3) s; plain: 1 token in step(1) = 1 s
    assert gate.expected_gain(1) == pytest.approx(alone) and alone > 1.0
    t4, t6 = 1.03, 1.05  # step(4), step(4 + 2)
    in_batch = (4 + 0.5) / 4 * t4 / (0.2 + t6)
    assert gate.expected_gain(1, batch_rows=4) == pytest.approx(in_batch) and in_batch < 1.0
    assert gate.rows_to_draft(1) == 1 and gate.rows_to_draft(1, batch_rows=4) == 0
    assert gated_rows(gate, [2], [0, 0, 0, 0], batch_rows=4) == [] and gated_rows(gate, [2], [0, 0, 0, 0]) == [2]
    assert gate.expected_gain(4, batch_rows=4) == pytest.approx(gate.expected_gain(4))  # the whole batch: as before


def test_beside_a_fused_prompt_verify_tokens_cost_what_they_add_to_the_longer_pass():
    """A step that jumps by 0.6 s at its first draft beside 4 rows but is on a 0.001 s/token slope
    past it: a cheap pass drafting one row does not pay in the rows' own step, and does beside
    40 prompt tokens, whose own time is paid either way (the plain step stays t(4))."""
    table = SpsTable(tokens=[1, 4, 5, 64], steps_per_s=[1.0, 1.0, 1.0 / 1.6, 1.0 / 1.659], device="cpu",
                     engine="toy", draft_requests=[1, 64], draft_seconds=[0.01, 0.01])
    gate = DraftGate(table, max_tokens=64, prior_rows=0.0)
    gate.observe(requests=2, verified=4, accepted=1)  # per request: 2 verified, 0.5 accepted
    t = gate._step_time
    assert t(4, prompt_tokens=40) == pytest.approx(t(4))
    assert t(4, 6, prompt_tokens=40) == pytest.approx(t(4) + t(4, 46) - t(4, 44))
    plain = (4 + 0.5) / 4 * t(4) / (0.01 + t(4, 6))
    beside = (4 + 0.5) / 4 * t(4) / (0.01 + t(4, 6, prompt_tokens=40))
    assert gate.expected_gain(1, batch_rows=4) == pytest.approx(plain) and plain < 1.0
    assert gate.expected_gain(1, batch_rows=4, prompt_tokens=40) == pytest.approx(beside) and beside > 1.0
    assert gate.rows_to_draft(1, batch_rows=4) == 0
    assert gated_rows(gate, [2], [0, 0, 0, 0], batch_rows=4, prompt_tokens=40) == [2]


def test_acceptance_is_shrunk_towards_zero_by_the_prior_rows():
    gate = DraftGate(_table(draft_seconds=0.5, verify_slope=0.1), max_tokens=64, prior_rows=4.0)
    gate.observe(requests=2, verified=8, accepted=4)
    assert gate.accepted == pytest.approx(4 / (2 + 4)) and gate.verified == pytest.approx(4.0)
    assert gate.expected_gain(1) == pytest.approx((1 + 4 / 6) * 1.0 / (0.5 + 1.4))


def test_estimates_weigh_rows_not_steps():
    gate = DraftGate(_table(draft_seconds=0.5), max_tokens=64, horizon=16.0, prior_rows=0.0)
    gate.observe(requests=64, verified=64, accepted=0)  # a full batch: drafting found nothing
    gate.observe(requests=2, verified=8, accepted=8)  # a small probe that got lucky
    keep = (1 - 1 / 16) ** 2
    assert gate.accepted == pytest.approx(8 / (64 * keep + 2))  # the 64 rows still dominate
    gate.observe(requests=64, verified=64, accepted=128)  # a large step replaces old evidence
    assert gate.accepted == pytest.approx(2.0, rel=0.02)


def test_a_lucky_row_does_not_switch_a_batch_to_drafting():
    """One row of a 4-row probe accepting a whole block is not evidence that the batch pays."""
    table = _table(draft_seconds=0.25, verify_slope=0.01)
    gate = DraftGate(table, max_tokens=64)
    gate.observe(requests=16, verified=16, accepted=0)
    gate.observe(requests=4, verified=10, accepted=7)
    assert gate.expected_gain(16) < 1.0
    unshrunk = DraftGate(table, max_tokens=64, prior_rows=0.0, horizon=4.0)  # a short memory, no prior
    unshrunk.observe(requests=16, verified=16, accepted=0)
    unshrunk.observe(requests=4, verified=10, accepted=7)
    assert unshrunk.expected_gain(16) > 1.0


def test_gate_rejects_bad_settings():
    for kw in ({"horizon": 1.0}, {"prior_rows": -1.0}, {"probe_rows": 0}, {"min_probe": 0}, {"probe_budget": 0.0},
               {"probe_budget": 1.5}, {"probe_growth": 1.0}):
        with pytest.raises(ValueError):
            DraftGate(_table(draft_seconds=0.5), max_tokens=64, **kw)


def test_a_drafter_that_never_pays_is_skipped_with_backed_off_probes():
    gate = DraftGate(_table(draft_seconds=0.5), max_tokens=64, min_probe=2, max_probe=8)
    decisions = []
    for _ in range(40):
        d = gate.rows_to_draft(1)
        decisions.append(d)
        assert d in (0, 1)
        if d:
            gate.observe(1, verified=1, accepted=0)
    drafted = [i for i, d in enumerate(decisions) if d]
    assert drafted[0] == 0  # the first step drafts to measure acceptance
    gaps = [b - a for a, b in zip(drafted, drafted[1:])]
    assert gaps[:3] == [2, 4, 8] and all(g == 8 for g in gaps[3:])  # probe interval doubles to the cap
    assert gate.skipped_steps == 40 - len(drafted)


def test_a_faster_growing_interval_probes_a_drafter_that_never_pays_less_often():
    decisions = {}
    for growth in (2.0, 4.0):
        gate = DraftGate(_table(draft_seconds=0.5), max_tokens=64, max_probe=1024, probe_growth=growth)
        drafted = []
        for step in range(253):
            if gate.rows_to_draft(1):
                drafted.append(step)
                gate.observe(1, verified=1, accepted=0)
        decisions[growth] = drafted
    # the first step drafts; then the gaps grow from 4 up to the budget's cap, 0.5 / 0.005 = 100 plain steps
    assert decisions[2.0] == [0, 4, 12, 28, 60, 124, 224]
    assert decisions[4.0] == [0, 4, 20, 84, 184]


def test_the_engine_probes_its_neural_drafter_with_two_rows_a_quadrupling_interval_and_its_budget():
    target = make_tiny_target()
    drafter = build_drafter(drafter_config_for(tiny_run_config("dspark"), target), target)
    table = _table(draft_seconds=0.5)
    eng = SpecEngine(target, drafter, EngineConfig(scheduler="algorithm1", max_batch=8), sps=table)
    assert (eng.gate.probe_rows, eng.gate.probe_growth, eng.gate.probe_budget) == (2, 4.0, 0.005)
    # beside the suffix proposer the neural probes get a fifth of the budget; the suffix gate keeps the
    # defaults: its probes cost host time only
    hybrid = SpecEngine(target, drafter, EngineConfig(scheduler="algorithm1", max_batch=8, proposers="neural+suffix"),
                        sps=table)
    assert (hybrid.gate.probe_rows, hybrid.gate.probe_growth, hybrid.gate.probe_budget) == (2, 4.0, 0.001)
    assert (hybrid.suffix_gate.probe_rows, hybrid.suffix_gate.probe_growth) == (4, 2.0)


def test_the_probe_interval_stops_doubling_where_probing_costs_the_budget():
    # a probe: 0.5 s of drafter + 1 verified token at 0.1 s = 0.6 plain steps of 1 s
    gate = DraftGate(_table(draft_seconds=0.5, verify_slope=0.1), max_tokens=64, min_probe=2, max_probe=1000,
                     probe_budget=0.05)
    assert gate.rows_to_draft(1) == 1
    gate.observe(1, verified=1, accepted=0)
    assert gate.probe_cost(1, 1) == pytest.approx(0.6)
    assert gate.probe_cap(1, 1) == 12  # ceil(0.6 / 0.05)
    drafted = []
    for step in range(200):
        if gate.rows_to_draft(1):
            drafted.append(step)
            gate.observe(1, verified=1, accepted=0)
    gaps = [b - a for a, b in zip(drafted, drafted[1:])]
    assert gaps[:2] == [4, 8] and set(gaps[2:]) == {12}  # the interval doubles to 4 and 8, then stops at 12, not 16
    assert gate.probe_cost(1, 1) / 12 <= 0.05 + 1e-9  # the time spent probing stays within the budget
    # a costlier probe (a larger verify) earns a longer interval; the caps bound it both ways
    gate.observe(1, verified=30, accepted=0)
    assert gate.probe_cap(1, 1) > 12
    assert DraftGate(_table(draft_seconds=50.0), max_tokens=64, max_probe=100).probe_cap(1, 1) == 100
    assert DraftGate(_table(draft_seconds=1e-4), max_tokens=64, min_probe=4).probe_cap(1, 1) == 4


def test_a_probe_is_priced_with_its_rows_context_catch_up():
    # the probe above plus 0.1 s per row to rebuild a skipped row's drafter context: 0.6 + 2 x 0.1 (2 rows)
    plain = DraftGate(_table(draft_seconds=0.5, verify_slope=0.1), max_tokens=64, probe_budget=0.05)
    gate = DraftGate(_table(draft_seconds=0.5, verify_slope=0.1), max_tokens=64, probe_budget=0.05,
                     catchup_time=lambda rows: 0.1 * rows)
    for g in (plain, gate):
        g.observe(2, verified=1, accepted=0)
    assert gate.probe_cost(4, 2) == pytest.approx(plain.probe_cost(4, 2) + 0.2 / 1.3)  # a plain step of 4: 1.3 s
    assert gate.probe_cap(4, 2) > plain.probe_cap(4, 2)  # a dearer probe comes less often


def test_a_probe_drafts_only_a_few_rows_of_a_large_batch():
    gate = DraftGate(_table(draft_seconds=0.5), max_tokens=64, min_probe=2, max_probe=8, probe_rows=3)
    assert gate.rows_to_draft(16) == 3  # no history yet: a probe measures it, not the whole batch
    gate.observe(3, verified=3, accepted=0)
    decisions = [gate.rows_to_draft(16) for _ in range(6)]
    assert decisions == [0, 3, 0, 0, 0, 3]  # probes at intervals 2 then 4, three rows each
    assert gate.rows_to_draft(2) == 0 and gate.probe_rows == 3


def test_steps_with_no_row_to_draft_count_down_to_the_next_probe():
    """``steps_to_probe`` says how soon a skipping gate probes; a step whose rows could not draft
    (``skip_step``) counts as a skipped one, and a probe that falls due in such a step is taken by
    the next step with rows."""
    gate = DraftGate(_table(draft_seconds=0.5), max_tokens=64, min_probe=4, max_probe=64, probe_rows=3)
    assert gate.rows_to_draft(16) == 3
    gate.observe(3, verified=3, accepted=0)
    assert gate.steps_to_probe == 4
    assert gate.rows_to_draft(16) == 0 and gate.steps_to_probe == 3
    for left in (2, 1, 0, 0):  # nothing to draft in these steps: the countdown runs on, and holds at a due probe
        gate.skip_step(16)
        assert gate.steps_to_probe == left and gate.expects_skipping(16)
    assert gate.rows_to_draft(16) == 3  # the due probe, at the first step with rows
    assert gate.steps_to_probe == 8  # and the interval grew


def test_a_pass_that_could_not_pay_even_with_every_verifiable_draft_accepted_is_neither_run_nor_probed():
    """With a step budget of one draft beside 16 rows, a 0.5 s pass cannot pay for one token of a
    1 s step, whatever a probe would find: the gate skips without probing and reports its next
    probe as far away (its rows keep no context); without the budget it probes as before, also
    when the steps that find no row to draft are the ones that see the budget lift."""
    gate = DraftGate(_table(draft_seconds=0.5), max_tokens=64, min_probe=2, max_probe=64, probe_rows=3)
    assert not gate.could_pay(16, budget=1) and gate.could_pay(16) and gate.could_pay(16, budget=16)
    assert [gate.rows_to_draft(16, budget=1) for _ in range(10)] == [0] * 10  # not even the first probe
    assert gate.accepted is None and gate.steps_to_probe == 64 and gate.expects_skipping(16)
    assert gate.rows_to_draft(16) == 3  # no budget: the first probe
    asleep = DraftGate(_table(draft_seconds=0.5), max_tokens=64, min_probe=4, max_probe=64, probe_rows=3)
    assert asleep.rows_to_draft(16, budget=1) == 0 and asleep.steps_to_probe == 64
    asleep.skip_step(16, budget=1)  # its rows keep no context, so later steps ask skip_step, not rows_to_draft
    assert asleep.steps_to_probe == 64
    asleep.skip_step(4)  # the batch drained: drafting could pay again, and the countdown to a probe starts
    assert asleep.steps_to_probe == 3
    cheap = DraftGate(_table(draft_seconds=0.001), max_tokens=64, probe_rows=3)
    assert cheap.could_pay(16, budget=1)  # a cheap pass may pay for one accepted draft


def test_at_best_a_pass_pays_for_every_row_drafting_and_not_where_no_row_count_could():
    """``could_pay``'s best case drafts one row or all of them, ``row_drafts`` each, every draft accepted.
    Beside 16 rows on a table where a verified draft (0.01 s) costs far less than a row's token
    (0.07 s), one row cannot pay for a 0.5 s pass but 16 rows of 7 drafts can, unless the step
    verifies 7 drafts in all. Beside 64 rows where a draft costs more than a row's token, no row
    count pays for the pass: the gate calls such a step futile without looking at a row."""
    gate = DraftGate(_table(draft_seconds=0.5, verify_slope=0.01), max_tokens=512, row_drafts=7)
    assert gate.could_pay(16) and not gate.could_pay(16, budget=7)
    assert not gate.could_pay(1, batch_rows=16)  # one row of the 16: the pass is paid for 7 drafts at most
    dear = _table(draft_seconds=0.5, verify_slope=0.01)
    dear.set_rows_grid([64], [[0, 1, 448]], [[1 / 1.0, 1 / 1.02, 1 / 9.96]])  # a draft 0.02 s, a row's token 1/64 s
    futile = DraftGate(dear, max_tokens=512, row_drafts=7)
    assert not futile.could_pay(64) and not futile.could_pay(64, budget=448)
    assert futile.skip_if_futile(64) and futile.steps_to_probe == futile.max_probe
    assert DraftGate(dear, max_tokens=512).could_pay(64), "with no bound on the drafts it cannot tell: assumed so"
    with pytest.raises(ValueError, match="row_drafts"):
        DraftGate(dear, max_tokens=512, row_drafts=0)


def test_skipping_is_expected_before_the_first_decision_only_where_a_probe_is_part_of_the_batch():
    gate = DraftGate(_table(draft_seconds=0.5), max_tokens=64, probe_rows=3)
    assert not gate.expects_skipping(1) and not gate.expects_skipping(3)  # the first probe drafts them all
    assert gate.expects_skipping(4)
    assert gate.rows_to_draft(2) == 2 and not gate.expects_skipping(16)  # then: the latest decision's answer
    gate.observe(2, verified=2, accepted=0)
    assert gate.rows_to_draft(2) == 0 and gate.expects_skipping(1)
    free = DraftGate(_table(draft_seconds=0.01), max_tokens=64, probe_rows=3, free_share=0.5)
    assert not free.expects_skipping(16)  # a pass too cheap to gate always runs


def test_a_drafter_that_pays_is_always_run_and_one_good_probe_resets_the_interval():
    gate = DraftGate(_table(draft_seconds=0.1), max_tokens=64, min_probe=2, max_probe=8)
    gate.observe(1, verified=4, accepted=3)
    assert all(gate.rows_to_draft(1) for _ in range(10))
    for _ in range(20):  # acceptance collapses: the average falls until skipping starts
        if gate.rows_to_draft(1):
            gate.observe(1, verified=4, accepted=0)
    assert gate.skipped_steps > 0 and gate.probe > 2
    while not gate.rows_to_draft(1):
        pass
    gate.observe(1, verified=4, accepted=40)  # the probe finds a predictable stretch
    assert gate.rows_to_draft(1) and gate.probe == 2


def test_gate_needs_a_table_with_drafter_cost():
    table = SpsTable(tokens=[1, 8], steps_per_s=[2.0, 1.0], device="cpu", engine="toy")
    with pytest.raises(ValueError, match="no drafter cost"):
        DraftGate(table, max_tokens=8)


@pytest.mark.parametrize("draft_seconds, verify_slope", [(0.0, 0.0), (10.0, 0.01)])  # free / ruinous drafting
def test_engine_with_the_gate_stays_token_identical_to_target_only(draft_seconds, verify_slope):
    target = make_tiny_target()
    torch.manual_seed(5)
    drafter = build_drafter(drafter_config_for(tiny_run_config("dspark"), target), target)
    jobs = [(f"r{i}", list(range(7 + i, 20 + 2 * i)), SamplingParams(max_tokens=12 + i)) for i in range(4)]
    base = run_to_completion(SpecEngine(target, None, EngineConfig(mode="target_only", max_batch=4)), jobs)
    engine = SpecEngine(target, drafter, EngineConfig(mode="spec", scheduler="algorithm1", max_batch=4),
                        sps=_table(draft_seconds, verify_slope))
    assert engine.gate is not None
    assert run_to_completion(engine, jobs) == base
    if draft_seconds > 0:
        assert engine.stats["skipped_draft_steps"] > 0
    else:
        assert engine.stats["skipped_draft_steps"] == 0


def test_gate_is_off_for_fixed_blocks_and_for_tables_without_drafter_cost():
    target = make_tiny_target()
    drafter = build_drafter(drafter_config_for(tiny_run_config("dspark"), target), target)
    assert SpecEngine(target, drafter, EngineConfig(scheduler="fixed"), sps=_table(10.0)).gate is None
    plain = SpsTable(tokens=[1, 8, 64], steps_per_s=[3.0, 2.0, 1.0], device="cpu", engine="toy")
    assert SpecEngine(target, drafter, EngineConfig(scheduler="algorithm1"), sps=plain).gate is None
    off = EngineConfig(scheduler="algorithm1", adaptive_drafting=False)
    assert SpecEngine(target, drafter, off, sps=_table(10.0)).gate is None


def test_engine_probes_draft_only_the_least_recently_drafted_rows_and_stay_lossless():
    target = make_tiny_target()
    torch.manual_seed(5)
    drafter = build_drafter(drafter_config_for(tiny_run_config("dspark"), target), target)
    jobs = [(f"r{i}", list(range(7 + i, 20 + 2 * i)), SamplingParams(max_tokens=24)) for i in range(6)]
    sampled = ("s", [9, 10, 11], SamplingParams(max_tokens=24, temperature=0.9, top_k=8, seed=3))
    base = run_to_completion(SpecEngine(target, None, EngineConfig(mode="target_only", max_batch=7)), jobs)
    # a pass as dear as a step: it would pay only for drafts this untrained drafter does not make, so the
    # gate skips it and probes (a pass that could not pay at all would not even be probed: could_pay)
    engine = SpecEngine(target, drafter, EngineConfig(mode="spec", scheduler="algorithm1", max_batch=7),
                        sps=_table(draft_seconds=1.0, verify_slope=0.01))
    engine.gate.probe_rows = 2
    drafted_slots: list[list[int]] = []
    propose = engine.draft_runner.propose

    def recording_propose(slots, *args, **kwargs):
        drafted_slots.append(list(slots))
        assert all(neural.has_context(s) for s in slots)  # a row whose context was dropped does not draft
        return propose(slots, *args, **kwargs)
    engine.draft_runner.propose = recording_propose
    neural = engine.neural
    neural.idle_context_tokens = 3
    idle_backlogs: list[int] = []
    kept: list[int] = []
    settle = neural.settle

    def recording_settle(slots):
        settle(slots)
        if neural.idle:
            idle_backlogs.extend(neural.backlog_tokens(s) for s in slots)
            kept.append(len(neural.keep) if slots else None)
    neural.settle = recording_settle
    out = run_to_completion(engine, jobs + [sampled])
    assert {rid: out[rid] for rid, _, _ in jobs} == base
    assert len(out["s"]) == 24
    probes = [s for s in drafted_slots[1:] if len(s) < 7]
    assert probes and all(len(s) == 2 for s in probes)
    assert len({tuple(s) for s in probes}) > 1  # probes rotate over the batch
    assert idle_backlogs and max(idle_backlogs) < 2 * 3  # a skipped drafter holds a window, not the history
    live = [n for n in kept if n is not None]
    assert live and max(live) == PROBE_CANDIDATES * NEURAL_PROBE_ROWS < 7  # and only for the next probes' rows,
    assert 0 in live  # and between probes, more than a window of steps before the next, for none of the live rows


def test_a_batch_larger_than_a_probe_keeps_only_a_window_of_its_first_prompts():
    """Before the gate's first decision, which at a batch larger than a probe leaves rows undrafted,
    the prompts' features are already cut to the idle window: the ring keeps its width (no growth
    for prompts longer than the backlog bound) and the output stays target-only's."""
    target = make_tiny_target()
    torch.manual_seed(5)
    drafter = build_drafter(drafter_config_for(tiny_run_config("dspark"), target), target)
    jobs = [(f"r{i}", [(7 * j + i) % 50 + 3 for j in range(40)], SamplingParams(max_tokens=6)) for i in range(6)]
    base = run_to_completion(SpecEngine(target, None, EngineConfig(mode="target_only", max_batch=6)), jobs)
    engine = SpecEngine(target, drafter, EngineConfig(mode="spec", scheduler="algorithm1", max_batch=6),
                        sps=_table(draft_seconds=10.0, verify_slope=0.01))
    engine.gate.probe_rows = 2
    neural = engine.neural
    neural.max_backlog_tokens, neural.idle_context_tokens = 16, 4
    widths = []
    settle = neural.settle
    neural.settle = lambda slots: (settle(slots), widths.append(neural._ring.shape[1]))
    assert run_to_completion(engine, jobs) == base
    assert widths and set(widths) == {16 + 2 * (neural.max_drafts + 1)}


def test_gated_rows_takes_the_least_recently_drafted_rows_in_row_order():
    gate = DraftGate(_table(10.0, 0.01), max_tokens=64, probe_rows=2)
    assert gated_rows(None, [0, 1, 2], [5, 1, 3]) == [0, 1, 2]
    assert gated_rows(gate, [], [5, 1, 3]) == []
    assert gated_rows(gate, [0, 1, 2, 3], [5, 1, 3, 1]) == [1, 3]  # no history yet: a 2-row probe


@pytest.mark.parametrize("host_seconds", [0.0, 0.5, 100.0])  # free / dear / ruinous lookups
def test_suffix_lookups_are_gated_by_their_host_cost_and_stay_token_identical(host_seconds):
    """The suffix gate skips the lookups where their host cost outweighs what they gain, probing
    now and then where they could pay at best (0.5 s a row against 1 s steps: 4 rows with 3
    accepted drafts each would), never where they could not (100 s a row); every request gets
    exactly target-only's tokens."""
    from dspark.engine.proposers import SuffixConfig

    target = make_tiny_target()
    motif = [11, 12, 13, 14, 15]
    jobs = [(f"r{i}", (motif * 6)[i:i + 20], SamplingParams(max_tokens=20)) for i in range(4)]
    base = run_to_completion(SpecEngine(target, None, EngineConfig(mode="target_only", max_batch=4)), jobs)
    cfg = EngineConfig(proposers="suffix", scheduler="algorithm1", max_batch=4,
                       suffix=SuffixConfig(max_drafts=3, host_seconds_per_row=host_seconds))
    engine = SpecEngine(target, None, cfg, sps=_table(0.0))
    assert engine.suffix_gate is not None
    looked = record_rows(engine.suffix, "propose")
    assert run_to_completion(engine, jobs) == base
    steps = engine.stats.decode_steps
    if host_seconds > 1.0:
        assert not looked and not engine.suffix_gate.could_pay(4, budget=12)
    elif host_seconds:
        assert 0 < len(looked) < steps / 2, f"{len(looked)} lookup steps of {steps}: the dear lookups were not skipped"
    else:
        assert len(looked) == steps, "free lookups must run on every decode step"
        assert engine.stats.by_proposer["suffix"].accepted > 0


def test_a_pass_cheaper_than_the_free_share_of_a_step_always_runs():
    table = _table(draft_seconds=0.01, verify_slope=0.0)  # a plain step is 1 s
    gate = DraftGate(table, max_tokens=64, draft_time=lambda rows: 0.001 * rows, free_share=0.02)
    gate.observe(8, 8, 0)  # history says drafting never pays ...
    assert gate.expected_gain(4) < 1.0
    assert gate.rows_to_draft(4) == 4  # ... but 4 ms of a 1 s step is too cheap to skip
    assert gate.rows_to_draft(64) == 0  # 64 ms is not
    with pytest.raises(ValueError, match="free_share"):
        DraftGate(table, max_tokens=8, free_share=1.0)


def test_the_gate_prices_a_step_by_its_rows_where_the_table_has_the_grid():
    """Beside 4 rows a verified draft costs 0.1 s on the grid; the 1-D curve (rows of K+1 tokens) says 0.01."""
    table = _table(draft_seconds=0.0, verify_slope=0.01)
    gate_1d = DraftGate(table, max_tokens=64, prior_rows=0.0)
    table_rows = _table(draft_seconds=0.0, verify_slope=0.01)
    table_rows.set_rows_grid([1, 4], [[0, 8], [0, 8]], [[1.0, 1 / 1.08], [1 / 1.2, 1 / 2.0]])
    gate = DraftGate(table_rows, max_tokens=64, prior_rows=0.0)
    for g in (gate_1d, gate):
        g.observe(requests=4, verified=8, accepted=2)  # per request: 2 verified, 0.5 accepted
    assert gate._step_time(4) == pytest.approx(1.2) and gate._step_time(4, 6) == pytest.approx(1.4)
    assert gate.expected_gain(4) == pytest.approx((4 + 2) / 4 * 1.2 / 2.0)  # 8 drafts beside 4 rows: 2.0 s
    assert gate.expected_gain(4) < 1.0 < gate_1d.expected_gain(4)


def test_a_step_budget_caps_the_drafts_the_gate_expects_to_be_verified():
    """History of 4-row probes: 1 of a row's drafts verified, 0.9 accepted. Drafting all 64 rows
    would verify 64 drafts at a token's price each and lose; with a budget of one draft (what the
    scheduler can verify beside 64 rows on such a table) the step verifies one, gains 0.9 of a token,
    and pays for the lookups only."""
    tokens = [1, 64, 65, 66, 256]
    ms = [10.0, 100.0, 100.0, 102.0, 400.0]  # the 65th token free, the 66th as dear as a row's token
    table = SpsTable(tokens=tokens, steps_per_s=[1000.0 / m for m in ms], device="cpu", engine="toy",
                     draft_requests=[1, 64], draft_seconds=[0.0, 0.0])
    gate = DraftGate(table, max_tokens=256, prior_rows=0.0, draft_time=lambda rows: 1e-5 * rows)
    gate.observe(requests=4, verified=4, accepted=3.6)
    t = gate._step_time
    unbounded = (64 + 64 * 0.9) / 64 * t(64) / (64e-5 + t(64, 128))
    assert gate.expected_gain(64) == pytest.approx(unbounded) and unbounded < 1.0
    one = (64 + 0.9) / 64 * t(64) / (64e-5 + t(64, 65))
    assert gate.expected_gain(64, budget=1) == pytest.approx(one) and one > 1.0
    assert gate.rows_to_draft(64) == 0 and gate.rows_to_draft(64, budget=1) == 64
    assert gate.expected_gain(64, budget=1000) == pytest.approx(unbounded), "a budget above the need changes nothing"
    assert gate.probe_cost(64, 4, budget=1) == pytest.approx((4e-5 + t(64, 65) - t(64)) / t(64))


def test_the_engine_proposes_nothing_in_a_step_whose_scheduler_could_verify_no_draft():
    """Beside 4 rows the table's 5th token costs two whole steps: Algorithm 1 could verify no draft
    there whatever its confidence, so a 4-row step runs no lookup at all, while the same requests
    one at a time, where drafts are cheap, look up every step. Output: target-only's either way."""
    from dspark.engine.proposers import SuffixConfig

    target = make_tiny_target()
    motif = [11, 12, 13, 14, 15]
    jobs = [(f"r{i}", (motif * 6)[i:i + 20], SamplingParams(max_tokens=20)) for i in range(4)]
    base = run_to_completion(SpecEngine(target, None, EngineConfig(mode="target_only", max_batch=4)), jobs)
    ms = [1.0 if b <= 4 else 3.0 + 0.001 * b for b in range(1, 65)]  # 1 s up to 4 tokens, then a cliff
    table = SpsTable(tokens=list(range(1, 65)), steps_per_s=[1.0 / t for t in ms], device="cpu", engine="toy",
                     draft_requests=[1, 64], draft_seconds=[0.0, 0.0])
    for batch, expect_lookups in ((4, False), (1, True)):
        cfg = EngineConfig(proposers="suffix", scheduler="algorithm1", max_batch=batch,
                           suffix=SuffixConfig(max_drafts=3, host_seconds_per_row=0.0))
        engine = SpecEngine(target, None, cfg, sps=table)
        looked = record_rows(engine.suffix, "propose")
        assert run_to_completion(engine, jobs) == base
        if expect_lookups:
            assert looked and engine.stats.by_proposer["suffix"].accepted > 0
        else:
            assert looked == [] and engine.stats.total.drafted == 0
