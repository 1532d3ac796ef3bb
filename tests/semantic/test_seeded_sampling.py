"""A request with a seed gives the same tokens every time (the coupled rule, plugins/coupled.py).

The same text alone five times in a row, through the engine's own thread (tokens streamed to
the callback as they come) five times, and four copies inside a 32-way in-flight batch of
mixed requests; with target-only decoding and with drafters that accept little, a lot, or
on some steps only (the drafting gate), under every verify-length policy. The sampler
itself is checked to be exact (chi-square); the multi-step distribution test of the
scheduler's Markov toy runs the coupled rule too (test_scheduler_lossless.py).
"""
from __future__ import annotations

import threading

import numpy as np
import pytest
import torch
from scipy import stats

from dspark.engine.api import RequestValidationError, SamplingParams
from dspark.engine.runtime import EngineConfig, SpecEngine
from dspark.engine.sps import SpsTable
from dspark.plugins import coupled
from dspark.plugins.reference import process_logits, verify

from ..conftest import make_tiny_target, run_with_arrivals, tiny_drafter

# ---------------------------------------------------------------------------------------
# The noise and the sampler
# ---------------------------------------------------------------------------------------

_M = 0xFFFFFFFF


def _mix(x: int) -> int:
    x &= _M
    x ^= x >> 16
    x = (x * 0x7FEB352D) & _M
    x ^= x >> 15
    x = (x * 0x846CA68B) & _M
    return x ^ (x >> 16)


def _noise_in_python(key: int, pos: int, token: int) -> float:
    """The race noise computed with Python integers (no wrap-around assumptions) and float64."""
    lo = _mix((key & _M) ^ 0x5BD1E995)
    hi = _mix(((key >> 32) * 0x9E3779B9 + 0x5BD1E995) & _M)
    k = _mix(_mix(lo ^ hi) ^ _mix((pos * 0x9E3779B9 + 0x27D4EB2F) & _M))
    h = _mix(k ^ _mix((token * 0x9E3779B9) & _M))
    w = min(((h & 0x7FFFFFFF) + 0.5) * 2.0**-31, 1.0 - 2.0**-24)
    return -float(np.log1p(-w))


def test_race_noise_is_the_documented_hash_whatever_the_integer_width_of_the_device():
    """The int32 tensor code (wrap-around products) equals the hash in exact integers."""
    keys = torch.tensor([0, 1, 1234, 2**40 + 5, 2**63 - 1])
    pos = torch.tensor([0, 7, 19, 123_456, 2**31 + 3])
    ids = torch.tensor([0, 3, 63, 49_151])
    got = coupled.race_noise(keys, pos, 49_152, ids)
    want = torch.tensor([[_noise_in_python(int(k), int(p), int(t)) for t in ids] for k, p in zip(keys, pos)],
                        dtype=torch.float64)
    torch.testing.assert_close(got.double(), want, rtol=1e-6, atol=0)
    full = coupled.race_noise(keys, pos, 64)  # the cached whole-vocabulary path: same values
    torch.testing.assert_close(full[:, [0, 3, 63]], got[:, :3], rtol=0, atol=0)


def _chi2(counts: torch.Tensor, probs: torch.Tensor) -> float:
    expected = probs.double() / probs.double().sum() * float(counts.sum())
    big = expected >= 5
    obs = torch.cat([counts[big].double(), counts[~big].double().sum().reshape(1)])
    exp = torch.cat([expected[big], expected[~big].sum().reshape(1)])
    if float(exp[-1]) == 0.0:
        assert float(obs[-1]) == 0.0, "a zero-probability token was drawn"
        obs, exp = obs[:-1], exp[:-1]
    return float(stats.chisquare(obs.numpy(), exp.numpy()).pvalue)


