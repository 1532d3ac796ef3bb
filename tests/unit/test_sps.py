"""SPS tables: JSON round trip, refusal of bad files, dense expansion, profiling, plotting."""
from __future__ import annotations

import json
import math

import pytest
import torch

from dspark.engine.sps import (
    SPS_FORMAT,
    FlatCostTableError,
    SpsTable,
    SpsTableError,
    isotonic_non_decreasing,
    load_sps_table,
    plot_sps,
    profile_sps,
)

from .side_files import assert_refused_in_one_line


def _table(**kw) -> SpsTable:
    args = dict(tokens=[1, 8, 64, 256], steps_per_s=[100.0, 95.0, 60.0, 20.0], device="cpu",
                engine="toy", created_at="2026-12-01T00:00:00+00:00", meta={"warmup": 1})
    args.update(kw)
    return SpsTable(**args)


def _write(tmp_path, data, name="sps.json"):
    path = tmp_path / name
    path.write_text(json.dumps(data) if not isinstance(data, str) else data)
    return path


def test_save_then_load_round_trips_every_field(tmp_path):
    table = _table()
    path = table.save(tmp_path / "sub" / "sps.json")
    data = json.loads(path.read_text())
    assert data["format"] == SPS_FORMAT and data["format_version"] == 1
    loaded = SpsTable.load(path)
    assert loaded == table
    assert load_sps_table(path) == table


@pytest.mark.parametrize("mutate, needle", [
    (lambda d: d.update(format_version=99), "format_version"),
    (lambda d: d.pop("steps_per_s"), "missing key"),
    (lambda d: d.update(stepz=1), "unknown key"),
    (lambda d: d.update(format="something-else"), "'format'"),
    (lambda d: d.update(tokens=[1, 64, 8, 256]), "strictly increasing"),
    (lambda d: d.update(tokens=[0, 8, 64, 256]), ">= 1"),
    (lambda d: d.update(steps_per_s=[100.0, -1.0, 60.0, 20.0]), "> 0"),
    (lambda d: d.update(steps_per_s=[100.0, 95.0, 60.0]), "entries"),
    (lambda d: d.update(tokens=[4], steps_per_s=[10.0]), "at least 2"),
    (lambda d: d.update(tokens="1,8"), "must be a list"),
    (lambda d: d.update(device=3), "'device'"),
    (lambda d: d.update(draft_requests=[1, 4]), "go together"),
    (lambda d: d.update(draft_requests=[4, 1], draft_seconds=[0.1, 0.2]), "strictly increasing"),
    (lambda d: d.update(draft_requests=[1, 4], draft_seconds=[0.1]), "equal length"),
    (lambda d: d.update(draft_requests=[1], draft_seconds=[-0.1]), ">= 0"),
    (lambda d: d.update(draft_append_seconds=1e-5), "needs 'draft_requests'"),
    (lambda d: d.update(draft_requests=[1], draft_seconds=[0.1], draft_append_seconds=-1e-5), ">= 0"),
    (lambda d: d.update(batch_rows=[1, 4]), "go together"),
    (lambda d: d.update(batch_rows=[1, 4], extra_tokens=[[0, 2]], rows_steps_per_s=[[9.0, 8.0]]), "2 lists"),
    (lambda d: d.update(batch_rows=[4, 1], extra_tokens=[[0, 2]] * 2, rows_steps_per_s=[[9.0, 8.0]] * 2),
     "strictly increasing"),
    (lambda d: d.update(batch_rows=[1], extra_tokens=[[1, 2]], rows_steps_per_s=[[9.0, 8.0]]), "starting at 0"),
    (lambda d: d.update(batch_rows=[1], extra_tokens=[[0, 2, 2]], rows_steps_per_s=[[9.0, 8.0, 7.0]]),
     "strictly increasing"),
    (lambda d: d.update(batch_rows=[1], extra_tokens=[[0, 2]], rows_steps_per_s=[[9.0, 0.0]]), "> 0"),
    (lambda d: d.update(batch_rows=[1], extra_tokens=[[0, 2]], rows_steps_per_s=[[9.0]]), "equal lists"),
])
def test_loader_refuses_corrupt_tables_with_a_one_line_reason_naming_the_file(tmp_path, mutate, needle):
    data = _table().to_dict()
    mutate(data)
    assert_refused_in_one_line(SpsTable.load, _write(tmp_path, data), SpsTableError, needle)


