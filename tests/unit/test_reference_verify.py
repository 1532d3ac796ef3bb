"""reference.verify against brute-force enumeration, hand-written greedy cases, and its contract.

The sampled tests enumerate every draft sequence of a tiny vocabulary to get the exact
distribution of what one verify step emits, check that distribution analytically (the
first emitted token follows the target exactly; acceptance probability = sum min(p_t, p_d)),
then compare the reference's empirical distribution to it with a chi-square test at a fixed
seed (deterministic, no flakiness).
"""
from __future__ import annotations

import logging
from collections import Counter

import numpy as np
import pytest
import torch

from dspark.plugins import ops, reference
from dspark.plugins.reference import process_logits, verify

from ..distribution import chisquare_pvalue, exact_verify_outcomes


# --------------------------------------------------------------------------------------
# Exact enumeration
# --------------------------------------------------------------------------------------
def sample_outcomes(p_t: torch.Tensor, p_d: torch.Tensor, l: int, n: int, temperature: float = 1.0,
                    seed0: int = 0) -> Counter:
    """Run reference.verify on n independent requests sharing p_t / p_d; count emitted tuples."""
    K, V = p_d.shape
    g = torch.Generator().manual_seed(1234 + seed0)
    probs = p_d.unsqueeze(0).expand(n, K, V).contiguous()
    drafts = torch.multinomial(probs.reshape(-1, V), 1, generator=g).reshape(n, K)
    logits = (temperature * p_t.log()).unsqueeze(0).expand(n, K + 1, V).contiguous()
    res = verify(drafts, probs, logits, torch.full((n,), l), torch.full((n,), temperature),
                 seed=torch.arange(n) + seed0, offset=torch.full((n,), 7))
    counts: Counter = Counter()
    for row, m in zip(res.output_tokens.tolist(), res.num_emitted.tolist()):
        counts[tuple(row[:m])] += 1
    return counts


P_T = torch.tensor([[0.50, 0.20, 0.20, 0.10],
                    [0.05, 0.60, 0.25, 0.10],
                    [0.25, 0.25, 0.25, 0.25]], dtype=torch.float64)
P_D = torch.tensor([[0.25, 0.25, 0.40, 0.10],
                    [0.10, 0.70, 0.00, 0.20]], dtype=torch.float64)


# --------------------------------------------------------------------------------------
# Exact (analytic) properties of the enumerated law
# --------------------------------------------------------------------------------------
@pytest.mark.parametrize("l", [0, 1, 2])
def test_enumeration_first_emitted_token_follows_the_target_exactly(l: int) -> None:
    exact = exact_verify_outcomes(P_T.numpy(), P_D.numpy(), l)
    assert sum(exact.values()) == pytest.approx(1.0, abs=1e-12)
    first = np.zeros(4)
    for k, v in exact.items():
        first[k[0]] += v
    np.testing.assert_allclose(first, P_T[0].numpy(), atol=1e-12)


def test_enumeration_acceptance_probability_is_sum_of_min() -> None:
    exact = exact_verify_outcomes(P_T.numpy(), P_D.numpy(), 2)
    p_len_ge2 = sum(v for k, v in exact.items() if len(k) >= 2)  # first draft accepted
    assert p_len_ge2 == pytest.approx(float(torch.minimum(P_T[0], P_D[0]).sum()), abs=1e-12)
    p_len3 = sum(v for k, v in exact.items() if len(k) == 3)  # both accepted
    both = float(torch.minimum(P_T[0], P_D[0]).sum() * torch.minimum(P_T[1], P_D[1]).sum())
    assert p_len3 == pytest.approx(both, abs=1e-12)


def test_enumeration_second_token_given_first_follows_the_target() -> None:
    exact = exact_verify_outcomes(P_T.numpy(), P_D.numpy(), 2)
    for a in range(4):
        cond = np.zeros(4)
        for k, v in exact.items():
            if len(k) >= 2 and k[0] == a:
                cond[k[1]] += v
        if cond.sum() > 0:
            np.testing.assert_allclose(cond / cond.sum(), P_T[1].numpy(), atol=1e-12)


# --------------------------------------------------------------------------------------
# Reference vs enumeration (empirical, fixed seeds)
# --------------------------------------------------------------------------------------
@pytest.mark.parametrize("l", [0, 1, 2])
def test_reference_emits_the_enumerated_distribution(l: int) -> None:
    counts = sample_outcomes(P_T.float(), P_D.float(), l, n=20000)
    assert chisquare_pvalue(counts, exact_verify_outcomes(P_T.numpy(), P_D.numpy(), l)) > 1e-3


