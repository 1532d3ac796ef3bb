"""Drafter-side state for in-flight batching: per-slot context caches that only grow.

The drafter's context is a function of *committed* target features, so its cache never
needs trimming: after each verify step the engine appends the features of the positions
the target just committed. Slots mirror the target runner's (rows 0..R-1 are active).

- ``BlockDraftRunner`` (DSpark, DFlash): per layer K/V of ``H_ctx``; one parallel pass
  proposes the block, then the Markov/confidence heads run left to right.
- ``Eagle3DraftRunner``: per layer K/V of the true entries ``(f_i, x_{i+1})`` plus the
  last entry's output (it predicts draft 1); then K-1 autoregressive steps.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from dspark.training.algorithms import algorithm
from dspark.training.models import BlockDrafter, Eagle3Drafter, Proposal


class _SlotCache:
    def __init__(self, n_layers: int, slots: int, n_kv: int, head_dim: int, capacity: int, device, dtype):
        shape = (n_layers, slots, n_kv, capacity, head_dim)
        self.k = torch.zeros(shape, device=device, dtype=dtype)
        self.v = torch.zeros(shape, device=device, dtype=dtype)
        self.lengths = torch.zeros(slots, dtype=torch.long)

    @property
    def capacity(self) -> int:
        return self.k.shape[3]

    def ensure(self, needed: int) -> None:
        if needed > self.capacity:
            pad = max(needed, 2 * self.capacity) - self.capacity
            self.k = F.pad(self.k, (0, 0, 0, pad))
            self.v = F.pad(self.v, (0, 0, 0, pad))

    def write(self, layer: int, rows: torch.Tensor, pos: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """rows/pos [n]; k/v [n, Hkv, hd]."""
        self.k[layer][rows, :, pos] = k
        self.v[layer][rows, :, pos] = v

    def view(self, layer: int, slots: list[int], T: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K/V of ``slots`` up to T: a view when slots are 0..R-1, else a gather."""
        if slots == list(range(len(slots))):
            return self.k[layer, : len(slots), :, :T], self.v[layer, : len(slots), :, :T]
        idx = torch.tensor(slots, device=self.k.device)
        return self.k[layer, idx, :, :T], self.v[layer, idx, :, :T]

    def valid(self, slots: list[int], T: int) -> torch.Tensor:
        return torch.arange(T).unsqueeze(0) < self.lengths[slots].unsqueeze(1)

    def move(self, src: int, dst: int) -> None:
        n = int(self.lengths[src])
        self.k[:, dst, :, :n] = self.k[:, src, :, :n]
        self.v[:, dst, :, :n] = self.v[:, src, :, :n]
        self.lengths[dst], self.lengths[src] = n, 0