def test_loader_refuses_missing_and_non_json_files(tmp_path):
    with pytest.raises(SpsTableError, match="cannot read"):
        SpsTable.load(tmp_path / "nope.json")
    path = _write(tmp_path, "{not json")
    with pytest.raises(SpsTableError, match="not valid JSON") as err:
        SpsTable.load(path)
    assert str(path) in str(err.value)
    with pytest.raises(SpsTableError, match="JSON object"):
        SpsTable.load(_write(tmp_path, [1, 2], "list.json"))


@pytest.mark.parametrize("sps", [
    [50.0, 50.0, 50.0, 50.0],  # flat: an unsynchronised GPU step looks like this
    [50.0, 50.4, 49.9, 50.2],  # flat with noise
    [10.0, 20.0, 40.0, 80.0],  # more tokens, more steps/s: nonsense
])
def test_loader_refuses_flat_or_rising_tables_unless_allowed(tmp_path, sps):
    path = _table(steps_per_s=sps).save(tmp_path / "flat.json")
    with pytest.raises(FlatCostTableError) as err:
        SpsTable.load(path)
    assert str(path) in str(err.value) and "flat" in str(err.value)
    assert SpsTable.load(path, allow_flat=True).steps_per_s == sps


def test_noisy_but_falling_table_is_accepted(tmp_path):
    path = _table(steps_per_s=[100.0, 101.0, 60.0, 61.0]).save(tmp_path / "noisy.json")
    SpsTable.load(path)


def test_drafter_cost_round_trips_and_interpolates_like_step_time(tmp_path):
    table = _table(draft_requests=[1, 4, 16], draft_seconds=[0.01, 0.02, 0.08])
    loaded = SpsTable.load(table.save(tmp_path / "sps.json"))
    assert loaded == table and loaded.has_draft_cost
    assert loaded.draft_time(1) == pytest.approx(0.01) and loaded.draft_time(0) == pytest.approx(0.01)
    assert loaded.draft_time(10) == pytest.approx(0.05)  # halfway between 4 and 16
    assert loaded.draft_time(32) == pytest.approx(0.16)  # proportional to rows past the table
    assert not _table().has_draft_cost and "draft_requests" not in _table().to_dict()
    with pytest.raises(SpsTableError, match="no drafter cost"):
        _table().draft_time(1)


def test_drafter_append_cost_round_trips_and_prices_a_catch_up(tmp_path):
    table = _table(draft_requests=[1, 4], draft_seconds=[0.01, 0.02], draft_append_seconds=2e-5)
    loaded = SpsTable.load(table.save(tmp_path / "sps.json"))
    assert loaded == table and loaded.to_dict()["draft_append_seconds"] == 2e-5
    assert loaded.catchup_time(100) == pytest.approx(2e-3) and loaded.catchup_time(0) == 0.0
    older = _table(draft_requests=[1, 4], draft_seconds=[0.01, 0.02])  # profiled before the key existed
    assert older.catchup_time(100) == 0.0 and "draft_append_seconds" not in older.to_dict()


def test_as_tensor_hits_profiled_points_and_interpolates_step_time_linearly():
    table = _table()
    sps = table.as_tensor()
    assert sps.shape == (257,) and sps.dtype == torch.float64
    for t, s in zip(table.tokens, table.steps_per_s):
        assert float(sps[t]) == pytest.approx(s)
    # halfway between 8 and 64 tokens: mean of the step times
    want = 1.0 / (0.5 / 95.0 + 0.5 / 60.0)
    assert float(sps[36]) == pytest.approx(want)
    assert float(sps[0]) == float(sps[1]), "entry 0 is unused and copies entry 1"