def test_reference_with_temperature_emits_the_enumerated_distribution() -> None:
    # logits = T * log p  ->  softmax(logits / T) = p
    counts = sample_outcomes(P_T.float(), P_D.float(), 2, n=20000, temperature=0.7, seed0=99)
    assert chisquare_pvalue(counts, exact_verify_outcomes(P_T.numpy(), P_D.numpy(), 2)) > 1e-3


def test_acceptance_frequency_per_position_matches_the_exact_probability() -> None:
    n = 20000
    counts = sample_outcomes(P_T.float(), P_D.float(), 2, n=n, seed0=5)
    n_ge1 = sum(v for k, v in counts.items() if len(k) >= 2)
    p = float(torch.minimum(P_T[0], P_D[0]).sum())
    assert abs(n_ge1 / n - p) < 4 * (p * (1 - p) / n) ** 0.5


# --------------------------------------------------------------------------------------
# Greedy, hand-written
# --------------------------------------------------------------------------------------
def _onehot_logits(argmaxes: list[list[int]], V: int) -> torch.Tensor:
    out = torch.zeros(len(argmaxes), len(argmaxes[0]), V)
    for r, row in enumerate(argmaxes):
        for j, a in enumerate(row):
            out[r, j, a] = 5.0
    return out


def test_greedy_docstring_example() -> None:
    res = verify(torch.tensor([[2, 1]]), None, _onehot_logits([[2, 0, 1]], 3), torch.tensor([2]), torch.tensor([0.0]))
    assert res.num_accepted.tolist() == [1]
    assert res.output_tokens.tolist() == [[2, 0, -1]]
    assert res.num_emitted.tolist() == [2]


def test_greedy_all_accepted_emits_the_bonus_argmax() -> None:
    res = verify(torch.tensor([[1, 2, 3]]), None, _onehot_logits([[1, 2, 3, 0]], 4), torch.tensor([3]),
                 torch.tensor([0.0]))
    assert res.output_tokens.tolist() == [[1, 2, 3, 0]]
    assert res.num_accepted.tolist() == [3]


def test_greedy_first_rejection_emits_the_target_argmax_and_pads() -> None:
    res = verify(torch.tensor([[0, 2, 3]]), None, _onehot_logits([[1, 2, 3, 0]], 4), torch.tensor([3]),
                 torch.tensor([0.0]))
    assert res.output_tokens.tolist() == [[1, -1, -1, -1]]
    assert res.num_accepted.tolist() == [0]


def test_greedy_ties_take_the_first_index_like_argmax() -> None:
    logits = torch.tensor([[[1.0, 3.0, 3.0, 0.0], [2.0, 2.0, 2.0, 2.0]]])
    res = verify(torch.tensor([[2]]), None, logits, torch.tensor([1]), torch.tensor([0.0]))
    assert res.output_tokens.tolist() == [[1, -1]], "tied maximum: the lower index is the argmax"
    res = verify(torch.tensor([[1]]), None, logits, torch.tensor([1]), torch.tensor([0.0]))
    assert res.output_tokens.tolist() == [[1, 0]]


def test_ragged_lens_zero_and_full_in_one_batch() -> None:
    V = 5
    argmaxes = [[1, 2, 3, 4]] * 4
    drafts = torch.tensor([[1, 2, 3]] * 4)  # every draft would be accepted
    lens = torch.tensor([0, 1, 2, 3])
    res = verify(drafts, None, _onehot_logits(argmaxes, V), lens, torch.zeros(4))
    assert res.num_accepted.tolist() == [0, 1, 2, 3], "drafts past verify_lens are never accepted"
    assert res.output_tokens.tolist() == [[1, -1, -1, -1], [1, 2, -1, -1], [1, 2, 3, -1], [1, 2, 3, 4]]
    assert (res.num_emitted == res.num_accepted + 1).all()


def test_drafts_past_the_verify_length_are_ignored_even_when_invalid() -> None:
    res = verify(torch.tensor([[1, -1, 99]]), None, _onehot_logits([[1, 2, 3, 0]], 4), torch.tensor([1]),
                 torch.tensor([0.0]))
    assert res.output_tokens.tolist() == [[1, 2, -1, -1]]


