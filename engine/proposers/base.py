"""The proposer interface: what the engine asks of every drafting method.

A proposer keeps per-slot state about the requests the engine runs. Slots are the
engine's batch rows (0..R-1 are active; the engine compacts them when requests leave, so a
proposer must follow ``move``). The engine drives it through one cycle per request:

- ``reset(slot, prompt)``: a request enters ``slot``; its committed sequence is ``prompt``.
- ``commit(slot, tokens, features)``: ``tokens`` were appended to the slot's committed
  sequence (the first token after prefill, then each verify round's accepted drafts and
  recovered/bonus token); ``features`` are the target's features (``[n, F]``) of the n
  positions the target just ran for this slot, in order (a prefill chunk; a round's
  anchor and accepted drafts), or None. A proposer whose ``needs_features`` is False
  never gets features. Feature row ``i`` belongs to sequence position ``i``; the token
  that follows it may arrive in a later ``commit`` (the prompt's last position waits for
  the first sampled token).
- ``commit_many(slots, tokens, features, counts)``: the same for every slot of an engine
  phase in one call (the engine's way; a proposer may batch its bookkeeping). ``counts``
  says how many positions the target ran for each slot; ``features`` None with ``counts``
  means they ran but their features were withheld, because ``wants_features`` declined
  them (a drafter keeping no context for that slot).
- ``wants_features(slots)``: which of ``slots`` want their new positions' features, asked
  before each commit, so the engine builds features only for the rows some proposer keeps.
- ``propose(slots, temperature, noise)``: up to ``max_drafts`` drafts per slot that
  continue its committed sequence, as a ``DraftBatch``; ``noise`` is the randomness of
  sampled drafts, row by row (``dspark.plugins.coupled.RaceNoise``, built by the engine from
  each request's seed and next position; None for greedy rows and deterministic proposers).
- ``settle(slots)``: the end of an engine phase, after its tokens went out: deferred work
  that must not delay them (the neural proposer bounds its context backlog here).
- ``release(slot)``: the request left (finished, stopped or cancelled); before any ``move``.
- ``move(src, dst)``: the request in ``src`` now lives in ``dst`` (``dst`` is free).
- ``cost()``: seconds of proposer work per drafted step, for the drafting gate and the
  scheduler (``ProposerCost``).

Lossless by construction: a proposal is a function of the committed sequence (and, for a
sampling drafter, of its own random draws), and ``DraftBatch.probs`` is the distribution
each draft was drawn from; ``None`` means a point mass at the drafted token (a
deterministic proposer, or a greedy draw), which ``plugins.reference.verify`` takes as a
one-hot ``p_d``: it accepts draft x with probability ``min(1, p_t(x) / 1) = p_t(x)`` and on
rejection samples ``norm(max(p_t - onehot(x), 0))``, i.e. ``p_t`` with x removed, so the
emitted token follows ``p_t`` exactly. Under the coupled rule (``plugins/coupled.py``) a
draft is accepted iff it equals the target's seeded choice, which a point mass at x also
matches with probability ``p_t(x)``: the same acceptance, and the output is the target's.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Sequence

import torch

__all__ = ["DraftBatch", "ProposerCost", "Proposer"]


@dataclass
class DraftBatch:
    """Drafts for a set of slots (row r of every tensor is ``slots[r]``)."""

    tokens: torch.Tensor  # [R, K] int64 drafts; entries at or past lens[r] are 0 and never verified
    lens: torch.Tensor  # [R] int64 in 0..K: drafts this proposer has for the row (the verify cap)
    confidence: torch.Tensor  # [R, K] float32, calibrated P(draft j accepted | drafts < j accepted); 0 past lens
    probs: torch.Tensor | None = None  # [R, K, V] distributions the drafts were drawn from; None: point mass
    conf_logits: torch.Tensor | None = None  # [R, K] raw confidence logits (what STS is fitted on), or None
    source: str = ""  # the proposer's name (stats by proposer)
    row_sources: list[str] | None = None  # per row, when rows come from different proposers (``combine``)

    def __post_init__(self) -> None:
        R, K = self.tokens.shape
        if self.row_sources is not None and len(self.row_sources) != R:
            raise ValueError(f"DraftBatch: row_sources needs {R} entries, got {len(self.row_sources)}")
        if self.lens.shape != (R,) or self.confidence.shape != (R, K):
            raise ValueError(f"DraftBatch: tokens [R, K] = {tuple(self.tokens.shape)} needs lens [R] and "
                             f"confidence [R, K], got {tuple(self.lens.shape)} and {tuple(self.confidence.shape)}")
        if self.probs is not None and self.probs.shape[:2] != (R, K):
            raise ValueError(f"DraftBatch: probs must be [R, K, V] = [{R}, {K}, V], got {tuple(self.probs.shape)}")

    @property
    def rows(self) -> int:
        return self.tokens.shape[0]

    @property
    def width(self) -> int:
        """K: drafts per row, the widest row's cap."""
        return self.tokens.shape[1]

    @property
    def point_mass(self) -> bool:
        return self.probs is None

    def source_of(self, row: int) -> str:
        """The proposer that drafted ``row`` (for stats by proposer)."""
        return self.row_sources[row] if self.row_sources is not None else self.source

    def verify_probs(self, vocab: int, length: int | None = None) -> torch.Tensor:
        """Draft distributions ``[R, length, vocab]`` for ``verify``: ``probs`` or a one-hot at the drafts."""
        L = self.width if length is None else length
        if self.probs is not None:
            return self.probs[:, :L].float()
        return torch.nn.functional.one_hot(self.tokens[:, :L].clamp(0, vocab - 1), vocab).float()

    def expected_accepts(self) -> torch.Tensor:
        """[R] expected accepted drafts if every available draft is verified: sum_j prod_{i<=j} c_i."""
        keep = torch.arange(self.width).unsqueeze(0) < self.lens.cpu().unsqueeze(1)
        return (torch.cumprod(self.confidence.cpu().double(), dim=1) * keep).sum(1)

    @classmethod
    def combine(cls, batches: Sequence["DraftBatch"], choice: torch.Tensor, vocab: int) -> "DraftBatch":
        """Row r taken from ``batches[choice[r]]`` (all batches cover the same rows), padded to the
        widest; the result has per-row sources, and ``probs`` (one-hot for point-mass rows) unless
        every chosen row is a point mass.

        Lossless only if ``choice`` was fixed without looking at the drafts it picks between (e.g.
        from deterministic proposals and committed history, before a sampling drafter ran); a
        choice that reads a sampled draft makes that draft's law differ from its ``probs``."""
        if not batches:
            raise ValueError("combine needs at least one DraftBatch")
        R = batches[0].rows
        if any(b.rows != R for b in batches) or choice.shape != (R,):
            raise ValueError(f"combine: every batch and choice must cover the same {R} rows")
        choice = choice.long().cpu()
        K = max(b.width for b in batches)
        tokens = torch.zeros(R, K, dtype=torch.long)
        confidence = torch.zeros(R, K)
        lens = torch.zeros(R, dtype=torch.long)
        logits = torch.zeros(R, K) if any(b.conf_logits is not None for b in batches) else None
        sampled = any(b.probs is not None and bool((choice == i).any()) for i, b in enumerate(batches))
        probs = None
        if sampled:
            device = next(b.probs.device for i, b in enumerate(batches) if b.probs is not None and bool((choice == i).any()))
            probs = torch.zeros(R, K, vocab, device=device)
        for i, b in enumerate(batches):
            rows = (choice == i).nonzero().flatten()
            if rows.numel() == 0:
                continue
            w = b.width
            tokens[rows, :w] = b.tokens[rows].cpu()
            confidence[rows, :w] = b.confidence[rows].cpu().float()
            lens[rows] = b.lens[rows].cpu()
            if logits is not None and b.conf_logits is not None:
                logits[rows, :w] = b.conf_logits[rows].cpu().float()
            if probs is not None:
                if b.probs is not None:
                    chosen = b.probs[rows.to(b.probs.device)].float()
                else:
                    chosen = torch.nn.functional.one_hot(b.tokens[rows].clamp(0, vocab - 1), vocab).float()
                probs[rows.to(probs.device), :w] = chosen.to(probs.device)
        sources = [batches[int(c)].source_of(r) for r, c in enumerate(choice)]
        return cls(tokens=tokens, lens=lens, confidence=confidence, probs=probs, conf_logits=logits,
                   source="+".join(dict.fromkeys(b.source for b in batches)), row_sources=sources)

    @classmethod
    def empty(cls, rows: int, width: int = 0, source: str = "") -> "DraftBatch":
        """No drafts for ``rows`` rows (every verify length 0)."""
        return cls(tokens=torch.zeros(rows, width, dtype=torch.long), lens=torch.zeros(rows, dtype=torch.long),
                   confidence=torch.zeros(rows, width), source=source)


