"""Benchmark bookkeeping: prompts, per-level summary, reports (no server)."""
from __future__ import annotations

import json
import os

import pytest

from dspark.engine.serving import bench
from dspark.engine.serving.client import Result


def result(t0, first, done, tokens, steps=0, accepted=0, error=None):
    r = Result("r", t0, chunks=["x"], chunk_times=[t0 + first, t0 + done], tokens=tokens,
               token_times=[(t0 + first, 1), (t0 + done, tokens)], num_steps=steps,
               num_accepted_tokens=accepted, error=error)
    r.t_done = t0 + done
    return r


def test_prompts_are_first_turns_interleaved_across_files(tmp_path):
    (tmp_path / "a.jsonl").write_text('{"turns": ["a1", "a1b"]}\n{"turns": ["a2"]}\n{"turns": ["a3"]}\n')
    (tmp_path / "b.jsonl").write_text('{"turns": ["b1"]}\n\n{"turns": []}\n')
    assert bench.load_prompts(sorted(tmp_path.glob("*.jsonl"))) == ["a1", "b1", "a2", "a3"]
    assert bench.load_prompts([tmp_path / "a.jsonl"], limit=2) == ["a1", "a2"]
    with pytest.raises(ValueError):
        bench.load_prompts([tmp_path / "b.jsonl"][:0])


def test_summary_reports_latency_percentiles_throughput_and_accept_len():
    rs = [result(0.0, 0.1, 1.1, 11, steps=5, accepted=6), result(0.0, 0.2, 2.2, 21, steps=10, accepted=11),
          result(0.0, 0.1, 0.5, 0, error="boom")]
    row = bench.summarize("spec", 2, rs, wall=2.2)
    assert row["failed"] == 1 and row["output_tokens"] == 32
    assert row["output_tokens_per_s"] == pytest.approx(32 / 2.2, rel=1e-3)
    assert row["ttft_ms"]["p50"] == pytest.approx(150.0)
    assert row["itl_ms"]["p50"] == pytest.approx(100.0)  # (1.1-0.1)/10 and (2.2-0.2)/20
    assert row["accept_len"] == pytest.approx((17 + 15) / 15, rel=1e-3)
    assert set(row) >= {"system", "concurrency", "output_tokens_per_s", "requests_per_s", "ttft_ms", "itl_ms",
                        "e2e_ms", "accept_len"}


def test_report_files_and_speedup_table(tmp_path):
    rows = [bench.summarize(s, c, [result(0.0, 0.1, 1.1, n)], wall=1.0)
            for s, n in (("spec", 20), ("target_only", 10)) for c in (1, 4)]
    report = {"command": "x", "device": "cpu", "results": rows}
    paths = bench.write_report(report, tmp_path / "serving")
    assert all(p.is_file() for p in paths)
    assert json.loads(paths[0].read_text())["results"][0]["system"] == "spec"
    md = paths[1].read_text()
    assert "| 1 | 2.00x | - |" in md and "| spec | 4 |" in md


def test_sustained_rate_counts_tokens_while_every_stream_is_busy():
    """Two streams, closed loop: a and b sent at 0, c when a finished (1.0 s), d when b finished
    (1.5 s); the window is [0, 1.5]. The drain after it (c until 3.0 s, d until 2.0 s) is outside:
    the whole-run rate counts it, the sustained rate does not."""
    def req(t0, stamps, done):
        r = Result("r", t0, token_times=stamps, tokens=stamps[-1][1])
        r.t_done = done
        return r
    rs = [req(0.0, [(0.5, 5), (1.0, 10)], 1.0), req(0.0, [(0.7, 6), (1.5, 12)], 1.5),
          req(1.0, [(1.2, 2), (1.6, 4), (3.0, 10)], 3.0), req(1.5, [(1.6, 1), (2.0, 10)], 2.0)]
    rate, window = bench.sustained_rate(rs)
    assert window == pytest.approx(1.5)
    assert rate == pytest.approx((10 + 12 + 2 + 0) / 1.5)  # c had 2 tokens by 1.5 s; d's first came at 1.6 s
    row = bench.summarize("spec", 2, rs, wall=3.0)
    assert row["output_tokens_per_s"] == pytest.approx(42 / 3.0, rel=1e-3)
    assert row["sustained_tokens_per_s"] == pytest.approx(24 / 1.5, rel=1e-3) and row["sustained_s"] == 1.5
    # every request sent at once (or before any finished): there was no sustained window
    assert bench.sustained_rate(rs[:2]) == (None, 0.0)
    assert bench.sustained_rate([req(0.0, [(1.0, 3)], 1.0), req(0.5, [(2.0, 3)], 2.0)])[0] is None
    assert bench.sustained_rate([]) == (None, 0.0)


def test_server_rss_covers_a_process_tree():
    assert bench.server_rss_mb(os.getpid()) > 0
    assert bench.server_rss_mb(None) is None


