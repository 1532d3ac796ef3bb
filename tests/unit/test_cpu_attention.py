"""The packed CPU attention reads exactly each token's own context, and the engine's forward
is the same with it as on the padded, masked grid."""
from __future__ import annotations

import pytest
import torch

from dspark.engine import cpu_attention
from dspark.engine.target_runner import TargetRunner

from ..conftest import make_tiny_target

pytestmark = pytest.mark.skipif(not cpu_attention.available(), reason="no C++ toolchain to build the kernel")


@pytest.mark.parametrize("heads,kv_heads,dim", [(9, 3, 64), (4, 4, 8), (6, 1, 24)])
def test_varlen_attention_matches_the_per_token_reference(heads, kv_heads, dim):
    g = torch.Generator().manual_seed(0)
    S, C = 5, 37
    k, v = torch.randn(S, kv_heads, C, dim, generator=g), torch.randn(S, kv_heads, C, dim, generator=g)
    q = torch.randn(11, heads, dim, generator=g)
    slot = torch.tensor([0, 0, 0, 3, 4, 2, 2, 2, 1, 1, 4])
    pos = torch.tensor([5, 6, 7, 0, 36, 10, 11, 12, 1, 2, 20])  # a causal block, a lone first token, the last key
    for limit in (0, 9):  # 0: the whole cache; 9: keys past the first 9 are never read
        out = cpu_attention.varlen_attention(q, k, v, slot, pos, dim ** -0.5, limit)
        ref = cpu_attention.reference(q, k, v, slot, pos, dim ** -0.5, limit)
        torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


def test_blocks_share_a_read_of_the_keys_and_give_each_token_the_same_bits():
    """Tokens of one slot at consecutive positions read its keys once (a verify block; a prompt
    chunk cut into blocks of ``block``); every token's output is bit for bit what it gets alone
    (``block=1``), whatever blocks the packing makes."""
    g = torch.Generator().manual_seed(2)
    S, C, Hq, Hkv, D = 4, 80, 9, 3, 64
    k, v = torch.randn(S, Hkv, C, D, generator=g), torch.randn(S, Hkv, C, D, generator=g)
    # slot 0: a 40-token prompt chunk (blocks of 16, 16, 8); slot 2: a verify block of 5; slot 1: lone tokens;
    # slot 3: two runs of the same slot that are not consecutive (two blocks)
    slot = torch.tensor([0] * 40 + [2] * 5 + [1, 1] + [3, 3, 3, 3])
    pos = torch.tensor(list(range(40)) + list(range(60, 65)) + [10, 30] + [20, 21, 40, 41])
    q = torch.randn(slot.numel(), Hq, D, generator=g)
    alone = cpu_attention.varlen_attention(q, k, v, slot, pos, D ** -0.5, 0, block=1)
    for block in (2, 5, 16, 64):
        for limit in (0, 33):
            got = cpu_attention.varlen_attention(q, k, v, slot, pos, D ** -0.5, limit, block=block)
            want = alone if limit == 0 else cpu_attention.varlen_attention(q, k, v, slot, pos, D ** -0.5, limit, 1)
            assert torch.equal(got, want), (block, limit)
    torch.testing.assert_close(alone, cpu_attention.reference(q, k, v, slot, pos, D ** -0.5), rtol=1e-5, atol=1e-5)
    with pytest.raises(RuntimeError, match="block"):
        cpu_attention.varlen_attention(q, k, v, slot, pos, D ** -0.5, 0, block=0)


def test_varlen_attention_ignores_keys_past_each_tokens_position():
    g = torch.Generator().manual_seed(1)
    k, v = torch.randn(2, 1, 16, 8, generator=g), torch.randn(2, 1, 16, 8, generator=g)
    q = torch.randn(2, 1, 8, generator=g)
    slot, pos = torch.tensor([0, 1]), torch.tensor([3, 9])
    before = cpu_attention.varlen_attention(q, k, v, slot, pos, 0.3)
    k[0, :, 4:], v[0, :, 4:], k[1, :, 10:] = 1e4, -1e4, 1e4  # garbage where no query may look
    torch.testing.assert_close(cpu_attention.varlen_attention(q, k, v, slot, pos, 0.3), before)


