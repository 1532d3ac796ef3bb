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