def test_as_tensor_is_monotone_non_increasing_after_isotonic_smoothing():
    table = _table(tokens=[1, 2, 4, 8, 16], steps_per_s=[100.0, 90.0, 95.0, 50.0, 52.0])
    sps = table.as_tensor()
    assert bool((sps[2:] <= sps[1:-1] + 1e-12).all())
    raw = table.as_tensor(smooth="none")
    assert float(raw[4]) == pytest.approx(95.0), "smooth='none' keeps the raw points"
    with pytest.raises(ValueError, match="smooth"):
        table.as_tensor(smooth="cubic")


def test_as_tensor_extrapolates_with_time_proportional_to_tokens():
    table = _table()
    sps = table.as_tensor(max_tokens=512)
    assert sps.shape == (513,)
    assert float(sps[512]) == pytest.approx(20.0 * 256 / 512)
    small = table.as_tensor(max_tokens=32)
    assert torch.equal(small, table.as_tensor()[:33])


def test_isotonic_fit_is_non_decreasing_and_keeps_the_mean():
    values = [3.0, 1.0, 2.0, 5.0, 4.0, 4.0]
    fit = isotonic_non_decreasing(values)
    assert all(b >= a for a, b in zip(fit, fit[1:]))
    assert sum(fit) == pytest.approx(sum(values))
    assert isotonic_non_decreasing([1.0, 2.0, 3.0]) == [1.0, 2.0, 3.0]


class _FakeClock:
    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


def test_profile_sps_stores_one_over_the_median_step_time():
    clock = _FakeClock()
    calls = []

    def step(tokens: int) -> None:
        calls.append(tokens)
        n = sum(1 for c in calls if c == tokens)
        # cost 1 ms + 0.1 ms per token; the 5th call at each count is a 100x outlier
        clock.now += (1e-3 + 1e-4 * tokens) * (100.0 if n == 5 else 1.0)

    synced = []
    table = profile_sps(step, [64, 1, 16], warmup=2, repeats=5, sync=lambda: synced.append(1),
                        device="cpu", engine="fake", progress=False, timer=clock)
    assert table.tokens == [1, 16, 64]
    for t, s in zip(table.tokens, table.steps_per_s):
        assert s == pytest.approx(1.0 / (1e-3 + 1e-4 * t)), "median ignores the outlier"
    assert len(calls) == 3 * (2 + 5)
    assert len(synced) == 3 * (1 + 5), "sync after warmup and after every timed call"
    assert table.engine == "fake" and table.meta["repeats"] == 5


def test_a_slow_spell_during_profiling_lands_on_every_count_alike():
    """The host slows down 3x for the second half of the timed calls: with interleaved sweeps
    every count sees the same share of slow calls, so the table keeps the true cost ratios
    (timed count after count, the largest counts would all fall in the slow half)."""
    clock = _FakeClock()
    counts = [1, 4, 16, 64]
    repeats = 4
    timed = {"n": 0}

    def step(tokens: int) -> None:
        timed["n"] += 1
        slow = 3.0 if timed["n"] > len(counts) + len(counts) * repeats // 2 else 1.0  # after the warm-ups + half
        clock.now += (1e-3 + 1e-4 * tokens) * slow

    table = profile_sps(step, counts, warmup=1, repeats=repeats, progress=False, timer=clock)
    base = [1.0 / (1e-3 + 1e-4 * t) for t in counts]
    ratios = [s / b for s, b in zip(table.steps_per_s, base)]
    assert max(ratios) == pytest.approx(min(ratios)), "every count slowed down by the same factor"


