"""Acceptance and calibration metrics.

- ``accept_len``: mean over verify rounds of (accepted drafts + 1): the bonus or
  recovered token counts, so a drafter that never hits scores 1.0.
- ``num_accepted``: accepted drafts only.
- ``accept_rate@k`` (k = 1..K): P(accepted >= k | proposed >= k), the chance that the
  k-th draft survives given it was verified and all before it survived.
- Confidence calibration of the cumulative product ``a_k = prod_{i<=k} c_i`` against the
  accepted-prefix indicator ``1[accepted >= k]``: ECE (equal-width bins), AUC, Brier.
"""
from __future__ import annotations

import numpy as np


def accept_len(num_accepted: list[int] | np.ndarray) -> float:
    arr = np.asarray(num_accepted, dtype=np.float64)
    return float(arr.mean() + 1.0) if arr.size else float("nan")


def accept_rate_at_k(num_accepted: list[int] | np.ndarray, num_proposed: list[int] | np.ndarray, K: int) -> list[float]:
    """Per position k = 1..K: P(accepted >= k | proposed >= k and accepted >= k-1)."""
    acc = np.asarray(num_accepted)
    prop = np.asarray(num_proposed)
    out = []
    for k in range(1, K + 1):
        reached = (prop >= k) & (acc >= k - 1)
        out.append(float((acc[reached] >= k).mean()) if reached.any() else float("nan"))
    return out


def ece(prob: np.ndarray, label: np.ndarray, n_bins: int = 15) -> float:
    """Expected calibration error with equal-width bins on [0, 1]."""
    prob = np.asarray(prob, dtype=np.float64).ravel()
    label = np.asarray(label, dtype=np.float64).ravel()
    if prob.size == 0:
        return float("nan")
    bins = np.minimum((prob * n_bins).astype(int), n_bins - 1)
    total = 0.0
    for b in range(n_bins):
        sel = bins == b
        if sel.any():
            total += sel.sum() * abs(prob[sel].mean() - label[sel].mean())
    return float(total / prob.size)


def auc(prob: np.ndarray, label: np.ndarray) -> float:
    """ROC AUC via the rank statistic (ties averaged); nan when one class is absent."""
    from scipy.stats import rankdata

    prob = np.asarray(prob, dtype=np.float64).ravel()
    label = np.asarray(label).ravel().astype(bool)
    n_pos, n_neg = label.sum(), (~label).sum()
    if n_pos == 0 or n_neg == 0:
        return float("nan")
    ranks = rankdata(prob)
    return float((ranks[label].sum() - n_pos * (n_pos + 1) / 2) / (n_pos * n_neg))


def brier(prob: np.ndarray, label: np.ndarray) -> float:
    prob = np.asarray(prob, dtype=np.float64).ravel()
    label = np.asarray(label, dtype=np.float64).ravel()
    return float(np.mean((prob - label) ** 2)) if prob.size else float("nan")


def confidence_calibration(cum_conf: np.ndarray, num_accepted: np.ndarray, num_proposed: np.ndarray) -> list[dict]:
    """Per position: ECE / AUC / Brier of a_k against 1[accepted >= k], over rounds that proposed k."""
    cum_conf = np.asarray(cum_conf)
    acc = np.asarray(num_accepted)
    prop = np.asarray(num_proposed)
    out = []
    for k in range(1, cum_conf.shape[1] + 1):
        sel = prop >= k
        p, y = cum_conf[sel, k - 1], (acc[sel] >= k).astype(np.float64)
        out.append({"position": k, "n": int(sel.sum()), "ece": ece(p, y), "auc": auc(p, y), "brier": brier(p, y),
                    "mean_conf": float(p.mean()) if p.size else float("nan"),
                    "accept_rate": float(y.mean()) if y.size else float("nan")})
    return out