@pytest.mark.parametrize("model_type", ["llama", "qwen3"])
def test_ragged_forward_is_the_same_with_varlen_and_padded_attention(model_type):
    target = make_tiny_target(model_type)
    g = torch.Generator().manual_seed(2)
    prompts = [torch.randint(6, 64, (n,), generator=g).tolist() for n in (9, 3, 14)]
    steps = [[7, 8, 9], [10], [11, 12, 13, 14]]
    outs = []
    for attention in ("varlen", "sdpa"):
        r = TargetRunner(target, max_slots=4, max_context=64, attention=attention)
        assert r.varlen == (attention == "varlen")
        pre = r.forward([0, 2, 3], prompts, last_logits_only=True)  # slots not 0..R-1: the gathered path
        for s, p in zip((0, 2, 3), prompts):
            r.set_length(s, len(p))
        outs.append((pre, r.forward([0, 2, 3], steps)))
    (pv, sv), (pp, sp) = outs
    torch.testing.assert_close(pv.logits, pp.logits, rtol=1e-5, atol=1e-5)
    for i, t in enumerate(steps):
        torch.testing.assert_close(sv.logits[i, :len(t)], sp.logits[i, :len(t)], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(sv.aux[i, :len(t)], sp.aux[i, :len(t)], rtol=1e-5, atol=1e-5)


def test_attention_mode_is_checked():
    target = make_tiny_target()
    with pytest.raises(ValueError, match="attention must be one of"):
        TargetRunner(target, max_slots=2, attention="flash")


@pytest.mark.parametrize("attention", ["varlen", "sdpa"])
def test_mixed_forward_is_a_verify_pass_and_a_prefill_pass_in_one(attention):
    """forward_mixed: the first rows get every token's logits, the others their last token's,
    and each group's logits, features and cache writes are those of its own separate forward."""
    target = make_tiny_target("qwen3")
    g = torch.Generator().manual_seed(3)
    old = [torch.randint(6, 64, (n,), generator=g).tolist() for n in (7, 12)]
    verify = [[20, 21, 22], [23]]
    prompt = torch.randint(6, 64, (10,), generator=g).tolist()
    runs = []
    for mixed in (True, False):
        r = TargetRunner(target, max_slots=3, max_context=64, attention=attention)
        r.forward([0, 1], old, last_logits_only=True)
        for s, p in enumerate(old):
            r.set_length(s, len(p))
        if mixed:
            head, tail = r.forward_mixed([0, 1, 2], verify + [prompt], 2)
        else:
            head, tail = r.forward([0, 1], verify), r.forward([2], [prompt], last_logits_only=True)
        runs.append((head, tail, r.k.clone()))
    (hm, tm, km), (hs, ts, ks) = runs
    assert tm.logits.shape == ts.logits.shape == (1, 1, target.vocab_size)
    torch.testing.assert_close(tm.logits, ts.logits, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(tm.aux, ts.aux, rtol=1e-5, atol=1e-5)
    for i, t in enumerate(verify):
        torch.testing.assert_close(hm.logits[i, :len(t)], hs.logits[i, :len(t)], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(hm.aux[i, :len(t)], hs.aux[i, :len(t)], rtol=1e-5, atol=1e-5)
    written = [len(old[0]) + len(verify[0]), len(old[1]) + len(verify[1]), len(prompt)]
    for s, n in enumerate(written):  # past these, a CPU cache holds whatever its memory held
        torch.testing.assert_close(km[:, s, :, :n], ks[:, s, :, :n], rtol=1e-5, atol=1e-5)


def test_the_varlen_cache_is_allocated_once_and_never_reads_unwritten_positions():
    """The CPU cache spans max_context from the start, uninitialised: poisoned with NaN where
    nothing was written, a run past the zeroed sdpa cache's first doubling gives the same logits,
    and the cache never moves."""
    target = make_tiny_target()
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(6, 64, (n,), generator=g).tolist() for n in (7, 12)]
    logits = []
    for attention in ("varlen", "sdpa"):
        r = TargetRunner(target, max_slots=2, initial_capacity=8, max_context=48, attention=attention)
        if attention == "varlen":
            assert r.capacity == 48
            r.k.fill_(float("nan"))
            r.v.fill_(float("nan"))
            where = (r.k.data_ptr(), r.v.data_ptr())
        else:
            assert r.capacity == 8
        out = [r.forward([0, 1], prompts, last_logits_only=True).logits[:, 0]]
        for s, p in enumerate(prompts):
            r.set_length(s, len(p))
        for step in range(6):  # 3-token verify blocks: both rows pass 16 positions
            toks = [[6 + step, 7, 8], [9, 10 + step, 11]]
            out.append(r.forward([0, 1], toks).logits)
            for s in (0, 1):
                r.set_length(s, int(r.lengths[s]) + 3)
        logits.append(out)
        if attention == "varlen":
            assert (r.k.data_ptr(), r.v.data_ptr()) == where and r.capacity == 48
        else:
            assert r.capacity > 8  # the zeroed cache grew
    for a, b in zip(*logits):
        assert not a.isnan().any()
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_the_benchmark_compares_block_and_per_token_reads_and_writes_its_tables(tmp_path):
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "scripts" / "bench_cpu_attention.py"
    spec = importlib.util.spec_from_file_location("_bench_cpu_attention", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    runner = TargetRunner(make_tiny_target(), 2, initial_capacity=24, max_context=24)
    records = bench.run(runner, [(2, 1), (2, 3)], context=12, rounds=2, iters=1)
    assert [r["same_logits"] for r in records] == [True, True]
    assert all(r["block_ms"] > 0 and r["per_token_ms"] > 0 for r in records)
    assert runner.attention_block == cpu_attention.BLOCK  # the engine's setting is restored
    (draft,) = bench.marginal(records)
    assert draft["rows"] == 2 and draft["drafts_per_row"] == 2
    bench.write(records, tmp_path, 2, "python scripts/bench_cpu_attention.py")
    md = (tmp_path / "cpu_attention.md").read_text()
    assert "| 2 | 3 |" in md and (tmp_path / "cpu_attention.json").exists()


@pytest.mark.parametrize("attention", ["varlen", "sdpa"])
def test_aux_rows_builds_the_chosen_rows_features_as_the_whole_grid_holds_them(attention):
    """``aux_rows`` joins the captured layers for the chosen rows alone; each row's cells equal the
    laid-out grid's, zeros past its length, for a ragged verify pass and both halves of a mixed one."""
    target = make_tiny_target("qwen3")
    g = torch.Generator().manual_seed(4)
    old = [torch.randint(6, 64, (n,), generator=g).tolist() for n in (7, 12, 5)]
    verify = [[20, 21, 22], [23], [24, 25]]
    prompts = [torch.randint(6, 64, (n,), generator=g).tolist() for n in (10, 4)]

    def outputs():
        r = TargetRunner(target, max_slots=5, max_context=64, attention=attention)
        r.forward([0, 1, 2], old, last_logits_only=True)
        for s, p in enumerate(old):
            r.set_length(s, len(p))
        ragged = r.forward([0, 1, 2], verify)
        head, tail = r.forward_mixed([0, 1, 2, 3, 4], verify + prompts, 3)
        return [(ragged, [len(t) for t in verify]), (head, [len(t) for t in verify]),
                (tail, [len(t) for t in prompts])]

    for rows, width in [([1], 1), ([0, 2], 3), ([2, 0], 2), ([0, 1], 10)]:
        for (out, lens), (whole, _) in zip(outputs(), outputs()):
            rows_ = [r for r in rows if r < len(lens)]
            picked = out.aux_rows(rows_, width)  # before anything joins the whole grid
            assert picked.shape == (len(rows_), width, whole.aux.shape[-1])
            for j, r in enumerate(rows_):
                n = min(lens[r], width)
                torch.testing.assert_close(picked[j, :n], whole.aux[r, :n], rtol=1e-5, atol=1e-5)
                assert not picked[j, n:].any()