def test_profile_sps_refuses_a_flat_profile():
    clock = _FakeClock()

    def step(tokens: int) -> None:  # e.g. an asynchronous launch timed without a sync
        clock.now += 1e-5

    with pytest.raises(FlatCostTableError, match="flat"):
        profile_sps(step, [1, 64, 256], warmup=0, repeats=3, progress=False, timer=clock)
    table = profile_sps(step, [1, 64, 256], warmup=0, repeats=3, progress=False, timer=clock, allow_flat=True)
    assert len(table.tokens) == 3


def test_profile_sps_checks_its_arguments():
    with pytest.raises(ValueError, match="token_counts"):
        profile_sps(lambda b: None, [8], progress=False)
    with pytest.raises(ValueError, match="repeats"):
        profile_sps(lambda b: None, [1, 8], repeats=0, progress=False)


def test_profile_sps_times_a_real_callable():
    def step(tokens: int) -> None:
        x = torch.ones(tokens, 64)
        for _ in range(4):
            x = x @ torch.ones(64, 64) / 64

    table = profile_sps(step, [1, 4096], warmup=1, repeats=3, progress=False)
    assert table.steps_per_s[0] > table.steps_per_s[1]


def test_plot_sps_writes_a_png(tmp_path):
    path = plot_sps(_table(), tmp_path / "plots" / "sps.png")
    assert path.exists() and path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_profile_append_cost_times_a_real_drafter_per_appended_position():
    from dspark.engine.bench import profile_append_cost
    from dspark.training.models import build_drafter, drafter_config_for

    from ..conftest import make_tiny_target, tiny_run_config

    target = make_tiny_target()
    drafter = build_drafter(drafter_config_for(tiny_run_config("dspark"), target), target)
    seconds = profile_append_cost(drafter, rows=2, positions=16, repeats=2)
    assert math.isfinite(seconds) and 0.0 <= seconds < 0.01  # per position and row: far under a pass
    with pytest.raises(ValueError, match="positions >= 2"):
        profile_append_cost(drafter, positions=1)


def _rows_table() -> SpsTable:
    """A grid whose 64-row steps cost more per draft than the 1-D curve's slope says (as on a CPU);
    each row count's step times are convex in the drafts, so the fit keeps them."""
    table = _table()
    table.set_rows_grid([1, 4, 64], [[0, 4, 8], [0, 8, 32], [0, 1, 8, 64]],
                        [[100.0, 98.0, 95.0], [90.0, 80.0, 50.0], [10.0, 1 / 0.102, 1 / 0.116, 4.0]])
    return table


def test_rows_grid_round_trips_and_a_table_without_it_prices_every_row_count_alike(tmp_path):
    table = _rows_table()
    assert table.has_rows and SpsTable.load(table.save(tmp_path / "sps.json")) == table
    flat = _table()
    assert not flat.has_rows and torch.equal(flat.as_tensor(64, rows=16), flat.as_tensor(64))


def test_rows_curve_hits_the_profiled_points_of_each_row_count():
    table = _rows_table()
    for R, extras, rates in zip(table.batch_rows, table.extra_tokens, table.rows_steps_per_s):
        dense = table.as_tensor(R + extras[-1], rows=R)
        assert [dense[R + e].item() for e in extras] == pytest.approx(rates)
        assert dense[1:R].tolist() == pytest.approx([rates[0]] * (R - 1)), "fewer tokens than rows: the plain step"


def test_rows_curve_mixes_neighbouring_row_counts_at_the_same_extra_tokens():
    table = _rows_table()
    # 34 rows: halfway between 4 and 64 rows; 8 extra drafts were profiled at both
    t4, t64 = 1 / 80.0, 0.116
    assert 1 / table.as_tensor(64, rows=34)[34 + 8].item() == pytest.approx((t4 + t64) / 2)
    # between profiled extra counts step time is linear: 64 rows, 4 extra is 3/7 of the way from +1 to +8
    t1, t8 = 0.102, 0.116
    assert 1 / table.as_tensor(128, rows=64)[64 + 4].item() == pytest.approx(t1 + 3 / 7 * (t8 - t1))


