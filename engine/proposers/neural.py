"""The neural drafters (DSpark, DFlash, Eagle3) as proposers, with their lazy context backlog.

The drafter's context cache (``engine/draft_runner.py``) holds one entry per committed
position: the target's features there and the token that follows it. Extending it costs a
drafter pass, so it is done lazily: committed positions wait in a per-slot backlog and are
appended in one batched call when the slot next drafts (steps the drafting gate skips, and
prefill, leave them waiting), or at the end of a phase once a backlog reaches
``MAX_BACKLOG_TOKENS`` (which bounds the memory held for a slot that is not drafting). That
end-of-phase flush runs in ``settle``, after the phase's tokens were sent, so no token
waits for the drafter's context pass.

While the engine's drafting gate skips the drafter (``idle``, set by the engine from the
gate's latest decision), a backlog is not flushed but cut: once it reaches twice
``IDLE_CONTEXT_TOKENS`` only its most recent ``IDLE_CONTEXT_TOKENS`` positions are kept,
and the slot's drafter cache is dropped; its next draft rebuilds the cache from the kept
positions alone (a window of the recent text, positions renumbered from 0: the drafter's
rotary attention sees the same relative distances). A skipping drafter then runs no
context pass for the positions it skips (their features are still kept, on the host, until
cut), and a probe, which drafts the rows that drafted least recently, catches up at most
``2 * IDLE_CONTEXT_TOKENS`` positions per row instead of everything since the row's last
draft (hundreds of positions at a large batch, several times the drafter pass that the
gate budgets a probe at). A slot the gate drafts keeps its whole context. Which context a
drafter sees changes its drafts, never the output: verification is exact for any proposal.

Pairing features with tokens: feature row i (sequence position i) enters the backlog with
token i + 1, so a position's features wait in ``pending`` until the token after it is
committed (the prompt's last position waits for the first sampled token).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import torch

from ..draft_runner import make_draft_runner
from ..sts import apply_sts
from .base import DraftBatch, Proposer, ProposerCost

__all__ = ["NeuralProposer", "MAX_BACKLOG_TOKENS", "IDLE_CONTEXT_TOKENS"]

MAX_BACKLOG_TOKENS = 256  # bounds the features held for a slot whose drafter is not drafting
IDLE_CONTEXT_TOKENS = 32  # positions a skipped slot keeps for its next draft (module docstring)


@dataclass
class _SlotContext:
    last_token: int  # the slot's last committed token: the anchor of its next block
    upcoming: list[int] = field(default_factory=list)  # tokens after the last position paired with features
    pending: list[torch.Tensor] = field(default_factory=list)  # feature rows still waiting for their next token
    backlog: list[tuple[torch.Tensor, torch.Tensor]] = field(default_factory=list)  # (features [n, F], next tokens [n])
    backlog_tokens: int = 0
    stale: bool = False  # the drafter's cache of this slot was dropped: rebuild it from the backlog alone


class NeuralProposer(Proposer):
    """A trained drafter behind the proposer interface.

    ``drafter``: a ``BlockDrafter`` (DSpark / DFlash) or ``Eagle3Drafter``; ``sps``: an SPS table
    with the profiled drafter pass (its cost), or None; ``sts_temperatures``: per-position STS
    temperatures for the confidence head (``engine/sts.py``), or None (raw sigmoid).
    """

    needs_features = True

    def __init__(self, drafter, max_slots: int, sps=None, sts_temperatures: Sequence[float] | None = None) -> None:
        self.drafter = drafter
        self.runner = make_draft_runner(drafter, max_slots)
        self.name = drafter.cfg.algo
        self.max_drafts = drafter.cfg.block_size
        self.has_confidence = getattr(drafter, "confidence", None) is not None
        self.sts = None if sts_temperatures is None else torch.as_tensor(sts_temperatures, dtype=torch.float32)
        self.device = next(drafter.parameters()).device
        self._sps = sps
        self.max_backlog_tokens = MAX_BACKLOG_TOKENS
        self.idle_context_tokens = IDLE_CONTEXT_TOKENS
        self.idle = False  # the engine's gate is skipping the drafter: cut backlogs instead of flushing them
        self._slots: dict[int, _SlotContext] = {}

    # -- the slot cycle --------------------------------------------------------------------------
    def reset(self, slot: int, prompt: Sequence[int]) -> None:
        if not prompt:
            raise ValueError("a request needs at least one prompt token")
        self.runner.reset(slot)
        self._slots[slot] = _SlotContext(last_token=int(prompt[-1]), upcoming=[int(t) for t in prompt[1:]])

    def commit(self, slot: int, tokens: Sequence[int], features: torch.Tensor | None = None) -> None:
        st = self._slots[slot]
        if len(tokens):
            st.upcoming.extend(int(t) for t in tokens)
            st.last_token = int(tokens[-1])
        if features is not None and features.shape[0]:
            st.pending.append(features)
        waiting = sum(f.shape[0] for f in st.pending)
        k = min(waiting, len(st.upcoming))
        if k == 0:
            return
        # one copy: the rows must own their memory (the engine's feature tensor is the whole batch's)
        rows = torch.cat(st.pending) if len(st.pending) > 1 else st.pending[0].clone()
        st.pending = [rows[k:]] if k < waiting else []
        st.backlog.append((rows[:k], torch.tensor(st.upcoming[:k], dtype=torch.long)))
        st.backlog_tokens += k
        del st.upcoming[:k]

    def settle(self, slots: Sequence[int]) -> None:
        """Append the backlogs past ``max_backlog_tokens`` in one batch; while ``idle``, cut those
        past twice ``idle_context_tokens`` to their most recent ``idle_context_tokens`` instead."""
        live = {s: self._slots[s] for s in slots if s in self._slots}
        if self.idle:
            keep = self.idle_context_tokens
            for st in live.values():
                if st.backlog_tokens >= min(2 * keep, self.max_backlog_tokens):
                    self._cut(st, keep)
            return
        self._flush([s for s, st in live.items() if st.backlog_tokens >= self.max_backlog_tokens])

    @staticmethod
    def _joined(st: _SlotContext) -> tuple[torch.Tensor, torch.Tensor]:
        """A slot's backlog as one (features [n, F], next tokens [n]) pair."""
        return torch.cat([a for a, _ in st.backlog]), torch.cat([t for _, t in st.backlog])

    @classmethod
    def _cut(cls, st: _SlotContext, keep: int) -> None:
        """Keep the most recent ``keep`` backlog positions of a slot and drop its drafter cache."""
        aux, nxt = cls._joined(st)
        st.backlog = [(aux[-keep:].clone(), nxt[-keep:].clone())]
        st.backlog_tokens = st.backlog[0][1].shape[0]
        st.stale = True

    def release(self, slot: int) -> None:
        self._slots.pop(slot, None)

    def move(self, src: int, dst: int) -> None:
        self.runner.move(src, dst)
        self._slots[dst] = self._slots.pop(src)

    def backlog_tokens(self, slot: int) -> int:
        """Committed positions of ``slot`` not yet in the drafter's cache (paired with their next token)."""
        return self._slots[slot].backlog_tokens

    def _flush(self, slots: Sequence[int]) -> None:
        """Bring the drafter's cache up to date for ``slots`` (one batched append of their backlogs)."""
        rows = []
        for s in slots:
            st = self._slots[s]
            if st.stale:
                self.runner.reset(s)
                st.stale = False
            if st.backlog:
                aux, nxt = self._joined(st)
                rows.append((s, aux, nxt))
                st.backlog.clear()
                st.backlog_tokens = 0
        if rows:
            self.runner.append(rows)

    # -- drafting ----------------------------------------------------------------------------------
    def propose(self, slots: Sequence[int], temperature: torch.Tensor, noise=None) -> DraftBatch:
        """One block per slot. tokens / lens / confidence / conf_logits come back on the CPU, probs
        stay on the drafter's device."""
        slots = list(slots)
        if not slots:
            return DraftBatch.empty(0, self.max_drafts, source=self.name)
        self._flush(slots)
        anchors = torch.tensor([self._slots[s].last_token for s in slots], device=self.device)
        prop = self.runner.propose(slots, anchors, temperature.to(self.device), noise)
        tokens = prop.tokens.cpu()
        R, K = tokens.shape
        conf_logits = None
        if prop.conf_logits is not None:
            conf_logits = prop.conf_logits.float().cpu()
            confidence = apply_sts(conf_logits, self.sts)
        else:
            confidence = torch.ones(R, K)
        return DraftBatch(tokens=tokens, lens=torch.full((R,), K, dtype=torch.long), confidence=confidence,
                          probs=prop.probs, conf_logits=conf_logits, source=self.name)

    def cost(self) -> ProposerCost:
        if self._sps is not None and getattr(self._sps, "has_draft_cost", False):
            # a row back from idle rebuilds its cache from a backlog of window..2*window positions
            catchup = self._sps.catchup_time(round(1.5 * self.idle_context_tokens))
            return ProposerCost(table=self._sps, on_device=True, catchup_s_per_row=catchup)
        return ProposerCost(on_device=True, known=False)
