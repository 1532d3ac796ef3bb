"""Suffix-only and hybrid (suffix + neural) drafting in the engine are lossless.

Greedy (and coupled-rule sampled) requests give exactly target-only's tokens in a mixed
in-flight batch; rejection-sampled output follows the target's joint distribution
(chi-square); the hybrid step really leaves rows to the suffix proposal without a neural
pass, and a run repeats exactly.
"""
from __future__ import annotations

import pytest
import torch

from dspark.engine.api import SamplingParams
from dspark.engine.proposers import SuffixConfig
from dspark.engine.runtime import EngineConfig, SpecEngine, parse_proposers
from dspark.engine.sps import SpsTable
from dspark.training.models import build_drafter, drafter_config_for

from ..conftest import make_tiny_target, record_rows, run_to_completion, tiny_run_config
from ..distribution import pooled_chisquare_pvalue


def _table() -> SpsTable:
    """A toy cost table with a drafter pass: verify tokens cheap, the drafter a third of a step."""
    tokens = [1, 8, 64, 256]
    return SpsTable(tokens=tokens, steps_per_s=[1.0 / (1.0 + 0.02 * (t - 1)) for t in tokens], device="cpu",
                    engine="toy", draft_requests=[1, 64], draft_seconds=[0.3, 0.6])


def _drafter(target, seed: int = 3):
    torch.manual_seed(seed)
    return build_drafter(drafter_config_for(tiny_run_config("dspark"), target), target)  # untrained


def _jobs(n: int = 9, seed: int = 0):
    """Mixed prompts: some repeat a motif (suffix matches), some random; greedy and seeded sampled."""
    g = torch.Generator().manual_seed(seed)
    jobs = []
    for i in range(n):
        if i % 2 == 0:
            motif = torch.randint(6, 64, (int(torch.randint(2, 6, (1,), generator=g)),), generator=g).tolist()
            prompt = (motif * 12)[: int(torch.randint(8, 40, (1,), generator=g))]
        else:
            prompt = torch.randint(6, 64, (int(torch.randint(3, 30, (1,), generator=g)),), generator=g).tolist()
        sampled = i % 3 == 2
        params = SamplingParams(max_tokens=int(torch.randint(10, 40, (1,), generator=g)),
                                temperature=0.9 if sampled else 0.0, top_k=10 if sampled else 0, seed=100 + i)
        jobs.append((f"r{i}", prompt, params))
    return jobs


def _engines(target):
    tiny = dict(max_batch=4, prefill_chunk=8)
    yield "suffix fixed", SpecEngine(target, None, EngineConfig(proposers="suffix", scheduler="fixed", **tiny))
    yield "suffix algorithm1 request-scope", SpecEngine(
        target, None, EngineConfig(proposers="suffix", scheduler="algorithm1",
                                   suffix=SuffixConfig(max_drafts=5, scope="request"), **tiny), sps=_table())
    yield "hybrid fixed", SpecEngine(target, _drafter(target), EngineConfig(proposers="neural+suffix",
                                                                            scheduler="fixed", **tiny))
    yield "hybrid algorithm1 + gate", SpecEngine(
        target, _drafter(target), EngineConfig(proposers="neural+suffix", scheduler="algorithm1", **tiny), sps=_table())
    yield "hybrid no_slowdown + gate", SpecEngine(
        target, _drafter(target), EngineConfig(proposers="neural+suffix", scheduler="no_slowdown", **tiny),
        sps=_table())


def test_suffix_and_hybrid_output_is_identical_to_target_only_for_every_request():
    """Greedy rows and coupled-rule sampled rows (the target's seeded choices) alike."""
    target = make_tiny_target()
    jobs = _jobs()
    base = run_to_completion(SpecEngine(target, None, EngineConfig(mode="target_only", max_batch=3)), jobs)
    for name, engine in _engines(target):
        out = run_to_completion(engine, jobs)
        for rid, _, params in jobs:
            assert len(out[rid]) == params.max_tokens
            assert out[rid] == base[rid], f"{name}: request {rid} differs from target-only"
        suffix = engine.stats.by_proposer.get("suffix")
        assert suffix is not None and suffix.accepted > 0, f"{name}: the suffix proposer never had a draft accepted"
        if "hybrid" in name:
            assert engine.stats.by_proposer["dspark"].drafted > 0, f"{name}: the neural drafter never verified"


