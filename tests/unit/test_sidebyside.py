"""The side-by-side harness's pure parts: paired ratios, identity, the per-task split, the
results-file schema, levels and prompts, and the in-flight driver (no model is loaded)."""
from __future__ import annotations

import json
import time

import pytest

from collections import defaultdict

from dspark.engine.sidebyside import (NEEDS_DRAFTER, OURS_TARGET_ONLY, Drive, Level, Prompt, Recorder, attribute_step,
                                      drive, level_prompts, levels_for, suffix_config,
                                      lockstep, plan_levels, resolve_systems, run_order)
from dspark.engine.sidebyside_report import (REQUIRED_RESULT_KEYS, check_results_schema, identical_share,
                                             paired_median_ratio, percentile, round_ratios_by_system, split_by_task,
                                             summarise, write_report)


def test_paired_ratio_is_the_median_of_same_round_ratios_not_a_ratio_of_medians():
    ours = [10.0, 30.0, 20.0]
    base = [5.0, 30.0, 40.0]  # same-round ratios 2.0, 1.0, 0.5 -> median 1.0; medians 20 / 30 would give 0.67
    assert paired_median_ratio(ours, base) == 1.0
    assert paired_median_ratio([10.0, 12.0], [5.0, 4.0]) == 2.5  # even count: mean of the middle two


def test_paired_ratio_pairs_by_round_and_skips_rounds_missing_on_either_side():
    assert paired_median_ratio([10.0, None, 9.0], [5.0, 4.0, 3.0]) == 2.5  # rounds 1 and 3: 2.0, 3.0
    assert paired_median_ratio([10.0, 8.0, 6.0], [5.0]) == 2.0  # a peer that ran in round 1 only
    assert paired_median_ratio([None], [5.0]) is None
    assert paired_median_ratio([1.0], [0.0]) is None


def test_the_plots_round_ratios_pair_each_system_with_our_target_only_round_by_round():
    def row(system, rounds, batch=4, temperature=0.0):
        return {"system": system, "batch": batch, "temperature": temperature, "task": "overall",
                "tokens_per_s_rounds": rounds}
    rows = [row("ours_target_only", [100.0, 200.0, None]), row("ours_target_only_aa", [101.0, 198.0, 50.0]),
            row("ours_hybrid", [102.0, None, 60.0]), row("vllm_target_only", None),
            row("ours_hybrid", [1.0, 1.0], batch=16)]
    got = round_ratios_by_system(rows, 0.0, 4)
    assert got == {"ours_target_only_aa": [1.01, 0.99], "ours_hybrid": [1.02]}  # round 3: no target-only


def test_identity_counts_every_round_against_the_reference():
    ref = [[1, 2, 3], [4, 5]]
    assert identical_share([[[1, 2, 3], [4, 5]], [[1, 2, 3], [4, 6]]], ref) == 0.75
    assert identical_share([], ref) is None
    with pytest.raises(ValueError, match="2 reference requests"):
        identical_share([[[1, 2, 3]]], ref)


def test_split_by_task_keeps_task_order_and_an_overall_group():
    reqs = [{"task": "chat", "i": 0}, {"task": "math", "i": 1}, {"task": "chat", "i": 2}]
    groups = split_by_task(reqs)
    assert list(groups) == ["math", "chat", "overall"]
    assert [r["i"] for r in groups["chat"]] == [0, 2] and len(groups["overall"]) == 3


def test_percentile_matches_numpy_linear_rule():
    np = pytest.importorskip("numpy")
    v = [3.0, 1.0, 7.0, 4.0, 10.0]
    for q in (0, 50, 90, 99, 100):
        assert percentile(v, q) == pytest.approx(float(np.percentile(v, q)))
    assert percentile([], 50) is None


def _req(task: str, tokens: list[int], seconds: float, rounds: int | None = None, accepted: int | None = None) -> dict:
    r = {"task": task, "tokens": tokens, "seconds": seconds, "ttft_ms": 10.0, "gaps_ms": [seconds * 1000 / len(tokens)]}
    if rounds is not None:
        r.update(rounds=rounds, drafted=accepted, accepted=accepted)
    return r