def test_out_of_range_draft_inside_the_prefix_is_rejected() -> None:
    logits = _onehot_logits([[0, 2, 3]], 4)
    res = verify(torch.tensor([[-1, 2]]), None, logits, torch.tensor([2]), torch.tensor([0.0]))
    assert res.output_tokens.tolist() == [[0, -1, -1]], "-1 must not be read as token 0"
    p_d = torch.full((1, 2, 4), 0.25)
    res = verify(torch.tensor([[7, 2]]), p_d, logits, torch.tensor([2]), torch.tensor([1.0]), seed=torch.tensor([3]))
    assert res.num_accepted.tolist() == [0]


def test_mixed_greedy_and_sampled_rows() -> None:
    V = 4
    logits = _onehot_logits([[1, 2, 3], [1, 2, 3]], V) * 10  # sampled row: essentially one-hot too
    p_d = torch.nn.functional.one_hot(torch.tensor([[1, 2], [1, 2]]), V).float()
    res = verify(torch.tensor([[1, 2], [1, 2]]), p_d, logits, torch.tensor([2, 2]), torch.tensor([0.0, 1.0]),
                 seed=torch.tensor([0, 1]))
    assert res.output_tokens.tolist() == [[1, 2, 3], [1, 2, 3]]


# --------------------------------------------------------------------------------------
# top-k / top-p
# --------------------------------------------------------------------------------------
def test_top_k_keeps_the_k_largest_and_ties() -> None:
    logits = torch.tensor([[1.0, 4.0, 3.0, 3.0, 0.0]])
    p = process_logits(logits, torch.tensor([1.0]), top_k=torch.tensor([2]))
    assert (p[0, [0, 4]] == 0).all() and (p[0, [1, 2, 3]] > 0).all(), "ties at the k-th value are kept"
    p = process_logits(logits, torch.tensor([1.0]), top_k=torch.tensor([1]))
    assert p[0].tolist() == [0.0, 1.0, 0.0, 0.0, 0.0]


def test_top_p_keeps_the_smallest_prefix_reaching_p() -> None:
    logits = torch.tensor([[0.5, 0.3, 0.2]]).log()
    p = process_logits(logits, torch.tensor([1.0]), top_p=torch.tensor([0.7]))
    torch.testing.assert_close(p[0], torch.tensor([0.625, 0.375, 0.0]))
    p = process_logits(logits, torch.tensor([1.0]), top_p=torch.tensor([0.1]))
    assert p[0].tolist() == [1.0, 0.0, 0.0], "the most likely token is always kept"


def test_top_p_one_is_off_even_when_the_cumsum_rounds_to_one() -> None:
    # a tail far below fp32 resolution: the cumulative mass reaches 1.0 before it
    logits = torch.cat([torch.zeros(1), torch.full((999,), -20.0)]).unsqueeze(0)
    plain = process_logits(logits, torch.tensor([1.0]))
    with_p = process_logits(logits, torch.tensor([1.0]), top_p=torch.tensor([1.0]))
    assert torch.equal(plain, with_p)


def test_top_k_sampling_follows_the_truncated_distribution() -> None:
    n, V = 20000, 5
    probs = torch.tensor([0.4, 0.3, 0.15, 0.1, 0.05])
    logits = probs.log().expand(n, 1, V).contiguous()
    res = verify(torch.zeros(n, 0, dtype=torch.long), torch.zeros(n, 0, V), logits, torch.zeros(n, dtype=torch.long),
                 torch.ones(n), top_k=torch.full((n,), 2), seed=torch.arange(n))
    counts = Counter(res.output_tokens[:, 0].tolist())
    assert set(counts) <= {0, 1}
    exact = {(0,): 0.4 / 0.7, (1,): 0.3 / 0.7}
    assert chisquare_pvalue(Counter({(k,): v for k, v in counts.items()}), exact) > 1e-3


