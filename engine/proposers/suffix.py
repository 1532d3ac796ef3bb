"""The suffix proposer: drafts copied from text already seen, no training.

Every slot has its own suffix index (``suffix_index.py``) over its request's prompt and
output so far; with ``scope="shared"`` there is also one shared index over the outputs of
recent requests (a ring: the last ``shared_max_outputs`` outputs, at most
``shared_max_tokens`` tokens; the oldest output is removed, its counts decremented, when a
new one would pass either bound). A finished request's output enters the shared index when
the engine releases its slot.

To propose for a slot, each index is matched against the slot's committed sequence: the
longest suffix of it (at least ``min_match`` tokens) that the index has seen followed by
something; the draft is then the most frequent continuation, token by token (backing off
to a shorter context where a path ends), up to ``max_drafts`` tokens. In the slot's own
index the match is where its last insertion ended (no search); in the shared index a
per-slot cursor advances with every committed token (amortised O(1)) and re-syncs from the
last ``max_depth`` tokens when the shared index changed (an output added or evicted).

Committed tokens are indexed lazily, when the slot is next looked up: a commit only records
them. The engine's suffix gate skips most rows' lookups at large batches, and an index
append right after the target's forward pass finds none of the slot's trie in cache (some
40 us per token on a 2-core host, against 4 us warm), while a lookup's catch-up appends a
run of tokens whose later ones find the nodes the first one brought in. A row that is not
looked up again before it finishes never pays for its last tokens. The drafts are the same
as with eager indexing: a lookup sees the index of the whole committed sequence.

Confidence of draft j: its empirical continuation probability ``n_c / n`` (``n_c`` times
the chosen token followed the context, ``n`` times anything did), smoothed by half a count
on each side so that a continuation seen once is not a certainty: the raw logit is
``log((n_c + 1/2) / (n - n_c + 1/2))``. How often such a draft survives verification is
another matter (a continuation seen twice in a text that repeats itself is not a 0.83
chance), so the proposer calibrates: with per-position STS temperatures ``T_j`` given
(``engine/sts.py``: ``fit_sts`` on replayed rounds; ``scripts/replay_suffix.py`` fits them)
the confidence is ``sigmoid(z / T_j)``; without them, online (``OnlineCalibration``): the
observed survival rate of this engine's verified drafts at the same position, matched depth
and raw-logit bin, shrunk towards coarser cells and ``sigmoid(z)`` while there are few; kept
apart for greedy and sampled rows (a point-mass draft survives a greedy verify iff it is the
target's argmax, a sampled one with the target's probability of it, which is lower), so a
server that mostly decodes greedily does not overrate the drafts of its sampled requests. Of the
two candidates (own, shared) the one with more expected accepted drafts (sum of cumulative
confidences) is proposed.

Drafts are point masses (``DraftBatch.probs`` is None): the proposal is a deterministic
function of the committed tokens, so verification with a one-hot draft distribution is
exact at any temperature (``base.py``). The online calibration only moves confidences, from
rounds already verified: a function of the committed history too, so it never makes a draft
decide its own verification (docs/runtime.md "Proposers and hybrid drafting").

Scopes, for multi-tenant servers: ``"shared"`` lets a request draft from other requests'
outputs (the output is still exactly the target's, but how fast it comes depends on what
other requests generated); ``"request"`` keeps every request to its own prompt and output.
"""
from __future__ import annotations

import bisect
import math
from collections import deque
from dataclasses import dataclass, field
from typing import Sequence

import torch

from .base import DraftBatch, Proposer, ProposerCost
from .suffix_index import ROOT, SuffixIndex, new_suffix_index

__all__ = ["SuffixConfig", "SuffixProposer", "OnlineCalibration", "continuation_logit", "SCOPES"]

SCOPES = ("shared", "request")