def _run(wall: float, math_s: float, chat_s: float, chat_tokens: list[int], temperature: float = 0.0,
         rounds: int | None = None, accepted: int | None = None) -> dict:
    return {"info": {"threads": 1, "pinning": "none"}, "levels": [{
        "batch": 1, "temperature": temperature, "requests": 2, "new_tokens": 4, "seconds": wall,
        "request_records": [_req("math", [1, 2, 3, 4], math_s, rounds, accepted),
                            _req("chat", chat_tokens, chat_s, rounds, accepted)]}]}


def test_summarise_gives_overall_and_task_rows_with_paired_ratios_identity_and_accept_len():
    raw = {"ours_target_only": [_run(2.0, 1.0, 1.0, [5, 6, 7, 8], rounds=4, accepted=0),
                                _run(4.0, 2.0, 2.0, [5, 6, 7, 8], rounds=4, accepted=0),
                                _run(2.0, 1.0, 1.0, [5, 6, 7, 8], rounds=4, accepted=0)],
           "ours_suffix": [_run(1.0, 0.5, 0.5, [5, 6, 7, 8], rounds=2, accepted=2),
                           _run(1.0, 0.5, 0.5, [5, 6, 7, 9], rounds=2, accepted=2),
                           _run(2.0, 0.5, 1.5, [5, 6, 7, 8], rounds=2, accepted=2)]}
    results, tasks = summarise(raw)
    by = {r["system"]: r for r in results}
    s = by["ours_suffix"]
    assert s["tokens_per_s"] == 8.0 and s["tokens_per_s_rounds"] == [8.0, 8.0, 4.0]
    assert s["x_target_only"] == 2.0  # same-round ratios 2.0, 4.0, 1.0
    assert s["identical_to_target_only"] == pytest.approx(5 / 6)  # round 2's chat request differs
    assert s["accept_len"] == 2.0 and by["ours_target_only"]["accept_len"] == 1.0
    assert s["identical_to_vllm_fp32"] is None and s["x_vllm_target_only"] is None
    chat = next(r for r in tasks if r["system"] == "ours_suffix" and r["task"] == "chat")
    assert chat["tokens_per_s"] is None  # not separable inside a mixed batch
    # a task's rate is the one its requests see: tokens over their summed seconds in flight
    assert chat["tokens_per_s_rounds"] == [8.0, 8.0, pytest.approx(4 / 1.5)]
    assert chat["x_target_only"] == 2.0  # same-round ratios 8/4, 8/2, (4/1.5)/4
    assert chat["identical_to_target_only"] == pytest.approx(2 / 3)
    math = next(r for r in tasks if r["system"] == "ours_suffix" and r["task"] == "math")
    assert math["identical_to_target_only"] == 1.0 and math["x_target_only"] == 2.0
    for r in results:
        assert set(REQUIRED_RESULT_KEYS) <= set(r), set(REQUIRED_RESULT_KEYS) - set(r)


def test_identity_to_other_samplers_is_undefined_at_t1_but_ours_is_checked_against_our_seeded_target_only():
    raw = {"ours_target_only": [_run(2.0, 1.0, 1.0, [5, 6, 7, 8], temperature=1.0)],
           "ours_hybrid": [_run(1.0, 0.5, 0.5, [5, 6, 7, 8], temperature=1.0)],
           "hf_generate": [_run(3.0, 1.5, 1.5, [5, 6, 7, 8], temperature=1.0)],
           "vllm_target_only": [_run(2.0, 1.0, 1.0, [9, 9, 9, 9], temperature=1.0)]}
    by = {r["system"]: r for r in summarise(raw)[0]}
    assert by["ours_hybrid"]["identical_to_target_only"] == 1.0
    assert by["hf_generate"]["identical_to_target_only"] is None
    assert all(r["identical_to_vllm_fp32"] is None for r in by.values())
    assert by["ours_hybrid"]["x_vllm_target_only"] == 2.0  # speed ratios are defined at any temperature