# --------------------------------------------------------------------------------------
# Determinism
# --------------------------------------------------------------------------------------
def _sampled_batch(n: int, K: int, V: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(drafts [n, K] sampled from p_d, p_d [n, K, V], target logits [n, K+1, V]) at a fixed seed."""
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(n, K + 1, V, generator=g)
    p_d = torch.softmax(torch.randn(n, K, V, generator=g), -1)
    drafts = torch.multinomial(p_d.reshape(-1, V), 1, generator=g).reshape(n, K)
    return drafts, p_d, logits


def test_same_seed_and_offset_give_the_same_result_and_offsets_change_it() -> None:
    n, K, V = 64, 3, 6
    drafts, p_d, logits = _sampled_batch(n, K, V, seed=0)
    args = (drafts, p_d, logits, torch.full((n,), K), torch.ones(n))
    a = verify(*args, seed=torch.arange(n), offset=torch.full((n,), 3))
    b = verify(*args, seed=torch.arange(n), offset=torch.full((n,), 3))
    c = verify(*args, seed=torch.arange(n), offset=torch.full((n,), 4))
    assert torch.equal(a.output_tokens, b.output_tokens)
    assert not torch.equal(a.output_tokens, c.output_tokens)


def test_rows_are_independent_of_their_batch() -> None:
    n, K, V = 16, 2, 5
    drafts, p_d, logits = _sampled_batch(n, K, V, seed=1)
    full = verify(drafts, p_d, logits, torch.full((n,), K), torch.ones(n), seed=torch.arange(n))
    part = verify(drafts[5:9], p_d[5:9], logits[5:9], torch.full((4,), K), torch.ones(4), seed=torch.arange(5, 9))
    assert torch.equal(full.output_tokens[5:9], part.output_tokens)


# --------------------------------------------------------------------------------------
# Errors
# --------------------------------------------------------------------------------------
def test_bad_shapes_raise_clear_errors() -> None:
    d, lg, ln, t = torch.zeros(2, 3, dtype=torch.long), torch.zeros(2, 4, 5), torch.zeros(2, dtype=torch.long), torch.zeros(2)
    with pytest.raises(ValueError, match=r"target_logits must be \[R, K\+1, V\]"):
        verify(d, None, torch.zeros(2, 3, 5), ln, t)
    with pytest.raises(ValueError, match="verify_lens must be"):
        verify(d, None, lg, torch.zeros(3, dtype=torch.long), t)
    with pytest.raises(ValueError, match=r"verify_lens must lie in \[0, 3\]"):
        verify(d, None, lg, torch.tensor([0, 4]), t)
    with pytest.raises(ValueError, match="draft_probs is required"):
        verify(d, None, lg, ln, torch.tensor([0.0, 1.0]))
    with pytest.raises(ValueError, match=r"draft_probs must be \[R, K, V\]"):
        verify(d, torch.zeros(2, 3, 4), lg, ln, torch.ones(2))


# --------------------------------------------------------------------------------------
# ops.verify on CPU: the reference, with a one-time notice
# --------------------------------------------------------------------------------------
def test_ops_take_exactly_the_references_arguments() -> None:
    """ops mirrors the reference's signatures (names, order, defaults, annotations) on purpose:
    callers switch between them freely, so the two must not drift apart."""
    import inspect

    for name in ("verify", "schedule_prefix"):
        assert inspect.signature(getattr(ops, name)) == inspect.signature(getattr(reference, name)), name


def test_ops_verify_on_cpu_is_the_reference_with_one_notice(caplog: pytest.LogCaptureFixture) -> None:
    g = torch.Generator().manual_seed(2)
    n, K, V = 8, 2, 6
    logits = torch.randn(n, K + 1, V, generator=g)
    p_d = torch.softmax(torch.randn(n, K, V, generator=g), -1)
    drafts = torch.multinomial(p_d.reshape(-1, V), 1, generator=g).reshape(n, K)
    args = (drafts, p_d, logits, torch.full((n,), K), torch.linspace(0, 1, n))
    ops._noticed.clear()
    with caplog.at_level(logging.INFO, logger="dspark.plugins.ops"):
        a = ops.verify(*args, seed=torch.arange(n))
        ops.verify(*args, seed=torch.arange(n))
    b = reference.verify(*args, seed=torch.arange(n))
    assert torch.equal(a.output_tokens, b.output_tokens) and torch.equal(a.num_accepted, b.num_accepted)
    notices = [r for r in caplog.records if "running the PyTorch reference" in r.getMessage()]
    assert len(notices) == 1


def test_enumeration_of_a_deterministic_case() -> None:
    p = np.eye(3)  # p_d = p_t one-hot: every draft accepted, the bonus is token 2
    assert exact_verify_outcomes(p, p[:2], 2) == {(0, 1, 2): 1.0}