def test_sweep_runs_the_systems_back_to_back_per_level_in_alternating_order(monkeypatch):
    calls = []

    def fake_level(url, model, prompts, concurrency, num_requests, max_tokens, temperature):
        calls.append((model, concurrency, num_requests))
        return [result(0.0, 0.1, 1.1, max_tokens)], 1.0
    monkeypatch.setattr(bench, "run_level", fake_level)
    rows = bench.sweep("u", ["p"], [1, 4, 16], ["spec", "target_only"], 8, log=lambda *_: None)
    spec, base = bench.SYSTEMS["spec"], bench.SYSTEMS["target_only"]
    n = bench.MIN_REQUESTS
    assert calls == [(spec, 1, 1), (base, 1, 1),  # warm-ups
                     (spec, 1, n), (base, 1, n), (base, 4, 16), (spec, 4, 16), (spec, 16, 64), (base, 16, 64)]
    assert [(r["system"], r["concurrency"]) for r in rows] == [
        ("spec", 1), ("spec", 4), ("spec", 16), ("target_only", 1), ("target_only", 4), ("target_only", 16)]


def test_repeated_sweep_alternates_rounds_and_reports_median_runs_and_paired_ratios(monkeypatch):
    speeds = {("spec", 1): iter([30, 10, 20]), ("target_only", 1): iter([10, 20, 40])}  # tokens per 1 s run
    order = []

    def fake_level(url, model, prompts, concurrency, num_requests, max_tokens, temperature):
        system = next(s for s, m in bench.SYSTEMS.items() if m == model)
        if num_requests == 1:  # warm-up
            return [result(0.0, 0.1, 1.0, 1)], 1.0
        order.append(system)
        fail = "boom" if (system, len(order)) == ("target_only", 2) else None
        return [result(0.0, 0.1 * len(order), 1.0, next(speeds[(system, concurrency)])),
                result(0.0, 0.1, 1.0, 0, error=fail)], 1.0
    monkeypatch.setattr(bench, "run_level", fake_level)
    rows = bench.sweep("u", ["p"], [1], ["spec", "target_only"], 8, repeats=3, log=lambda *_: None)
    assert order == ["spec", "target_only", "target_only", "spec", "spec", "target_only"]
    spec, base = rows
    assert spec["output_tokens_per_s_runs"] == [30, 10, 20] and spec["output_tokens_per_s"] == 20
    assert base["output_tokens_per_s_runs"] == [10, 20, 40] and base["output_tokens_per_s"] == 20
    assert base["repeats"] == 3 and base["requests"] == 6 and base["failed"] == 1  # a failure in any run shows
    [(c, tok, held, ttft)] = bench.speedup_rows(rows)
    assert c == 1 and tok == pytest.approx(0.5)  # median of 30/10, 10/20, 20/40, not the median runs' 20/20
    assert held is None  # every request of these runs was sent at once: no run sustained its load
    # TTFT p50 per run (ms): spec 100, 250, 300; target_only 200 (its failed request left out), 200, 350
    assert spec["ttft_p50_ms_runs"] == [100, 250, 300] and base["ttft_p50_ms_runs"] == [200, 200, 350]
    assert ttft == pytest.approx(300 / 350)
    md = bench.markdown({"command": "x", "device": "cpu", "results": rows})
    assert "median of the 3 rounds' ratios" in md and "| 1 | 0.50x | - | 0.86x |" in md
    with pytest.raises(ValueError):
        bench.sweep("u", ["p"], [1], ["spec"], 8, repeats=0, log=lambda *_: None)


def test_proposer_counters_are_published_as_increments_and_read_back_per_run():
    """The model publishes the engine's running totals by proposer; the client reads them from
    the metrics text before and after a run and gets that run's accept_len by proposer."""
    from types import SimpleNamespace

    from dspark.engine.serving.metrics import InMemoryFamily, ServingMetrics

    families = {}

    def family(name, desc, kind):
        families[name] = InMemoryFamily(name, desc, kind)
        return families[name]
    m = ServingMetrics(family, {"model": "dspark_llm"})
    m.proposer_totals({"suffix": SimpleNamespace(rounds=4, drafted=6, accepted=3)})
    m.proposer_totals({"suffix": SimpleNamespace(rounds=10, drafted=12, accepted=9),
                       "none": SimpleNamespace(rounds=2, drafted=0, accepted=0)})
    (rounds,) = [x for x in families["dspark_proposer_rounds_total"].metrics if x.labels["proposer"] == "suffix"]
    assert rounds.value == 10 and rounds.labels["model"] == "dspark_llm"

    def text(values):
        return "\n".join(["# HELP dspark_proposer_rounds_total x", "nv_inference_count{model=\"a\"} 3"] + [
            f'dspark_proposer_{k}_total{{model="{mod}",proposer="{p}"}} {v}' for (k, mod, p), v in values.items()])
    before = bench.parse_proposer_counters(text({("rounds", "dspark_llm", "suffix"): 4,
                                                 ("accepted_tokens", "dspark_llm", "suffix"): 3}))
    after = bench.parse_proposer_counters(text({("rounds", "dspark_llm", "suffix"): 10,
                                                ("rounds", "dspark_llm_target_only", "suffix"): 2,
                                                ("draft_tokens", "dspark_llm", "suffix"): 12,
                                                ("accepted_tokens", "dspark_llm", "suffix"): 9,
                                                ("rounds", "dspark_llm", "dspark"): 0}))
    assert after["suffix"] == {"rounds": 12.0, "drafted": 12.0, "accepted": 9.0}  # summed over models
    window = bench.proposer_window(before, after)
    assert window == {"suffix": {"rounds": 8, "drafted": 12, "accepted": 6, "accept_len": 1.75}}  # no rounds: left out
    assert bench.proposer_window(None, after) is None
    assert bench.scrape_proposer_counters(None) is None
    assert bench.scrape_proposer_counters("http://127.0.0.1:9/metrics", timeout=0.5) is None  # unreachable: None


