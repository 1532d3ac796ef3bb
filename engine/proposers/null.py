"""The null proposer: no drafts, so every round verifies 0 tokens (target-only decoding).

With it the engine loop has no ``drafter is None`` branch: target-only is speculation with
a proposer that never proposes, and the first token after prefill can go through the same
verify path with zero drafts.
"""
from __future__ import annotations

from typing import Sequence

import torch

from .base import DraftBatch, Proposer, ProposerCost

__all__ = ["NullProposer"]


class NullProposer(Proposer):
    """Proposes nothing and costs nothing."""

    name = "none"
    max_drafts = 0
    needs_features = False

    def reset(self, slot: int, prompt: Sequence[int]) -> None:
        pass

    def commit(self, slot: int, tokens: Sequence[int], features: torch.Tensor | None = None) -> None:
        pass

    def propose(self, slots: Sequence[int], temperature: torch.Tensor, noise=None) -> DraftBatch:
        return DraftBatch.empty(len(slots), 0, source=self.name)

    def move(self, src: int, dst: int) -> None:
        pass

    def cost(self) -> ProposerCost:
        return ProposerCost()