def test_results_schema_is_checked_and_the_files_are_written(tmp_path):
    raw = {"ours_target_only": [_run(2.0, 1.0, 1.0, [5, 6, 7, 8])],
           "vllm_target_only": [_run(1.0, 0.5, 0.5, [5, 6, 7, 8])]}
    results, tasks = summarise(raw)
    report = {"host": "cpu", "threads": 1, "command": "test", "results": results, "task_results": tasks}
    write_report(report, tmp_path, "engine_vs_vllm")
    back = json.loads((tmp_path / "engine_vs_vllm.json").read_text())
    assert back["results"][0]["x_vllm_target_only"] == 0.5 and back["results"][0]["identical_to_vllm_fp32"] == 1.0
    assert isinstance(back["threads"], int) and "command" in back
    assert (tmp_path / "engine_vs_vllm.png").stat().st_size > 0
    assert "| ours_target_only | 1 | 0 | 2 x 4 |" in (tmp_path / "engine_vs_vllm.md").read_text()
    del report["results"][0]["ttft_p50_ms"]
    with pytest.raises(ValueError, match="ttft_p50_ms"):
        check_results_schema(report)
    with pytest.raises(ValueError, match="'host'"):
        check_results_schema({"threads": 1, "command": "x", "results": []})


def test_levels_and_distinct_prompts():
    levels = plan_levels([1, 4, 16], [0.0, 1.0], prompts_1=6, new_tokens_1=256, new_tokens_c=128)
    assert [(lv.batch, lv.requests, lv.new_tokens, lv.temperature) for lv in levels[:3]] == [
        (1, 6, 256, 0.0), (4, 4, 128, 0.0), (16, 16, 128, 0.0)]
    assert levels[3].temperature == 1.0
    assert levels_for("hf_prompt_lookup", levels) == [levels[0], levels[3]]
    assert levels_for("vllm_ngram", levels, peer_temperatures=[0.0]) == levels[:3]
    assert levels_for("hf_prompt_lookup", levels, peer_temperatures=[0.0]) == [levels[0]]
    assert levels_for("ours_hybrid", levels, peer_temperatures=[0.0]) == levels, "our systems run every level"
    prompts = [Prompt("math", i, (i, i + 1)) for i in range(5)]
    assert len(level_prompts(prompts, Level(4, 4, 8, 0.0))) == 4
    with pytest.raises(ValueError, match="needs 6 distinct prompts"):
        level_prompts(prompts, Level(6, 6, 8, 0.0))
    with pytest.raises(ValueError, match="distinct"):
        level_prompts(prompts[:3] + [prompts[0]], Level(4, 4, 8, 0.0))
    with pytest.raises(ValueError):
        plan_levels([0], [0.0], 1, 1, 1)


def test_systems_resolve_aliases_and_refuse_unknown_names():
    assert resolve_systems("target_only,dspark_scheduled,hybrid,ours_suffix,hybrid") == [
        "ours_target_only", "ours_spec", "ours_hybrid", "ours_suffix"]
    with pytest.raises(ValueError, match="unknown system 'nope'"):
        resolve_systems("nope")
    # the A/A control is a second target-only engine (no drafter, no proposer)
    assert resolve_systems("target_only,target_only_aa") == ["ours_target_only", "ours_target_only_aa"]
    assert "ours_target_only_aa" in OURS_TARGET_ONLY and "ours_target_only_aa" not in NEEDS_DRAFTER


def test_recorder_spreads_tokens_that_arrive_together_and_measures_ttft():
    rec = Recorder()
    rec.submit("a", now=0.0)
    rec.arrive("a", [1], now=0.5)
    rec.arrive("a", [2, 3], now=1.5)
    rec.arrive("a", [], now=9.0)  # an update without tokens is not an arrival
    (r,) = rec.records([("a", "code")])
    assert r["tokens"] == [1, 2, 3] and r["task"] == "code"
    assert r["ttft_ms"] == 500.0 and r["seconds"] == 1.5
    assert r["gaps_ms"] == [500.0, 500.0]


