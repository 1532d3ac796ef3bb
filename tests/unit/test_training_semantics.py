"""Invariants of the DSpark model and loss that the report fixes."""
from __future__ import annotations

import math

import pytest
import torch

from dspark.training.loss import block_loss, confidence_target, position_weights
from dspark.training.metrics import accept_len, accept_rate_at_k
from dspark.training.models import build_drafter, drafter_config_for

from ..conftest import tiny_run_config


def _drafter(target, algo="dspark", markov="vanilla"):
    cfg = tiny_run_config(algo)
    cfg.algo.markov_head = markov if algo == "dspark" else "none"
    torch.manual_seed(1)
    d = build_drafter(drafter_config_for(cfg, target), target)
    if d.markov is not None:
        torch.nn.init.normal_(d.markov.w2.weight, std=0.5)  # non-zero bias to observe
    return d


def test_markov_bias_is_added_to_logits_before_softmax_starting_at_position_one(tiny_target):
    d = _drafter(tiny_target)
    hidden = torch.randn(2, 4, 32)
    prev = torch.tensor([[7, 8, 9, 10], [11, 12, 13, 14]])  # x_0 = anchor at k=1
    out = d.heads(hidden, prev)
    expected = d.lm_head(hidden) + d.markov.w2(d.markov.w1(prev))
    torch.testing.assert_close(out.logits, expected)
    # position 1 depends on the anchor
    prev2 = prev.clone(); prev2[:, 0] = 20
    assert not torch.allclose(d.heads(hidden, prev2).logits[:, 0], out.logits[:, 0])


def test_rnn_markov_head_carries_state_left_to_right(tiny_target):
    d = _drafter(tiny_target, markov="rnn")
    hidden = torch.randn(1, 4, 32)
    prev = torch.tensor([[7, 8, 9, 10]])
    a = d.heads(hidden, prev).logits
    prev2 = prev.clone(); prev2[0, 0] = 30
    b = d.heads(hidden, prev2).logits
    assert not torch.allclose(a[0, 3], b[0, 3]), "a change of x_0 must reach the last position through the state"


def test_confidence_target_is_one_minus_half_l1_clamped():
    p_d = torch.tensor([[0.5, 0.5, 0.0]])
    p_t = torch.tensor([[0.7, 0.3, 0.0]])
    assert confidence_target(p_d, p_t).item() == pytest.approx(0.8)
    assert confidence_target(torch.tensor([[1.0, 0.0]]), torch.tensor([[0.0, 1.0]])).item() == 0.0


def test_l1_term_is_not_halved_and_weights_decay_exponentially():
    torch.manual_seed(0)
    logits, tlogits = torch.randn(3, 4, 10), torch.randn(3, 4, 10)
    labels, valid = torch.randint(0, 10, (3, 4)), torch.ones(3, 4, dtype=torch.bool)
    terms = block_loss(logits, tlogits, labels, valid, None, 0.0, 1.0, 0.0, gamma=4.0)
    l1 = (logits.softmax(-1) - tlogits.softmax(-1)).abs().sum(-1)
    w = torch.exp(-torch.arange(4) / 4.0)
    assert terms.l1.item() == pytest.approx(((l1 * w).sum() / (w.sum() * 3)).item(), rel=1e-5)
    assert position_weights(3, 4.0).tolist() == pytest.approx([1.0, math.exp(-0.25), math.exp(-0.5)])


def test_block_sees_only_context_before_its_anchor(tiny_target):
    d = _drafter(tiny_target)
    T = 12
    tokens = torch.randint(6, 64, (1, T))
    aux = torch.randn(1, T, 3 * 32)
    anchors = torch.tensor([[6]])
    base = d.forward_train(aux, tokens, anchors).logits
    later = aux.clone(); later[:, 6:] += 5.0  # positions >= anchor
    torch.testing.assert_close(d.forward_train(later, tokens, anchors).logits, base)
    earlier = aux.clone(); earlier[:, 5] += 5.0  # position a-1 is visible
    assert not torch.allclose(d.forward_train(earlier, tokens, anchors).logits, base)


def test_blocks_trained_together_do_not_see_each_other(tiny_target):
    d = _drafter(tiny_target)
    tokens = torch.randint(6, 64, (1, 16))
    aux = torch.randn(1, 16, 96)
    both = d.forward_train(aux, tokens, torch.tensor([[4, 10]])).logits
    alone = d.forward_train(aux, tokens, torch.tensor([[4]])).logits
    torch.testing.assert_close(both[:, :1], alone, atol=1e-5, rtol=1e-5)


def test_accept_len_counts_the_bonus_token_and_rate_at_k_is_conditional():
    assert accept_len([0, 0, 0]) == 1.0
    assert accept_len([3, 1]) == 3.0
    rates = accept_rate_at_k([2, 0, 1], [3, 3, 3], 3)
    assert rates[0] == pytest.approx(2 / 3)  # 2 of 3 rounds accept draft 1
    assert rates[1] == pytest.approx(1 / 2)  # of the 2 that reached draft 2, one accepts it
    assert rates[2] == pytest.approx(0.0)