def _packed(rows_new: list[tuple[int, torch.Tensor]]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """[(row, x [n, ...])] -> (x packed [sum n, ...], row ids [sum n], offsets within row [sum n])."""
    xs = torch.cat([x for _, x in rows_new])
    rows = torch.cat([torch.full((x.shape[0],), r, dtype=torch.long) for r, x in rows_new])
    offs = torch.cat([torch.arange(x.shape[0]) for _, x in rows_new])
    return xs, rows, offs


class _CachedDraftRunner:
    """What both runners share: the drafter, a context cache for its layers, and slot bookkeeping."""

    def __init__(self, drafter: BlockDrafter | Eagle3Drafter, max_slots: int, capacity: int = 256):
        self.model = drafter.eval()
        layer0 = drafter.layers[0].s
        p = next(drafter.parameters())
        self.cache = _SlotCache(len(drafter.layers), max_slots, layer0.num_kv_heads, layer0.head_dim, capacity,
                                p.device, p.dtype)
        self.block_size = drafter.cfg.block_size

    def _context(self, slots: list[int], device) -> tuple[list[tuple[torch.Tensor, torch.Tensor]], torch.Tensor,
                                                          torch.Tensor]:
        """The slots' cached contexts: (per layer K/V [R, Hkv, T, hd], valid [R, T] on ``device``,
        lengths [R] on ``device``), T the longest context."""
        T = int(self.cache.lengths[slots].max())
        past = [self.cache.view(li, slots, T) for li in range(len(self.model.layers))]
        return past, self.cache.valid(slots, T).to(device), self.cache.lengths[slots].to(device)

    def reset(self, slot: int) -> None:
        self.cache.lengths[slot] = 0

    def move(self, src: int, dst: int) -> None:
        self.cache.move(src, dst)


class BlockDraftRunner(_CachedDraftRunner):
    @torch.no_grad()
    def append(self, rows_new: list[tuple[int, torch.Tensor, torch.Tensor]]) -> None:
        """[(slot, aux [n, m*d], next_tokens [n])] for newly committed positions (tokens unused here)."""
        rows_new = [(r, a) for r, a, _ in rows_new if a.shape[0] > 0]
        if not rows_new:
            return
        aux, rows, offs = _packed(rows_new)
        pos = self.cache.lengths[rows] + offs
        self.cache.ensure(int(pos.max()) + 1)
        p = next(self.model.parameters())
        h = self.model.context(aux.to(device=p.device, dtype=p.dtype)).unsqueeze(0)
        kv = self.model.context_kv(h, pos.unsqueeze(0).to(p.device))
        for li, (k, v) in enumerate(kv):
            self.cache.write(li, rows, pos, k[0].transpose(0, 1), v[0].transpose(0, 1))
        for r, a in rows_new:
            self.cache.lengths[r] += a.shape[0]

    @torch.no_grad()
    def propose(self, slots: list[int], anchors: torch.Tensor, temperature: torch.Tensor, noise=None) -> Proposal:
        """One block per slot; the anchor sits right after the slot's context."""
        ctx_kv, valid, lengths = self._context(slots, anchors.device)
        return self.model.propose(anchors, lengths, ctx_kv, valid, temperature, noise)


class Eagle3DraftRunner(_CachedDraftRunner):
    def __init__(self, drafter: Eagle3Drafter, max_slots: int, capacity: int = 256):
        super().__init__(drafter, max_slots, capacity)
        p = next(drafter.parameters())
        self.last_hidden = torch.zeros(max_slots, drafter.cfg.hidden_size, device=p.device, dtype=p.dtype)

    @torch.no_grad()
    def append(self, rows_new: list[tuple[int, torch.Tensor, torch.Tensor]]) -> None:
        """[(slot, aux [n, m*d], next_tokens [n])]: true entries (f_i, x_{i+1}) of committed positions."""
        rows_new = [x for x in rows_new if x[1].shape[0] > 0]
        if not rows_new:
            return
        m = self.model
        p = next(m.parameters())
        slots = [r for r, _, _ in rows_new]
        R = len(slots)
        n_max = max(a.shape[0] for _, a, _ in rows_new)
        T = int(self.cache.lengths[slots].max())
        feats = torch.zeros(R, n_max, m.cfg.num_aux_layers * m.cfg.hidden_size, device=p.device, dtype=p.dtype)
        toks = torch.zeros(R, n_max, dtype=torch.long, device=p.device)
        n_new = torch.zeros(R, dtype=torch.long)
        for i, (_, a, t) in enumerate(rows_new):
            feats[i, : a.shape[0]] = a.to(p.device, p.dtype)
            toks[i, : t.shape[0]] = t.to(p.device)
            n_new[i] = a.shape[0]
        x = m.entry(m.fuse(feats), toks)
        pos = self.cache.lengths[slots].unsqueeze(1) + torch.arange(n_max).unsqueeze(0)
        own = torch.ones(n_max, n_max, dtype=torch.bool).tril().expand(R, -1, -1) \
            & (torch.arange(n_max).view(1, 1, -1) < n_new.view(-1, 1, 1))
        mask = torch.cat([self.cache.valid(slots, T).unsqueeze(1).expand(R, n_max, T), own], dim=-1).to(p.device)
        past = [self.cache.view(li, slots, T) for li in range(len(m.layers))]
        out, new_kv = m.run_layers(x, pos.to(p.device), past, mask)
        self.cache.ensure(int((self.cache.lengths[slots] + n_new).max()) + 1)
        valid = torch.arange(n_max).unsqueeze(0) < n_new.unsqueeze(1)
        rows = torch.tensor(slots).unsqueeze(1).expand(R, n_max)[valid]
        wpos = pos[valid]
        for li, (k, v) in enumerate(new_kv):
            self.cache.write(li, rows, wpos, k.transpose(1, 2)[valid], v.transpose(1, 2)[valid])
        for i, (r, a, _) in enumerate(rows_new):
            self.last_hidden[r] = out[i, a.shape[0] - 1]
            self.cache.lengths[r] += a.shape[0]

    @torch.no_grad()
    def propose(self, slots: list[int], anchors: torch.Tensor, temperature: torch.Tensor, noise=None) -> Proposal:
        past, valid, lengths = self._context(slots, anchors.device)
        return self.model.propose_from(self.last_hidden[slots], past, valid, lengths, temperature, noise)

    def move(self, src: int, dst: int) -> None:
        super().move(src, dst)
        self.last_hidden[dst] = self.last_hidden[src]


RUNNERS = {"block": BlockDraftRunner, "autoregressive": Eagle3DraftRunner}  # by drafter kind (training/algorithms.py)


def make_draft_runner(drafter, max_slots: int):
    """The runner of the drafter's kind (its registered algorithm's)."""
    kind = algorithm(drafter.cfg.algo).kind
    if kind not in RUNNERS:
        raise TypeError(f"no draft runner for {kind!r} drafters ({type(drafter).__name__})")
    return RUNNERS[kind](drafter, max_slots)
