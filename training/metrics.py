"""Acceptance and calibration metrics (numpy only; torch tensors and lists are accepted too).

- ``accept_len``: mean over verify rounds of (accepted drafts + 1): the bonus or
  recovered token counts, so a drafter that never hits scores 1.0.
- ``accept_rate@k`` (k = 1..K): P(accepted >= k | proposed >= k), the chance that the
  k-th draft survives given it was verified and all before it survived.
- Calibration of binary predictions, used for the confidence head (the cumulative product
  ``a_k = prod_{i<=k} c_i`` against the accepted-prefix indicator ``1[accepted >= k]``),
  by evaluation and by STS calibration (``dspark.engine.sts``); all in float64:
  - ``ece``: expected calibration error with ``n_bins`` equal-width bins on [0, 1],
    ``sum_b (n_b / n) * |mean(p in b) - mean(y in b)|``; p = 1 falls in the last bin;
    0.0 for empty input. ``ece_rows`` scores many candidate rows against one label
    vector at once (the STS grid search).
  - ``brier``: ``mean((p - y)^2)``.
  - ``roc_auc``: probability that a random positive scores above a random negative (ties
    count one half), the normalised Mann-Whitney U; NaN if only one class is present.
  - ``confidence_calibration``: the three above per draft position for the survival
    ``a_k``, each position scored on the rounds that verified it; one home for
    ``dspark eval`` and the STS report (``dspark.engine.sts.calibration_report``).
"""
from __future__ import annotations

from typing import Any

import numpy as np

__all__ = ["accept_len", "accept_rate_at_k", "confidence_calibration", "ece", "ece_rows", "brier", "roc_auc",
           "reliability_bins", "bin_index"]


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


def _as_1d(x: Any, name: str) -> np.ndarray:
    if hasattr(x, "detach"):  # torch tensor, without importing torch here
        x = x.detach().cpu().double().numpy()
    arr = np.asarray(x, dtype=np.float64).reshape(-1)
    if not np.all(np.isfinite(arr)):
        raise ValueError(f"{name} contains non-finite values")
    return arr


def _check_pair(probs: Any, labels: Any) -> tuple[np.ndarray, np.ndarray]:
    p = _as_1d(probs, "probs")
    y = _as_1d(labels, "labels")
    if p.shape != y.shape:
        raise ValueError(f"probs and labels must have the same length, got {p.size} and {y.size}")
    return p, y


def bin_index(probs: np.ndarray, n_bins: int) -> np.ndarray:
    """Equal-width bin of each probability in [0, 1] -> int array in [0, n_bins)."""
    if n_bins < 1:
        raise ValueError(f"n_bins must be >= 1, got {n_bins}")
    return np.clip(np.floor(np.asarray(probs) * n_bins), 0, n_bins - 1).astype(np.int64)


def reliability_bins(probs: Any, labels: Any, n_bins: int = 15) -> dict[str, np.ndarray]:
    """Per-bin ``count``, ``mean_prob`` and ``accuracy`` (NaN for empty bins), and ``edges``."""
    p, y = _check_pair(probs, labels)
    b = bin_index(p, n_bins)
    count = np.bincount(b, minlength=n_bins).astype(np.float64)
    with np.errstate(invalid="ignore", divide="ignore"):
        mean_prob = np.bincount(b, weights=p, minlength=n_bins) / count
        accuracy = np.bincount(b, weights=y, minlength=n_bins) / count
    return {"count": count, "mean_prob": mean_prob, "accuracy": accuracy,
            "edges": np.linspace(0.0, 1.0, n_bins + 1)}


def ece(probs: Any, labels: Any, n_bins: int = 15) -> float:
    """Expected calibration error (equal-width bins); 0.0 for empty input."""
    p, y = _check_pair(probs, labels)
    return float(ece_rows(p[None, :], y, n_bins)[0])


