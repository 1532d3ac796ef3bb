"""Greedy speculative decoding is token-identical to the target alone, in a batched in-flight run."""
from __future__ import annotations

import pytest
import torch

from dspark.engine.api import SamplingParams
from dspark.engine.runtime import EngineConfig, SpecEngine
from dspark.training.models import build_drafter, drafter_config_for

from ..conftest import make_tiny_target, tiny_run_config


def _hf_greedy(target, prompt, n):
    out = target.model.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False, min_new_tokens=n,
                                pad_token_id=0)
    return out[0, len(prompt):].tolist()


def _run_in_flight(engine, jobs):
    """jobs: [(arrival_step, rid, prompt, params)]; requests join while others run."""
    outs: dict[str, list[int]] = {}
    finished: dict[str, str] = {}

    def cb(o):
        outs.setdefault(o.request_id, []).extend(o.new_token_ids)
        if o.finished:
            finished[o.request_id] = o.finish_reason
    step = 0
    pending = sorted(jobs, key=lambda j: j[0])
    while pending or engine.has_work():
        while pending and pending[0][0] <= step:
            _, rid, prompt, params = pending.pop(0)
            engine.submit(rid, prompt, params, cb)
        engine.step()
        step += 1
    return outs, finished


def _jobs(seed=0):
    g = torch.Generator().manual_seed(seed)
    jobs = []
    for i in range(7):
        plen = int(torch.randint(3, 40, (1,), generator=g))
        prompt = torch.randint(6, 64, (plen,), generator=g).tolist()
        greedy = i % 3 != 2
        params = SamplingParams(max_tokens=int(torch.randint(5, 30, (1,), generator=g)),
                                temperature=0.0 if greedy else 0.8, top_k=0 if greedy else 10, seed=i)
        jobs.append((i * 2, f"r{i}", prompt, params))
    return jobs


@pytest.mark.parametrize("algo", ["dspark", "dflash", "eagle3"])
def test_greedy_speculative_output_is_identical_to_target_only_in_flight(algo):
    target = make_tiny_target()
    cfg = tiny_run_config(algo)
    torch.manual_seed(3)
    drafter = build_drafter(drafter_config_for(cfg, target), target)  # untrained: many rejections
    jobs = _jobs()
    spec, fin = _run_in_flight(SpecEngine(target, drafter, EngineConfig(mode="spec", max_batch=4, prefill_chunk=8)), jobs)
    base, _ = _run_in_flight(SpecEngine(target, None, EngineConfig(mode="target_only", max_batch=3)), jobs)
    for _, rid, prompt, params in jobs:
        assert len(spec[rid]) == params.max_tokens and fin[rid] == "length"
        if params.temperature == 0:
            assert spec[rid] == base[rid], f"{algo}: request {rid} differs from target-only greedy"
            assert spec[rid] == _hf_greedy(target, prompt, params.max_tokens), f"{rid} differs from HF generate"


@pytest.mark.parametrize("mode", ["spec", "target_only"])
def test_prompt_chunks_in_the_verify_pass_change_no_output(mode):
    """With fused_prefill the prompt chunks of arriving requests ride in the running requests'
    verify pass; every output, greedy or seeded-sampled, is the one of separate passes."""
    target = make_tiny_target()
    torch.manual_seed(3)
    drafter = build_drafter(drafter_config_for(tiny_run_config("dspark"), target), target) if mode == "spec" else None
    outs = []
    for fused in (True, False):
        engine = SpecEngine(target, drafter, EngineConfig(mode=mode, max_batch=4, prefill_chunk=8,
                                                          fused_prefill=fused))
        assert engine._fused == fused
        outs.append(_run_in_flight(engine, _jobs(1)))
    assert outs[0] == outs[1]


