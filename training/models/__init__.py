"""Draft models, and how a run config + a loaded target become one.

Which class an algorithm builds is its registry entry's (training/algorithms.py); that module
imports these models, so it is imported here only when a drafter is built.
"""
from __future__ import annotations

from torch import nn

from .block_drafter import BlockDrafter, BlockOutput, DrafterConfig, Proposal
from .eagle3 import Eagle3Drafter

__all__ = ["BlockDrafter", "BlockOutput", "DrafterConfig", "Eagle3Drafter", "Proposal", "DRAFTERS",
           "drafter_config_for", "draft_layers_for", "layer_style_for", "check_target_family",
           "build_drafter"]


def __getattr__(name: str):
    if name == "DRAFTERS":  # {algorithm name: model class}, a view of the registry
        from ..algorithms import REGISTRY
        return {a.name: a.model for a in REGISTRY}
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def drafter_config_for(run_cfg, target) -> DrafterConfig:
    """Derive the drafter's architecture from the run config and the loaded target: the profile's
    features as configured (the registry refuses a feature the algorithm's kind cannot carry)."""
    from ..algorithms import algorithm

    algo = run_cfg.algo
    algorithm(algo.algo).check(algo)
    check_target_family(target)
    return DrafterConfig(
        algo=algo.algo,
        hidden_size=target.hidden_size,
        vocab_size=target.vocab_size,
        num_aux_layers=len(target.profile.layer_ids),
        num_layers=draft_layers_for(run_cfg),
        block_size=run_cfg.target.block_size,
        mask_token_id=run_cfg.target.mask_token_id,
        markov_head=algo.markov_head,
        markov_rank=run_cfg.target.markov_rank,
        confidence_head=bool(algo.confidence_head),
        draft_vocab_size=run_cfg.target.draft_vocab if run_cfg.target.draft_vocab < target.vocab_size else 0,
        layer_style=layer_style_for(run_cfg),
    )


def check_target_family(target) -> None:
    """Refuse a target whose architecture is not the family its profile was written for
    (``target.family``): the profile's layer ids, mask token and stop tokens are that family's.
    A family matches its own model type and that type's variants (``qwen3`` matches ``qwen3_moe``,
    ``gemma3`` matches ``gemma3_text``)."""
    family = target.profile.family
    model_type = str(getattr(target.config, "model_type", ""))
    if model_type != family and not model_type.startswith(family + "_"):
        from ..config import ConfigError
        raise ConfigError(f"target profile {target.profile.name!r} is for the {family!r} family, but its model is "
                          f"a {model_type!r}: use that family's profile (configs/targets/) or set target.family")


def layer_style_for(run_cfg) -> str:
    """The algorithm profile's layer style when it sets one, else the target profile's."""
    style = run_cfg.algo.layer_style
    return run_cfg.target.layer_style if style is None else style


def draft_layers_for(run_cfg) -> int:
    """The algorithm's own depth when its profile sets one, else the target profile's."""
    n = run_cfg.algo.draft_layers
    return run_cfg.target.draft_layers if n is None else n


def build_drafter(cfg: DrafterConfig, target) -> nn.Module:
    """The registered algorithm's model for ``cfg`` over ``target``'s frozen embedding and LM head."""
    from ..algorithms import algorithm

    return algorithm(cfg.algo).model(cfg, target.config, target.embed_tokens, target.lm_head)