def test_draft_draw_takes_the_argmax_for_greedy_rows_and_samples_the_others():
    from dspark.plugins.coupled import RaceNoise
    from dspark.training.models.block_drafter import draft_distribution, draw
    logits = torch.tensor([[0.0, 1.0, 0.5, -1.0]]).repeat(3, 1)
    temperature = torch.tensor([0.0, 1.0, 0.0])
    probs = draft_distribution(logits, temperature)
    n = 20000
    counts = torch.zeros(4)
    for i in range(n // 100):
        # a fresh (seed, position) per draw: the race noise of plugins/coupled.py
        xs = torch.stack([draw(probs, temperature, RaceNoise(torch.full((3,), i), torch.full((3,), j)))
                          for j in range(100)])  # [100, 3]
        assert (xs[:, 0] == 1).all() and (xs[:, 2] == 1).all()  # greedy rows: argmax, no draw
        counts += torch.bincount(xs[:, 1], minlength=4).float()
    expected = torch.softmax(logits[1], -1) * n
    chi2 = float(((counts - expected) ** 2 / expected).sum())
    assert chi2 < 16.27  # chi-square, 3 degrees of freedom, p = 0.001


@pytest.mark.parametrize("draft_ids", [None, torch.tensor([0, 3, 5, 9, 17, 40, 63])])
@pytest.mark.parametrize("cached_stats", [False, True])
def test_target_distribution_computed_once_per_position_equals_the_per_slot_one(draft_ids, cached_stats):
    """Overlapping slots share one LM-head row; the gathered result is the per-slot computation.
    With a feature cache's target stats (log-normalizer, greedy token) and a draft vocabulary
    only the draft ids' rows of the LM head are used, for the same distribution."""
    from types import SimpleNamespace

    from dspark.training.loss import target_dist
    from dspark.training.trainer import Batch, target_at

    g = torch.Generator().manual_seed(0)
    lm_head = torch.nn.Linear(16, 64, bias=False)
    draft_head = lm_head
    if draft_ids is not None:
        draft_head = torch.nn.Linear(16, draft_ids.numel(), bias=False)
        draft_head.weight.data.copy_(lm_head.weight.data[draft_ids])
    core = SimpleNamespace(lm_head=lm_head, draft_head=draft_head, draft_ids=draft_ids,
                           cfg=SimpleNamespace(draft_vocab_size=0 if draft_ids is None else draft_ids.numel()))
    last = torch.randn(3, 10, 16, generator=g)
    with torch.no_grad():
        logits = lm_head(last)
    stats = (torch.logsumexp(logits, -1), logits.argmax(-1)) if cached_stats else (None, None)
    b = Batch(torch.zeros(3, 10, dtype=torch.long), torch.zeros(3, 10, 1), last, torch.full((3,), 10),
              torch.zeros(3, dtype=torch.long), *stats)
    pos = torch.randint(0, 10, (3, 5, 4), generator=g)
    pos[0, 1] = pos[0, 0]  # two blocks predicting the same positions
    rows = torch.arange(3).view(3, 1, 1)
    got = target_at(core, b, rows, pos)
    want = target_dist(lm_head(last.gather(1, pos.view(3, -1, 1).expand(-1, -1, 16))).view(3, 5, 4, 64), draft_ids)
    torch.testing.assert_close(got.p_t, want.p_t)
    assert torch.equal(got.argmax, want.argmax)
    if draft_ids is None:
        assert got.outside is None
    else:
        torch.testing.assert_close(got.outside, want.outside)


def test_eagle3_unroll_of_chosen_entries_equals_the_full_unroll_there(tiny_target):
    """Training-time test computes only the chains it scores: each chain sees the true entries
    up to its own and its own earlier steps, so unrolling a subset (duplicates and the last
    entry included) gives the full unroll's hidden states at those entries, and their
    gradients."""
    d = _drafter(tiny_target, algo="eagle3")
    T, S = 14, 4
    torch.manual_seed(3)
    tokens = torch.randint(6, 64, (2, T))
    aux = torch.randn(2, T, 3 * 32)
    positions = torch.tensor([[0, 5, 5, 13], [2, 7, 11, 12]])
    full = d.forward_train(aux, tokens, S)  # [S, N, T, d]
    part = d.forward_train(aux, tokens, S, positions)  # [S, N, P, d]
    at = full.gather(2, positions.view(1, 2, 4, 1).expand(S, -1, -1, full.shape[-1]))
    torch.testing.assert_close(part, at, atol=1e-5, rtol=1e-5)
    grad_full = torch.autograd.grad(at.sum(), d.fc.weight)[0]
    grad_part = torch.autograd.grad(d.forward_train(aux, tokens, S, positions).sum(), d.fc.weight)[0]
    torch.testing.assert_close(grad_part, grad_full, atol=1e-4, rtol=1e-4)
    # a chain of step >= 1 depends on its own tokens: changing a later token moves it
    later = tokens.clone(); later[0, 8] = (later[0, 8] + 1) % 64
    moved = d.forward_train(aux, later, S, positions)
    assert not torch.allclose(moved[3, 0, 1], part[3, 0, 1])  # entry 5, step 3 reads x_{5+1+3}