def test_drive_keeps_at_most_concurrency_requests_in_flight_and_admits_one_per_step():
    running: list[str] = []
    peak = []
    left: dict[str, int] = {}

    def submit(rid, i):
        running.append(rid)
        left[rid] = 4 + i % 3

    def step():
        peak.append(len(running))
        done = []
        for rid in list(running):
            left[rid] -= 1
            if left[rid] == 0:
                running.remove(rid)
                done.append(rid)
        return done
    rids, secs = drive([[1]] * 7, 3, submit, step, lambda: bool(running), Recorder(), "t")
    assert rids == [f"t-{i}" for i in range(7)] and secs >= 0
    assert max(peak) == 3 and peak[:3] == [1, 2, 3]  # arrivals one per step until 3 run
    assert not running


def test_lockstep_times_each_drive_by_its_own_steps_only():
    """Two drives taking turns: each one's clock (its seconds, its requests' arrival times) runs only
    inside its own steps, so the other's slow steps are on neither its total nor its latencies."""
    def make(step_s: float, steps: int, rec: Recorder) -> Drive:
        left = {"n": steps}

        def step():
            time.sleep(step_s)
            left["n"] -= 1
            rec.arrive("t-0", [1])
            return ["t-0"] if left["n"] == 0 else []
        return Drive([[1]], 1, lambda rid, i: None, step, lambda: left["n"] > 0, rec, "t")
    fast_rec, slow_rec = Recorder(), Recorder()
    fast, slow = make(0.002, 5, fast_rec), make(0.03, 5, slow_rec)
    lockstep([fast, slow])
    assert fast.done and slow.done
    assert 0.010 <= fast.seconds < 0.05, fast.seconds  # 5 x 2 ms of its own, not the other's 150 ms
    assert 0.150 <= slow.seconds < 0.30, slow.seconds
    (r,) = fast_rec.records([("t-0", "math")])
    assert len(r["gaps_ms"]) == 4 and max(r["gaps_ms"]) < 30.0


def test_lockstep_rotates_which_drive_steps_first():
    """Each turn starts with the next drive, so no system always steps right after the same other one."""
    order: list[str] = []

    def make(name: str, steps: int) -> Drive:
        left = {"n": steps}

        def step():
            order.append(name)
            left["n"] -= 1
            return [f"{name}-0"] if left["n"] == 0 else []
        return Drive([[1]], 1, lambda rid, i: None, step, lambda: left["n"] > 0, Recorder(), name)
    lockstep([make("a", 4), make("b", 4), make("c", 2)])
    assert order == ["a", "b", "c", "b", "c", "a", "a", "b", "b", "a"]


def test_run_order_by_level_puts_a_levels_systems_back_to_back_and_rotates_them():
    levels = plan_levels([1, 4], [0.0], 3, 256, 128, 1.0)
    plan = run_order(["a", "b", "c"], levels, rounds=2, by_level=True, few=["c"], few_rounds=1)
    assert [(r, s, lv[0].batch) for r, (s,), lv in plan] == [
        (0, "a", 1), (0, "b", 1), (0, "c", 1), (0, "b", 4), (0, "c", 4), (0, "a", 4),
        (1, "b", 1), (1, "a", 1), (1, "a", 4), (1, "b", 4)], "c runs in the first round only"
    by_system = run_order(["a", "b"], levels, rounds=2, by_level=False)
    assert [(r, s, len(lv)) for r, (s,), lv in by_system] == [(0, "a", 2), (0, "b", 2), (1, "b", 2), (1, "a", 2)]


def test_run_order_puts_lockstep_systems_in_one_process_that_rotates_as_one_unit():
    levels = plan_levels([1, 4], [0.0], 3, 256, 128, 1.0)
    plan = run_order(["a", "p", "b", "c"], levels, rounds=2, by_level=True, few=["c", "p"], few_rounds=1,
                     lockstep=["a", "b", "c"])
    assert [(r, u, lv[0].batch) for r, u, lv in plan] == [
        (0, ("a", "b", "c"), 1), (0, ("p",), 1), (0, ("p",), 4), (0, ("a", "b", "c"), 4),
        (1, ("a", "b"), 1), (1, ("a", "b"), 4)], "c and the peer p run in the first round only"


