"""Acceptance statistics: one ``accept_len`` definition and a typed per-engine stats object.

``accept_len`` = mean over verify rounds of (accepted drafts + 1): the recovered or bonus
token every round emits counts, so target-only decoding scores exactly 1.0. A round is one
request's verify step (a batch step of R requests is R rounds). From totals that is
``(accepted + rounds) / rounds``; ``accept_len_of_rounds`` is the same from a per-round list
(``dspark.training.metrics.accept_len`` computes the same value from that list).

``EngineStats`` replaces the engine's stats dict: counters plus a ``ProposerStats`` per
proposer (rounds, drafts verified, accepted, by position), so a hybrid run reports accepted
per round by proposer, and the host time of each engine phase (``PHASES``), so a run reports
where its steps went. ``as_dict`` gives the legacy keys; ``since`` the difference to an
earlier ``snapshot`` (what a benchmark measured over its run).
"""
from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Sequence

__all__ = ["accept_len", "accept_len_of_rounds", "ProposerStats", "EngineStats", "PHASES"]

# The engine's timed phases: "step" (whole steps), and within them "prefill" (prompt chunks that run
# outside a verify pass, and committing every chunk), "neural" and "suffix" (the proposers' drafting),
# "verify" (the target pass, with any prompt chunks fused into it, and the verify rule). What a step
# spends outside them is host work: admission, gates, scheduling, commits, emitting tokens. Wall
# time on the host: on an accelerator, queued work counts in the phase that waits for it.
PHASES = ("step", "prefill", "neural", "suffix", "verify")


def accept_len(accepted: int, rounds: int) -> float | None:
    """Mean tokens emitted per verify round, ``(accepted + rounds) / rounds``; None before any round."""
    if rounds < 0 or accepted < 0:
        raise ValueError(f"need accepted >= 0 and rounds >= 0, got {accepted}, {rounds}")
    return (accepted + rounds) / rounds if rounds else None


def accept_len_of_rounds(accepted_per_round: Sequence[int]) -> float | None:
    """``accept_len`` from each round's accepted drafts (bonus not counted)."""
    acc = [int(a) for a in accepted_per_round]
    return accept_len(sum(acc), len(acc))


def _add_at(hist: list[int], i: int, n: int = 1) -> None:
    if i >= len(hist):
        hist.extend([0] * (i + 1 - len(hist)))
    hist[i] += n


@dataclass
class ProposerStats:
    """Verify rounds whose drafts came from one proposer."""

    rounds: int = 0  # request rounds (a row that verified 0 drafts counts: it emitted one token)
    drafted: int = 0  # drafts verified
    accepted: int = 0  # drafts accepted (bonus / recovered not counted)
    accepted_per_position: list[int] = field(default_factory=list)  # [k]: rounds whose draft k (0-based) was accepted
    verify_len_hist: list[int] = field(default_factory=list)  # [l]: rounds that verified l drafts

    def record(self, verify_len: int, accepted: int) -> None:
        if not 0 <= accepted <= verify_len:
            raise ValueError(f"accepted must lie in [0, verify_len={verify_len}], got {accepted}")
        self.rounds += 1
        self.drafted += verify_len
        self.accepted += accepted
        _add_at(self.verify_len_hist, verify_len)
        for k in range(accepted):
            _add_at(self.accepted_per_position, k)

    @property
    def accept_len(self) -> float | None:
        return accept_len(self.accepted, self.rounds)

    @property
    def accepted_per_round(self) -> float | None:
        return self.accepted / self.rounds if self.rounds else None

    def since(self, earlier: "ProposerStats") -> "ProposerStats":
        def diff(a: list[int], b: list[int]) -> list[int]:
            return [x - (b[i] if i < len(b) else 0) for i, x in enumerate(a)]
        return ProposerStats(self.rounds - earlier.rounds, self.drafted - earlier.drafted,
                             self.accepted - earlier.accepted,
                             diff(self.accepted_per_position, earlier.accepted_per_position),
                             diff(self.verify_len_hist, earlier.verify_len_hist))


@dataclass
class EngineStats:
    """Counters of one engine over its lifetime (``snapshot`` / ``since`` for a window)."""

    steps: int = 0  # engine steps
    decode_steps: int = 0  # steps that ran a verify batch (the legacy dict's "rounds")
    emitted_tokens: int = 0  # tokens sent to requests (prefill's first tokens included)
    skipped_draft_steps: int = 0  # decode steps the drafting gate ran without drafts
    total: ProposerStats = field(default_factory=ProposerStats)  # every request round
    by_proposer: dict[str, ProposerStats] = field(default_factory=dict)
    # host wall seconds by engine phase (PHASES): "step" the whole steps, the others parts of them
    seconds: dict[str, float] = field(default_factory=lambda: dict.fromkeys(PHASES, 0.0))

    def record_round(self, proposer: str, verify_len: int, accepted: int) -> None:
        """One request's verify round with drafts from ``proposer`` (the null proposer's name for none)."""
        self.total.record(verify_len, accepted)
        self.by_proposer.setdefault(proposer, ProposerStats()).record(verify_len, accepted)

    @property
    def rounds(self) -> int:
        """Request rounds (the legacy dict's "batch_size_sum")."""
        return self.total.rounds

    @property
    def accept_len(self) -> float | None:
        return self.total.accept_len

    def snapshot(self) -> "EngineStats":
        return copy.deepcopy(self)

    def since(self, earlier: "EngineStats") -> "EngineStats":
        empty = ProposerStats()
        return EngineStats(
            steps=self.steps - earlier.steps, decode_steps=self.decode_steps - earlier.decode_steps,
            emitted_tokens=self.emitted_tokens - earlier.emitted_tokens,
            skipped_draft_steps=self.skipped_draft_steps - earlier.skipped_draft_steps,
            total=self.total.since(earlier.total),
            by_proposer={k: v.since(earlier.by_proposer.get(k, empty)) for k, v in self.by_proposer.items()},
            seconds={k: v - earlier.seconds.get(k, 0.0) for k, v in self.seconds.items()})

    def __getitem__(self, key: str):
        """The legacy dict's view: ``stats["accepted_tokens"]`` is ``as_dict()["accepted_tokens"]``."""
        return self.as_dict()[key]

    def as_dict(self, max_drafts: int | None = None) -> dict:
        """The legacy stats dict's keys (engine/runtime.py before the typed stats)."""
        K = max_drafts if max_drafts is not None else max(len(self.total.verify_len_hist) - 1, 0)
        per_pos = (self.total.accepted_per_position + [0] * max(K, 1))[:max(K, 1)]
        hist = (self.total.verify_len_hist + [0] * (K + 1))[:K + 1]
        return {"steps": self.steps, "rounds": self.decode_steps, "draft_tokens": self.total.drafted,
                "accepted_tokens": self.total.accepted, "emitted_tokens": self.emitted_tokens,
                "accepted_per_position": per_pos, "verify_len_hist": hist,
                "batch_size_sum": self.total.rounds, "skipped_draft_steps": self.skipped_draft_steps}
