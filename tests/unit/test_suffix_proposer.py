"""The suffix index against brute force on random token streams, and the suffix proposer's contract.

Brute force: every substring of length <= D of the indexed sequences, counted by end
position; the index must hold exactly those strings (no more nodes, also after removals),
with the same occurrence and continuation counts, the most frequent continuation (ties:
the one seen last), and the longest-suffix match of any query stream. Both implementations
(the Python reference and the C++ trie the engine uses) face the same checks, and the same
random calls must leave them identical, node for node.
"""
from __future__ import annotations

import random
from collections import Counter

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from dspark.engine.proposers import SuffixConfig, SuffixIndex, SuffixProposer
from dspark.engine.proposers.suffix import OnlineCalibration, continuation_logit
from dspark.engine.proposers.suffix_index import ROOT, native_available, new_suffix_index

streams = st.lists(st.integers(0, 3), min_size=0, max_size=40)
IMPLS = ["python", pytest.param("native", marks=pytest.mark.skipif(
    not native_available(), reason="the C++ suffix trie could not be built here (no compiler?)"))]


def make_index(impl: str, D: int):
    return new_suffix_index(D, native=impl == "native")


def brute_counts(seqs: list[list[int]], D: int) -> tuple[Counter, Counter]:
    """(occurrences, occurrences followed by a token) of every substring of length 1..D; a length-D
    string has no children in a depth-D trie, so its continuations are not counted."""
    occ, cont = Counter(), Counter()
    for s in seqs:
        for i in range(len(s)):
            for m in range(1, min(D, i + 1) + 1):
                w = tuple(s[i - m + 1:i + 1])
                occ[w] += 1
                if i + 1 < len(s) and m < D:
                    cont[w] += 1
    return occ, cont


def all_nodes(ix: SuffixIndex) -> dict[tuple[int, ...], int]:
    out, stack = {}, [ROOT]
    while stack:
        u = stack.pop()
        for v in ix.children(u):
            out[tuple(ix.node_string(v))] = v
            stack.append(v)
    return out


def check_against_brute(ix: SuffixIndex, seqs: list[list[int]]) -> None:
    D = ix.max_depth
    occ, cont = brute_counts(seqs, D)
    nodes = all_nodes(ix)
    assert set(nodes) == set(occ), "the trie must hold exactly the substrings of length <= D"
    assert ix.num_nodes == len(occ) + 1, "no node may outlive its last occurrence (root included)"
    assert ix.num_tokens == sum(map(len, seqs))
    for w, v in nodes.items():
        assert ix.count[v] == occ[w], f"count of {w}"
        assert ix.out[v] == cont[w], f"continuation count of {w}"
        assert ix.depth[v] == len(w)
        assert ix.node_string(ix.link[v]) == list(w[1:]), "the suffix link names w[1:]"
        kids = [(ix.count[c], ix.token[c]) for c in ix.children(v)]
        if kids:
            assert ix.count[ix.best[v]] == max(k for k, _ in kids), f"best child of {w} is a most frequent one"
        else:
            assert ix.best[v] == -1


@pytest.mark.parametrize("impl", IMPLS)
@settings(max_examples=60, deadline=None)
@given(seqs=st.lists(streams, min_size=1, max_size=4), D=st.integers(2, 6), data=st.data())
def test_index_counts_equal_brute_force_through_inserts_and_removals(impl, seqs, D, data):
    ix = make_index(impl, D)
    ids = []
    for s in seqs:  # insert each sequence in random pieces: appending is incremental
        sid = ix.add_sequence()
        cut = sorted(data.draw(st.lists(st.integers(0, len(s)), max_size=3)))
        for a, b in zip([0] + cut, cut + [len(s)]):
            ix.extend(sid, s[a:b])
        ids.append(sid)
    check_against_brute(ix, seqs)
    alive = list(range(len(seqs)))
    for k in data.draw(st.permutations(range(len(seqs)))):
        ix.remove(ids[k])
        alive.remove(k)
        check_against_brute(ix, [seqs[i] for i in alive])
    assert ix.num_nodes == 1 and not ix.edges


