"""The drafter's output vocabulary: a frequent subset of the target's, or all of it.

A drafter that predicts over the target's full vocabulary spends most of its time in
vocabulary-sized products: on SmolLM2 (49,152 tokens) the LM head and the Markov head's
``W2`` were 21 of 33 ms of a one-request draft step, and about 70% of a training step
(LM head, ``W2`` and the target's logits over 224 block positions). Answers use far fewer
tokens: the 1,024-record SmolLM2 set has 6,519 distinct answer tokens in 122k.

With ``target.draft_vocab = N`` the drafter predicts over the ``N`` ids in
``draft_ids`` (sorted, chosen by :func:`choose_draft_vocab` from the training records):
its LM head is the target's rows at those ids (frozen), the Markov head maps draft
index to draft index, and a draft token ``i`` is the target token ``draft_ids[i]``. This
stays lossless: verification sees draft probabilities over the full vocabulary (zero
outside the subset), and rejection sampling only needs ``q(x) > 0`` wherever a draft is
drawn. Tokens outside the subset are never drafted; the bonus/recovered token from the
target covers them.
"""
from __future__ import annotations

from collections import Counter
from typing import Iterable, Sequence

import torch

__all__ = ["DraftVocabError", "choose_draft_vocab", "check_draft_ids", "target_to_draft", "scatter_to_vocab"]


class DraftVocabError(ValueError):
    pass


def choose_draft_vocab(answers: Iterable[Sequence[int]], prompts: Iterable[Sequence[int]], size: int,
                       vocab_size: int) -> torch.Tensor:
    """The ``size`` ids to draft over, sorted: most frequent answer tokens first, then prompt
    tokens, then the lowest remaining ids (so a small data set still gives ``size`` ids)."""
    if not 0 < size <= vocab_size:
        raise DraftVocabError(f"draft vocabulary size must be in 1..{vocab_size}, got {size}")
    answer_counts, prompt_counts = Counter(), Counter()
    for ids in answers:
        answer_counts.update(ids)
    for ids in prompts:
        prompt_counts.update(ids)
    chosen: dict[int, None] = {}
    for counts in (answer_counts, prompt_counts):
        for tok, _ in sorted(counts.items(), key=lambda kv: (-kv[1], kv[0])):
            if len(chosen) == size:
                break
            if 0 <= tok < vocab_size:
                chosen.setdefault(tok)
    tok = 0
    while len(chosen) < size:
        chosen.setdefault(tok)
        tok += 1
    return torch.tensor(sorted(chosen), dtype=torch.long)


def check_draft_ids(ids: torch.Tensor, size: int, vocab_size: int) -> None:
    """A usable ``draft_ids``: ``size`` strictly increasing ids inside the target vocabulary."""
    if ids.dim() != 1 or ids.numel() != size:
        raise DraftVocabError(f"draft_ids must be {size} ids, got shape {tuple(ids.shape)}")
    if size and (int(ids.min()) < 0 or int(ids.max()) >= vocab_size):
        raise DraftVocabError(f"draft_ids must lie in [0, {vocab_size}), got {int(ids.min())}..{int(ids.max())}")
    if size > 1 and not bool((ids[1:] > ids[:-1]).all()):
        raise DraftVocabError("draft_ids must be sorted and unique")


def target_to_draft(draft_ids: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Lookup table [vocab_size]: target id -> draft index, ``len(draft_ids)`` for ids outside it."""
    table = torch.full((vocab_size,), draft_ids.numel(), dtype=torch.long, device=draft_ids.device)
    table[draft_ids] = torch.arange(draft_ids.numel(), device=draft_ids.device)
    return table


def scatter_to_vocab(probs: torch.Tensor, draft_ids: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Draft-vocabulary distributions [..., N] -> target-vocabulary ones [..., V] (zero elsewhere)."""
    out = probs.new_zeros(probs.shape[:-1] + (vocab_size,))
    return out.index_copy_(-1, draft_ids, probs)