@pytest.mark.parametrize("case", ["dense", "top_k_top_p", "subset_of_ids"])
def test_the_race_is_an_exact_sampler(case):
    """Over many (seed, position) keys the winner follows the row's distribution (chi-square);
    masked tokens (probability 0) never win."""
    g = torch.Generator().manual_seed(5)
    logits = torch.randn(40, generator=g) * 2.0
    if case == "top_k_top_p":
        p = process_logits(logits, torch.tensor(0.8), torch.tensor(12), torch.tensor(0.9))
    else:
        p = torch.softmax(logits, -1)
    ids = torch.randperm(49_152, generator=g)[:40] if case == "subset_of_ids" else None
    n = 60_000
    seeds = torch.arange(n) // 3
    picks = coupled.race_sample(p.expand(n, -1), seeds, 100 + torch.arange(n) % 3, ids)
    assert _chi2(torch.bincount(picks, minlength=40), p) > 1e-3


def test_the_choice_at_a_position_depends_on_seed_and_position_only():
    p = torch.softmax(torch.randn(3, 64, generator=torch.Generator().manual_seed(0)) * 0.3, -1)
    a = coupled.race_sample(p, torch.tensor([7, 7, 7]), torch.tensor([10, 11, 12]))
    rows = torch.tensor([2, 0])  # the same rows in another batch, in another order
    b = coupled.race_sample(p[rows], torch.tensor([7, 7]), torch.tensor([12, 10]))
    assert b.tolist() == a[rows].tolist()
    many = coupled.race_sample(p[:1].expand(200, -1), torch.arange(200), torch.full((200,), 10))
    assert len(set(many.tolist())) > 20, "different seeds must give different choices"


def test_the_race_among_the_top_candidates_is_the_full_race_whenever_its_winner_is_one_of_them():
    """``race_sample_top`` over m columns: the full race's winner where that is among the row's m
    likeliest, always one of them, and with m = N the full race everywhere."""
    g = torch.Generator().manual_seed(11)
    n, N, m = 3000, 300, 8
    logits = torch.randn(n, N, generator=g) * 3.0
    temps = torch.rand(n, generator=g) * 1.5 + 0.3
    ids = torch.randperm(49_152, generator=g)[:N]
    keys, pos = torch.randint(0, 2**40, (n,), generator=g), torch.randint(0, 10_000, (n,), generator=g)
    full = coupled.race_sample(torch.softmax(logits / temps.unsqueeze(-1), -1), keys, pos, ids)
    top = coupled.race_sample_top(logits, temps, keys, pos, ids, candidates=m)
    among = logits.topk(m, -1).indices
    inside = (among == full.unsqueeze(-1)).any(-1)
    assert 0.5 < float(inside.float().mean()) < 1.0, "the case must have winners inside and outside the top m"
    assert torch.equal(top[inside], full[inside])
    assert bool((among == top.unsqueeze(-1)).any(-1).all()), "the winner is always one of the m candidates"
    assert torch.equal(coupled.race_sample_top(logits, temps, keys, pos, ids, candidates=N), full)


def test_the_race_among_the_top_candidates_samples_the_distribution_cut_to_them():
    """Chi-square: the winner follows q restricted to its m likeliest tokens, renormalised."""
    logits = torch.randn(40, generator=torch.Generator().manual_seed(5)) * 1.2
    m, n, t = 10, 60_000, 0.8
    q = torch.softmax(logits / t, -1)
    cut = torch.zeros_like(q)
    top = logits.topk(m).indices
    cut[top] = q[top]
    picks = coupled.race_sample_top(logits.expand(n, -1), torch.full((n,), t), torch.arange(n) // 3,
                                    100 + torch.arange(n) % 3, candidates=m)
    assert _chi2(torch.bincount(picks, minlength=40), cut) > 1e-3