@dataclass(frozen=True)
class SuffixConfig:
    max_drafts: int = 7  # K: most drafts per round
    max_depth: int = 16  # D: longest context an index matches (tokens); memory is at most D nodes per token
    min_match: int = 2  # shortest matched context that may draft
    scope: str = "shared"  # shared | request (module docstring)
    shared_max_outputs: int = 256  # the shared ring keeps at most this many outputs ...
    shared_max_tokens: int = 65536  # ... and at most this many tokens
    # host seconds of one row's lookup (propose, with the indexing of its tokens since the last one), for
    # the suffix gate: what skipping a row saves. Priced above the native index's own time (about a third
    # of this on a 2-core Xeon): at that price lookups would run ungated up to 16 rows (`DraftGate.free_share`),
    # and at T=1, where their drafts mostly fail, gated lookups are faster (docs/benchmarks/decode_ab_probes.md)
    host_seconds_per_row: float = 1.5e-4
    native: bool = True  # the C++ index where it builds (suffix_index.py), else the Python one

    def __post_init__(self) -> None:
        if self.scope not in SCOPES:
            raise ValueError(f"suffix scope must be one of {SCOPES}, got {self.scope!r}")
        if self.max_drafts < 1:
            raise ValueError(f"max_drafts must be >= 1, got {self.max_drafts}")
        if self.max_depth < 2:
            raise ValueError(f"max_depth must be >= 2, got {self.max_depth}")
        if not 1 <= self.min_match < self.max_depth:
            raise ValueError(f"min_match must lie in [1, max_depth), got {self.min_match}")
        if self.shared_max_outputs < 1 or self.shared_max_tokens < 1:
            raise ValueError("shared_max_outputs and shared_max_tokens must be >= 1")
        if self.host_seconds_per_row < 0:
            raise ValueError(f"host_seconds_per_row must be >= 0, got {self.host_seconds_per_row}")


def continuation_logit(chosen: int, total: int) -> float:
    """Raw confidence logit of a continuation seen ``chosen`` of ``total`` times (half-count smoothing)."""
    return math.log((chosen + 0.5) / (total - chosen + 0.5))


class OnlineCalibration:
    """Survival of verified drafts by position, matched depth and raw logit, learnt from the rounds verified so far.

    A draft at position j is *tested* when every draft before it was accepted and it was
    verified. Tables count tested and survived drafts per (j, depth bin, raw-logit bin), the
    depth being how many tokens of context the draft was matched on (a continuation after a
    12-token match in a text that repeats itself survives far more often than one after 2
    tokens, at the same counts); their sums over depth bins are the (j, raw-logit bin) counts.
    The confidence of a draft is its own cell's rate shrunk towards the (j, logit bin) rate,
    that one shrunk towards ``sigmoid(z)``: ``c1 = (s1 + p sigmoid(z)) / (t1 + p)``,
    ``c = (s2 + p c1) / (t2 + p)``: ``sigmoid(z)`` until there is evidence, the observed rate of
    its own cell once there is plenty, its position's and logit's rate in between."""

    EDGES = (-1.0, 0.0, 0.5, 1.0, 1.5, 2.0, 2.5, 3.0)  # bin boundaries on the raw logit
    DEPTH_EDGES = (3, 5, 8, 12)  # bin boundaries on the matched depth (tokens)

    def __init__(self, positions: int, prior: float = 4.0) -> None:
        if positions < 1 or prior <= 0:
            raise ValueError(f"need positions >= 1 and prior > 0, got {positions}, {prior}")
        self.prior = prior
        bins, dbins = len(self.EDGES) + 1, len(self.DEPTH_EDGES) + 1
        self.tested_at = [[[0] * bins for _ in range(dbins)] for _ in range(positions)]  # [j][depth bin][logit bin]
        self.survived_at = [[[0] * bins for _ in range(dbins)] for _ in range(positions)]

    @property
    def tested(self) -> list[list[int]]:
        """Tested drafts per (position, raw-logit bin): the per-depth counts summed over depth bins."""
        return [[sum(col) for col in zip(*by_depth)] for by_depth in self.tested_at]

    @classmethod
    def _bin(cls, z: float) -> int:
        return bisect.bisect_right(cls.EDGES, z)

    @classmethod
    def _depth_bin(cls, depth: int) -> int:
        return bisect.bisect_right(cls.DEPTH_EDGES, depth)

    def confidence(self, z: float, j: int, depth: int) -> float:
        b, d, p = self._bin(z), self._depth_bin(depth), self.prior
        raw = 1.0 / (1.0 + math.exp(-z))
        tested = sum(row[b] for row in self.tested_at[j])
        survived = sum(row[b] for row in self.survived_at[j])
        pooled = (survived + p * raw) / (tested + p)
        return (self.survived_at[j][d][b] + p * pooled) / (self.tested_at[j][d][b] + p)

    def observe(self, logits: Sequence[float], depths: Sequence[int], verified: int, accepted: int) -> None:
        """One round: drafts ``0..accepted`` (within ``verified``) were tested, the first ``accepted`` survived."""
        for j in range(min(accepted + 1, verified, len(logits), len(depths), len(self.tested_at))):
            b, d, ok = self._bin(float(logits[j])), self._depth_bin(int(depths[j])), int(j < accepted)
            self.tested_at[j][d][b] += 1
            self.survived_at[j][d][b] += ok


