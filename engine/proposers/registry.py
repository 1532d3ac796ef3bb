"""Building proposers by name: the one place that maps a configured method to its class.

Names: ``none`` (target-only), ``neural`` (the trained drafter of the engine directory:
DSpark, DFlash or Eagle3, whichever the checkpoint holds), ``suffix`` (no training;
``SuffixConfig`` settings). A hybrid engine builds several (e.g. ``["suffix", "neural"]``).
"""
from __future__ import annotations

from typing import Sequence

from .base import Proposer
from .neural import NeuralProposer
from .null import NullProposer
from .suffix import SuffixConfig, SuffixProposer

__all__ = ["PROPOSERS", "UnknownProposerError", "build_proposer", "build_proposers"]

PROPOSERS = ("none", "neural", "suffix")


class UnknownProposerError(ValueError):
    """A proposer name that is not registered; the message lists the known ones."""


def build_proposer(name: str, *, max_slots: int, drafter=None, sps=None,
                   sts_temperatures: Sequence[float] | None = None, suffix: SuffixConfig | None = None) -> Proposer:
    """One proposer: ``drafter`` (and its ``sps`` / ``sts_temperatures``) for ``neural``,
    ``suffix`` (and ``sts_temperatures``, its own) for ``suffix``."""
    if name == "none":
        return NullProposer()
    if name == "neural":
        if drafter is None:
            raise ValueError("the neural proposer needs a drafter checkpoint (build one with scripts/build_engine.sh)")
        return NeuralProposer(drafter, max_slots, sps=sps, sts_temperatures=sts_temperatures)
    if name == "suffix":
        return SuffixProposer(suffix, sts_temperatures=sts_temperatures)
    raise UnknownProposerError(f"unknown proposer {name!r}; known: {', '.join(PROPOSERS)}")


def build_proposers(names: Sequence[str], **kwargs) -> list[Proposer]:
    """Several proposers, refusing duplicates (a hybrid engine drafts with each once)."""
    if len(set(names)) != len(names):
        raise ValueError(f"proposer names must be distinct, got {list(names)}")
    return [build_proposer(n, **kwargs) for n in names]
