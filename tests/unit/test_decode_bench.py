"""The decode benchmark and SPS profiler run end to end on a tiny target and report sane fields."""
from __future__ import annotations

import json

import pytest

from dspark.engine.bench import decode_benchmark, profile_draft_cost, profile_target_sps, write_decode_results
from dspark.training.models import build_drafter, drafter_config_for

from ..conftest import make_tiny_target, tiny_run_config


def test_decode_benchmark_reports_every_system_side_by_side(tmp_path):
    target = make_tiny_target()
    drafter = build_drafter(drafter_config_for(tiny_run_config("dspark"), target), target)
    sps = profile_target_sps(target, 4, context=16, token_counts=[1, 4, 8, 16], repeats=1, allow_flat=True)
    prompts = [[7, 8, 9], [10, 11, 12, 13, 14]]
    results = decode_benchmark(target, drafter, prompts, [1, 2], max_tokens=6, sps=sps)
    systems = {(r.system, r.batch) for r in results}
    assert {("target_only", 1), ("spec_fixed", 2), ("spec_scheduled", 1), ("hf_generate", 2), ("hf_prompt_lookup", 1)} <= systems
    for r in results:
        assert r.output_tokens == 6 * max(2 * r.batch, 4), f"{r.system}@{r.batch} emitted {r.output_tokens}"
        if r.system.startswith("spec"):
            assert 1.0 <= r.accept_len <= 5.0
            assert r.identical_to_target_only == 1.0, f"{r.system}@{r.batch}: greedy output differs from target_only"
        else:
            assert r.identical_to_target_only is None
    report = write_decode_results(results, tmp_path, "decode", "test", "cpu")
    assert json.loads((tmp_path / "decode.json").read_text()) == report
    assert (tmp_path / "decode.md").is_file() and (tmp_path / "decode.png").is_file()


def test_fixed_shape_steps_are_counted_and_stay_token_identical():
    """`static_steps="eager"` runs the GPU path's buckets on the CPU: the bench reports that
    every decode step came from a bucket and that greedy outputs still match target-only."""
    target = make_tiny_target()
    drafter = build_drafter(drafter_config_for(tiny_run_config("dspark"), target), target)
    results = decode_benchmark(target, drafter, [[7, 8, 9], [10, 11, 12, 13, 14]], [2], max_tokens=6,
                               systems=("target_only", "spec_fixed"), static_steps="eager")
    assert [r.system for r in results] == ["target_only", "spec_fixed"]
    assert all(r.static_step_frac == 1.0 for r in results), [r.static_step_frac for r in results]
    assert results[1].identical_to_target_only == 1.0


def test_repeats_rotate_the_order_and_report_medians_and_paired_ratios(tmp_path, monkeypatch):
    import dspark.engine.bench as bench
    target = make_tiny_target()
    drafter = build_drafter(drafter_config_for(tiny_run_config("dspark"), target), target)
    order, real = [], bench._run_system

    def recording(system, *args, **kwargs):
        order.append(system)
        return real(system, *args, **kwargs)
    monkeypatch.setattr(bench, "_run_system", recording)
    results = decode_benchmark(target, drafter, [[7, 8, 9], [10, 11, 12, 13, 14]], [2], max_tokens=5,
                               systems=("target_only", "spec_fixed", "hf_generate"), repeats=3)
    assert order == ["target_only", "spec_fixed", "hf_generate", "spec_fixed", "hf_generate", "target_only",
                     "hf_generate", "target_only", "spec_fixed"]
    by = {r.system: r for r in results}
    for r in results:
        assert len(r.tokens_per_s_runs) == 3 and r.tokens_per_s == sorted(r.tokens_per_s_runs)[1]
    assert by["target_only"].ratio_to_target_only == 1.0
    base = by["target_only"].tokens_per_s_runs
    paired = sorted(a / b for a, b in zip(by["spec_fixed"].tokens_per_s_runs, base))
    assert by["spec_fixed"].ratio_to_target_only == paired[1]
    assert by["spec_fixed"].identical_to_target_only == 1.0
    write_decode_results(results, tmp_path, "decode", "test", "cpu")
    assert "3 rounds in rotating order" in (tmp_path / "decode.md").read_text()


@pytest.mark.parametrize("algo", ["dspark", "eagle3"])
def test_drafter_cost_covers_the_context_append_and_the_pass(algo, monkeypatch):
    """`profile_draft_cost` times what a drafted step costs the drafter: extending its context
    with the committed positions, then one proposal, for every row of the batch."""
    from dspark.engine import draft_runner

    target = make_tiny_target()
    drafter = build_drafter(drafter_config_for(tiny_run_config(algo), target), target)
    calls: list[tuple[str, int]] = []
    make = draft_runner.make_draft_runner

    def recording_runner(*args, **kwargs):
        runner = make(*args, **kwargs)
        append, propose = runner.append, runner.propose

        def recording_append(rows):
            calls.append(("append", sum(aux.shape[0] for _, aux, _ in rows)))
            return append(rows)

        def recording_propose(slots, *a, **k):
            calls.append(("propose", len(slots)))
            return propose(slots, *a, **k)
        runner.append, runner.propose = recording_append, recording_propose
        return runner
    monkeypatch.setattr(draft_runner, "make_draft_runner", recording_runner)
    seconds = profile_draft_cost(drafter, [1, 3], context=8, repeats=2, committed=2)
    assert len(seconds) == 2 and all(s > 0 for s in seconds)
    timed = [c for c in calls if c != ("append", 8)]  # drop the context set-up (one 8-position append per row)
    # per batch size: warm-up + 2 timed steps, each an append of 2 positions per row then a pass over every row
    assert timed == [("append", 2), ("propose", 1)] * 3 + [("append", 6), ("propose", 3)] * 3