def test_peer_batches_limit_the_peers_not_our_systems():
    levels = plan_levels([1, 4, 16], [0.0], 3, 256, 128, 1.0)
    assert levels_for("vllm_ngram", levels, peer_batches=[1]) == levels[:1]
    assert levels_for("hf_generate", levels, peer_batches=[1, 16]) == [levels[0], levels[2]]
    assert levels_for("ours_target_only", levels, peer_batches=[1]) == levels


def test_a_steps_decode_time_is_shared_equally_by_its_rows_and_host_is_what_the_phases_leave():
    totals = defaultdict(lambda: defaultdict(float))
    step = {"step": 0.100, "prefill": 0.020, "verify": 0.060, "neural": 0.008, "suffix": 0.002}
    attribute_step(totals, step, ["a", "b"])
    attribute_step(totals, {**step, "neural": 0.0}, ["a"])  # a lone row gets the whole step
    attribute_step(totals, step, [])  # prompt work only: nobody's round
    assert set(totals) == {"a", "b"}
    assert totals["b"] == pytest.approx({"neural": 0.004, "suffix": 0.001, "verify": 0.030, "host": 0.005})
    assert totals["a"] == pytest.approx({"neural": 0.004, "suffix": 0.003, "verify": 0.090, "host": 0.023})
    assert sum(totals["a"].values()) + sum(totals["b"].values()) == pytest.approx(2 * (0.100 - 0.020))


def test_history_prompts_are_each_eval_sets_last_whatever_the_levels_take():
    from dspark.engine.sidebyside import history_prompts, load_prompts

    a, b = history_prompts(22, 6), history_prompts(43, 6)
    assert a == b and len(a) == 6 and [p.task for p in a[:3]] == ["math", "code", "chat"]
    ends = {p.task: p.index for p in load_prompts(1, from_end=True)}  # each set's very last prompt
    assert {p.task: p.index for p in a[3:]} == ends
    firsts = {p.ids for p in load_prompts(43)}
    assert not firsts & {p.ids for p in a}  # no level's prompt
    with pytest.raises(ValueError, match="overlap"):
        history_prompts(79, 6)  # chat has 80 prompts: its last two are among the first 79


def test_tasks_make_a_one_task_workload_and_history():
    from dspark.engine.sidebyside import history_prompts, load_prompts, parse_tasks

    assert parse_tasks("chat,math") == ["math", "chat"]  # eval-set order, whatever the order given
    for bad in ("chat,poetry", "chat,chat", ""):
        with pytest.raises(ValueError, match="--tasks"):
            parse_tasks(bad)
    chat = load_prompts(5, tasks=["chat"])
    assert [p.task for p in chat] == ["chat"] * 5 and [p.index for p in chat] == list(range(5))
    assert [p.ids for p in chat] == [p.ids for p in load_prompts(5) if p.task == "chat"]
    hist = history_prompts(32, 24, tasks=["chat"])
    assert len(hist) == 24 and {p.task for p in hist} == {"chat"} and min(p.index for p in hist) >= 32
    with pytest.raises(ValueError, match="overlap"):
        history_prompts(60, 24, tasks=["chat"])  # the last 24 of chat's 80 start at 56


def test_our_suffix_rows_run_the_engine_directorys_suffix_settings_unless_the_command_line_says():
    engine_suffix = {"max_drafts": 5, "scope": "request", "host_seconds_per_row": 2e-5, "max_depth": 12}
    cfg = suffix_config(engine_suffix)
    assert (cfg.max_drafts, cfg.scope, cfg.host_seconds_per_row, cfg.max_depth) == (5, "request", 2e-5, 12)
    cfg = suffix_config(engine_suffix, max_drafts=2, scope="shared")
    assert (cfg.max_drafts, cfg.scope, cfg.host_seconds_per_row) == (2, "shared", 2e-5)
    assert suffix_config({}).max_drafts == 3 and suffix_config({}).scope == "shared"
