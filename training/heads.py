"""DSpark's sequential heads, shared by training, the engine and ONNX export.

Markov head (vanilla, the production one): ``logits_k = U_k + W2(W1[x_{k-1}])`` where
``U_k`` are the block's parallel logits, ``W1 = Embedding(V, r)``, ``W2 = Linear(r, V)``
(no bias) and ``x_0`` is the anchor token. The bias is added *before* the softmax and
already at position 1 (from the anchor).

RNN head (report Eq. 6): a gated recurrent state ``s_k`` over ``W1[x_{k-1}]`` and the
block hidden ``h_k``; ``logits_k = U_k + W2(s_k)``.

Confidence head: ``c_k = sigmoid(Linear(d + r, 1)([h_k ; W1[x_{k-1}]]))`` predicts the
probability that draft ``x_k`` survives verification given the drafts before it.
"""
from __future__ import annotations

import torch
from torch import nn

from .cpu_linear import project


class MarkovHead(nn.Module):
    """Bigram correction of the block logits from the previous token (vanilla or RNN)."""

    def __init__(self, vocab_size: int, hidden_size: int, rank: int, kind: str = "vanilla",
                 prev_vocab_size: int | None = None):
        """``vocab_size``: the logits' (draft) vocabulary; ``prev_vocab_size``: ids ``x_{k-1}``
        may take (one more than ``vocab_size`` with a draft vocabulary: its out-of-vocabulary row)."""
        super().__init__()
        if kind not in ("vanilla", "rnn"):
            raise ValueError(f"markov head kind must be vanilla or rnn, got {kind!r}")
        self.kind = kind
        self.rank = rank
        self.w1 = nn.Embedding(prev_vocab_size or vocab_size, rank)
        self.w2 = nn.Linear(rank, vocab_size, bias=False)
        nn.init.normal_(self.w1.weight, std=0.02)
        nn.init.zeros_(self.w2.weight)  # starts as the identity correction: DFlash behaviour
        if kind == "rnn":
            self.gate = nn.Linear(rank + hidden_size, rank)
            self.cand = nn.Linear(rank + hidden_size, rank)

    def features(self, prev_tokens: torch.Tensor, hidden: torch.Tensor, state: torch.Tensor | None = None
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """prev_tokens [..., K] (x_{k-1}), hidden [..., K, d] -> (feature [..., K, r], W1 emb [..., K, r],
        state after position K [..., r] or None).

        The head steps itself: the vanilla head has no state (every position at once, None); the
        RNN head runs its state left to right over K, from ``state`` (a previous call's, e.g. one
        position at a time while sampling) or zeros. Callers pass the returned state back unchanged.
        """
        emb = self.w1(prev_tokens)
        if self.kind == "vanilla":
            return emb, emb, None
        s = torch.zeros_like(emb[..., 0, :]) if state is None else state
        outs = []
        for k in range(emb.shape[-2]):
            z = torch.cat([emb[..., k, :], hidden[..., k, :]], dim=-1)
            g = torch.sigmoid(self.gate(z))
            s = g * s + (1 - g) * torch.tanh(self.cand(z))
            outs.append(s)
        return torch.stack(outs, dim=-2), emb, s

    def bias(self, feature: torch.Tensor) -> torch.Tensor:
        """[..., r] -> [..., V] additive logit correction. ``W2`` is one of a drafting step's two
        large products (the LM head is the other, ``TargetTiedDrafter.draft_logits``), so it goes
        through ``cpu_linear.project``, the small-row kernel on CPU inference."""
        return project(self.w2, feature)


class ConfidenceHead(nn.Module):
    """c_k = sigmoid(Linear(d + r -> 1)([h_k ; W1[x_{k-1}]])); returns the logit."""

    def __init__(self, hidden_size: int, rank: int):
        super().__init__()
        self.proj = nn.Linear(hidden_size + rank, 1)
        nn.init.zeros_(self.proj.weight)
        nn.init.constant_(self.proj.bias, 0.0)

    def forward(self, hidden: torch.Tensor, prev_emb: torch.Tensor) -> torch.Tensor:
        """hidden [..., d], prev_emb [..., r] -> confidence logit [...]."""
        return self.proj(torch.cat([hidden, prev_emb], dim=-1)).squeeze(-1)
