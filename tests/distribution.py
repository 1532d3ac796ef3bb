"""Exact laws and goodness-of-fit checks shared by the sampling tests: the exact law of one
request's verify step (by enumeration), and a chi-square test of observed counts against
exact probabilities, sparse cells pooled so the chi-square approximation holds."""
from __future__ import annotations

from collections import Counter, defaultdict
from typing import Any, Mapping

import numpy as np
from scipy.stats import chisquare


def pooled_chisquare_pvalue(counts: Any, probs: Any, min_expected: float = 5.0) -> float:
    """p-value of ``counts`` [C] (observed per cell) against ``probs`` [C] (exact, any scale).

    Cells expecting fewer than ``min_expected`` observations are pooled into one; a cell of
    probability 0 must never be observed (that fails the caller's test outright).
    """
    obs = np.asarray(counts.detach().cpu() if hasattr(counts, "detach") else counts, dtype=np.float64).reshape(-1)
    p = np.asarray(probs.detach().cpu() if hasattr(probs, "detach") else probs, dtype=np.float64).reshape(-1)
    assert obs.shape == p.shape, f"{obs.size} observed cells for {p.size} probabilities"
    assert not obs[p <= 0].any(), "an outcome with probability 0 was observed"
    expected = p / p.sum() * obs.sum()
    big = expected >= min_expected
    o, e = list(obs[big]), list(expected[big])
    if expected[~big].sum() > 0:
        o.append(obs[~big].sum())
        e.append(expected[~big].sum())
    return float(chisquare(np.array(o), np.array(e)).pvalue)


def chisquare_pvalue(counts: Counter, exact: Mapping[Any, float]) -> float:
    """:func:`pooled_chisquare_pvalue` over outcomes keyed by value (``exact``: outcome -> probability)."""
    assert set(counts) <= {k for k, v in exact.items() if v > 0}, "an outcome with probability 0 was emitted"
    keys = sorted(exact)
    return pooled_chisquare_pvalue([counts.get(k, 0) for k in keys], [exact[k] for k in keys])


def exact_verify_outcomes(p_t: np.ndarray, p_d: np.ndarray, l: int) -> dict[tuple[int, ...], float]:
    """Exact law of the emitted tokens of one request. p_t [K+1, V], p_d [K, V] (float64).

    Drafts x_j ~ p_d[j] independently; accept x_j with prob min(1, p_t/p_d); on the first
    rejection emit from norm(max(p_t - p_d, 0)) (p_t[j] if that has no mass); after l
    acceptances emit from p_t[l].
    """
    out: dict[tuple[int, ...], float] = defaultdict(float)

    def walk(j: int, prefix: tuple[int, ...], prob: float) -> None:
        if j == l:
            for y in np.nonzero(p_t[l])[0]:
                out[prefix + (int(y),)] += prob * p_t[l, y]
            return
        residual = np.maximum(p_t[j] - p_d[j], 0.0)
        residual = residual / residual.sum() if residual.sum() > 0 else p_t[j]
        for x in np.nonzero(p_d[j])[0]:
            acc = min(1.0, p_t[j, x] / p_d[j, x])
            if acc > 0:
                walk(j + 1, prefix + (int(x),), prob * p_d[j, x] * acc)
            if acc < 1.0:
                for y in np.nonzero(residual)[0]:
                    out[prefix + (int(y),)] += prob * p_d[j, x] * (1.0 - acc) * residual[y]

    walk(0, (), 1.0)
    return dict(out)
