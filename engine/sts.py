"""Sequential Temperature Scaling (STS) of the drafter's confidence head.

The confidence head gives, for draft position k, a logit ``z_k`` whose sigmoid ``c_k`` is
meant to be P(draft k accepted | drafts before k accepted). The scheduler uses the
cumulative products ``a_k = prod_{i<=k} c_i`` as absolute probabilities (expected accepts),
so they must be calibrated, not just well ranked. STS fits one temperature per position,
left to right: at position k the temperatures of positions < k are already fixed, and
``T_k`` is picked from a 1-D grid to minimise the ECE of
``a_k(T) = prod_{i<k} sigmoid(z_i / T_i) * sigmoid(z_k / T)`` against the indicator that
the accepted prefix reaches k (``accepted_len >= k + 1``, positions 0-based) on held-out
rounds. Rounds that verified fewer than k+1 drafts say nothing about position k; pass
``num_proposed`` and they are left out of that position's fit (default: all K verified).
Dividing a logit by a positive temperature is monotone, so the ranking of ``c_k`` across
drafts (its AUC) is unchanged; only the magnitudes move.

Calibration file (JSON object)::

    {
      "format": "dspark-sts",
      "format_version": 1,
      "sts_temperatures": [1.8, 2.1, 2.3, 2.2, 2.4, 2.5, 2.6],  # one per draft position
      "n_bins": 15,                      # ECE bins used by the fit
      "ece_before": [...], "ece_after": [...],  # per position, on the fitting data
      "created_at": "2026-12-01T10:00:00+00:00",
      "meta": {}                         # free-form (checkpoint, data set, ...)
    }

We write ``sts_temperatures``; the reader also accepts the shorter key ``temperatures``
(and files with only that key), so tables from other tools load as-is.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import torch

from dspark.training.metrics import confidence_calibration, ece_rows, roc_auc
from dspark.training.jsonfile import read_json_file, write_json_file

__all__ = [
    "STS_FORMAT",
    "STS_FORMAT_VERSION",
    "StsCalibrationError",
    "StsCalibration",
    "PositionReport",
    "default_grid",
    "fit_sts",
    "apply_sts",
    "calibration_report",
]

STS_FORMAT = "dspark-sts"
STS_FORMAT_VERSION = 1
_TEMP_KEYS = ("sts_temperatures", "temperatures")


class StsCalibrationError(ValueError):
    """A calibration file or input that cannot be used; the message names the file and keys."""


def default_grid() -> torch.Tensor:
    """Temperatures 0.1 .. 10, log spaced (201 values), with exactly 1.0 included."""
    grid = torch.logspace(-1.0, 1.0, 201, dtype=torch.float64)
    grid[100] = 1.0
    return grid


def _as_logits(conf_logits: Any) -> torch.Tensor:
    z = torch.as_tensor(conf_logits).detach().to("cpu", torch.float64)
    if z.dim() != 2:
        raise ValueError(f"conf_logits must be [N, K], got shape {tuple(z.shape)}")
    if not bool(torch.isfinite(z).all()):
        raise ValueError("conf_logits contains non-finite values")
    return z


def _as_counts(counts: Any, n: int, k: int, name: str = "accepted_len") -> torch.Tensor:
    """Per-round draft counts [N] in 0..K (accepted_len, num_proposed) -> int64 CPU tensor."""
    out = torch.as_tensor(counts).detach().to("cpu").reshape(-1)
    if out.numel() != n:
        raise ValueError(f"{name} must be [N]={n}, got {out.numel()} values")
    out = out.long()
    if bool(((out < 0) | (out > k)).any()):
        raise ValueError(f"{name} must lie in [0, K={k}]")
    return out


def _check_temps(temps: Any, k: int) -> torch.Tensor:
    t = torch.as_tensor(temps, dtype=torch.float64).reshape(-1)
    if t.numel() < k:
        raise ValueError(f"need a temperature for each of the K={k} positions, got {t.numel()}")
    if not bool((torch.isfinite(t) & (t > 0)).all()):
        raise ValueError(f"temperatures must be finite and > 0, got {t.tolist()}")
    return t[:k]


def apply_sts(conf_logits: Any, temps: Any | None) -> torch.Tensor:
    """Calibrated per-position confidences ``sigmoid(z[:, k] / T_k)``: [N, K] -> [N, K].

    The one place STS is applied: the engine's proposer, ``StsCalibration.apply`` and the exported ONNX step
    (where ``temps`` is a list, a constant of the graph) call it. ``temps`` None: no
    calibration, the plain sigmoid. Keeps the input's dtype and device when given a floating
    tensor (float32 otherwise); ``temps`` may be longer than K (a drafter run with a shorter block).
    """
    z = conf_logits if isinstance(conf_logits, torch.Tensor) else torch.as_tensor(conf_logits)
    if not z.is_floating_point():
        z = z.float()
    if z.dim() < 1:
        raise ValueError("conf_logits must have a trailing position dimension")
    if temps is None:
        return torch.sigmoid(z)
    t = _check_temps(temps, z.shape[-1]).to(device=z.device, dtype=z.dtype)
    return torch.sigmoid(z / t)


def _as_proposed(num_proposed: Any, n: int, k: int) -> torch.Tensor:
    if num_proposed is None:
        return torch.full((n,), k, dtype=torch.long)
    return _as_counts(num_proposed, n, k, "num_proposed")


def fit_sts(
    conf_logits: Any,  # [N, K] confidence-head logits on held-out rounds
    accepted_len: Any,  # [N] accepted drafts per round (bonus not counted); k accepted iff >= k+1
    grid: Any = None,  # [G] candidate temperatures (> 0); default_grid() if None
    n_bins: int = 15,
    num_proposed: Any = None,  # [N] drafts verified per round; None = all K
) -> list[float]:
    """Fit one temperature per position, left to right, minimising the cumulative-product ECE.

    Position k (0-based) is scored on the rounds that verified at least k+1 drafts (all
    rounds when ``num_proposed`` is None); its label is ``accepted_len >= k+1``. Ties on
    the grid go to the temperature closest to 1 (in log scale); a position no round
    verified gets 1.0. Returns K floats.
    """
    z = _as_logits(conf_logits)
    n, k = z.shape
    acc = _as_counts(accepted_len, n, k)
    prop = _as_proposed(num_proposed, n, k)
    if bool((acc > prop).any()):
        raise ValueError("accepted_len must not exceed num_proposed")
    grid = default_grid() if grid is None else torch.as_tensor(grid, dtype=torch.float64).reshape(-1)
    if grid.numel() == 0 or not bool((torch.isfinite(grid) & (grid > 0)).all()):
        raise ValueError("grid must hold finite temperatures > 0")
    if n == 0:
        raise ValueError("fit_sts needs at least one round")
    # prefer temperatures near 1 among equal ECEs: visit the grid in that order
    order = torch.argsort(grid.log().abs(), stable=True)
    grid = grid[order]
    temps: list[float] = []
    prev = torch.ones(n, dtype=torch.float64)  # calibrated survival up to position k-1
    for pos in range(k):
        seen = prop >= pos + 1
        labels = (acc[seen] >= pos + 1).double()
        cand = prev[seen].unsqueeze(0) * torch.sigmoid(z[seen, pos].unsqueeze(0) / grid.unsqueeze(1))  # [G, n_seen]
        best = int(ece_rows(cand.numpy(), labels.numpy(), n_bins).argmin()) if labels.numel() else 0
        temp = float(grid[best]) if labels.numel() else 1.0
        temps.append(temp)
        prev = prev * torch.sigmoid(z[:, pos] / temp)
    return temps


@dataclass
class PositionReport:
    """Calibration of the cumulative survival ``a_k`` at one draft position (0-based)."""

    position: int
    n: int  # rounds that verified this position
    positive_rate: float  # fraction of those whose accepted prefix reaches this position
    ece_before: float
    ece_after: float
    brier_before: float
    brier_after: float
    auc_before: float  # AUC of a_k vs reached-k
    auc_after: float
    auc_conditional: float  # AUC of c_k among rounds that reached k-1 (unchanged by STS)


def calibration_report(conf_logits: Any, accepted_len: Any, temps: Any, n_bins: int = 15,
                       num_proposed: Any = None) -> list[PositionReport]:
    """Per-position ECE / Brier / AUC of the cumulative product before (T=1) and after STS.

    Both sides are ``dspark.training.metrics.confidence_calibration`` of the survival; a
    position no round verified reports NaN. ``auc_conditional`` ranks the raw logit ``z_k``
    among the rounds that reached draft k, which no temperature changes.
    """
    z = _as_logits(conf_logits)
    n, k = z.shape
    acc = _as_counts(accepted_len, n, k)
    prop = _as_proposed(num_proposed, n, k)
    t = _check_temps(temps, k)
    a_before = torch.cumprod(torch.sigmoid(z), dim=1)
    a_after = torch.cumprod(torch.sigmoid(z / t), dim=1)
    before = confidence_calibration(a_before, acc, prop, n_bins)
    after = confidence_calibration(a_after, acc, prop, n_bins)
    rows = []
    for pos, (b, a) in enumerate(zip(before, after)):
        seen = prop >= pos + 1
        judged = acc[seen] >= pos  # rounds whose accepted prefix reached draft `pos`
        y = (acc[seen] >= pos + 1).double()
        rows.append(PositionReport(
            position=pos, n=b["n"], positive_rate=b["accept_rate"],
            ece_before=b["ece"], ece_after=a["ece"], brier_before=b["brier"], brier_after=a["brier"],
            auc_before=b["auc"], auc_after=a["auc"],
            auc_conditional=roc_auc(z[seen, pos][judged], y[judged]),
        ))
    return rows


@dataclass
class StsCalibration:
    """Per-position STS temperatures plus how well they did on the fitting data."""

    temperatures: list[float]  # one per draft position, > 0
    n_bins: int = 15
    ece_before: list[float] = field(default_factory=list)  # per position, cumulative product
    ece_after: list[float] = field(default_factory=list)
    created_at: str = field(default_factory=lambda: datetime.now(timezone.utc).isoformat(timespec="seconds"))
    format_version: int = STS_FORMAT_VERSION
    meta: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.temperatures = [float(t) for t in self.temperatures]
        if not self.temperatures or not all(math.isfinite(t) and t > 0 for t in self.temperatures):
            raise StsCalibrationError(f"temperatures must be a non-empty list of finite values > 0, "
                                      f"got {self.temperatures}")

    @classmethod
    def fit(cls, conf_logits: Any, accepted_len: Any, grid: Any = None, n_bins: int = 15,
            num_proposed: Any = None, meta: dict[str, Any] | None = None) -> "StsCalibration":
        temps = fit_sts(conf_logits, accepted_len, grid=grid, n_bins=n_bins, num_proposed=num_proposed)
        report = calibration_report(conf_logits, accepted_len, temps, n_bins=n_bins, num_proposed=num_proposed)
        return cls(temperatures=temps, n_bins=n_bins, ece_before=[r.ece_before for r in report],
                   ece_after=[r.ece_after for r in report], meta=dict(meta or {}))

    def apply(self, conf_logits: Any) -> torch.Tensor:
        return apply_sts(conf_logits, self.temperatures)

    def to_dict(self) -> dict[str, Any]:
        return {
            "format": STS_FORMAT,
            "format_version": self.format_version,
            "sts_temperatures": list(self.temperatures),
            "n_bins": self.n_bins,
            "ece_before": list(self.ece_before),
            "ece_after": list(self.ece_after),
            "created_at": self.created_at,
            "meta": dict(self.meta),
        }

    def save(self, path: str | Path) -> Path:
        return write_json_file(path, self.to_dict())

    @classmethod
    def from_dict(cls, data: Any, source: str = "<dict>") -> "StsCalibration":
        if not isinstance(data, dict):
            raise StsCalibrationError(f"{source}: expected a JSON object, got {type(data).__name__}")
        found = sorted(data)
        if "format" in data and data["format"] != STS_FORMAT:
            raise StsCalibrationError(f"{source}: 'format' is {data['format']!r}, expected {STS_FORMAT!r} "
                                      f"(found keys: {found})")
        version = data.get("format_version", STS_FORMAT_VERSION)
        if version != STS_FORMAT_VERSION:
            raise StsCalibrationError(f"{source}: unknown format_version {version!r} "
                                      f"(this kit reads {STS_FORMAT_VERSION})")
        present = [key for key in _TEMP_KEYS if key in data]
        if not present:
            raise StsCalibrationError(f"{source}: no 'sts_temperatures' or 'temperatures' key "
                                      f"(found keys: {found})")
        if len(present) == 2 and data["sts_temperatures"] != data["temperatures"]:
            raise StsCalibrationError(f"{source}: 'sts_temperatures' and 'temperatures' disagree "
                                      f"(found keys: {found})")
        key = present[0]
        temps = data[key]
        if (not isinstance(temps, list) or not temps
                or not all(isinstance(t, (int, float)) and not isinstance(t, bool) for t in temps)):
            raise StsCalibrationError(f"{source}: '{key}' must be a non-empty list of numbers, got {temps!r}")
        if not all(math.isfinite(t) and t > 0 for t in temps):
            raise StsCalibrationError(f"{source}: '{key}' must hold finite temperatures > 0, got {temps}")
        n_bins = data.get("n_bins", 15)
        if isinstance(n_bins, bool) or not isinstance(n_bins, int) or n_bins < 1:
            raise StsCalibrationError(f"{source}: 'n_bins' must be an integer >= 1, got {n_bins!r}")
        lists = {}
        for name in ("ece_before", "ece_after"):
            value = data.get(name, [])
            if not isinstance(value, list):
                raise StsCalibrationError(f"{source}: '{name}' must be a list, got {type(value).__name__}")
            lists[name] = [float(v) for v in value]
        meta = data.get("meta", {})
        if not isinstance(meta, dict):
            raise StsCalibrationError(f"{source}: 'meta' must be an object, got {type(meta).__name__}")
        return cls(temperatures=temps, n_bins=n_bins, created_at=str(data.get("created_at", "")),
                   format_version=version, meta=meta, **lists)

    @classmethod
    def load(cls, path: str | Path) -> "StsCalibration":
        """Read a calibration file; reads ``sts_temperatures`` or ``temperatures``."""
        path = Path(path)
        data = read_json_file(path, "STS calibration", StsCalibrationError)
        return cls.from_dict(data, source=str(path))

