"""STS calibration: the fit lowers ECE, keeps the ranking, and its file format round-trips."""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from dspark.training.metrics import brier, confidence_calibration, ece, ece_rows, reliability_bins, roc_auc
from dspark.engine.sts import (
    StsCalibration,
    StsCalibrationError,
    apply_sts,
    calibration_report,
    default_grid,
    fit_sts,
)

from .side_files import assert_refused_in_one_line

K = 5


def _synthetic(n: int = 20000, scale: float = 2.5, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Rounds whose true per-position acceptance is sigmoid(z); the head reports scale * z.

    -> (reported logits [n, K], accepted_len [n]); scale > 1 means overconfident.
    """
    g = torch.Generator().manual_seed(seed)
    z_true = torch.randn(n, K, generator=g, dtype=torch.float64) * 1.5 + 1.0
    ok = torch.rand(n, K, generator=g, dtype=torch.float64) < torch.sigmoid(z_true)
    accepted_len = torch.cumprod(ok.long(), dim=1).sum(1)
    return z_true * scale, accepted_len


@pytest.fixture(scope="module")
def overconfident():
    """(logits, accepted_len, fitted temperatures), fitted once for the module."""
    z, acc = _synthetic(n=12000, scale=2.5)
    return z, acc, fit_sts(z, acc)


def test_sts_reduces_ece_of_every_position_on_overconfident_data(overconfident):
    z, acc, temps = overconfident
    assert len(temps) == K
    for row in calibration_report(z, acc, temps):
        assert row.ece_after < 0.4 * row.ece_before, \
            f"position {row.position}: ECE {row.ece_before:.4f} -> {row.ece_after:.4f} should drop a lot"
        assert row.ece_after < 0.02
        assert row.brier_after <= row.brier_before + 1e-9
    assert temps[0] == pytest.approx(2.5, rel=0.15), "position 0 should recover the true over-scaling"


def test_sts_keeps_each_positions_ranking(overconfident):
    z, acc, temps = overconfident
    c_before, c_after = torch.sigmoid(z), apply_sts(z, temps)
    for k in range(K):
        assert torch.equal(torch.argsort(c_before[:, k], stable=True), torch.argsort(c_after[:, k], stable=True)), \
            f"temperature scaling must preserve the order of confidences at position {k}"
    report = calibration_report(z, acc, temps)
    assert report[0].auc_after == pytest.approx(report[0].auc_before, abs=1e-12), \
        "position 0: the cumulative product is c_0 itself, so its AUC is unchanged"


def test_sts_leaves_calibrated_data_nearly_alone():
    z, acc = _synthetic(n=10000, scale=1.0, seed=1)
    temps = fit_sts(z, acc)
    assert all(0.8 < t < 1.25 for t in temps), temps
    for row in calibration_report(z, acc, temps):
        assert row.ece_after <= row.ece_before + 0.005


def test_sts_fixes_earlier_positions_before_fitting_later_ones():
    """Position k's temperature is fitted against the calibrated, not raw, earlier positions."""
    z, acc = _synthetic(n=4000, scale=2.5, seed=2)
    temps = fit_sts(z, acc)
    z_k0 = z.clone()
    z_k0[:, 1:] = 0.0  # later positions do not influence earlier ones
    assert fit_sts(z_k0, acc)[0] == temps[0]
    prefix_only = fit_sts(z[:, :2], acc.clamp(max=2))
    assert prefix_only == temps[:2], "the fit of positions 0..1 does not look at positions 2.."


def test_fit_sts_prefers_temperature_one_on_ties():
    z = torch.zeros(10, 2)  # sigmoid(0 / T) = 0.5 for every T: all grid points tie
    acc = torch.tensor([0, 1, 2, 0, 1, 2, 0, 1, 2, 2])
    assert fit_sts(z, acc) == [1.0, 1.0]
    assert float(default_grid()[100]) == 1.0


def test_fit_sts_checks_inputs():
    with pytest.raises(ValueError, match=r"\[N, K\]"):
        fit_sts(torch.zeros(10), torch.zeros(10))
    with pytest.raises(ValueError, match="accepted_len"):
        fit_sts(torch.zeros(4, 2), torch.tensor([0, 1, 2, 3]))
    with pytest.raises(ValueError, match="grid"):
        fit_sts(torch.zeros(4, 2), torch.zeros(4), grid=[1.0, -2.0])
    with pytest.raises(ValueError, match="temperature"):
        apply_sts(torch.zeros(4, 3), [1.0, 1.0])


def test_apply_sts_accepts_longer_temperature_lists_and_keeps_dtype():
    z = torch.zeros(2, 3, dtype=torch.float32)
    out = apply_sts(z, [2.0, 2.0, 2.0, 2.0, 2.0])
    assert out.dtype == torch.float32 and out.shape == (2, 3)
    assert torch.allclose(apply_sts(torch.tensor([[2.0, -4.0]]), [2.0, 4.0]), torch.sigmoid(torch.tensor([[1.0, -1.0]])))


def test_calibration_save_writes_sts_temperatures_and_round_trips(tmp_path):
    z, acc = _synthetic(n=3000, scale=2.0, seed=3)
    cal = StsCalibration.fit(z, acc, meta={"checkpoint": "toy"})
    assert cal.temperatures == fit_sts(z, acc)
    path = cal.save(tmp_path / "sts.json")
    data = json.loads(path.read_text())
    assert "sts_temperatures" in data and "temperatures" not in data
    loaded = StsCalibration.load(path)
    assert loaded == cal
    assert torch.equal(loaded.apply(z), apply_sts(z, cal.temperatures))
    assert all(a < b for a, b in zip(cal.ece_after, cal.ece_before))


def test_calibration_loader_reads_the_temperatures_key(tmp_path):
    path = tmp_path / "other.json"
    path.write_text(json.dumps({"temperatures": [1.5, 2.0, 2.5]}))
    assert StsCalibration.load(path).temperatures == [1.5, 2.0, 2.5]
    path.write_text(json.dumps({"temperatures": [1.5, 2.0], "sts_temperatures": [1.5, 2.0]}))
    assert StsCalibration.load(path).temperatures == [1.5, 2.0]


@pytest.mark.parametrize("data, needle", [
    ({"temps": [1.0]}, "no 'sts_temperatures' or 'temperatures' key (found keys: ['temps'])"),
    ({"sts_temperatures": [1.0], "temperatures": [2.0]}, "disagree"),
    ({"sts_temperatures": []}, "non-empty list"),
    ({"sts_temperatures": [1.0, -0.5]}, "> 0"),
    ({"sts_temperatures": ["1.0"]}, "list of numbers"),
    ({"sts_temperatures": [1.0], "format_version": 7}, "format_version"),
    ({"sts_temperatures": [1.0], "format": "dspark-sps"}, "'format'"),
    ({"sts_temperatures": [1.0], "n_bins": 0}, "n_bins"),
    ([1.0, 2.0], "JSON object"),
])
def test_calibration_loader_refuses_bad_files_naming_file_and_keys(tmp_path, data, needle):
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(data))
    assert_refused_in_one_line(StsCalibration.load, path, StsCalibrationError, needle)