def test_hybrid_skips_the_neural_pass_where_the_suffix_proposal_wins_and_repeats_exactly():
    target = make_tiny_target()
    jobs = _jobs(seed=1)
    runs = []
    for _ in range(2):
        engine = SpecEngine(target, _drafter(target), EngineConfig(proposers="neural+suffix", scheduler="algorithm1",
                                                                   max_batch=4, prefill_chunk=8), sps=_table())
        calls: list[int] = []
        inner = engine.draft_runner.propose

        def spy(slots, *a, _inner=inner, _calls=calls, **k):
            _calls.append(len(slots))
            return _inner(slots, *a, **k)
        engine.draft_runner.propose = spy
        out = run_to_completion(engine, jobs)
        runs.append((out, engine.stats.as_dict(), {k: v.accepted for k, v in engine.stats.by_proposer.items()}, calls))
    (out, st, by, calls), again = runs[0], runs[1]
    assert again[0] == out and again[1] == st and again[2] == by and again[3] == calls  # deterministic
    neural_rows = sum(calls)
    suffix_rounds = engine.stats.by_proposer["suffix"].rounds
    assert suffix_rounds > 0 and neural_rows < engine.stats.total.rounds, \
        "every row ran the neural pass: the suffix proposal never won a row"


def _joint_of_tokens_2_and_3(target, prompt):
    V = target.vocab_size
    with torch.no_grad():
        p0 = torch.softmax(target.model(torch.tensor([prompt])).logits[0, -1].double(), -1)
        p1 = torch.softmax(target.model(torch.tensor([prompt + [a] for a in range(V)])).logits[:, -1].double(), -1)
        seq2 = torch.tensor([prompt + [a, b] for a in range(V) for b in range(V)])
        p2 = torch.softmax(target.model(seq2).logits[:, -1].double(), -1).view(V, V, V)
    return (p0[:, None, None] * p1[:, :, None] * p2).sum(0).reshape(-1)


@pytest.mark.slow
@pytest.mark.parametrize("proposers", ["suffix", "neural+suffix"])
def test_rejection_sampled_suffix_and_hybrid_output_follows_the_target_distribution(proposers):
    """Tokens 2 and 3 of one repetitive prompt (the 1st comes from prefill, the others from
    rounds whose drafts are suffix point masses or sampled neural drafts), 3,000 times, under the
    rejection rule (where the drafts shape the randomness), against the target's exact joint
    distribution (chi-square, sparse cells pooled)."""
    target = make_tiny_target()
    prompt = [7, 8, 9, 7, 8, 9, 7, 8]
    V = target.vocab_size
    joint = _joint_of_tokens_2_and_3(target, prompt)
    drafter = _drafter(target) if "neural" in proposers else None
    engine = SpecEngine(target, drafter, EngineConfig(proposers=proposers, max_batch=64, sampling_rule="rejection",
                                                      adaptive_drafting=False, seed=5,
                                                      suffix=SuffixConfig(max_drafts=3, min_match=1)))
    n = 3000
    outs = run_to_completion(engine, [(f"s{i}", prompt, SamplingParams(max_tokens=4, temperature=1.0))
                                      for i in range(n)])
    cells = torch.tensor([outs[f"s{i}"][1] * V + outs[f"s{i}"][2] for i in range(n)])
    assert pooled_chisquare_pvalue(torch.bincount(cells, minlength=V * V), joint) > 1e-3
    suffix = engine.stats.by_proposer["suffix"]
    assert 0 < suffix.accepted < suffix.drafted, "the suffix drafts were never (or always) accepted"


def test_proposer_names_are_checked():
    assert parse_proposers("neural+suffix") == ["suffix", "neural"]
    assert parse_proposers("suffix") == ["suffix"]
    for bad in ("", "ngram", "suffix+suffix", "none+suffix"):
        with pytest.raises(ValueError, match="proposers"):
            parse_proposers(bad)
    with pytest.raises(ValueError, match="drafter checkpoint"):
        SpecEngine(make_tiny_target(), None, EngineConfig(proposers="neural+suffix"))


def test_hybrid_keeps_probing_a_drafter_whose_first_probe_accepted_nothing():
    """A row with an empty suffix proposal stays a candidate for the neural pass even when the
    drafter's estimate is 0, so an unlucky first probe does not switch the drafter off for good."""
    target = make_tiny_target()
    jobs = [("r", list(range(7, 30)), SamplingParams(max_tokens=80))]
    base = run_to_completion(SpecEngine(target, None, EngineConfig(mode="target_only", max_batch=2)), jobs)
    rare = SuffixConfig(max_drafts=3, min_match=15)  # suffix proposals rare: most rows have none
    engine = SpecEngine(target, _drafter(target), EngineConfig(proposers="neural+suffix", scheduler="algorithm1",
                                                               max_batch=2, suffix=rare), sps=_table())
    calls = record_rows(engine.draft_runner, "propose")
    engine.gate.probe_growth = 2.0  # the run consults the gate a dozen times: room for two probes when doubling
    engine.gate.observe(8, 8, 0)  # a history in which the drafter accepted nothing: its estimate is 0
    assert engine.gate.accepted == 0.0
    assert run_to_completion(engine, jobs) == base
    assert len(calls) >= 2, f"the neural pass ran {len(calls)} time(s) in {engine.stats.decode_steps} steps"
