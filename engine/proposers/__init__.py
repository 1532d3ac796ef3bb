"""Drafting methods behind one interface (``base.Proposer``).

- ``NullProposer`` (``null.py``): no drafts; target-only decoding.
- ``NeuralProposer`` (``neural.py``): the trained DSpark / DFlash / Eagle3 drafters, owning
  their lazy context backlog.
- ``SuffixProposer`` (``suffix.py``): suffix-match drafts over the request's own text and a
  bounded shared index of recent outputs (``suffix_index.py``), no training.

``registry.py`` builds them by name; ``stats.py`` holds the one ``accept_len`` definition and the typed ``EngineStats``.
"""
from .base import DraftBatch, Proposer, ProposerCost
from .neural import NeuralProposer
from .null import NullProposer
from .registry import PROPOSERS, UnknownProposerError, build_proposer, build_proposers
from .stats import EngineStats, ProposerStats, accept_len, accept_len_of_rounds
from .suffix import SCOPES, SuffixConfig, SuffixProposer
from .suffix_index import SuffixIndex

__all__ = ["DraftBatch", "Proposer", "ProposerCost", "NullProposer", "NeuralProposer", "SuffixProposer",
           "SuffixConfig", "SuffixIndex", "SCOPES", "EngineStats", "ProposerStats", "accept_len",
           "accept_len_of_rounds", "PROPOSERS", "UnknownProposerError", "build_proposer", "build_proposers"]