def ece_rows(probs: np.ndarray, labels: np.ndarray, n_bins: int = 15) -> np.ndarray:
    """ECE of each row of ``probs`` [G, N] against the one label vector ``labels`` [N] -> [G].

    Rows are binned separately (bin ``g * n_bins + b`` of one flat bincount), so a grid of G
    candidate calibrations is scored in one pass; 0.0 per row when N = 0.
    """
    probs = np.asarray(probs, dtype=np.float64)
    labels = np.asarray(labels, dtype=np.float64).reshape(-1)
    if probs.ndim != 2 or probs.shape[1] != labels.size:
        raise ValueError(f"probs must be [G, N] with N = {labels.size} labels, got shape {probs.shape}")
    g, n = probs.shape
    if n == 0:
        return np.zeros(g, dtype=np.float64)
    b = (bin_index(probs, n_bins) + np.arange(g)[:, None] * n_bins).reshape(-1)
    sum_p = np.bincount(b, weights=probs.reshape(-1), minlength=g * n_bins)
    sum_y = np.bincount(b, weights=np.broadcast_to(labels, (g, n)).reshape(-1), minlength=g * n_bins)
    return np.abs(sum_p - sum_y).reshape(g, n_bins).sum(-1) / n


def brier(probs: Any, labels: Any) -> float:
    """Mean squared error between probabilities and 0/1 labels; NaN for empty input."""
    p, y = _check_pair(probs, labels)
    return float(np.mean((p - y) ** 2)) if p.size else float("nan")


def roc_auc(scores: Any, labels: Any) -> float:
    """ROC-AUC via average ranks (ties count one half); NaN when a class is missing."""
    s, y = _check_pair(scores, labels)
    pos = y > 0.5
    n_pos = int(pos.sum())
    n_neg = s.size - n_pos
    if n_pos == 0 or n_neg == 0:
        return float("nan")
    order = np.argsort(s, kind="mergesort")
    sorted_s = s[order]
    ranks = np.empty(s.size, dtype=np.float64)
    # average rank (1-based) over each run of equal scores
    starts = np.flatnonzero(np.r_[True, sorted_s[1:] != sorted_s[:-1]])
    ends = np.r_[starts[1:], s.size]
    avg = (starts + ends + 1) / 2.0
    ranks[order] = np.repeat(avg, ends - starts)
    u = ranks[pos].sum() - n_pos * (n_pos + 1) / 2.0
    return float(u / (n_pos * n_neg))


def confidence_calibration(survival: Any, num_accepted: Any, num_proposed: Any = None,
                           n_bins: int = 15) -> list[dict]:
    """Per draft position k = 1..K: how well the survival ``a_k`` [N, K] predicts 1[accepted >= k].

    Position k is scored on the rounds that verified at least k drafts (``num_proposed``
    [N]; None = all K), since the others say nothing about it. Each row holds
    ``position`` (1-based), ``n`` (rounds scored), ``ece``, ``auc``, ``brier``,
    ``mean_conf`` and ``accept_rate`` (the label's mean); the metrics are NaN where n = 0.
    """
    a = np.asarray(survival.detach().cpu() if hasattr(survival, "detach") else survival, dtype=np.float64)
    acc = np.asarray(num_accepted).reshape(-1)
    if a.ndim != 2 or a.shape[0] != acc.size:
        raise ValueError(f"survival must be [N, K] with N = {acc.size} rounds, got shape {a.shape}")
    prop = np.full(acc.size, a.shape[1]) if num_proposed is None else np.asarray(num_proposed).reshape(-1)
    nan = float("nan")
    out = []
    for k in range(1, a.shape[1] + 1):
        sel = prop >= k
        p, y = a[sel, k - 1], (acc[sel] >= k).astype(np.float64)
        empty = p.size == 0
        out.append({"position": k, "n": int(sel.sum()), "ece": nan if empty else ece(p, y, n_bins),
                    "auc": roc_auc(p, y), "brier": brier(p, y),
                    "mean_conf": nan if empty else float(p.mean()),
                    "accept_rate": nan if empty else float(y.mean())})
    return out