@dataclass(frozen=True)
class ProposerCost:
    """Seconds of proposer work on a drafted step with ``rows`` drafting rows.

    ``table`` (an ``SpsTable`` with a profiled drafter pass) gives ``table.draft_time(rows)``;
    without one the cost is ``fixed_s + per_row_s * rows``. ``on_device`` says whether the
    work occupies the accelerator that runs the target (a neural drafter) or only the host
    (a suffix lookup), which a scheduler overlapping host work with the target step needs.
    ``known`` is False for a drafter whose cost was never profiled (the gate stays off).
    ``catchup_s_per_row``: what a row that has not drafted for a while pays first, bringing
    the proposer's context up to date (the neural proposer's idle window); the drafting
    gate counts it in the price of a probe.
    """

    fixed_s: float = 0.0
    per_row_s: float = 0.0
    table: object | None = None  # dspark.engine.sps.SpsTable with draft_requests/draft_seconds
    on_device: bool = False
    known: bool = True
    catchup_s_per_row: float = 0.0

    def seconds(self, rows: int) -> float:
        if rows <= 0:
            return 0.0
        if self.table is not None:
            return float(self.table.draft_time(rows))
        if not self.known:
            raise ValueError("this proposer's cost was never profiled (dspark profile --checkpoint ...)")
        return self.fixed_s + self.per_row_s * rows

    def catchup_seconds(self, rows: int) -> float:
        """Seconds for ``rows`` rows that have not drafted for a while to catch up their context."""
        return max(rows, 0) * self.catchup_s_per_row