@dataclass
class _Slot:
    own: SuffixIndex
    own_seq: int
    tokens: list[int]  # prompt + committed output
    prompt_len: int
    indexed: int  # tokens[:indexed] are in ``own`` (and the shared cursor has read them)
    shared_node: int = ROOT  # cursor: longest suffix of ``tokens`` in the shared index
    shared_version: int = -1  # the shared index's version the cursor is valid for
    proposed_depths: list[int] = field(default_factory=list)  # matched depths of the last proposal's drafts
    proposed_sampled: bool = False  # whether the last proposal was for a sampled (T > 0) row


@dataclass
class _Candidate:
    tokens: list[int] = field(default_factory=list)
    logits: list[float] = field(default_factory=list)
    confidence: list[float] = field(default_factory=list)
    depths: list[int] = field(default_factory=list)  # tokens of context each draft was matched on

    @property
    def expected_accepts(self) -> float:
        total, run = 0.0, 1.0
        for c in self.confidence:
            run *= c
            total += run
        return total


class SuffixProposer(Proposer):
    """Suffix-match drafting over the request's own text and a shared ring of recent outputs."""

    name = "suffix"
    needs_features = False

    def __init__(self, config: SuffixConfig | None = None, sts_temperatures: Sequence[float] | None = None) -> None:
        self.cfg = config or SuffixConfig()
        self.max_drafts = self.cfg.max_drafts
        self.temps: list[float] | None = None
        if sts_temperatures is not None:
            temps = [float(t) for t in sts_temperatures]
            if len(temps) < self.max_drafts or not all(math.isfinite(t) and t > 0 for t in temps):
                raise ValueError(f"need {self.max_drafts} finite STS temperatures > 0, got {temps}")
            self.temps = temps[: self.max_drafts]
        # online calibration when no STS temperatures are given: one for greedy rows, one for sampled ones
        self.calibrations = ((OnlineCalibration(self.max_drafts), OnlineCalibration(self.max_drafts))
                             if self.temps is None else None)
        self.shared = new_suffix_index(self.cfg.max_depth, self.cfg.native) if self.cfg.scope == "shared" else None
        self._ring: deque[int] = deque()  # shared sequence ids, oldest first
        self._slots: dict[int, _Slot] = {}

    # -- the slot cycle --------------------------------------------------------------------------
    def reset(self, slot: int, prompt: Sequence[int]) -> None:
        own = new_suffix_index(self.cfg.max_depth, self.cfg.native)
        tokens = [int(t) for t in prompt]
        self._slots[slot] = _Slot(own=own, own_seq=own.add_sequence(tokens), tokens=tokens, prompt_len=len(tokens),
                                 indexed=len(tokens))

    def commit(self, slot: int, tokens: Sequence[int], features: torch.Tensor | None = None) -> None:
        self._slots[slot].tokens.extend(int(t) for t in tokens)

    def commit_many(self, slots: Sequence[int], tokens: Sequence[Sequence[int]],
                    features: torch.Tensor | None = None, counts: Sequence[int] | None = None) -> None:
        """Every slot's committed tokens appended (indexed lazily, at its next lookup): one loop,
        not a call per slot, since a 64-row step commits every step."""
        known = self._slots
        for s, toks in zip(slots, tokens):
            known[s].tokens.extend(map(int, toks))

    def _catch_up(self, st: _Slot) -> None:
        """Index the tokens committed since the slot's last lookup (own index, shared cursor)."""
        new = st.tokens[st.indexed:]
        if not new:
            return
        st.own.extend(st.own_seq, new)
        st.indexed = len(st.tokens)
        if self.shared is not None and st.shared_version == self.shared.version:
            node = st.shared_node
            for t in new:
                node = self.shared.advance(node, t)
            st.shared_node = node

    def release(self, slot: int) -> None:
        st = self._slots.pop(slot, None)
        if st is not None and self.shared is not None and len(st.tokens) > st.prompt_len:
            self.add_shared(st.tokens[st.prompt_len:])

    def move(self, src: int, dst: int) -> None:
        self._slots[dst] = self._slots.pop(src)

    def cost(self) -> ProposerCost:
        return ProposerCost(per_row_s=self.cfg.host_seconds_per_row, on_device=False)

    def observe(self, slot: int, conf_logits: Sequence[float], verified: int, accepted: int) -> None:
        st = self._slots.get(slot)
        if self.calibrations is not None and st is not None:
            self.calibrations[st.proposed_sampled].observe(conf_logits, st.proposed_depths, verified, accepted)

    # -- the shared ring -----------------------------------------------------------------------------
    def add_shared(self, tokens: Sequence[int]) -> None:
        """Index one output in the shared ring, evicting the oldest past the bounds."""
        if self.shared is None:
            raise ValueError("this suffix proposer has request scope: there is no shared index")
        tokens = [int(t) for t in tokens][-self.cfg.shared_max_tokens:]
        while self._ring and (len(self._ring) >= self.cfg.shared_max_outputs
                              or self.shared.num_tokens + len(tokens) > self.cfg.shared_max_tokens):
            self.shared.remove(self._ring.popleft())
        self._ring.append(self.shared.add_sequence(tokens))

    def clear_shared(self) -> None:
        """Forget every output in the shared ring (a benchmark's warm-up, a tenant switch)."""
        if self.shared is not None:
            while self._ring:
                self.shared.remove(self._ring.popleft())

    @property
    def shared_outputs(self) -> int:
        return len(self._ring)

    # -- drafting ------------------------------------------------------------------------------------
    def _candidate(self, index: SuffixIndex, node: int, k: int, sampled: bool) -> _Candidate:
        toks, counts, totals, depths = index.draft(node, k, self.cfg.min_match)
        cand = _Candidate(tokens=toks, depths=depths)
        for j, (n_c, n) in enumerate(zip(counts, totals)):
            z = continuation_logit(n_c, n)
            cand.logits.append(z)
            if self.calibrations is not None:
                cand.confidence.append(self.calibrations[sampled].confidence(z, j, depths[j]))
            else:
                cand.confidence.append(1.0 / (1.0 + math.exp(-z / self.temps[j])))
        return cand

    def _shared_cursor(self, st: _Slot) -> int:
        if st.shared_version != self.shared.version:  # the index changed: a longer match, or a reused node id
            st.shared_node = self.shared.match(st.tokens)
            st.shared_version = self.shared.version
        return st.shared_node

    def propose_one(self, slot: int, k: int | None = None, sampled: bool = False) -> _Candidate:
        """The better of the own-text and shared-index candidates for one slot (up to ``k`` drafts),
        confidences calibrated for a greedy or a ``sampled`` row."""
        k = self.max_drafts if k is None else min(k, self.max_drafts)
        st = self._slots[slot]
        self._catch_up(st)
        best = self._candidate(st.own, st.own.last_node(st.own_seq), k, sampled)
        if self.shared is not None and self.shared.num_tokens:
            other = self._candidate(self.shared, self._shared_cursor(st), k, sampled)
            if other.expected_accepts > best.expected_accepts:
                best = other
        return best

    def propose(self, slots: Sequence[int], temperature: torch.Tensor | None = None, noise=None) -> DraftBatch:
        """Point-mass drafts for ``slots``; ``temperature`` [R] (None: all greedy) picks each row's
        calibration (``noise`` is not needed: the drafts are not sampled)."""
        K = self.max_drafts
        sampled = [False] * len(slots) if temperature is None else (temperature.cpu() > 0).tolist()
        tokens, logits, confidence, lens = [], [], [], []
        for s, hot in zip(slots, sampled):  # padded host lists, one tensor each at the end (not a write per row)
            cand = self.propose_one(s, sampled=hot)
            self._slots[s].proposed_depths = cand.depths
            self._slots[s].proposed_sampled = hot
            pad = [0] * (K - len(cand.tokens))
            lens.append(len(cand.tokens))
            tokens.append(cand.tokens + pad)
            logits.append(cand.logits + pad)
            confidence.append(cand.confidence + pad)
        R = len(slots)
        return DraftBatch(tokens=torch.tensor(tokens, dtype=torch.long).reshape(R, K),
                          lens=torch.tensor(lens, dtype=torch.long),
                          confidence=torch.tensor(confidence, dtype=torch.float32).reshape(R, K), probs=None,
                          conf_logits=torch.tensor(logits, dtype=torch.float32).reshape(R, K), source=self.name)