@pytest.mark.parametrize("impl", IMPLS)
@settings(max_examples=60, deadline=None)
@given(seq=streams, D=st.integers(2, 6))
def test_ties_go_to_the_continuation_seen_last(impl, seq, D):
    ix = make_index(impl, D)
    ix.add_sequence(seq)
    for w, v in all_nodes(ix).items():
        if len(w) >= D or ix.best[v] == -1:
            continue
        followers = {}  # token -> (count, last position it followed w)
        for i in range(len(w), len(seq)):
            if tuple(seq[i - len(w):i]) == w:
                n, _ = followers.get(seq[i], (0, -1))
                followers[seq[i]] = (n + 1, i)
        assert ix.token[ix.best[v]] == max(followers, key=lambda t: followers[t])


@pytest.mark.parametrize("impl", IMPLS)
@settings(max_examples=80, deadline=None)
@given(seqs=st.lists(streams, min_size=1, max_size=3), query=streams, D=st.integers(2, 6))
def test_match_and_advance_give_the_longest_suffix_in_the_index(impl, seqs, query, D):
    ix = make_index(impl, D)
    for s in seqs:
        ix.add_sequence(s)
    occ, _ = brute_counts(seqs, D)
    node = ROOT
    for i, t in enumerate(query):
        node = ix.advance(node, t)  # amortised O(1): from the previous state, never from the start
        prefix = query[:i + 1]
        best = max((m for m in range(0, min(D, len(prefix)) + 1) if m == 0 or tuple(prefix[-m:]) in occ), default=0)
        assert ix.depth[node] == best
        assert ix.node_string(node) == (prefix[-best:] if best else [])
        assert ix.match(prefix) == node


@pytest.mark.parametrize("impl", IMPLS)
@settings(max_examples=80, deadline=None)
@given(seq=st.lists(st.integers(0, 3), min_size=1, max_size=40), D=st.integers(3, 7), min_match=st.integers(1, 2))
def test_first_draft_is_the_most_frequent_follower_of_the_longest_repeated_suffix(impl, seq, D, min_match):
    ix = make_index(impl, D)
    sid = ix.add_sequence(seq)
    toks, counts, totals, depths = ix.draft(ix.last_node(sid), 1, min_match)
    _, cont = brute_counts([seq], D)
    # the longest suffix (shorter than D, at least min_match) that occurred followed by a token
    ms = [m for m in range(min_match, min(D - 1, len(seq)) + 1) if cont[tuple(seq[-m:])] > 0]
    if not ms:
        assert toks == []
        return
    w = tuple(seq[-max(ms):])
    followers = Counter(seq[i] for i in range(len(w), len(seq)) if tuple(seq[i - len(w):i]) == w)
    assert counts[0] == max(followers.values()) and followers[toks[0]] == counts[0]
    assert totals[0] == sum(followers.values()), "the confidence's denominator counts continued occurrences"
    assert depths[0] == len(w), "the first draft is matched on the longest such suffix"


@pytest.mark.parametrize("impl", IMPLS)
def test_drafts_continue_a_repeated_pattern_and_back_off_past_the_depth(impl):
    ix = make_index(impl, 4)
    sid = ix.add_sequence([9, 1, 2, 3, 4, 5, 6, 9, 1, 2])
    toks, counts, totals, depths = ix.draft(ix.last_node(sid), 6)
    assert toks == [3, 4, 5, 6, 9, 1]  # longer than D - match: the walk backs off along suffix links
    assert counts == totals  # every step seen once, followed once
    assert depths == [3] * 6, "matched on '9 1 2', then each step backs off from depth D=4 to its 3-token suffix"


@pytest.mark.skipif(not native_available(), reason="the C++ suffix trie could not be built here (no compiler?)")
@settings(max_examples=40, deadline=None)
@given(seqs=st.lists(streams, min_size=1, max_size=5), queries=st.lists(streams, max_size=3),
       D=st.integers(2, 6), data=st.data())
