"""The proposer interface: point-mass drafts stay lossless, the null proposer, the neural adapter
feeds the drafter exactly what the engine does, one accept_len, typed stats, costs."""
from __future__ import annotations


import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from scipy.stats import chisquare

from dspark.engine.api import SamplingParams
from dspark.engine.proposers import (DraftBatch, EngineStats, NullProposer, ProposerCost, ProposerStats,
                                     SuffixConfig, SuffixProposer, accept_len, accept_len_of_rounds)
from dspark.engine.proposers.neural import MAX_BACKLOG_TOKENS, NeuralProposer
from dspark.engine.proposers.stats import PHASES
from dspark.engine.runtime import EngineConfig, SpecEngine
from dspark.engine.sidebyside import EngineProbe
from dspark.engine.sps import SpsTable
from dspark.engine.target_runner import RaggedOutput, TargetRunner
from dspark.plugins.reference import verify
from dspark.training.metrics import accept_len as accept_len_training
from dspark.training.models import build_drafter, drafter_config_for

from ..conftest import make_tiny_target, run_to_completion, tiny_run_config


# -- point-mass drafts through the lossless verify rule ------------------------------------------------
def _verify_point_mass(batch: DraftBatch, logits: torch.Tensor, temperature: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Verify every available draft of ``batch`` (one row per request, each its own seed)."""
    R, L = batch.rows, batch.width
    V = logits.shape[-1]
    res = verify(batch.tokens, batch.verify_probs(V), logits.expand(R, L + 1, V).contiguous(), batch.lens,
                 torch.full((R,), temperature), seed=torch.arange(R) + 12345, offset=torch.zeros(R, dtype=torch.long))
    return res.num_accepted, res.output_tokens


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_point_mass_drafts_emit_exactly_the_target_distribution(temperature):
    """A point mass at x is valid input for the rejection rule: accept x with probability p_t(x),
    else sample from p_t with x removed; so the first emitted token follows p_t and, after an
    accepted x, the next one follows the target's next distribution."""
    V, R = 6, 6000
    logits = torch.tensor([[[1.2, 0.3, -0.5, 0.9, 0.0, -1.0], [0.1, 1.5, -0.2, 0.4, -0.8, 0.6],
                            [0.0, 0.0, 0.0, 0.0, 0.0, 0.0]]])
    p_t = torch.softmax(logits[0].double() / temperature, -1).numpy()
    x0, x1 = 3, 1  # drafts: a mid-probability first token, then the second position's favourite
    batch = DraftBatch(tokens=torch.tensor([[x0, x1]]).expand(R, 2), lens=torch.full((R,), 2),
                       confidence=torch.ones(R, 2))
    assert batch.point_mass and torch.equal(batch.verify_probs(V)[0, 0], torch.eye(V)[x0])
    n, out = _verify_point_mass(batch, logits, temperature)
    y0 = out[:, 0].numpy()
    observed = np.bincount(y0, minlength=V)
    assert chisquare(observed, R * p_t[0]).pvalue > 1e-3, "the first emitted token must follow p_t"
    assert not bool(((n == 0) & (out[:, 0] == x0)).any()), "a rejected draft is never the recovered token"
    after = out[:, 1][out[:, 0] == x0].numpy()  # accepted x0: the next token follows p_t at position 1
    observed1 = np.bincount(after, minlength=V)
    assert chisquare(observed1, len(after) * p_t[1]).pvalue > 1e-3
    assert abs((n >= 1).double().mean().item() - p_t[0, x0]) < 4 * np.sqrt(p_t[0, x0] * (1 - p_t[0, x0]) / R)


@settings(max_examples=25, deadline=None)
@given(drafts=st.lists(st.integers(0, 4), min_size=1, max_size=5), data=st.data())
def test_greedy_point_mass_accepts_the_longest_prefix_equal_to_the_argmaxes(drafts, data):
    K = len(drafts)
    argmax = data.draw(st.lists(st.integers(0, 4), min_size=K + 1, max_size=K + 1))
    logits = torch.nn.functional.one_hot(torch.tensor(argmax), 5).float().unsqueeze(0) * 3.0
    batch = DraftBatch(tokens=torch.tensor([drafts]), lens=torch.tensor([K]), confidence=torch.ones(1, K))
    n, out = _verify_point_mass(batch, logits, 0.0)
    expect = next((j for j in range(K) if drafts[j] != argmax[j]), K)
    assert int(n[0]) == expect and out[0, : expect + 1].tolist() == argmax[: expect + 1]


def test_suffix_drafts_are_point_masses_that_verify_unchanged():
    prop = SuffixProposer(SuffixConfig(max_drafts=3, scope="request"))
    prop.reset(0, [4, 1, 2, 3, 4, 1])
    batch = prop.propose([0])
    assert batch.point_mass and batch.tokens[0].tolist() == [2, 3, 4]
    logits = torch.nn.functional.one_hot(torch.tensor([2, 3, 0, 1]), 5).float().unsqueeze(0) * 3.0
    n, out = _verify_point_mass(batch, logits, 0.0)
    assert int(n[0]) == 2 and out[0, :3].tolist() == [2, 3, 0]


# -- the null proposer -------------------------------------------------------------------------------
def test_null_proposer_drafts_nothing_costs_nothing_and_verify_then_samples_the_target():
    prop = NullProposer()
    prop.reset(3, [1, 2])
    prop.commit(3, [5], None)
    batch = prop.propose([3, 0, 1], torch.zeros(3))
    assert batch.width == 0 and batch.lens.tolist() == [0, 0, 0] and prop.max_drafts == 0
    assert prop.cost().seconds(64) == 0.0 and not prop.needs_features
    prop.move(3, 0)
    prop.release(0)
    # the first token through the verify path with zero drafts: greedy gives the argmax, T=1 samples p_t
    V, R = 5, 4000
    logits = torch.tensor([[[0.5, 1.0, -0.3, 0.2, 0.0]]])
    empty = NullProposer().propose(list(range(R)), torch.ones(R))
    _, out = _verify_point_mass(empty, logits, 1.0)
    p = torch.softmax(logits[0, 0].double(), -1).numpy()
    assert chisquare(np.bincount(out[:, 0].numpy(), minlength=V), R * p).pvalue > 1e-3
    _, greedy = _verify_point_mass(NullProposer().propose([0], torch.zeros(1)), logits, 0.0)
    assert greedy[0].tolist() == [1]


# -- the neural adapter ---------------------------------------------------------------------------------
def _decode_with_proposer(target, prop: NeuralProposer, prompt: list[int], max_tokens: int, chunk: int):
    """Greedy batch-1 decoding the way the engine runs it, through the proposer interface;
    -> (emitted tokens, the drafts of every round)."""
    runner = TargetRunner(target, 1)
    K = prop.max_drafts
    prop.reset(0, prompt)
    for a in range(0, len(prompt), chunk):  # prefill in chunks: features of each chunk's positions
        piece = prompt[a:a + chunk]
        o = runner.forward([0], [piece], need_features=True, last_logits_only=True)
        runner.set_length(0, a + len(piece))
        prop.commit(0, [], o.aux[0, :len(piece)].float())
        prop.settle([0])
    emitted = [int(o.logits[0, 0].argmax())]
    prop.commit(0, emitted[:1])
    prop.settle([0])
    rounds = []
    while len(emitted) < max_tokens:
        batch = prop.propose([0], torch.zeros(1))
        rounds.append(batch.tokens.clone())
        L = min(K, max_tokens - len(emitted) - 1)
        o = runner.forward([0], [[emitted[-1]] + batch.tokens[0, :L].tolist()], need_features=True)
        res = verify(batch.tokens[:, :L], None, o.logits[:, :L + 1].float(), torch.tensor([L]), torch.zeros(1))
        n = int(res.num_accepted[0])
        new = res.output_tokens[0, :n + 1].tolist()
        runner.set_length(0, int(runner.lengths[0]) + n + 1)
        prop.commit(0, new, o.aux[0, :n + 1].float())
        prop.settle([0])
        emitted += new
    return emitted[:max_tokens], rounds


@pytest.mark.parametrize("algo, prompt_len, chunk", [("dspark", 23, 6), ("eagle3", 23, 6), ("dspark", 270, 64)])
def test_neural_proposer_feeds_the_drafter_what_the_engine_does(algo, prompt_len, chunk):
    """Same drafts every round as engine/runtime.py's own backlog path, so the moved logic is the same."""
    target = make_tiny_target()
    torch.manual_seed(5)
    drafter = build_drafter(drafter_config_for(tiny_run_config(algo), target), target)
    prompt = [3 + (7 * i) % 60 for i in range(prompt_len)]
    eng = SpecEngine(target, drafter, EngineConfig(mode="spec", scheduler="fixed", max_batch=1, prefill_chunk=chunk,
                                                   static_steps="off"))
    seen = []
    engine_propose = eng.draft_runner.propose

    def spy(*args, **kwargs):
        prop = engine_propose(*args, **kwargs)
        seen.append(prop.tokens.cpu().clone())
        return prop
    eng.draft_runner.propose = spy
    out = run_to_completion(eng, [("r", prompt, SamplingParams(max_tokens=10))])["r"]
    prop = NeuralProposer(drafter, 1)
    emitted, rounds = _decode_with_proposer(target, prop, prompt, 10, chunk)
    assert emitted == out
    assert len(rounds) == len(seen) and all(torch.equal(a, b) for a, b in zip(rounds, seen))
    if prompt_len > MAX_BACKLOG_TOKENS:  # a long prompt's backlog was flushed at the end of prefill
        assert int(prop.runner.cache.lengths[0]) >= MAX_BACKLOG_TOKENS


def test_neural_backlog_waits_for_a_draft_and_follows_a_move():
    target = make_tiny_target()
    torch.manual_seed(1)
    drafter = build_drafter(drafter_config_for(tiny_run_config("dspark"), target), target)
    prop = NeuralProposer(drafter, 2)
    F = drafter.fc.in_features
    for slot in (0, 1):
        prop.reset(slot, [4, 5, 6, 7 + slot])
        prop.commit(slot, [], torch.randn(4, F))  # the prompt's last position waits for its next token
        assert prop.backlog_tokens(slot) == 3
        prop.commit(slot, [9], None)
        prop.settle([slot])  # under the bound: nothing flushed, the drafter's cache is untouched
        assert prop.backlog_tokens(slot) == 4 and int(prop.runner.cache.lengths[slot]) == 0
    before = prop.propose([1], torch.zeros(1)).tokens
    assert prop.backlog_tokens(1) == 0 and int(prop.runner.cache.lengths[1]) == 4
    prop.release(0)
    prop.move(1, 0)
    assert torch.equal(prop.propose([0], torch.zeros(1)).tokens, before)
    assert prop.cost().known is False
    with pytest.raises(ValueError, match="never profiled"):
        prop.cost().seconds(1)


@settings(max_examples=40, deadline=None)
@given(ops=st.lists(st.tuples(st.integers(0, 9), st.sampled_from(["commit", "settle", "idle", "drop", "draft"])),
                    min_size=1, max_size=60))
def test_the_feature_ring_hands_the_drafter_each_position_with_its_next_token(ops):
    """Whatever the mix of commits, flushes, idle cuts, idle spells outside ``keep`` (no context kept)
    and wrap-arounds of the (small) ring, every append since a cache reset is the next run of
    consecutive positions, each with its own features and the token after it, and a draft appends
    everything paired so far."""
    target = make_tiny_target()
    drafter = build_drafter(drafter_config_for(tiny_run_config("dspark"), target), target)
    F = drafter.fc.in_features
    prop = NeuralProposer(drafter, 2)
    prop.max_backlog_tokens, prop.idle_context_tokens = 6, 2  # a ring of 6 + 2 (K + 1) positions
    log: list[tuple[str, list[int], list[int]]] = []
    prop.runner.append = lambda rows: log.extend(("append", r[1][:, 0].long().tolist(), r[2].tolist()) for r in rows)
    reset = prop.runner.reset
    prop.runner.reset = lambda slot: (log.append(("reset", [], [])), reset(slot))
    seq = [5, 6, 7]  # the committed sequence
    prop.reset(0, seq)
    fed = 0
    for n, op in ops:
        if op == "commit":  # features of the next n positions, then tokens up to one past them
            take = min(n, len(seq) - fed)
            prop.commit(0, [], torch.arange(fed, fed + take).float().unsqueeze(1).expand(take, F))
            fed += take
            new = [3 + (7 * k) % 50 for k in range(len(seq), len(seq) + n)]
            prop.commit(0, new)
            seq += new
        elif op in ("settle", "idle", "drop"):
            prop.idle = op != "settle"
            prop.keep = frozenset() if op == "drop" else None
            prop.settle([0])
            assert prop.backlog_tokens(0) < max(prop.max_backlog_tokens, 2 * prop.idle_context_tokens)
        elif prop.has_context(0):  # the engine drafts only a row with some context
            prop.propose([0], torch.zeros(1))
            assert prop.backlog_tokens(0) == 0
    expect = None
    for kind, positions, tokens in log:
        if kind == "reset":
            expect = None
            continue
        assert positions == list(range(positions[0], positions[0] + len(positions)))
        assert expect is None or positions[0] == expect  # no gap and no repeat within one cache
        assert tokens == [seq[p + 1] for p in positions]
        expect = positions[-1] + 1


def test_an_idle_proposer_writes_only_the_window_of_a_long_prompt():
    """While idle, a prompt chunk past the window is cut as it arrives: the ring keeps its size and
    the next draft's context is the chunk's last positions."""
    target = make_tiny_target()
    drafter = build_drafter(drafter_config_for(tiny_run_config("dspark"), target), target)
    F = drafter.fc.in_features
    prop = NeuralProposer(drafter, 1)
    prop.idle = True
    prompt = [3 + (7 * i) % 50 for i in range(400)]
    prop.reset(0, prompt)
    prop.commit(0, [], torch.arange(400).float().unsqueeze(1).expand(400, F))
    capacity = prop.max_backlog_tokens + 2 * (prop.max_drafts + 1)
    assert prop._ring.shape[1] == capacity and prop.backlog_tokens(0) == prop.idle_context_tokens
    seen = []
    prop.runner.append = lambda rows: seen.extend(r[1][:, 0].long().tolist() for r in rows)
    prop._flush([0])
    assert seen == [list(range(399 - prop.idle_context_tokens, 399))]  # position 399 awaits its next token


def test_an_idle_proposer_keeps_no_context_for_a_slot_outside_keep():
    """While idle, a slot outside ``keep`` writes nothing to the ring and drops its drafter cache, so
    it has no context to draft from; back in ``keep`` it builds a window from its new positions only."""
    target = make_tiny_target()
    drafter = build_drafter(drafter_config_for(tiny_run_config("dspark"), target), target)
    F = drafter.fc.in_features
    prop = NeuralProposer(drafter, 2)
    for slot in (0, 1):
        prop.reset(slot, [3, 4, 5, 6])
    prop.commit_many([0, 1], [[], []], torch.arange(8).float().view(2, 4, 1).expand(2, 4, F), [4, 4])
    prop.propose([0, 1], torch.zeros(2))  # both prompts in the drafter's cache
    prop.idle, prop.keep = True, frozenset({1})
    writes = []
    store = prop._store
    prop._store = lambda features, entries: (writes.extend(st.row for _, st, _, _ in entries), store(features, entries))
    prop.commit_many([0, 1], [[7, 8], [7, 8]], torch.arange(4).float().view(2, 2, 1).expand(2, 2, F), [2, 2])
    assert writes == [prop._slots[1].row]  # the slot outside keep wrote nothing
    prop.settle([0, 1])
    assert not prop.has_context(0) and prop.backlog_tokens(0) == 0 and prop.has_context(1)
    prop.keep = frozenset({0, 1})  # slot 0 is a probe candidate again: its window starts at its next position
    prop.commit_many([0], [[9, 10]], torch.tensor([40.0, 41.0]).view(1, 2, 1).expand(1, 2, F), [2])
    assert prop.has_context(0) and prop.backlog_tokens(0) == 1  # position 7 awaits its next token
    seen = []
    prop.runner.append = lambda rows: seen.extend(r[1][:, 0].long().tolist() for r in rows)
    prop._flush([0])
    assert seen == [[40]] and int(prop.runner.cache.lengths[0]) == 0  # reset, then the one new position


def test_the_engine_builds_features_only_for_the_rows_its_drafter_keeps(monkeypatch):
    """While the drafter keeps context for slot 0 alone, every feature the engine builds (prompt
    chunks and verify rounds) is slot 0's, the whole grid is never joined, and greedy output is
    still the target's own."""
    target = make_tiny_target()
    drafter = build_drafter(drafter_config_for(tiny_run_config("dspark"), target), target)
    jobs = [(f"r{i}", [3 + (5 * i + 7 * k) % 50 for k in range(6 + 3 * i)], SamplingParams(max_tokens=12))
            for i in range(3)]
    base = run_to_completion(SpecEngine(target, None, EngineConfig(mode="target_only", max_batch=3)), jobs)
    eng = SpecEngine(target, drafter, EngineConfig(mode="spec", scheduler="fixed", max_batch=3, prefill_chunk=4,
                                                   static_steps="off"))

    def only_slot_0():
        eng.neural.idle, eng.neural.keep = True, frozenset({0})
    eng._mark_idle = only_slot_0
    built, joined = [], []
    aux_rows, aux = RaggedOutput.aux_rows, RaggedOutput.aux

    def recording_rows(out, rows, width):
        built.append(list(rows))
        return aux_rows(out, rows, width)
    monkeypatch.setattr(RaggedOutput, "aux_rows", recording_rows)
    monkeypatch.setattr(RaggedOutput, "aux", property(lambda out: joined.append(1) or aux.fget(out)))
    slots_of = []
    commit_many = eng.neural.commit_many
    eng.neural.commit_many = lambda slots, tokens, features=None, counts=None: (
        slots_of.append((list(slots), features is not None)), commit_many(slots, tokens, features, counts))[1]
    out = run_to_completion(eng, jobs)
    assert out == base
    assert built and all(len(rows) == 1 for rows in built) and not joined  # slot 0's row alone
    assert all(slots == [0] for slots, with_features in slots_of if with_features)
    assert any(0 not in slots for slots, with_features in slots_of if not with_features)


def test_the_engine_times_its_phases_and_the_probe_splits_steps_by_them():
    """``EngineStats.seconds``: every phase timed, the parts within the steps; ``EngineProbe`` shares
    each decode step's time among its rows by that clock, and ``since`` windows it."""
    target = make_tiny_target()
    drafter = build_drafter(drafter_config_for(tiny_run_config("dspark"), target), target)
    eng = SpecEngine(target, drafter, EngineConfig(scheduler="fixed", max_batch=2, prefill_chunk=4,
                                                   proposers="neural+suffix", static_steps="off"))
    jobs = [(f"r{i}", [3 + (5 * i + 7 * k) % 50 for k in range(9)], SamplingParams(max_tokens=10)) for i in range(3)]
    run_to_completion(eng, jobs[:1])
    start = eng.stats.snapshot()
    probe = EngineProbe(eng)
    run_to_completion(eng, jobs[1:])
    s = eng.stats.since(start).seconds
    assert set(s) == set(PHASES) and s == pytest.approx(probe.seconds)
    assert min(s.values()) > 0.0
    assert s["prefill"] + s["neural"] + s["suffix"] + s["verify"] <= s["step"]
    ms = probe.step_ms()
    assert ms["decode_steps"] == eng.stats.since(start).decode_steps > 0
    assert ms["total"] * ms["decode_steps"] == pytest.approx(1000 * (s["step"] - s["prefill"]))
    rounds = probe.round_ms_of([rid for rid, _, _ in jobs[1:]])
    assert rounds["rounds"] == eng.stats.since(start).rounds
    # the rows' shares are the decode time of the steps that had decode rows: at most all of it
    assert 0.0 < rounds["total"] * rounds["rounds"] <= 1000 * (s["step"] - s["prefill"]) * (1 + 1e-9)


def test_a_ring_grown_for_a_long_prompt_is_dropped_with_the_last_slot():
    """A prompt longer than the ring grows it (its positions wait unflushed, every slot's context
    kept); once every slot is released the ring goes, and the next request's features find one of
    the base width."""
    target = make_tiny_target()
    drafter = build_drafter(drafter_config_for(tiny_run_config("dspark"), target), target)
    F = drafter.fc.in_features
    prop = NeuralProposer(drafter, 2)
    base = prop.max_backlog_tokens + 2 * (prop.max_drafts + 1)
    prop.reset(1, [4, 5, 6, 7])
    prop.commit(1, [], torch.arange(4).float().unsqueeze(1).expand(4, F) + 1000)
    prop.reset(0, [3] * (base + 40))
    prop.commit(0, [], torch.arange(base + 40).float().unsqueeze(1).expand(base + 40, F))
    assert prop._ring.shape[1] > base and prop.backlog_tokens(0) == base + 39
    seen = []
    prop.runner.append = lambda rows: seen.extend(r[1][:, 0].long().tolist() for r in rows)
    prop._flush([1])
    assert seen == [[1000, 1001, 1002]]  # moved with the growth; position 3 awaits its next token
    prop.release(0)
    assert prop._ring is not None  # slot 1 still holds its positions
    prop.release(1)
    prop.reset(0, [3, 4])
    prop.commit(0, [], torch.zeros(2, F))
    assert prop._ring.shape[1] == base


@pytest.mark.parametrize("algo", ["dspark", "eagle3"])
def test_an_idle_neural_proposer_keeps_only_a_window_of_recent_context(algo):
    """While the gate skips the drafter, a backlog is cut to its recent positions and the slot's
    cache is dropped: the next draft is the one a fresh proposer fed only that window makes."""
    target = make_tiny_target()
    torch.manual_seed(2)
    drafter = build_drafter(drafter_config_for(tiny_run_config(algo), target), target)
    F = drafter.fc.in_features
    seq = [3 + (5 * i) % 50 for i in range(23)]  # prompt = seq[:13], then 10 committed tokens
    feats = torch.randn(len(seq), F)
    prop = NeuralProposer(drafter, 1)
    prop.idle_context_tokens = 4
    prop.reset(0, seq[:13])
    prop.commit(0, [], feats[:13])
    prop.propose([0], torch.zeros(1))  # drafting: the whole prompt goes into the cache
    assert int(prop.runner.cache.lengths[0]) == 12
    prop.commit(0, seq[13:], feats[13:])
    prop.settle([0])  # not idle, under the bound: the backlog waits
    assert prop.backlog_tokens(0) == 10
    prop.idle = True
    prop.settle([0])  # idle, at least twice the window: cut to the window
    assert prop.backlog_tokens(0) == 4
    drafts = prop.propose([0], torch.zeros(1)).tokens
    assert int(prop.runner.cache.lengths[0]) == 4  # rebuilt from the window alone, not appended to the old cache
    fresh = NeuralProposer(drafter, 1)
    fresh.reset(0, seq[18:])  # positions 18..21 paired with the tokens after them, anchored on the last
    fresh.commit(0, [], feats[18:])
    assert torch.equal(fresh.propose([0], torch.zeros(1)).tokens, drafts)
    prop.commit(0, [7, 8], feats[:2])
    prop.settle([0])  # idle, but a short backlog: kept whole
    assert prop.backlog_tokens(0) == 2


# -- one accept_len, typed stats, costs ---------------------------------------------------------------
@settings(max_examples=50, deadline=None)
@given(acc=st.lists(st.integers(0, 7), min_size=1, max_size=30))
def test_accept_len_is_the_mean_of_accepted_plus_one_in_every_form(acc):
    stats = ProposerStats()
    for a in acc:
        stats.record(7, a)
    value = accept_len(sum(acc), len(acc))
    assert value == pytest.approx(accept_len_training(acc)) == pytest.approx(accept_len_of_rounds(acc))
    assert stats.accept_len == pytest.approx(value)
    assert accept_len(0, 0) is None


def test_engine_stats_by_proposer_windows_and_legacy_keys():
    s = EngineStats()
    s.record_round("suffix", 3, 2)
    s.record_round("dspark", 7, 0)
    s.decode_steps += 1
    before = s.snapshot()
    s.record_round("suffix", 2, 2)
    s.record_round("none", 0, 0)
    s.decode_steps += 1
    window = s.since(before)
    assert window.rounds == 2 and window.accept_len == pytest.approx((2 + 2) / 2)
    assert window.by_proposer["suffix"].accept_len == 3.0 and window.by_proposer["dspark"].rounds == 0
    assert s.by_proposer["suffix"].accepted_per_round == 2.0
    legacy = s.as_dict(max_drafts=7)
    assert legacy["rounds"] == 2 and legacy["batch_size_sum"] == 4 and legacy["accepted_tokens"] == 4
    assert legacy["verify_len_hist"] == [1, 0, 1, 1, 0, 0, 0, 1] and legacy["accepted_per_position"][:3] == [2, 2, 0]
    with pytest.raises(ValueError):
        s.record_round("suffix", 1, 2)


def test_proposer_cost_reads_the_profiled_drafter_pass():
    table = SpsTable(tokens=[1, 8, 64], steps_per_s=[40.0, 20.0, 5.0], device="cpu", engine="toy",
                     draft_requests=[1, 16], draft_seconds=[0.01, 0.03])
    assert ProposerCost(table=table, on_device=True).seconds(8) == pytest.approx(table.draft_time(8))
    assert ProposerCost(per_row_s=1e-4, fixed_s=1e-3).seconds(10) == pytest.approx(2e-3)
    assert ProposerCost(per_row_s=1.0).seconds(0) == 0.0
    assert SuffixProposer().cost().on_device is False
    assert ProposerCost(catchup_s_per_row=0.002).catchup_seconds(4) == pytest.approx(0.008)
    assert ProposerCost(table=table).catchup_seconds(4) == 0.0  # nothing to catch up unless said


def test_a_neural_proposer_prices_the_catch_up_of_its_idle_window():
    target = make_tiny_target()
    drafter = build_drafter(drafter_config_for(tiny_run_config("dspark"), target), target)
    table = SpsTable(tokens=[1, 8, 64], steps_per_s=[40.0, 20.0, 5.0], device="cpu", engine="toy",
                     draft_requests=[1, 16], draft_seconds=[0.01, 0.03], draft_append_seconds=1e-5)
    prop = NeuralProposer(drafter, 2, sps=table)
    # a row back from idle rebuilds from 1.5 windows of positions on average (window..2*window)
    assert prop.cost().catchup_seconds(3) == pytest.approx(3 * 1.5 * prop.idle_context_tokens * 1e-5)
    assert prop.cost().seconds(4) == pytest.approx(table.draft_time(4))


def test_draft_batch_checks_shapes_and_counts_expected_accepts():
    b = DraftBatch(tokens=torch.zeros(2, 3, dtype=torch.long), lens=torch.tensor([3, 1]),
                   confidence=torch.tensor([[0.5, 0.5, 0.5], [0.9, 0.9, 0.9]]))
    assert b.expected_accepts().tolist() == pytest.approx([0.5 + 0.25 + 0.125, 0.9])
    with pytest.raises(ValueError):
        DraftBatch(tokens=torch.zeros(2, 3, dtype=torch.long), lens=torch.tensor([3]), confidence=torch.zeros(2, 3))


def test_combine_takes_each_row_from_its_chosen_proposer():
    V = 6
    suffix = DraftBatch(tokens=torch.tensor([[1, 2, 3], [4, 5, 0]]), lens=torch.tensor([3, 2]),
                        confidence=torch.full((2, 3), 0.9), conf_logits=torch.ones(2, 3), source="suffix")
    probs = torch.softmax(torch.randn(2, 2, V), -1)
    neural = DraftBatch(tokens=torch.tensor([[0, 1], [2, 3]]), lens=torch.tensor([2, 2]),
                        confidence=torch.full((2, 2), 0.5), probs=probs, source="dspark")
    both = DraftBatch.combine([suffix, neural], torch.tensor([0, 1]), V)
    assert both.tokens.tolist() == [[1, 2, 3], [2, 3, 0]] and both.lens.tolist() == [3, 2]
    assert [both.source_of(r) for r in range(2)] == ["suffix", "dspark"]
    assert torch.equal(both.probs[0], torch.eye(V)[[1, 2, 3]]), "a point-mass row becomes one-hot"
    assert torch.allclose(both.probs[1, :2], probs[1]) and both.probs[1, 2].sum() == 0
    only_suffix = DraftBatch.combine([suffix, neural], torch.tensor([0, 0]), V)
    assert only_suffix.point_mass and only_suffix.row_sources == ["suffix", "suffix"]


def test_registry_builds_by_name_and_lists_the_known_ones():
    from dspark.engine.proposers import UnknownProposerError, build_proposer, build_proposers

    assert isinstance(build_proposer("none", max_slots=4), NullProposer)
    sp = build_proposer("suffix", max_slots=4, suffix=SuffixConfig(max_drafts=3, scope="request"))
    assert isinstance(sp, SuffixProposer) and sp.max_drafts == 3
    with pytest.raises(UnknownProposerError, match="known: none, neural, suffix"):
        build_proposer("ngram", max_slots=4)
    with pytest.raises(ValueError, match="drafter checkpoint"):
        build_proposer("neural", max_slots=4)
    with pytest.raises(ValueError, match="distinct"):
        build_proposers(["suffix", "suffix"], max_slots=4)


def test_point_mass_drafts_under_the_coupled_rule_emit_the_target_only_tokens():
    """The coupled rule accepts a draft iff it equals the target's seeded choice: suffix drafts
    change how many tokens a round emits, never which."""
    from dspark.plugins.coupled import verify_coupled

    R, K, V = 300, 3, 7
    torch.manual_seed(0)
    logits = torch.randn(R, K + 1, V)
    seed, pos, temp = torch.arange(R), torch.full((R,), 11), torch.ones(R)
    alone = verify_coupled(torch.zeros(R, 0, dtype=torch.long), logits[:, :1], torch.zeros(R, dtype=torch.long), temp,
                           seed=seed, position=pos)
    drafts = torch.randint(0, V, (R, K))
    drafts[:, 0] = alone.output_tokens[:, 0].where(torch.rand(R) < 0.5, drafts[:, 0])  # half the rows guess right
    res = verify_coupled(drafts, logits, torch.full((R,), K), temp, seed=seed, position=pos)
    assert torch.equal(res.output_tokens[:, 0], alone.output_tokens[:, 0])
    assert bool((res.num_accepted > 0).any()) and bool((res.num_accepted == 0).any())