def test_calibration_loader_refuses_missing_and_non_json_files(tmp_path):
    with pytest.raises(StsCalibrationError, match="cannot read"):
        StsCalibration.load(tmp_path / "missing.json")
    path = tmp_path / "broken.json"
    path.write_text("{\"sts_temperatures\": [1.0,")
    with pytest.raises(StsCalibrationError, match="not valid JSON"):
        StsCalibration.load(path)


# -- calibration metrics -------------------------------------------------------------------


def test_ece_is_zero_when_every_bin_is_calibrated_and_the_gap_otherwise():
    p = np.array([0.25, 0.25, 0.25, 0.25, 0.75, 0.75, 0.75, 0.75])
    y = np.array([1, 0, 0, 0, 1, 1, 1, 0])
    assert ece(p, y, n_bins=10) == pytest.approx(0.0)
    assert ece(np.full(4, 0.9), np.array([1, 1, 0, 0]), n_bins=10) == pytest.approx(0.4)
    assert ece(np.array([1.0, 1.0]), np.array([1, 1])) == pytest.approx(0.0), "p = 1 lands in the last bin"
    assert ece(np.array([]), np.array([])) == 0.0


def test_roc_auc_counts_ties_as_half_and_matches_pairwise_definition():
    assert roc_auc([0.1, 0.2, 0.8, 0.9], [0, 0, 1, 1]) == 1.0
    assert roc_auc([0.9, 0.8, 0.2, 0.1], [0, 0, 1, 1]) == 0.0
    assert roc_auc([0.5, 0.5, 0.5, 0.5], [0, 1, 0, 1]) == 0.5
    assert np.isnan(roc_auc([0.1, 0.2], [1, 1]))
    rng = np.random.default_rng(0)
    s = rng.integers(0, 5, 200).astype(float)  # many ties
    y = rng.integers(0, 2, 200)
    pos, neg = s[y == 1], s[y == 0]
    pairwise = ((pos[:, None] > neg[None, :]) + 0.5 * (pos[:, None] == neg[None, :])).mean()
    assert roc_auc(s, y) == pytest.approx(pairwise)


