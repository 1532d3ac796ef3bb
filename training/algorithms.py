"""The drafting algorithms the kit trains: YAML profiles plus one small, immutable registry.

An algorithm is data first. ``configs/algos/<name>.yaml`` gives its drafter ``kind`` and
switches its features on or off (``markov_head``, ``confidence_head``, depth, layer style,
loss weights): DFlash is the block drafter with both heads off, not a special case. Its entry
here names what code it runs:

- ``model``: the drafter class (training/models/), built from the run's ``DrafterConfig``;
- ``loss_step``: its training step (training/loss_steps.py);
- ``proposer``: the name of the engine proposer that drafts with it (a string: training never
  imports the engine);
- ``exports``: the formats ``dspark build`` may write for it (:data:`EXPORT_FORMATS`).

Every question "what does this algorithm do" is answered by its entry or its profile; nothing
else in the kit compares algorithm names. A new algorithm of an existing kind is one YAML file
and one line in :data:`BUILTIN` (``for_kind``); a new kind adds its model and loss step to
:data:`KINDS` (docs/algorithms.md).
"""
from __future__ import annotations

from dataclasses import dataclass
from types import MappingProxyType
from typing import Iterator

from torch import nn

from .config import AlgoConfig, ConfigError
from .loss_steps import LossStep, block_step, eagle_step
from .models.block_drafter import BlockDrafter
from .models.eagle3 import Eagle3Drafter

__all__ = ["Algorithm", "Registry", "KINDS", "EXPORT_FORMATS", "BUILTIN", "REGISTRY", "for_kind", "algorithm",
           "from_profile"]

# what ``dspark build`` can write (engine/export/builder.py): the block-drafter ONNX step and the
# TensorRT engine built from it, TensorRT-LLM's DSpark options, and the two HF checkpoint layouts
EXPORT_FORMATS = ("onnx", "trt", "trtllm", "dspark-hf", "eagle3-hf")


@dataclass(frozen=True)
class Kind:
    """What every drafter of one kind shares: its model, its loss step, what it exports, and
    whether it can carry DSpark's Markov and confidence heads."""
    model: type[nn.Module]
    loss_step: LossStep
    exports: tuple[str, ...]
    heads: bool


KINDS: MappingProxyType[str, Kind] = MappingProxyType({
    # one parallel pass drafts a block; DSpark's heads optional (off: DFlash)
    "block": Kind(BlockDrafter, block_step, ("onnx", "trt", "trtllm", "dspark-hf"), heads=True),
    # drafts one token per step from its own hidden state (Eagle3)
    "autoregressive": Kind(Eagle3Drafter, eagle_step, ("eagle3-hf",), heads=False),
})


@dataclass(frozen=True)
class Algorithm:
    name: str  # the profile's ``algo`` and the ``algo`` recorded in drafter.json
    kind: str  # a key of KINDS
    model: type[nn.Module]
    loss_step: LossStep
    proposer: str  # the engine proposer that drafts with this drafter
    exports: tuple[str, ...]  # formats of EXPORT_FORMATS
    heads: bool  # may carry the Markov / confidence heads

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"algorithm {self.name!r}: kind must be one of {', '.join(KINDS)}, got {self.kind!r}")
        unknown = sorted(set(self.exports) - set(EXPORT_FORMATS))
        if unknown:
            raise ValueError(f"algorithm {self.name!r}: unknown export formats {unknown}; known: "
                             f"{', '.join(EXPORT_FORMATS)}")

    def check(self, algo: AlgoConfig) -> None:
        """Refuse a profile this algorithm cannot build as configured (a feature is never dropped)."""
        if algo.kind != self.kind:
            raise ConfigError(f"algo.kind={algo.kind!r}, but {self.name} drafters are {self.kind!r}")
        if not self.heads and (algo.markov_head != "none" or algo.confidence_head):
            raise ConfigError(f"algo.markov_head={algo.markov_head!r}, algo.confidence_head={algo.confidence_head}: "
                              f"{self.name} ({self.kind}) drafters have no Markov or confidence head; set "
                              "algo.markov_head=none algo.confidence_head=false")

    def supports(self, fmt: str) -> bool:
        return fmt in self.exports


def for_kind(name: str, kind: str, proposer: str = "neural") -> Algorithm:
    """The entry of an algorithm that is a profile of the drafter kind ``kind``."""
    if kind not in KINDS:
        raise ConfigError(f"algorithm {name!r}: kind must be one of {', '.join(KINDS)}, got {kind!r}")
    k = KINDS[kind]
    return Algorithm(name=name, kind=kind, model=k.model, loss_step=k.loss_step, proposer=proposer,
                     exports=k.exports, heads=k.heads)


class Registry:
    """An immutable set of algorithms by name; duplicates are refused, and an unknown name's
    error lists the known ones. ``with_entries`` returns a new registry."""

    def __init__(self, entries: tuple[Algorithm, ...]):
        by_name: dict[str, Algorithm] = {}
        for e in entries:
            if e.name in by_name:
                raise ValueError(f"algorithm {e.name!r} registered twice")
            by_name[e.name] = e
        self._by_name = MappingProxyType(by_name)

    def get(self, name: str) -> Algorithm:
        try:
            return self._by_name[name]
        except KeyError:
            raise ConfigError(f"unknown algorithm {name!r}; known: {', '.join(self._by_name)}") from None

    def names(self) -> tuple[str, ...]:
        return tuple(self._by_name)

    def with_entries(self, *entries: Algorithm) -> "Registry":
        return Registry(tuple(self._by_name.values()) + entries)

    def __contains__(self, name: object) -> bool:
        return name in self._by_name

    def __iter__(self) -> Iterator[Algorithm]:
        return iter(self._by_name.values())


BUILTIN: tuple[Algorithm, ...] = (
    for_kind("dspark", "block"),  # configs/algos/dspark.yaml: Markov + confidence heads
    for_kind("dflash", "block"),  # configs/algos/dflash.yaml: both heads off, CE only
    for_kind("eagle3", "autoregressive"),  # configs/algos/eagle3.yaml: training-time test
)
REGISTRY = Registry(BUILTIN)


def algorithm(name: str) -> Algorithm:
    """The registered algorithm ``name`` (a ConfigError listing the known ones otherwise)."""
    return REGISTRY.get(name)


def from_profile(algo: AlgoConfig) -> Algorithm:
    """The entry a profile describes by itself (its ``algo`` name and ``kind``): what
    :data:`BUILTIN` holds for a profile of an existing kind."""
    return for_kind(algo.algo, algo.kind)