def test_engine_phase_counters_are_published_as_increments_and_read_back_as_ms_per_step():
    """The model publishes the engine's step counts and phase seconds; the client turns a run's
    gain into ms per step by phase, host being what the timed phases leave."""
    from types import SimpleNamespace

    from dspark.engine.serving.metrics import InMemoryFamily, ServingMetrics

    families = {}

    def family(name, desc, kind):
        families[name] = InMemoryFamily(name, desc, kind)
        return families[name]
    m = ServingMetrics(family, {"model": "dspark_llm"})
    seconds = {"step": 1.0, "prefill": 0.1, "neural": 0.05, "suffix": 0.01, "verify": 0.7}
    m.engine_totals(SimpleNamespace(steps=10, decode_steps=8, seconds=seconds))
    m.engine_totals(SimpleNamespace(steps=30, decode_steps=26, seconds={**seconds, "step": 3.0, "verify": 2.3}))
    (step,) = [x for x in families["dspark_engine_seconds_total"].metrics if x.labels["phase"] == "step"]
    assert step.value == pytest.approx(3.0) and families["dspark_engine_steps_total"].metrics[0].value == 30

    def text(steps, decode, secs):
        return "\n".join([f'dspark_engine_steps_total{{model="dspark_llm"}} {steps}',
                          f'dspark_engine_decode_steps_total{{model="dspark_llm"}} {decode}',
                          'nv_inference_count{model="a"} 3'] +
                         [f'dspark_engine_seconds_total{{model="dspark_llm",phase="{p}"}} {v}' for p, v in secs.items()])
    before = bench.parse_engine_counters(text(10, 8, seconds))
    after = bench.parse_engine_counters(text(30, 26, {**seconds, "step": 3.0, "verify": 2.3, "neural": 0.25}))
    window = bench.engine_window(before, after)
    assert window["steps"] == 20 and window["decode_steps"] == 18
    assert window["ms_per_step"] == pytest.approx({"step": 100.0, "verify": 80.0, "neural": 10.0, "suffix": 0.0,
                                                   "prefill": 0.0, "host": 10.0})
    assert bench.engine_window(before, before) is None and bench.engine_window(None, after) is None
    row = {"system": "spec", "concurrency": 64, "output_tokens_per_s": 1.0, "requests_per_s": 1.0,
           "ttft_ms": {"p50": 1, "p90": 1, "p99": 1}, "itl_ms": {"p50": 1, "p90": 1, "p99": 1},
           "e2e_ms": {"p50": 1, "p90": 1, "p99": 1}, "accept_len": 1.0, "engine": window}
    assert "| spec | 64 | 20 | 18 | 100.0 | 80.0 | 10.0 | 0.0 | 0.0 | 10.0 |" in bench.markdown(
        {"command": "x", "device": "cpu", "results": [row]})


def test_every_round_of_every_level_sends_prompts_no_earlier_round_sent(monkeypatch):
    sent = []

    def fake_level(url, model, prompts, concurrency, num_requests, max_tokens, temperature):
        sent.append((model, [prompts[i % len(prompts)] for i in range(num_requests)]))
        return [result(0.0, 0.1, 1.1, max_tokens)], 1.0
    monkeypatch.setattr(bench, "run_level", fake_level)
    pool = [f"p{i}" for i in range(100)]
    bench.sweep("u", pool, [1, 4], ["spec", "target_only"], 8, repeats=2, log=lambda *_: None)
    rounds = sent[2:]  # after the two warm-ups on p0
    assert [p for _, p in rounds[0::2]] == [p for _, p in rounds[1::2]], "both systems of a round get the same prompts"
    fresh = [q for _, p in rounds[0::2] for q in p]
    per_round = [bench.MIN_REQUESTS, max(4 * bench.REQUESTS_PER_STREAM, bench.MIN_REQUESTS)]  # levels 1 and 4
    assert len(fresh) == 2 * sum(per_round) and len(set(fresh)) == len(fresh) and "p0" not in fresh
    warned = []
    bench.sweep("u", pool[:20], [1, 4], ["spec"], 8, repeats=1, log=warned.append)
    assert sum("run out" in w for w in warned) == 1