def test_the_scheduler_prices_the_prompt_tokens_fused_into_each_step():
    """Algorithm 1 is told how many prompt tokens ride in the step's pass (none without fused
    prefill), and the outputs stay those of target-only decoding."""
    from dspark.engine.sps import SpsTable

    target = make_tiny_target()
    torch.manual_seed(3)
    drafter = build_drafter(drafter_config_for(tiny_run_config("dspark"), target), target)
    table = SpsTable(tokens=[1, 8, 64], steps_per_s=[100.0, 90.0, 20.0], device="cpu", engine="toy")
    jobs = _jobs()
    base, _ = _run_in_flight(SpecEngine(target, None, EngineConfig(mode="target_only", max_batch=3)), jobs)
    for fused in (True, False):
        engine = SpecEngine(target, drafter, EngineConfig(mode="spec", scheduler="algorithm1", max_batch=4,
                                                          prefill_chunk=8, fused_prefill=fused), sps=table)
        priced, carried = {}, {}
        verify_round = engine._verify_round

        class RecordingPolicy:
            def __init__(self, inner, engine=engine, priced=priced):
                self.inner, self.engine, self.priced = inner, engine, priced

            def __call__(self, conf, cap=None, ids=None, prompt_tokens=0):
                self.priced[self.engine.stats.steps] = prompt_tokens
                return self.inner(conf, cap, ids, prompt_tokens=prompt_tokens)

            def __getattr__(self, name):
                return getattr(self.inner, name)

        def recording_verify(reqs, batch, lens, temps, chunks, engine=engine, carried=carried, run=verify_round):
            carried[engine.stats.steps] = sum(n for _, n in chunks)
            return run(reqs, batch, lens, temps, chunks)
        engine.policy, engine._verify_round = RecordingPolicy(engine.policy), recording_verify
        spec, _ = _run_in_flight(engine, jobs)
        assert priced and all(priced[step] == carried[step] for step in priced)
        assert (max(priced.values()) > 0) == fused
        for _, rid, _, params in jobs:
            if params.temperature == 0:
                assert spec[rid] == base[rid]


def test_greedy_identity_holds_when_the_drafter_is_the_target_itself_accepting_everything():
    """A drafter whose proposals are always right: every block fully accepted, output unchanged."""
    target = make_tiny_target()
    jobs = [(0, "a", [7, 8, 9, 10], SamplingParams(max_tokens=20))]
    base, _ = _run_in_flight(SpecEngine(target, None, EngineConfig(mode="target_only")), jobs)
    cfg = tiny_run_config("dflash")
    drafter = build_drafter(drafter_config_for(cfg, target), target)
    engine = SpecEngine(target, drafter, EngineConfig(mode="spec"))

    truth = base["a"]

    class Oracle:
        def __init__(self, inner):
            self.inner = inner

        def __getattr__(self, k):
            return getattr(self.inner, k)

        def propose(self, slots, anchors, temperature, generator=None):
            p = self.inner.propose(slots, anchors, temperature, generator)
            done = len(engine._active[0].generated)
            nxt = (truth[done:done + engine.K] + [0] * engine.K)[: engine.K]
            p.tokens[0] = torch.tensor(nxt)
            return p
    engine.draft_runner = Oracle(engine.draft_runner)
    spec, _ = _run_in_flight(engine, jobs)
    assert spec["a"] == truth
    assert engine.stats["accepted_tokens"] > 0.6 * len(truth)


def test_cancel_and_stop_tokens_end_requests_cleanly():
    target = make_tiny_target()
    eng = SpecEngine(target, None, EngineConfig(mode="target_only"))
    outs, fin = {}, {}

    def cb(o):
        outs.setdefault(o.request_id, []).extend(o.new_token_ids)
        if o.finished:
            fin[o.request_id] = o.finish_reason
    ref, _ = _run_in_flight(SpecEngine(target, None, EngineConfig(mode="target_only")),
                            [(0, "x", [7, 8, 9], SamplingParams(max_tokens=10))])
    stop_tok = ref["x"][3]
    eng.submit("s", [7, 8, 9], SamplingParams(max_tokens=10, stop_token_ids=[stop_tok]), cb)
    eng.submit("c", [7, 8, 9], SamplingParams(max_tokens=50), cb)
    eng.step(); eng.step()
    eng.cancel("c")
    eng.run_until_done()
    assert fin["s"] == "stop" and outs["s"] == ref["x"][: ref["x"].index(stop_tok) + 1]
    assert fin["c"] == "cancelled" and len(outs["c"]) < 50