def test_brier_and_reliability_bins():
    assert brier(torch.tensor([1.0, 0.0, 0.5]), torch.tensor([1.0, 1.0, 0.0])) == pytest.approx((0 + 1 + 0.25) / 3)
    bins = reliability_bins([0.05, 0.15, 0.95], [0, 1, 1], n_bins=10)
    assert bins["count"].tolist() == [1, 1] + [0] * 7 + [1]
    assert bins["accuracy"][1] == 1.0 and np.isnan(bins["accuracy"][5])


def test_ece_rows_scores_each_row_as_ece_does():
    rng = np.random.default_rng(3)
    y = (rng.random(500) < 0.4).astype(float)
    rows = np.concatenate([rng.random((6, 500)), np.ones((1, 500)), np.zeros((1, 500))])
    assert ece_rows(rows, y, 10).tolist() == [ece(r, y, 10) for r in rows]
    assert ece_rows(np.zeros((3, 0)), np.zeros(0)).tolist() == [0.0, 0.0, 0.0]
    with pytest.raises(ValueError, match=r"\[G, N\]"):
        ece_rows(np.zeros((2, 4)), np.zeros(5))


def test_confidence_calibration_scores_position_k_on_rounds_that_verified_k():
    survival = np.array([[0.9, 0.5], [0.8, 0.4], [0.7, 0.1]])
    acc, prop = np.array([2, 0, 1]), np.array([2, 2, 1])
    rows = confidence_calibration(survival, acc, prop)
    assert [(r["position"], r["n"]) for r in rows] == [(1, 3), (2, 2)]
    assert rows[0]["accept_rate"] == pytest.approx(2 / 3) and rows[1]["accept_rate"] == 0.5
    assert rows[1]["ece"] == pytest.approx(ece([0.5, 0.4], [1, 0]))
    assert rows[1]["auc"] == 1.0, "position 2 sees rounds 0 and 1 only"
    empty = confidence_calibration(survival, np.zeros(3), np.zeros(3))
    assert all(r["n"] == 0 and np.isnan(r["ece"]) and np.isnan(r["accept_rate"]) for r in empty), \
        "a position no round verified has no calibration to report"


def test_sts_scores_each_position_only_on_rounds_that_verified_it(overconfident):
    """Rounds that stopped verifying before position k say nothing about it (num_proposed)."""
    z, acc, temps = overconfident
    n = z.shape[0]
    prop = torch.full((n,), K)
    prop[: n // 2] = 2  # half the rounds verified only 2 drafts
    acc_cut = torch.minimum(acc, prop)
    temps_cut = fit_sts(z, acc_cut, num_proposed=prop)
    assert temps_cut[:2] == temps[:2], "positions 0..1 saw every round either way"
    assert temps_cut[2] == pytest.approx(2.5, rel=0.2)
    report = calibration_report(z, acc_cut, temps_cut, num_proposed=prop)
    assert [r.n for r in report] == [n, n, n - n // 2, n - n // 2, n - n // 2]
    with pytest.raises(ValueError, match="exceed"):
        fit_sts(z, acc, num_proposed=prop)


def test_calibrate_reports_out_of_sample_on_prompts_the_fit_never_saw(tmp_path):
    import json

    from dspark.engine.calibrate import calibrate, write_calibration_docs
    from dspark.training.models import build_drafter, drafter_config_for

    from ..conftest import make_tiny_target, tiny_run_config

    target = make_tiny_target()
    torch.manual_seed(0)
    drafter = build_drafter(drafter_config_for(tiny_run_config("dspark"), target), target).eval()
    with torch.no_grad():
        drafter.confidence.proj.weight.normal_(0, 0.5)
    prompts = ["abc", "hello", "xyz!", "spec"]
    summary = calibrate(target, drafter, prompts, max_new_tokens=12, seed=0, out=tmp_path / "sts.json",
                        report_fraction=0.5)
    assert summary["fit"]["prompts"] == 2 and summary["report"] == {
        "prompts": 2, "rounds": summary["rounds"] - summary["fit"]["rounds"], "out_of_sample": True}
    assert 0 < summary["fit"]["rounds"] < summary["rounds"]
    # the report counts the held-out rounds only (a round capped by max_tokens may verify none)
    assert 0 < summary["positions"][0]["n"] <= summary["report"]["rounds"]
    assert (tmp_path / "sts.json").is_file()
    write_calibration_docs(summary, tmp_path / "docs", "dspark calibrate ...")
    doc = json.loads((tmp_path / "docs" / "calibration.json").read_text())
    assert [p["position"] for p in doc["positions"]] == [1, 2, 3, 4]
    assert "never saw" in (tmp_path / "docs" / "calibration.md").read_text()
    with pytest.raises(ValueError):
        calibrate(target, drafter, prompts[:1], 4, 0, tmp_path / "x.json", report_fraction=0.5)
