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
gate's latest decision, or before the first from whether it will probe part of the batch), a
slot outside ``keep`` (the few slots the gate's next probe may draft, named by the engine)
keeps no context at all: its positions are counted, not written, and its drafter cache is
dropped, so a skipped drafter costs a large batch a few integer updates per row rather than
a feature write per row and step; a slot with no context left proposes nothing until it has
some again. A slot in ``keep`` (every slot when ``keep`` is None) keeps a window: its backlog
is not flushed but cut: once it reaches twice ``IDLE_CONTEXT_TOKENS`` only its most
recent ``IDLE_CONTEXT_TOKENS`` positions are kept,
and the slot's drafter cache is dropped; its next draft rebuilds the cache from the kept
positions alone (a window of the recent text, positions renumbered from 0: the drafter's
rotary attention sees the same relative distances). A skipping drafter then runs no
context pass for the positions it skips (their features are still kept, on the host, until
cut), and a probe, which drafts the rows that drafted least recently, catches up at most
``2 * IDLE_CONTEXT_TOKENS`` positions per row instead of everything since the row's last
draft (hundreds of positions at a large batch, several times the drafter pass). The gate
prices that catch-up into a probe (``cost().catchup_s_per_row``, from the SPS table's
profiled append cost). A slot the gate drafts keeps its whole context. Which context a
drafter sees changes its drafts, never the output: verification is exact for any proposal.

Pairing features with tokens: feature row i (sequence position i) enters the backlog with
token i + 1, so a position whose next token is not committed yet (the prompt's last
position, until the first sampled token; each round's last) waits outside the backlog.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from ..draft_runner import make_draft_runner
from ..sts import apply_sts
from .base import DraftBatch, Proposer, ProposerCost

__all__ = ["NeuralProposer", "MAX_BACKLOG_TOKENS", "IDLE_CONTEXT_TOKENS"]

# bounds the features held for a slot whose drafter is not drafting, and so sets the ring's width: the memory every
# slot's features touch, all of it page faults within a batch's first few hundred steps (80 positions of
# 5 x 576 float32 features: 0.9 MiB a slot; 3.1 MiB at 256)
MAX_BACKLOG_TOKENS = 64
IDLE_CONTEXT_TOKENS = 32  # positions a skipped slot keeps for its next draft (module docstring)


@dataclass
class _SlotContext:
    row: int  # this slot's row of the feature ring (it follows the request through moves)
    tokens: list[int]  # the committed sequence: prompt, then every committed token
    fed: int = 0  # positions 0..fed-1 have their features (in the ring while not yet cached)
    cached: int = 0  # positions before this one are in the drafter's cache, or were cut away
    stale: bool = False  # the drafter's cache of this slot was dropped: rebuild it from the backlog alone

    @property
    def paired(self) -> int:
        """Positions whose features and next token are both known: position i pairs with token i + 1."""
        return min(self.fed, len(self.tokens) - 1)

    @property
    def backlog(self) -> int:
        return max(0, self.paired - self.cached)  # a dropped slot's cut may run one position past its pairs


class NeuralProposer(Proposer):
    """A trained drafter behind the proposer interface.

    ``drafter``: a ``BlockDrafter`` (DSpark / DFlash) or ``Eagle3Drafter``; ``sps``: an SPS table
    with the profiled drafter pass (its cost), or None; ``sts_temperatures``: per-position STS
    temperatures for the confidence head (``engine/sts.py``), or None (raw sigmoid).

    Features not yet in the drafter's cache live in one ring ``[max_slots, capacity, F]`` (position
    p of a slot at ``p % capacity`` of its row), written for all rows of an engine phase at once
    (``commit_many``): a step's bookkeeping is a few tensor operations, not a few per row. The
    capacity is ``max_backlog_tokens`` plus two rounds of positions, grown (never flushed early)
    when a prompt chunk brings more, and dropped when the last slot is released.
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
        self.keep: frozenset[int] | None = None  # while idle, the slots that keep a context window (None: all)
        self._slots: dict[int, _SlotContext] = {}
        self._free_rows = list(range(max_slots - 1, -1, -1))
        self._ring: torch.Tensor | None = None  # [max_slots, capacity, F], allocated by the first features
        self._touched: set[int] = set()  # ring rows written once (their pages are mapped: no faults per step)
        self._max_slots = max_slots

    # -- the slot cycle --------------------------------------------------------------------------
    def reset(self, slot: int, prompt: Sequence[int]) -> None:
        if not prompt:
            raise ValueError("a request needs at least one prompt token")
        self.runner.reset(slot)
        old = self._slots.pop(slot, None)
        row = old.row if old is not None else self._free_rows.pop()
        self._slots[slot] = _SlotContext(row=row, tokens=[int(t) for t in prompt])

    def commit(self, slot: int, tokens: Sequence[int], features: torch.Tensor | None = None) -> None:
        feats = None if features is None else features.unsqueeze(0)
        self.commit_many([slot], [tokens], feats, None if features is None else [features.shape[0]])

    def commit_many(self, slots: Sequence[int], tokens: Sequence[Sequence[int]],
                    features: torch.Tensor | None = None, counts: Sequence[int] | None = None) -> None:
        """Committed tokens of every slot, then their new positions' features into the ring in one
        write. While ``idle``, positions the end-of-phase cut would drop are cut now, unwritten (a
        prompt chunk then costs the ring its last ``idle_context_tokens`` positions, not all).
        Positions counted without features (the engine withholds those ``wants_features``
        declines), and those of a slot that keeps no context, are counted and dropped."""
        entries = []
        known = self._slots
        keep = self._context_keepers()  # read once: a skipped drafter commits every row every step
        for i, s in enumerate(slots):
            st = known[s]
            st.tokens.extend(map(int, tokens[i]))
            n = int(counts[i]) if counts is not None else 0
            if not n:
                continue
            if features is None or (keep is not None and s not in keep):
                self._drop(st, n)
            else:
                skip = self._cut_ahead(st, n) if self.idle else 0
                entries.append((i, st, skip, n))
        if entries:
            self._store(features, entries)

    def wants_features(self, slots: Sequence[int]) -> list[bool]:
        """False for a slot that keeps no context (outside ``keep`` while ``idle``)."""
        return [self._keeps_context(s) for s in slots]

    def _context_keepers(self) -> frozenset[int] | None:
        """The slots that keep context: ``keep`` while ``idle``; None: every slot."""
        return self.keep if self.idle else None

    def _keeps_context(self, slot: int) -> bool:
        keep = self._context_keepers()
        return keep is None or slot in keep

    @staticmethod
    def _drop(st: _SlotContext, n: int) -> None:
        """``n`` new positions of a slot that keeps no context: counted as fed and cut, never written."""
        st.fed += n
        st.cached = max(st.cached, st.fed)
        st.stale = True

    def _cut_ahead(self, st: _SlotContext, n: int) -> int:
        """The cut ``settle`` makes while idle, applied before ``n`` new positions are written;
        -> how many of them fall before the kept window (not to be written)."""
        self._idle_cut(st, min(st.fed + n, len(st.tokens) - 1))
        return max(0, min(st.cached - st.fed, n))

    def _idle_cut(self, st: _SlotContext, paired: int) -> None:
        """With ``paired`` positions paired, a backlog of at least twice the window (or the backlog
        bound) keeps only its last ``idle_context_tokens`` and drops the slot's drafter cache."""
        keep = self.idle_context_tokens
        if paired - st.cached >= min(2 * keep, self.max_backlog_tokens):
            st.cached = max(st.cached, paired - keep)
            st.stale = True

    def _ring_for(self, features: torch.Tensor) -> torch.Tensor:
        F = features.shape[-1]
        if self._ring is None or self._ring.shape[2] != F or self._ring.dtype != features.dtype:
            capacity = self.max_backlog_tokens + 2 * (self.max_drafts + 1)
            self._ring = torch.empty(self._max_slots, capacity, F, dtype=features.dtype)
            self._touched = set()
        return self._ring

    def _touch(self, rows) -> None:
        """Zero ring rows on their first use: their memory is mapped then, once, rather than a few
        pages per step as positions advance (page faults cost more than the writes); rows no
        request uses stay unmapped."""
        for row in rows:
            if row not in self._touched:
                self._ring[row].zero_()
                self._touched.add(row)

    def _store(self, features: torch.Tensor, entries: list[tuple[int, _SlotContext, int, int]]) -> None:
        """For each entry (i, st, lo, n): write ``features[i, lo:n]`` at positions ``st.fed + lo ..``
        of the slot's ring row; its first ``lo`` positions are already cut. ``st.fed`` moves by n."""
        ring = self._ring_for(features)
        need = max(st.fed + n - st.cached for _, st, _, n in entries)  # positions each row holds
        if need > ring.shape[1]:  # a prompt chunk longer than the ring holds unflushed
            ring = self._grow(need)
        C = ring.shape[1]
        self._touch(st.row for _, st, _, _ in entries)
        L = features.shape[1]
        src, dst = [], []  # a few positions per row in a decode step: host lists, then one gather and one scatter
        for i, st, lo, n in entries:
            src.extend(range(i * L + lo, i * L + n))
            base = st.row * C
            dst.extend(base + p % C for p in range(st.fed + lo, st.fed + n))
            st.fed += n
        rows = features.reshape(-1, features.shape[2])[torch.tensor(src)]
        ring.view(-1, ring.shape[2]).index_copy_(0, torch.tensor(dst), rows.to(ring.dtype))

    def _grow(self, need: int) -> torch.Tensor:
        """A ring of at least ``need`` positions per row, holding every slot's unflushed positions."""
        old, C = self._ring, self._ring.shape[1]
        capacity = max(2 * C, -(-need // 64) * 64)  # doubling: a long prompt grows it once, not per chunk
        self._ring = torch.empty(old.shape[0], capacity, old.shape[2], dtype=old.dtype)
        self._touched = set()
        self._touch(st.row for st in self._slots.values())
        for st in self._slots.values():
            pos = torch.arange(st.cached, max(st.cached, st.fed))  # a cut ahead may leave none
            self._ring[st.row, pos % capacity] = old[st.row, pos % C]
        return self._ring

    def settle(self, slots: Sequence[int]) -> None:
        """Append the backlogs past ``max_backlog_tokens`` in one batch; while ``idle``, cut those
        past twice ``idle_context_tokens`` to their most recent ``idle_context_tokens`` instead."""
        live = [s for s in slots if s in self._slots]
        if self.idle:
            for s in live:
                st = self._slots[s]
                self._idle_cut(st, st.paired)
            return
        self._flush([s for s in live if self._slots[s].backlog >= self.max_backlog_tokens])

    def release(self, slot: int) -> None:
        """Free the slot's ring row; the last slot out drops the ring, whose rows each touch (and
        fault in) their whole width as positions wrap: a long prompt that grew it for one request
        does not widen the next batch's rows."""
        st = self._slots.pop(slot, None)
        if st is not None:
            self._free_rows.append(st.row)
        if not self._slots:
            self._ring = None

    def move(self, src: int, dst: int) -> None:
        self.runner.move(src, dst)
        self._slots[dst] = self._slots.pop(src)

    def has_context(self, slot: int) -> bool:
        """Whether ``slot`` has any context to draft from: positions waiting in the ring, or a drafter
        cache that was not dropped (a slot outside ``keep`` while idle has none)."""
        st = self._slots[slot]
        return st.paired > st.cached or not st.stale

    def backlog_tokens(self, slot: int) -> int:
        """Committed positions of ``slot`` not yet in the drafter's cache (paired with their next token)."""
        return self._slots[slot].backlog

    def _flush(self, slots: Sequence[int]) -> None:
        """Bring the drafter's cache up to date for ``slots`` (one batched append of their backlogs)."""
        rows = []
        for s in slots:
            st = self._slots[s]
            if st.stale:
                self.runner.reset(s)
                st.stale = False
            lo, hi = st.cached, st.paired
            if hi > lo:
                C = self._ring.shape[1]
                aux = self._ring[st.row].index_select(0, torch.arange(lo, hi) % C)
                rows.append((s, aux, torch.tensor(st.tokens[lo + 1:hi + 1], dtype=torch.long)))
                st.cached = hi
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
        anchors = torch.tensor([self._slots[s].tokens[-1] for s in slots], device=self.device)
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