def test_the_cpp_trie_and_the_python_reference_stay_identical_node_for_node(seqs, queries, D, data):
    py, cc = new_suffix_index(D, native=False), new_suffix_index(D, native=True)
    assert type(py) is not type(cc)
    live = []
    for s in seqs:  # interleave insertions (in pieces) and removals, so that freed node ids get reused
        cut = sorted(data.draw(st.lists(st.integers(0, len(s)), max_size=2)))
        sid = py.add_sequence(s[:cut[0]] if cut else s)
        assert cc.add_sequence(s[:cut[0]] if cut else s) == sid
        for a, b in zip(cut, cut[1:] + [len(s)]):
            py.extend(sid, s[a:b])
            cc.extend(sid, s[a:b])
        live.append(sid)
        if len(live) > 1 and data.draw(st.booleans()):
            gone = live.pop(data.draw(st.integers(0, len(live) - 1)))
            py.remove(gone)
            cc.remove(gone)
        for field in ("count", "out", "depth", "link", "parent", "token", "best"):
            assert list(getattr(py, field)) == list(getattr(cc, field)), field
        assert dict(py.edges) == dict(cc.edges)
        assert (py.version, py.num_tokens, py.num_nodes, py.sequence_ids) == (
            cc.version, cc.num_tokens, cc.num_nodes, cc.sequence_ids)
    for q in queries:
        node = py.match(q)
        assert cc.match(q) == node
        assert py.draft(node, 4, 1) == tuple(cc.draft(node, 4, 1))
    with pytest.raises(ValueError):
        cc.extend(live[0], [1 << 32])
    with pytest.raises(KeyError):
        cc.remove(10_000)


@pytest.mark.parametrize("impl", IMPLS)
def test_shared_ring_memory_stays_under_its_bound_over_a_long_run(impl):
    D, budget = 6, 1500
    prop = SuffixProposer(SuffixConfig(max_depth=D, shared_max_tokens=budget, shared_max_outputs=1000,
                                       native=impl == "native"))
    rng = random.Random(0)
    peak_nodes = peak_bytes = 0
    for i in range(200):  # 200 outputs of 20..80 tokens: ~10k tokens through a 1.5k-token ring
        n = rng.randint(20, 80)
        base = [rng.randrange(200) for _ in range(20)]
        out = [base[rng.randrange(20)] if rng.random() < 0.5 else rng.randrange(5000) for _ in range(n)]
        prop.add_shared(out)
        ix = prop.shared
        assert ix.num_tokens <= budget
        assert ix.num_nodes <= 1 + D * ix.num_tokens
        peak_nodes = max(peak_nodes, len(ix.count))  # allocated slots, freed ones included
        if i == 50:
            bytes_early = ix.nbytes()
        peak_bytes = max(peak_bytes, ix.nbytes())
    assert peak_nodes <= 1 + D * budget, "freed nodes are reused: the arrays never outgrow the bound"
    assert peak_bytes < 2 * bytes_early, "memory levels off once the ring is full"
    prop.shared.remove(prop.shared.sequence_ids[0])  # the structure stays consistent after evictions
    assert prop.shared.num_tokens <= budget


def _drive(prop: SuffixProposer, slot: int, prompt: list[int], output: list[int]) -> None:
    prop.reset(slot, prompt)
    prop.commit(slot, output)


def test_request_scope_never_drafts_from_another_requests_output():
    secret = [40, 41, 42, 43, 44, 45]
    for scope, shares in (("shared", True), ("request", False)):
        prop = SuffixProposer(SuffixConfig(max_drafts=4, scope=scope))
        _drive(prop, 0, [1, 2, 3], [7, 8] + secret)
        prop.release(0)  # request 0 finished: its output enters the shared ring (shared scope only)
        prop.reset(0, [5, 6, 7, 8, 40, 41])  # a new request in the same slot, ending like request 0's output
        batch = prop.propose([0])
        assert (batch.tokens[0, :4].tolist() == secret[2:6]) is shares
        if not shares:
            assert int(batch.lens[0]) == 0
            with pytest.raises(ValueError, match="request scope"):
                prop.add_shared(secret)