def test_rows_curve_extrapolates_along_the_last_slope_and_in_proportion_to_rows():
    table = _rows_table()
    t8, t64 = 0.116, 1 / 4.0
    slope = (t64 - t8) / 56
    assert 1 / table.as_tensor(200, rows=64)[64 + 100].item() == pytest.approx(t64 + 36 * slope)
    # 128 rows: the 64-row plain step twice over, the drafts priced as at 64 rows
    t0 = 1 / 10.0
    assert 1 / table.as_tensor(200, rows=128)[128].item() == pytest.approx(2 * t0)
    assert 1 / table.as_tensor(200, rows=128)[128 + 8].item() == pytest.approx(2 * t0 + (t8 - t0))


def test_rows_curve_is_convex_in_the_extra_tokens_from_the_plain_step():
    table = _table()
    # timing noise makes the second draft dear and the later ones cheap; a step faster than the plain one
    table.set_rows_grid([2, 4], [[0, 1, 2, 4, 8], [0, 1, 2]], [[1 / 1.0, 1 / 1.0, 1 / 1.3, 1 / 1.5, 1 / 1.9],
                                                              [1 / 2.0, 1 / 1.9, 1 / 2.2]])
    t = (1.0 / table.as_tensor(10, rows=2)[2:]).tolist()
    slopes = [b - a for a, b in zip(t, t[1:])]
    assert t[0] == pytest.approx(1.0), "anchored at the measured plain step"
    assert all(b >= a - 1e-12 for a, b in zip(slopes, slopes[1:])) and min(slopes) >= 0.0
    assert t[1] == pytest.approx(1.0), "a flat start is convex (a memory-bound step)"
    assert t[2] == pytest.approx(1.0 + 0.9 / 7), "drafts 2..8 pooled: 0.9 s over 7 drafts"
    assert t[8] == pytest.approx(1.9), "a pooled stretch keeps its total rise"
    t4 = (1.0 / table.as_tensor(10, rows=4)[4:]).tolist()
    assert t4[:3] == pytest.approx([2.0, 2.0, 2.3]), "a falling slope is clamped at 0: never below the plain step"


def test_step_costs_price_by_rows_only_with_a_grid():
    from dspark.engine.sps import StepCosts

    table = _rows_table()
    costs = StepCosts(table, 128)
    assert costs.by_rows and torch.equal(costs(64), table.as_tensor(128, rows=64)) and costs(64) is costs(64)
    flat = StepCosts(_table(), 128)
    assert not flat.by_rows and flat(1) is flat(64)
    assert torch.equal(StepCosts(costs)(4), costs(4))
    with pytest.raises(ValueError, match="max_tokens applies"):
        StepCosts(costs, 64)


def test_plot_sps_draws_the_rows_panel(tmp_path):
    path = plot_sps(_rows_table(), tmp_path / "sps.png")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_profile_target_sps_times_the_rows_grid_on_a_real_target():
    from dspark.engine.bench import profile_target_sps

    from ..conftest import make_tiny_target

    table = profile_target_sps(make_tiny_target(), 4, context=16, token_counts=[1, 4, 8, 16], repeats=1,
                               allow_flat=True, batch_rows=[1, 3])
    assert table.batch_rows == [1, 3]
    assert table.extra_tokens == [[0, 1, 2, 4], [0, 1, 2, 4, 8]], "extras up to R * K, from ROW_EXTRA_TOKENS"
    assert all(s > 0 and math.isfinite(s) for rates in table.rows_steps_per_s for s in rates)


