"""Start DSpark's vanilla Markov head from the training answers' bigram statistics.

The head adds ``W2(W1[x_{k-1}])`` to the block logits: a rank-``r`` bigram table. Learned
from zero, it needs many steps to reach even the accuracy of counting bigrams (on the
1,024-record SmolLM2 set a bigram table predicts the target's next greedy token 29% of the
time; the drafters trained for 300 CPU steps reached 19-27%). Counting is free, so the head
can start there and training refines it.

The table is ``log P(j | i)`` with ``P(j | i) = (c_ij + beta u_j) / (c_i + beta)`` (counts
``c``, smoothed unigram ``u``, pseudo-count ``beta``). Up to a per-row constant, which the
softmax ignores, that is ``log u_j + log1p(c_ij / (beta u_j))``: a rank-1 unigram term plus
a matrix that is zero wherever a pair was never seen. The sparse part is factorised by a
truncated SVD (rank ``r - 1``), so the cost follows the number of distinct pairs, not
vocabulary squared, and the unigram term takes the last rank.
"""
from __future__ import annotations

from collections import Counter
from typing import Iterable, Sequence

import torch

__all__ = ["bigram_factors", "init_markov_from_bigrams"]


def _pair_counts(sequences: Iterable[Sequence[int]], to_draft: torch.Tensor | None, n_out: int
                 ) -> tuple[Counter, torch.Tensor]:
    """(prev index, next index) counts and next-token counts, as draft indices. A next token
    outside the draft vocabulary cannot be drafted and is skipped; a previous token outside
    maps to index ``n_out`` (the head's out-of-vocabulary row)."""
    pairs: Counter = Counter()
    for seq in sequences:
        ids = torch.as_tensor(list(seq), dtype=torch.long)
        if ids.numel() < 2:
            continue
        idx = ids if to_draft is None else to_draft[ids]
        pairs.update(zip(idx[:-1].tolist(), idx[1:].tolist()))
    pairs = Counter({p: c for p, c in pairs.items() if p[1] < n_out})
    unigram = torch.zeros(n_out)
    for (_, j), c in pairs.items():
        unigram[j] += c
    return pairs, unigram


def bigram_factors(sequences: Iterable[Sequence[int]], n_prev: int, n_out: int, rank: int,
                   to_draft: torch.Tensor | None = None, beta: float = 4.0, niter: int = 6,
                   seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Factors ``(w1 [n_prev, rank], w2 [n_out, rank])`` with ``w1[i] @ w2[j]`` approximating
    ``log P(j | i)`` up to a per-row constant. ``sequences``: target-id sequences whose
    consecutive pairs are the training bigrams; ``to_draft``: target id -> draft index (None:
    the draft vocabulary is the target's)."""
    if rank < 2:
        raise ValueError(f"a bigram start needs markov_rank >= 2, got {rank}")
    pairs, unigram = _pair_counts(sequences, to_draft, n_out)
    if not pairs:
        raise ValueError("no token pairs in the training records to count bigrams from")
    u = (unigram + 1.0) / (unigram.sum() + n_out)
    rows = torch.tensor([i for i, _ in pairs], dtype=torch.long)
    cols = torch.tensor([j for _, j in pairs], dtype=torch.long)
    counts = torch.tensor(list(pairs.values()), dtype=torch.float32)
    values = torch.log1p(counts / (beta * u[cols]))
    # weight each row by its count to the power 1/4: the truncation then spends its rank on the previous
    # tokens that occur most, the ones whose bigrams matter to the acceptance rate
    row_counts = torch.zeros(n_prev).index_add_(0, rows, counts)
    row_weight = (row_counts + 1.0) ** 0.25
    sparse = torch.sparse_coo_tensor(torch.stack([rows, cols]), values * row_weight[rows], (n_prev, n_out),
                                     check_invariants=True).coalesce()
    k = min(rank - 1, n_prev, n_out)
    g = torch.get_rng_state()
    torch.manual_seed(seed)  # svd_lowrank draws its random projection from the global generator
    try:
        U, S, V = torch.svd_lowrank(sparse, q=k, niter=niter)
    finally:
        torch.set_rng_state(g)
    root = S.clamp(min=0).sqrt()
    w1 = torch.zeros(n_prev, rank)
    w2 = torch.zeros(n_out, rank)
    w1[:, :k], w2[:, :k] = U * root / row_weight.unsqueeze(1), V * root
    log_u = u.log()
    w1[:, rank - 1] = 1.0
    w2[:, rank - 1] = log_u - log_u.mean()
    return w1, w2


def init_markov_from_bigrams(drafter, sequences: Iterable[Sequence[int]], beta: float = 4.0) -> None:
    """Set a drafter's vanilla Markov head (``w1``, ``w2``) to the bigram factors of
    ``sequences`` (target ids), over its draft vocabulary."""
    head = drafter.markov
    if head is None or head.kind != "vanilla":
        raise ValueError("a bigram start applies to the vanilla Markov head only "
                         f"(this drafter has {'none' if head is None else head.kind!r})")
    # target id -> draft index for every target id, through the drafter's public mapping
    to_draft = (drafter.to_draft(torch.arange(drafter.lm_head.weight.shape[0], device=head.w1.weight.device)).cpu()
                if drafter.cfg.draft_vocab_size else None)
    w1, w2 = bigram_factors(sequences, head.w1.num_embeddings, head.w2.out_features, head.rank,
                            to_draft=to_draft, beta=beta)
    with torch.no_grad():
        head.w1.weight.copy_(w1.to(head.w1.weight))
        head.w2.weight.copy_(w2.to(head.w2.weight))