def test_a_prefill_token_budget_spreads_a_burst_over_steps_without_changing_outputs():
    """Eight prompts arrive at once; with 16 prompt tokens per step they prefill oldest first over
    several steps, a request that already decodes keeps emitting every step, and every greedy
    output equals the unbudgeted engine's."""
    target = make_tiny_target()
    torch.manual_seed(3)
    drafter = build_drafter(drafter_config_for(tiny_run_config("dspark"), target), target)
    jobs = [(0, "early", [7, 8, 9], SamplingParams(max_tokens=20))]
    jobs += [(2, f"b{i}", list(range(10 + i, 22 + i)), SamplingParams(max_tokens=6)) for i in range(8)]
    free, _ = _run_in_flight(SpecEngine(target, drafter, EngineConfig(mode="spec", max_batch=9, prefill_tokens=0)), jobs)
    engine = SpecEngine(target, drafter, EngineConfig(mode="spec", max_batch=9, prefill_chunk=8, prefill_tokens=16))
    firsts: dict[str, int] = {}
    emitted_at: list[int] = []
    step = [0]
    chunks_of = engine._prefill_chunks

    def counting_chunks(reqs):
        chunks = chunks_of(reqs)
        assert sum(n for _, n in chunks) <= 16 and len(chunks) >= 1
        return chunks
    engine._prefill_chunks = counting_chunks
    real_step = engine.step

    def stepping():
        before = len(engine._active[0].generated) if engine._active and engine._active[0].rid == "early" else None
        real_step()
        for r in engine._active:
            if r.generated and r.rid not in firsts:
                firsts[r.rid] = step[0]
        if before is not None and engine._active and engine._active[0].rid == "early":
            emitted_at.append(len(engine._active[0].generated) - before)
        step[0] += 1
    engine.step = stepping
    budgeted, _ = _run_in_flight(engine, jobs)
    assert budgeted == free
    burst = [firsts[f"b{i}"] for i in range(8) if f"b{i}" in firsts]
    assert len(set(burst)) > 1 and burst == sorted(burst)  # spread over steps, oldest first
    assert emitted_at and all(n >= 1 for n in emitted_at)  # the running request never waits on the burst


def test_a_long_prompts_first_token_is_sent_before_the_drafters_context_pass():
    """A prompt longer than the feature backlog's bound: its features go to the drafter in the
    prefill step, but after its first token was sent, and the outputs stay the target's own."""
    target = make_tiny_target()
    torch.manual_seed(4)
    drafter = build_drafter(drafter_config_for(tiny_run_config("dspark"), target), target)
    prompt = list(range(6, 46))  # 40 tokens
    jobs = [(0, "long", prompt, SamplingParams(max_tokens=8)), (0, "short", prompt[:5], SamplingParams(max_tokens=8))]
    base, _ = _run_in_flight(SpecEngine(target, None, EngineConfig(mode="target_only", max_batch=2)), jobs)
    engine = SpecEngine(target, drafter, EngineConfig(mode="spec", scheduler="fixed", max_batch=2))
    engine.MAX_BACKLOG_TOKENS = 16
    events: list[tuple[str, object]] = []
    append = engine.draft_runner.append

    def logged_append(rows):
        events.append(("append", sorted(int(r) for r, _, _ in rows)))
        append(rows)
    engine.draft_runner.append = logged_append
    outs: dict[str, list[int]] = {}

    def cb(o):
        if not outs.get(o.request_id):
            events.append(("first token", o.request_id))
        outs.setdefault(o.request_id, []).extend(o.new_token_ids)
    for _, rid, p, params in jobs:
        engine.submit(rid, p, params, cb)
    engine.step()  # prefill of both (only the long prompt's backlog is over the bound), then a drafted step
    long_slot = next(r.slot for r in engine._active if r.rid == "long")
    assert events[:3] == [("first token", "long"), ("first token", "short"), ("append", [long_slot])]
    assert int(engine.draft_runner.cache.lengths[long_slot]) == len(prompt)  # every prompt position, none held back
    engine.run_until_done()
    assert outs == base
