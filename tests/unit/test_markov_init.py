"""The Markov head's bigram start (training/markov_init.py)."""
from __future__ import annotations

import pytest
import torch

from dspark.training.markov_init import bigram_factors, init_markov_from_bigrams
from dspark.training.models import build_drafter, drafter_config_for

from ..conftest import tiny_run_config


def _smoothed_log_bigrams(seqs, n, beta):
    c = torch.zeros(n, n)
    for s in seqs:
        for a, b in zip(s, s[1:]):
            c[a, b] += 1
    u = (c.sum(0) + 1) / (c.sum() + n)
    return torch.log((c + beta * u) / (c.sum(1, keepdim=True) + beta))


def test_full_rank_factors_are_the_smoothed_log_bigram_table_up_to_a_row_constant():
    g = torch.Generator().manual_seed(0)
    n = 6
    seqs = [torch.randint(0, n, (30,), generator=g).tolist() for _ in range(5)]
    w1, w2 = bigram_factors(seqs, n, n, rank=n + 1, beta=2.0)
    diff = w1 @ w2.T - _smoothed_log_bigrams(seqs, n, 2.0)
    torch.testing.assert_close(diff - diff.mean(1, keepdim=True), torch.zeros(n, n), atol=1e-4, rtol=0)


def test_a_low_rank_start_keeps_the_dominant_bigrams():
    """A cycle 0 -> 1 -> 2 -> 0 makes most of the pairs; a rank-4 start (3 singular directions
    plus the unigram term) must rank each successor first, among 40 tokens of noise."""
    g = torch.Generator().manual_seed(1)
    n, seqs = 40, []
    for _ in range(60):
        x = [0]
        for _ in range(20):
            noisy = bool(torch.rand(1, generator=g) < 0.2) or x[-1] > 2
            x.append(int(torch.randint(0, n, (1,), generator=g)) if noisy else (x[-1] + 1) % 3)
        seqs.append(x)
    w1, w2 = bigram_factors(seqs, n, n, rank=4)
    assert (w1 @ w2.T)[:3].argmax(-1).tolist() == [1, 2, 0]


def test_the_drafters_head_starts_from_the_bigrams_of_its_draft_vocabulary(tiny_target):
    cfg = tiny_run_config("dspark")
    cfg.target.draft_vocab = 24
    d = build_drafter(drafter_config_for(cfg, tiny_target), tiny_target)
    d.set_draft_vocab(torch.arange(10, 34))
    seqs = [[12, 20, 12, 20, 12, 20, 12, 20, 50, 21]]  # 50 is outside the draft vocabulary
    init_markov_from_bigrams(d, seqs)
    bias = d.markov.bias(d.markov.w1(d.to_draft(torch.tensor([12, 50]))))
    assert int(d.to_target(bias[0].argmax())) == 20  # 12 -> 20, always
    assert int(d.to_target(bias[1].argmax())) == 21  # the out-of-vocabulary row: 50 -> 21


def test_a_bigram_start_is_refused_for_the_rnn_head(tiny_target):
    cfg = tiny_run_config("dspark")
    cfg.algo.markov_head = "rnn"
    d = build_drafter(drafter_config_for(cfg, tiny_target), tiny_target)
    with pytest.raises(ValueError, match="vanilla"):
        init_markov_from_bigrams(d, [[1, 2, 3]])


def test_the_config_says_how_to_combine_the_rnn_head_with_the_default_bigram_start():
    from dspark.training.config import ConfigError, load_run_config

    assert load_run_config(None, ["algo=dspark"]).algo.markov_init == "bigram"
    with pytest.raises(ConfigError, match="algo.markov_init=zero"):
        load_run_config(None, ["algo=dspark", "algo.markov_head=rnn"])
    assert load_run_config(None, ["algo=dspark", "algo.markov_head=rnn", "algo.markov_init=zero"]).algo.markov_head == "rnn"
    assert load_run_config(None, ["algo=dflash"]).algo.markov_init == "zero"