def test_race_noise_keys_cached_per_offset_give_the_samplers_own_draws():
    """``RaceNoise`` computes its keys once per span of offsets; a draw at any offset, for any
    subset of rows, is the sampler's own at (key, pos + offset)."""
    g = torch.Generator().manual_seed(4)
    R, N = 6, 50
    key, pos = torch.randint(0, 2**62, (R,), generator=g), torch.randint(0, 4000, (R,), generator=g)
    logits = torch.randn(R, N, generator=g)
    temps = torch.full((R,), 1.3)
    rows = torch.tensor([4, 1, 2])
    noise = coupled.RaceNoise(key, pos)
    for k in (0, 3, coupled.RaceNoise.KEY_SPAN + 5, 1):
        p = torch.softmax(logits[rows] / 1.3, -1)
        assert torch.equal(noise.draw(p, k, rows), coupled.race_sample(p, key[rows], pos[rows] + k))
        assert torch.equal(noise.draw_top(logits[rows], temps[rows], k, rows, candidates=7),
                           coupled.race_sample_top(logits[rows], temps[rows], key[rows], pos[rows] + k, candidates=7))


@pytest.mark.parametrize("algo", ["dspark", "eagle3"])
def test_drafts_judged_by_the_coupled_rule_skip_their_distributions_and_keep_their_tokens(algo):
    """With ``RaceNoise.coupled`` a drafter returns no draft distributions; over a vocabulary no
    wider than ``RACE_CANDIDATES`` its drafts are the exact sampler's, token for token."""
    from dspark.engine.draft_runner import make_draft_runner

    target = make_tiny_target()
    assert target.vocab_size <= coupled.RACE_CANDIDATES
    d = tiny_drafter(target, algo)
    runner = make_draft_runner(d, 4)
    g = torch.Generator().manual_seed(9)
    F = d.cfg.num_aux_layers * d.cfg.hidden_size
    runner.append([(s, torch.randn(5 + s, F, generator=g), torch.randint(0, 64, (5 + s,), generator=g))
                   for s in range(4)])
    anchors, temps = torch.tensor([3, 9, 27, 40]), torch.tensor([1.0, 0.0, 0.7, 1.3])
    key, pos = torch.tensor([5, 6, 7, 8]), torch.tensor([10, 11, 12, 13])
    exact = runner.propose([0, 1, 2, 3], anchors, temps, coupled.RaceNoise(key, pos))
    cheap = runner.propose([0, 1, 2, 3], anchors, temps, coupled.RaceNoise(key, pos, coupled=True))
    assert exact.probs is not None and cheap.probs is None
    assert torch.equal(cheap.tokens, exact.tokens)


# ---------------------------------------------------------------------------------------
# The verify rule
# ---------------------------------------------------------------------------------------