def test_rows_grid_prices_a_draft_by_its_difference_to_the_same_sweeps_plain_step(monkeypatch):
    """A host that slows down 3x for one whole sweep: each draft's price still comes out exact."""
    from dspark.engine import bench

    clock, calls = [0.0], [0]
    warm, per_sweep = 3 * 4, 2 * 4  # warm-up calls (3 per point); timed calls per sweep (2 per point)

    def step(R: int, e: int) -> None:
        calls[0] += 1
        in_second_sweep = warm < calls[0] and (calls[0] - warm - 1) // per_sweep == 1
        clock[0] += (3.0 if in_second_sweep else 1.0) + 0.1 * e  # a plain step of 1 s (3 s in the slow spell)

    monkeypatch.setattr(bench.time, "perf_counter", lambda: clock[0])
    out = bench.time_rows_grid(step, {4: [0, 1, 2, 8]}, warmup=3, repeats=3, iters=2)
    assert out[(4, 0)] == pytest.approx(1.0)  # median of 1, 3, 1
    assert [out[(4, e)] - out[(4, 0)] for e in (1, 2, 8)] == pytest.approx([0.1, 0.2, 0.8])


def test_a_draft_price_below_the_rows_slope_needs_the_sweeps_behind_it():
    """Beside many rows one draft adds less than a step's noise: a first draft that timed at nothing
    in a noisy sweep goes back on the slope of the largest count, while first drafts that every
    sweep shows cheap (a memory-bound step) keep their price, and prices above the line stand."""
    from dspark.engine.bench import supported_draft_prices

    noisy = [[-15.0, 14.0, -2.0, 16.0, -1.0], [12.0, -9.0, -3.0, 20.0, -1.5]]  # medians -1.0 and -1.5 ms
    largest = [[300.0, 330.0, 320.0, 318.0, 322.0]]  # 64 drafts: 5 ms each, far above the noise
    assert supported_draft_prices([1, 2, 64], noisy + largest) == pytest.approx([5.0, 10.0, 320.0])
    cheap = [[0.1, 0.2, 0.0, 0.1, 0.3], [0.2, 0.1, 0.4, 0.2, 0.1]]  # every sweep far below 5 ms per draft
    assert supported_draft_prices([1, 2, 64], cheap + largest) == pytest.approx([0.1, 0.2, 320.0])
    dear = [[9.0, 8.0, 7.5, 9.5, 8.5]]  # above the line: measured, kept
    assert supported_draft_prices([1, 64], dear + largest) == pytest.approx([8.5, 320.0])
    assert supported_draft_prices([], []) == []


def test_beside_a_prompt_a_step_is_priced_by_what_its_tokens_add_to_the_longer_pass():
    """``costs(R, prompt_tokens=P)[b]`` is ``1 / (t(R) + t(b + P) - t(R + P))``: the prompt's own time
    is left out (paid whatever is drafted); past the table's end time grows in proportion to tokens."""
    from dspark.engine.sps import StepCosts, beside_prompt_sps, seconds_at

    seconds = torch.tensor([1.0] + [0.010 + 0.001 * b for b in range(1, 11)], dtype=torch.float64)
    sps = 1.0 / seconds
    sps[0] = 0.0
    assert seconds_at(sps, 3) == pytest.approx(0.013) and seconds_at(sps, 15) == pytest.approx(0.020 * 15 / 10)
    assert beside_prompt_sps(sps, 2, 0) is sps
    priced = beside_prompt_sps(sps, 2, 4)
    assert priced.shape == sps.shape and priced[0] == 0.0
    assert 1.0 / float(priced[2]) == pytest.approx(0.012)  # the rows alone: their own step
    assert 1.0 / float(priced[5]) == pytest.approx(0.012 + 0.019 - 0.016)
    assert 1.0 / float(priced[9]) == pytest.approx(0.012 + 0.020 * 13 / 10 - 0.016)  # past the end
    costs = StepCosts(sps)
    assert torch.equal(costs(2, prompt_tokens=4), priced) and torch.equal(costs(2), sps)