class Proposer(ABC):
    """One drafting method, driven by the engine (see the module docstring for the cycle)."""

    name: str = "proposer"
    max_drafts: int = 0  # K: most drafts per slot per round
    needs_features: bool = False  # the engine passes target features to ``commit`` only if True

    @abstractmethod
    def reset(self, slot: int, prompt: Sequence[int]) -> None:
        """A request enters ``slot`` with committed sequence ``prompt`` (any earlier state is dropped)."""

    @abstractmethod
    def commit(self, slot: int, tokens: Sequence[int], features: torch.Tensor | None = None) -> None:
        """``tokens`` appended to the slot's committed sequence; ``features`` [n, F] of the positions just run."""

    def commit_many(self, slots: Sequence[int], tokens: Sequence[Sequence[int]],
                    features: torch.Tensor | None = None, counts: Sequence[int] | None = None) -> None:
        """``commit`` for several slots at once (the engine calls it once per phase): ``tokens[i]``
        appended to ``slots[i]``; ``features [R, L, F]`` (or None): row i's first ``counts[i]`` rows
        are the features of ``slots[i]``'s new positions (None with ``counts``: withheld, as
        ``wants_features`` asked). Default: one ``commit`` per slot; a proposer overrides it to
        batch its bookkeeping."""
        for i, s in enumerate(slots):
            self.commit(s, tokens[i], None if features is None else features[i, :counts[i]])

    def wants_features(self, slots: Sequence[int]) -> list[bool]:
        """Whether each of ``slots`` wants the features of its next positions; default: all of
        them when the proposer ``needs_features``."""
        return [self.needs_features] * len(slots)

    @abstractmethod
    def propose(self, slots: Sequence[int], temperature: torch.Tensor, noise=None) -> DraftBatch:
        """Drafts continuing each slot's committed sequence; ``temperature`` [R] (0 = greedy);
        ``noise``: the sampled drafts' per-row randomness (a ``RaceNoise``) or None."""

    @abstractmethod
    def move(self, src: int, dst: int) -> None:
        """The request in ``src`` moves to the free slot ``dst``."""

    def release(self, slot: int) -> None:
        """The request in ``slot`` left; default: nothing to keep."""

    def settle(self, slots: Sequence[int]) -> None:
        """End of an engine phase for ``slots`` (their tokens went out); default: nothing deferred."""

    def observe(self, slot: int, conf_logits: Sequence[float], verified: int, accepted: int) -> None:
        """This proposer's last proposal for ``slot`` was verified: the raw confidence logits of
        its drafts, how many of them were verified and how many accepted (for online
        calibration); default: nothing learnt."""

    @abstractmethod
    def cost(self) -> ProposerCost:
        """Seconds of work per drafted step (for the drafting gate and the scheduler)."""
