"""Fixed-shape decode steps (the shapes CUDA graphs replay) compute what the ragged forward does."""
from __future__ import annotations

import pytest
import torch

from dspark.engine.api import SamplingParams
from dspark.engine.runtime import EngineConfig, SpecEngine
from dspark.engine.static_target import (StaticTarget, default_ctx_buckets, default_prefill_buckets,
                                         default_row_buckets)
from dspark.engine.target_runner import TargetRunner
from dspark.training.models import build_drafter, drafter_config_for

from ..conftest import make_tiny_target, run_with_arrivals, tiny_run_config


@pytest.mark.parametrize("model_type", ["llama", "qwen3"])
def test_static_forward_matches_the_ragged_forward_on_every_valid_query(model_type):
    target = make_tiny_target(model_type)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(6, 64, (n,), generator=g).tolist() for n in (9, 3, 14)]
    steps = [[7, 8, 9], [10], [11, 12]]  # ragged queries, as in a verify step

    def prefilled(reserve: int | None) -> TargetRunner:
        r = TargetRunner(target, max_slots=4, initial_capacity=8, max_context=64)
        if reserve:
            r.reserve(reserve)
        r.forward([0, 1, 2], prompts, last_logits_only=True)
        for i, p in enumerate(prompts):
            r.set_length(i, len(p))
        return r

    ragged = prefilled(None).forward([0, 1, 2], steps)
    static_runner = prefilled(64 + 4)
    ids = torch.zeros(4, 4, dtype=torch.long)  # padded to a (4 rows, 4 queries) bucket
    for r, t in enumerate(steps):
        ids[r, : len(t)] = torch.tensor(t)
    start = static_runner.lengths[:4].clone()
    # the whole cache, and a context bucket just above the longest row (14 + 3 queries)
    for out in (static_runner.forward_static(ids, start), static_runner.forward_static(ids, start, ctx=18)):
        for r, t in enumerate(steps):
            n = len(t)
            torch.testing.assert_close(out.logits[r, :n], ragged.logits[r, :n], rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(out.aux[r, :n], ragged.aux[r, :n], rtol=1e-5, atol=1e-5)


def test_buckets_round_up_and_fall_back_past_the_largest():
    target = make_tiny_target()
    st = StaticTarget(TargetRunner(target, max_slots=6, max_context=32), default_row_buckets(6), [1, 5],
                      use_graphs=False, ctx_buckets=[8, 16])
    assert default_row_buckets(6) == [1, 2, 4, 6] and default_row_buckets(1) == [1]
    assert st.capacity == 32 + 5  # allocated once, with a query's slack past max_context
    assert st.ctx_buckets == [8, 16, 37]  # the capacity is always the last context bucket
    assert st.bucket(3, 2, 9) == (4, 5, 16) and st.bucket(1, 1, 8) == (1, 1, 8) and st.bucket(6, 5) == (6, 5, 37)
    assert st.bucket(7, 1) is None and st.bucket(2, 6) is None and st.bucket(1, 1, 38) is None
    assert default_ctx_buckets(2056) == [512, 1024, 2056] and default_ctx_buckets(300) == [300]
    assert default_prefill_buckets(256) == [16, 32, 64, 128, 256] and default_prefill_buckets(8) == [8]
    with pytest.raises(ValueError, match="CUDA"):
        StaticTarget(TargetRunner(target, max_slots=2, max_context=16), [1], [1], use_graphs=True)


@pytest.mark.parametrize("ctx_buckets", [None, (16, 32)], ids=["whole-cache", "context-buckets"])
@pytest.mark.parametrize("mode", ["spec", "target_only"])
def test_engine_on_static_steps_is_token_identical_to_the_ragged_engine(mode, ctx_buckets):
    target = make_tiny_target()
    torch.manual_seed(1)
    drafter = build_drafter(drafter_config_for(tiny_run_config("dspark"), target), target) if mode == "spec" else None
    g = torch.Generator().manual_seed(4)
    jobs = [(2 * i, f"r{i}", torch.randint(6, 64, (int(torch.randint(3, 30, (1,), generator=g)),), generator=g).tolist(),
             SamplingParams(max_tokens=int(torch.randint(6, 24, (1,), generator=g)), temperature=0.0 if i % 2 else 0.9,
                            seed=i)) for i in range(6)]
    ragged = run_with_arrivals(SpecEngine(target, drafter, EngineConfig(mode=mode, max_batch=4, prefill_chunk=8)), jobs)
    engine = SpecEngine(target, drafter, EngineConfig(mode=mode, max_batch=4, prefill_chunk=8, static_steps="eager"))
    assert isinstance(engine.runner, StaticTarget)
    if ctx_buckets:  # requests grow from ~10 to ~50 positions: steps cross 16 and 32
        st = engine.runner
        engine.runner = StaticTarget(st.runner, st.row_buckets, st.query_buckets, use_graphs=False,
                                     ctx_buckets=ctx_buckets, prefill_buckets=st.prefill_buckets)
    static = run_with_arrivals(engine, jobs)
    assert engine.runner.replays > 0, "decode steps must have gone through the buckets"
    assert engine.runner.prefill_replays > 0, "prefill chunks must have gone through the one-row buckets"
    for _, rid, _, params in jobs:
        if params.temperature == 0:
            assert static[rid] == ragged[rid], rid
        assert len(static[rid]) == params.max_tokens


def test_prefill_buckets_at_any_slot_match_the_ragged_prefill():
    """Two requests prefilled at slots 2 and 0 through one bucket, the second on top of an
    earlier chunk: logits and features as the ragged forward gives (on a GPU, the copies keep
    the second replay from overwriting the first one's output)."""
    target = make_tiny_target()
    g = torch.Generator().manual_seed(3)
    first = torch.randint(6, 64, (5,), generator=g).tolist()
    chunks = [torch.randint(6, 64, (n,), generator=g).tolist() for n in (7, 4)]

    def runner() -> TargetRunner:
        r = TargetRunner(target, max_slots=3, initial_capacity=8, max_context=64)
        r.forward([0], [first], last_logits_only=True)
        r.set_length(0, len(first))
        return r

    ragged = runner().forward([2, 0], chunks, last_logits_only=True)
    st = StaticTarget(runner(), [1], [1], use_graphs=False, ctx_buckets=[16], prefill_buckets=[8])
    out = st.forward([2, 0], chunks, last_logits_only=True)
    assert st.prefill_replays == 2 and out.logits.shape == ragged.logits.shape == (2, 1, target.vocab_size)
    torch.testing.assert_close(out.logits, ragged.logits, rtol=1e-5, atol=1e-5)
    for i, c in enumerate(chunks):
        torch.testing.assert_close(out.aux[i, : len(c)], ragged.aux[i, : len(c)], rtol=1e-5, atol=1e-5)
    assert st.forward([1], [list(range(6, 15))], last_logits_only=True) is not None  # 9 > 8: ragged fallback
    assert st.prefill_replays == 2


@pytest.mark.parametrize("model_type", ["llama", "qwen3"])
def test_a_ragged_step_computes_each_row_as_the_model_does_on_its_whole_sequence(model_type):
    """Rows of different lengths run packed (no padding through the projections): each row's
    logits and drafter features equal those of the transformers model on that row alone."""
    target = make_tiny_target(model_type)
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(6, 64, (n,), generator=g).tolist() for n in (9, 3, 14)]
    steps = [[7, 8, 9, 10, 11], [12], [13, 14]]
    runner = TargetRunner(target, max_slots=3, initial_capacity=8, max_context=64)
    runner.forward([0, 1, 2], prompts, last_logits_only=True)
    for i, p in enumerate(prompts):
        runner.set_length(i, len(p))
    out = runner.forward([0, 1, 2], steps)
    assert out.logits.shape[:2] == (3, 5) and out.aux.shape[:2] == (3, 5)
    with torch.no_grad():
        for r, (p, s) in enumerate(zip(prompts, steps)):
            full = target.features(torch.tensor([p + s]))
            ref = target.logits_from_last(full.last)[0, len(p):]
            torch.testing.assert_close(out.logits[r, : len(s)], ref, atol=1e-4, rtol=1e-4)
            torch.testing.assert_close(out.aux[r, : len(s)], full.aux[0, len(p):], atol=1e-4, rtol=1e-4)
            assert not out.logits[r, len(s):].any()  # padding cells are left empty


def test_a_steps_committed_positions_advance_each_slots_length_alone():
    """``advance_lengths`` (one tensor update per step) moves exactly the named slots, in any order,
    through the static wrapper too."""
    runner = TargetRunner(make_tiny_target(), max_slots=4, initial_capacity=8, max_context=64)
    for s, n in enumerate((5, 9, 2, 7)):
        runner.set_length(s, n)
    runner.advance_lengths([2, 0], [3, 1])
    assert runner.lengths.tolist() == [6, 9, 5, 7]
    StaticTarget(runner, [4], [1, 2], use_graphs=False).advance_lengths([3, 1, 0], [1, 4, 2])
    assert runner.lengths.tolist() == [8, 13, 5, 8]