def test_running_requests_do_not_see_each_others_text_until_released():
    prop = SuffixProposer(SuffixConfig(max_drafts=3))
    _drive(prop, 0, [1, 2], [30, 31, 32, 33])
    prop.reset(1, [9, 30, 31])
    assert int(prop.propose([1]).lens[0]) == 0  # slot 0 is still running: not in the shared index
    prop.release(0)
    prop.commit(1, [])  # nothing new in slot 1, but the shared index changed: the cursor re-syncs
    assert prop.propose([1]).tokens[0].tolist() == [32, 33, 0]


@settings(max_examples=40, deadline=None)
@given(stream=st.lists(st.integers(0, 4), min_size=4, max_size=60), data=st.data())
def test_lazy_indexing_drafts_what_indexing_every_commit_would(stream, data):
    """Commits are indexed at the slot's next lookup: whichever steps look a slot up, and whatever
    entered the shared index in between, a lookup drafts what a proposer that looked the slot up
    after every commit drafts at that point (confidences included)."""
    eager, lazy = (SuffixProposer(SuffixConfig(max_drafts=3, max_depth=4, min_match=1)) for _ in range(2))
    for prop in (eager, lazy):
        prop.reset(0, stream[:2])
    pos = 2
    while pos < len(stream):
        n = data.draw(st.integers(1, 3))
        chunk, pos = stream[pos:pos + n], pos + n
        released = data.draw(st.booleans())
        for prop in (eager, lazy):
            prop.commit(0, chunk)
            if released:  # another request finished: its output enters the shared index
                prop.reset(1, chunk)
                prop.commit(1, stream[:pos][-5:])
                prop.release(1)
        got = eager.propose([0])
        if data.draw(st.booleans()):
            want = lazy.propose([0])
            assert torch.equal(got.tokens, want.tokens) and torch.equal(got.lens, want.lens)
            assert torch.allclose(got.confidence, want.confidence)


def test_move_carries_a_slot_and_reset_forgets_it():
    prop = SuffixProposer(SuffixConfig(max_drafts=3, scope="request"))
    _drive(prop, 0, [1, 2, 3, 4], [1, 2])
    _drive(prop, 1, [5, 6, 7, 8], [5, 6])
    before = prop.propose([1]).tokens.tolist()
    assert before == [[7, 8, 5]]
    prop.release(0)
    prop.move(1, 0)  # the engine compacts slot 1 into the hole at 0
    assert prop.propose([0]).tokens.tolist() == before
    prop.commit(0, [7])
    assert prop.propose([0]).tokens.tolist() == [[8, 5, 6]]
    with pytest.raises(KeyError):
        prop.propose([1])
    prop.reset(0, [9, 9, 1])  # a new request: nothing of the old one remains
    assert int(prop.propose([0]).lens[0]) == 0


def test_confidence_is_the_smoothed_continuation_probability_and_sts_rescales_it():
    seq = [1, 2, 3, 1, 2, 4, 1, 2, 3, 1, 2]  # "1 2" was followed by 3 twice and by 4 once
    plain = SuffixProposer(SuffixConfig(max_drafts=2, min_match=2, max_depth=3, scope="request"))
    plain.reset(0, seq)
    b = plain.propose([0])
    assert b.tokens[0, 0] == 3 and b.point_mass
    assert b.conf_logits[0, 0].item() == pytest.approx(continuation_logit(2, 3))
    assert b.confidence[0, 0].item() == pytest.approx(2.5 / 4)
    hot = SuffixProposer(plain.cfg, sts_temperatures=[2.0, 2.0])
    hot.reset(0, seq)
    h = hot.propose([0])
    assert torch.equal(h.tokens, b.tokens), "calibration changes confidences, never drafts"
    assert h.confidence[0, 0].item() == pytest.approx(torch.sigmoid(torch.tensor(continuation_logit(2, 3) / 2)).item())
    with pytest.raises(ValueError):
        SuffixProposer(plain.cfg, sts_temperatures=[1.0])