def _random_case(R: int, K: int, V: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(R, K + 1, V, generator=g) * 1.5
    temps = torch.where(torch.rand(R, generator=g) < 0.25, 0.0, 1.0)
    lens = torch.randint(0, K + 1, (R,), generator=g)
    return logits, temps, lens, torch.randint(0, 2**40, (R,), generator=g), torch.randint(0, 500, (R,), generator=g)


def _choices(logits, temps, seeds, pos):
    """The target's own choices position by position, as target-only decoding makes them."""
    R, J, _ = logits.shape
    out = torch.empty(R, J, dtype=torch.long)
    for j in range(J):
        res = coupled.verify_coupled(torch.zeros(R, 0, dtype=torch.long), logits[:, j:j + 1],
                                     torch.zeros(R, dtype=torch.long), temps, seed=seeds, position=pos + j)
        out[:, j] = res.output_tokens[:, 0]
    return out


def test_coupled_verify_emits_the_targets_own_choices_whatever_was_drafted():
    """Drafts that are right for a random prefix, then wrong, or random: the emitted tokens are
    always a prefix of the target-only choices, and a draft is accepted exactly when it is one."""
    R, K, V = 64, 5, 30
    logits, temps, lens, seeds, pos = _random_case(R, K, V, seed=1)
    y = _choices(logits, temps, seeds, pos)
    g = torch.Generator().manual_seed(2)
    right = torch.randint(0, K + 1, (R,), generator=g)
    drafts = torch.where(torch.arange(K) < right.unsqueeze(-1), y[:, :K], (y[:, :K] + 1) % V)
    drafts[::4] = torch.randint(0, V, (R // 4 + (R % 4 > 0), K), generator=g)
    drafts[1, 0] = V + 3  # out of range: never accepted
    res = coupled.verify_coupled(drafts, logits, lens, temps, seed=seeds, position=pos)
    match = torch.cumprod((drafts == y[:, :K]).long(), -1).sum(-1)
    assert res.num_accepted.tolist() == torch.minimum(match, lens).tolist()
    for r in range(R):
        n = int(res.num_accepted[r])
        assert res.output_tokens[r, :n + 1].tolist() == y[r, :n + 1].tolist()
        assert bool((res.output_tokens[r, n + 1:] == -1).all())


def test_greedy_rows_are_verified_alike_by_both_rules():
    R, K, V = 32, 4, 20
    logits, _, lens, seeds, pos = _random_case(R, K, V, seed=3)
    temps = torch.zeros(R)
    drafts = logits[:, :K].argmax(-1)
    drafts[::3, 1] = (drafts[::3, 1] + 1) % V
    a = coupled.verify_coupled(drafts, logits, lens, temps, seed=seeds, position=pos)
    b = verify(drafts, None, logits, lens, temps, seed=seeds, offset=pos)
    assert a.output_tokens.tolist() == b.output_tokens.tolist()
    assert a.num_accepted.tolist() == b.num_accepted.tolist()


def test_the_packed_rule_reads_only_the_verified_cells_and_agrees_with_the_grid():
    """The engine verifies on the ragged pass's packed logits: the same result as on the padded
    grid, with whatever lies in the padding (NaN here) never read; a miscounted pack is refused."""
    R, K, V = 48, 4, 25
    logits, temps, lens, seeds, pos = _random_case(R, K, V, seed=5)
    temps[::2] = 0.0  # greedy and sampled rows mixed
    drafts = torch.randint(0, V, (R, K), generator=torch.Generator().manual_seed(6))
    drafts[::3] = logits[::3, :K].argmax(-1)
    cells = torch.arange(K + 1).unsqueeze(0) <= lens.unsqueeze(-1)
    padded = logits.clone()
    padded[~cells] = float("nan")
    grid = coupled.verify_coupled(drafts, padded, lens, temps, top_k=torch.full((R,), 7), seed=seeds, position=pos)
    packed = coupled.verify_coupled_packed(drafts, logits[cells], lens, temps, top_k=torch.full((R,), 7),
                                           seed=seeds, position=pos)
    assert packed.num_accepted.tolist() == grid.num_accepted.tolist()
    assert packed.output_tokens.tolist() == grid.output_tokens.tolist()
    assert int(grid.num_accepted.sum()) > 0
    with pytest.raises(ValueError, match="sum"):
        coupled.verify_coupled_packed(drafts, logits[cells][1:], lens, temps, seed=seeds, position=pos)


# ---------------------------------------------------------------------------------------
# The engine: one identical text everywhere
# ---------------------------------------------------------------------------------------

PROMPT = [7, 8, 9, 10, 11]
TEMPERATURE = 3.0  # the tiny target is sharp: at 3.0 its tokens mix near-certain and open choices
SEEDED = [SamplingParams(max_tokens=16, temperature=TEMPERATURE, seed=1234),
          SamplingParams(max_tokens=16, temperature=TEMPERATURE, top_k=12, top_p=0.9, seed=99)]


def _drafter(target, algo: str, draft_vocab: bool = False):
    return tiny_drafter(target, algo, torch.arange(0, target.vocab_size, 2) if draft_vocab else None)


def _gate_table() -> SpsTable:
    """Verify tokens nearly free and a cheap drafter: the gate drafts, probes, and skips as it learns."""
    tokens = [1, 8, 64, 256]
    return SpsTable(tokens=tokens, steps_per_s=[1.0 / (1.0 + 0.02 * (t - 1)) for t in tokens], device="cpu",
                    engine="toy", draft_requests=[1, 64], draft_seconds=[0.3, 0.6])


class _Oracle:
    """A drafter proposing the request's known answer with one wrong token at a varying place,
    so blocks are accepted for 0..K tokens."""

    def __init__(self, engine, truth: dict[int, list[int]]):
        self.engine, self.inner, self.truth, self.calls = engine, engine.draft_runner, truth, 0

    def __getattr__(self, k):
        return getattr(self.inner, k)

    def propose(self, slots, anchors, temperature, noise=None):
        prop = self.inner.propose(slots, anchors, temperature, noise)
        by_slot = {r.slot: r for r in self.engine._active}
        K = prop.tokens.shape[1]
        for i, s in enumerate(slots):
            r = by_slot[s]
            if r.params.seed not in self.truth:
                continue
            done = len(r.generated)
            nxt = (self.truth[r.params.seed][done:done + K] + [0] * K)[:K]
            self.calls += 1
            wrong = self.calls % (K + 2)
            if wrong < K:
                nxt[wrong] = (nxt[wrong] + 1) % self.engine.target.vocab_size
            prop.tokens[i] = torch.tensor(nxt)
        return prop


def _engine(name: str, target, truth: dict[int, list[int]]) -> SpecEngine:
    tiny = dict(max_batch=32, prefill_chunk=4)
    if name == "target_only":
        return SpecEngine(target, None, EngineConfig(mode="target_only", **tiny))
    if name == "dspark fixed":
        return SpecEngine(target, _drafter(target, "dspark"), EngineConfig(mode="spec", **tiny))
    if name == "dspark threshold":
        return SpecEngine(target, _drafter(target, "dspark"),
                          EngineConfig(mode="spec", scheduler="threshold", threshold=0.5, **tiny))
    if name == "dspark algorithm1 + gate":
        return SpecEngine(target, _drafter(target, "dspark"), EngineConfig(mode="spec", scheduler="algorithm1", **tiny),
                          sps=_gate_table())
    if name == "eagle3 draft vocab":
        return SpecEngine(target, _drafter(target, "eagle3", draft_vocab=True), EngineConfig(mode="spec", **tiny))
    assert name == "oracle dflash"
    engine = SpecEngine(target, _drafter(target, "dflash"), EngineConfig(mode="spec", **tiny))
    engine.draft_runner = _Oracle(engine, truth)
    return engine


def _alone(engine, params) -> list[int]:
    out: list[int] = []
    engine.submit("alone", PROMPT, params, lambda o: out.extend(o.new_token_ids))
    engine.run_until_done()
    return out


def _streamed(engine, params) -> list[int]:
    """Through the engine's own thread: the callback gets the tokens step by step."""
    out: list[int] = []
    done = threading.Event()

    def cb(o):
        out.extend(o.new_token_ids)
        if o.finished:
            done.set()
    engine.submit("streamed", PROMPT, params, cb)
    assert done.wait(120), "the streamed request did not finish"
    return out


def _in_batch(engine, copies: list[SamplingParams]) -> dict[str, list[int]]:
    """32 requests in flight: the copies join at different steps among 32 - len(copies) others
    (greedy, sampled with other seeds, unseeded, other prompts and lengths)."""
    g = torch.Generator().manual_seed(8)
    jobs = []
    for i in range(32 - len(copies)):
        plen = int(torch.randint(2, 14, (1,), generator=g))
        kind = i % 3
        params = SamplingParams(max_tokens=int(torch.randint(4, 24, (1,), generator=g)),
                                temperature=0.0 if kind == 0 else float(torch.rand(1, generator=g)) * 3 + 0.3,
                                top_k=int(torch.randint(0, 20, (1,), generator=g)),
                                seed=None if kind == 2 else 5000 + i)
        jobs.append((int(torch.randint(0, 6, (1,), generator=g)), f"other{i}",
                     torch.randint(6, 64, (plen,), generator=g).tolist(), params))
    jobs += [(3 * c, f"copy{c}", PROMPT, p) for c, p in enumerate(copies)]
    outs = run_with_arrivals(engine, jobs)
    return {rid: outs[rid] for _, rid, _, _ in jobs if rid.startswith("copy")}


@pytest.mark.parametrize("name, params", [
    ("target_only", SEEDED[0]),
    ("dspark algorithm1 + gate", SEEDED[0]),
    ("oracle dflash", SEEDED[0]),
    pytest.param("target_only", SEEDED[1], marks=pytest.mark.slow),
    pytest.param("dspark fixed", SEEDED[1], marks=pytest.mark.slow),
    pytest.param("dspark threshold", SEEDED[0], marks=pytest.mark.slow),
    pytest.param("dspark algorithm1 + gate", SEEDED[1], marks=pytest.mark.slow),
    pytest.param("eagle3 draft vocab", SEEDED[0], marks=pytest.mark.slow),
    pytest.param("oracle dflash", SEEDED[1], marks=pytest.mark.slow),
])
def test_a_seeded_request_gives_one_text_alone_streamed_and_in_a_32_way_batch_with_any_drafter_or_none(name, params):
    """Five runs alone, five streamed through the engine thread, four copies in a 32-way batch:
    all equal to target-only decoding with the same seed."""
    target = make_tiny_target()
    reference = {p.seed: _alone(SpecEngine(target, None, EngineConfig(mode="target_only")), p) for p in SEEDED}
    assert all(len(t) == 16 for t in reference.values())
    other = _alone(SpecEngine(target, None, EngineConfig(mode="target_only")),
                   SamplingParams(max_tokens=16, temperature=params.temperature, top_k=params.top_k,
                                  top_p=params.top_p, seed=params.seed + 1))
    assert other != reference[params.seed], "another seed must give another text (else the test proves nothing)"
    engine = _engine(name, target, reference)
    want = reference[params.seed]
    runs = [_alone(engine, params) for _ in range(5)]
    engine.start()
    try:
        runs += [_streamed(engine, params) for _ in range(5)]
    finally:
        engine.stop()
    assert all(run == want for run in runs), f"{name}: alone/streamed runs differ from target-only: {runs} vs {want}"
    batch = _in_batch(engine, [params] * 4)
    assert all(run == want for run in batch.values()), \
        f"{name}: copies in a 32-way batch differ from the request alone: {batch} vs {want}"
    if name != "target_only":
        assert engine.stats["accepted_tokens"] > 0, f"{name}: no draft was ever accepted"
    if name == "dspark algorithm1 + gate":
        assert engine.gate is not None and 0 < engine.stats["skipped_draft_steps"] < engine.stats["rounds"], \
            "the gate must both draft and skip in this run"


def test_with_the_auto_setting_unseeded_requests_use_rejection_sampling_and_seeded_ones_still_reproduce():
    target = make_tiny_target()
    want = _alone(SpecEngine(target, None, EngineConfig(mode="target_only")), SEEDED[0])
    engine = SpecEngine(target, _drafter(target, "dspark"), EngineConfig(mode="spec", max_batch=32,
                                                                         sampling_rule="auto"))
    rejection_rows = []
    inner = engine.verify

    def spy(drafts, *args, **kwargs):
        rejection_rows.append(drafts.shape[0])
        return inner(drafts, *args, **kwargs)
    engine.verify = spy
    batch = _in_batch(engine, [SEEDED[0]] * 4)
    assert all(run == want for run in batch.values())
    assert sum(rejection_rows) > 0, "unseeded sampled requests must go through rejection sampling"
    with pytest.raises(ValueError, match="sampling_rule"):
        SpecEngine(target, None, EngineConfig(mode="target_only", sampling_rule="gumbel"))


@pytest.mark.parametrize("seed", [-1, 2**63, 1.5, True])
def test_a_seed_outside_the_63_bit_range_is_refused(seed):
    with pytest.raises(RequestValidationError, match="seed"):
        SamplingParams(seed=seed).validate()
