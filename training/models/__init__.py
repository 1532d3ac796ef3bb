"""Draft models and the registry that builds them from a run config + a loaded target."""
from __future__ import annotations

from torch import nn

from .block_drafter import BlockDrafter, BlockOutput, DrafterConfig, Proposal
from .eagle3 import Eagle3Drafter

DRAFTERS: dict[str, type[nn.Module]] = {
    "dspark": BlockDrafter,
    "dflash": BlockDrafter,
    "eagle3": Eagle3Drafter,
}

__all__ = ["BlockDrafter", "BlockOutput", "DrafterConfig", "Eagle3Drafter", "Proposal", "DRAFTERS",
           "drafter_config_for", "draft_layers_for", "layer_style_for",
           "build_drafter"]


def drafter_config_for(run_cfg, target) -> DrafterConfig:
    """Derive the drafter's architecture from the run config and the loaded target."""
    algo = run_cfg.algo
    return DrafterConfig(
        algo=algo.algo,
        hidden_size=target.hidden_size,
        vocab_size=target.vocab_size,
        num_aux_layers=len(target.profile.layer_ids),
        num_layers=draft_layers_for(run_cfg),
        block_size=run_cfg.target.block_size,
        mask_token_id=run_cfg.target.mask_token_id,
        markov_head=algo.markov_head if algo.algo == "dspark" else "none",
        markov_rank=run_cfg.target.markov_rank,
        confidence_head=bool(algo.confidence_head) and algo.algo == "dspark",
        draft_vocab_size=run_cfg.target.draft_vocab if run_cfg.target.draft_vocab < target.vocab_size else 0,
        layer_style=layer_style_for(run_cfg),
    )


def layer_style_for(run_cfg) -> str:
    """The algorithm profile's layer style when it sets one, else the target profile's."""
    style = run_cfg.algo.layer_style
    return run_cfg.target.layer_style if style is None else style


def draft_layers_for(run_cfg) -> int:
    """The algorithm's own depth when its profile sets one, else the target profile's."""
    n = run_cfg.algo.draft_layers
    return run_cfg.target.draft_layers if n is None else n


def build_drafter(cfg: DrafterConfig, target) -> nn.Module:
    if cfg.algo not in DRAFTERS:
        raise ValueError(f"unknown drafter {cfg.algo!r}; known: {', '.join(sorted(DRAFTERS))}")
    return DRAFTERS[cfg.algo](cfg, target.config, target.embed_tokens, target.lm_head)