def test_online_calibration_moves_from_the_raw_confidence_to_the_observed_survival():
    seq = [1, 2, 3, 1, 2, 4, 1, 2, 3, 1, 2]
    sp = SuffixProposer(SuffixConfig(max_drafts=2, min_match=2, max_depth=3, scope="request"))
    sp.reset(0, seq)
    before = sp.propose([0])
    z, z1 = before.conf_logits[0].tolist()
    raw = 2.5 / 4
    assert before.confidence[0, 0].item() == pytest.approx(raw), "no evidence yet: the raw confidence"
    for _ in range(96):  # drafts in this cell at position 0 survive one time in four
        sp.observe(0, [z, z1], verified=2, accepted=0)
    for _ in range(32):
        sp.observe(0, [z, z1], verified=2, accepted=1)
    after = sp.propose([0])
    assert torch.equal(after.tokens, before.tokens), "calibration changes confidences, never drafts"
    pooled = (32 + 4 * raw) / (128 + 4)  # position 0, this logit bin, any depth
    assert after.confidence[0, 0].item() == pytest.approx((32 + 4 * pooled) / (128 + 4))
    # position 1 was tested only where draft 0 survived (32 times), and never survived itself
    assert sp.calibrations[False].tested[1][OnlineCalibration._bin(z1)] == 32
    assert after.confidence[0, 1].item() < 0.1
    # unverified drafts teach nothing
    frozen = sp.calibrations[False].tested
    sp.observe(0, [z, z1], verified=0, accepted=0)
    assert sp.calibrations[False].tested == frozen


def test_greedy_and_sampled_rows_are_calibrated_apart():
    seq = [1, 2, 3, 1, 2, 4, 1, 2, 3, 1, 2]
    sp = SuffixProposer(SuffixConfig(max_drafts=2, min_match=2, max_depth=3, scope="request"))
    sp.reset(0, seq)
    greedy, hot = torch.tensor([0.0]), torch.tensor([1.0])
    before = sp.propose([0], hot)
    z = before.conf_logits[0].tolist()
    for _ in range(64):  # every sampled round rejects the first draft
        sp.propose([0], hot)
        sp.observe(0, z, verified=2, accepted=0)
    assert sp.propose([0], hot).confidence[0, 0].item() < 0.1
    g = sp.propose([0], greedy)
    assert g.confidence[0, 0].item() == pytest.approx(before.confidence[0, 0].item()), "greedy rows learnt nothing"
    assert sp.propose([0]).confidence[0, 0].item() == pytest.approx(g.confidence[0, 0].item()), "no temperature: greedy"


def test_online_calibration_tells_deep_matches_from_shallow_ones_at_the_same_counts():
    cal = OnlineCalibration(positions=1)
    z = continuation_logit(1, 1)  # a continuation seen once: the same raw logit at any depth
    for i in range(200):
        cal.observe([z], [14], verified=1, accepted=int(i % 10 != 0))  # deep matches survive 9 times in 10
        cal.observe([z], [2], verified=1, accepted=int(i % 10 == 0))  # shallow ones 1 time in 10
    deep, shallow = cal.confidence(z, 0, 14), cal.confidence(z, 0, 2)
    assert deep == pytest.approx(0.9, abs=0.03) and shallow == pytest.approx(0.1, abs=0.03)
    assert cal.confidence(z, 0, 6) == pytest.approx(0.5, abs=0.03), "an unseen depth falls back to its position's rate"


def test_config_refuses_bad_settings():
    for bad in ({"scope": "tenant"}, {"max_depth": 1}, {"min_match": 0}, {"max_drafts": 0}, {"shared_max_tokens": 0}):
        with pytest.raises(ValueError):
            SuffixConfig(**bad)
