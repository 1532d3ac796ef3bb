"""The loss steps of the drafter kinds: one training batch -> the loss terms (training/loss.py).

A step samples where to score (random anchors inside each record's answer), runs the model's
training forward there, and scores the outputs against the labels and the target's
next-token distribution at the positions the *model* says each output predicts
(``label_positions``): no step shifts labels by hand. The registry (training/algorithms.py)
names each algorithm's step.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from .config import RunConfig
from .loss import LossTerms, TargetDist, block_loss, eagle_loss, target_dist, target_dist_from_lse

__all__ = ["Batch", "LossStep", "sample_anchors", "block_step", "eagle_step", "labels_at", "target_at",
           "draft_ids_of"]


@dataclass
class Batch:
    tokens: torch.Tensor  # [N, T]
    aux: torch.Tensor  # [N, T, m*d]
    last: torch.Tensor  # [N, T, d]
    lengths: torch.Tensor  # [N]
    prompt_lens: torch.Tensor  # [N]
    lse: torch.Tensor | None = None  # [N, T] target log-normalizers (a cache with target stats)
    argmax: torch.Tensor | None = None  # [N, T] the target's greedy tokens there


def sample_anchors(b: Batch, blocks: int, gen: torch.Generator) -> torch.Tensor:
    """Random anchors per sequence in [prompt_len - 1, length - 2]: every block predicts answer tokens."""
    lo = (b.prompt_lens - 1).clamp(min=0).cpu()
    hi = (b.lengths - 2).clamp(min=0).cpu()
    span = (hi - lo + 1).clamp(min=1)
    u = torch.rand(len(lo), blocks, generator=gen)
    return (lo.unsqueeze(1) + (u * span.unsqueeze(1)).long().clamp(max=span.unsqueeze(1) - 1)).clamp(min=0).to(b.tokens.device)


def block_step(model: nn.Module, core: nn.Module, b: Batch, cfg: RunConfig, gen: torch.Generator) -> LossTerms:
    """DSpark / DFlash loss on random anchor blocks."""
    anchors = sample_anchors(b, cfg.train.blocks_per_seq, gen)  # [N, nb]
    out = model(b.aux, b.tokens, anchors)
    labels, valid, target = labels_at(core, b, core.label_positions(anchors))  # [N, nb, K]
    lc = cfg.algo.loss
    return block_loss(out.logits, target, labels, valid, out.conf_logits,
                      lc.ce_weight, lc.l1_weight, lc.conf_weight, lc.gamma, draft_ids_of(core))


def eagle_step(model: nn.Module, core: nn.Module, b: Batch, cfg: RunConfig, gen: torch.Generator) -> LossTerms:
    """Eagle3 soft-CE with training-time test over ``ttt_steps`` unrolled steps."""
    S = cfg.algo.loss.ttt_steps
    # score the same number of positions as the block drafters see: blocks_per_seq * K
    n_pos = min(cfg.train.blocks_per_seq * core.cfg.block_size, b.tokens.shape[1])
    entries = core.entries_for(sample_anchors(b, n_pos, gen))  # [N, P]
    h = model(b.aux, b.tokens, S, entries)  # [S, N, P, d]
    _, valid, target = labels_at(core, b, core.label_positions(entries, S), row_axis=1)  # [S, N, P]
    return eagle_loss(core.draft_head(h), target, valid, cfg.algo.loss.step_decay, draft_ids_of(core))


def labels_at(core: nn.Module, b: Batch, pred: torch.Tensor, row_axis: int = 0
              ) -> tuple[torch.Tensor, torch.Tensor, TargetDist]:
    """Predicted token positions ``pred`` (a drafter's ``label_positions``: [N, nb, K] for a block
    drafter, [S, N, P] for Eagle3; ``row_axis`` is the batch row's axis) -> (labels, valid, the
    target's next-token distribution there), each shaped like ``pred``. Valid: an answer token
    (inside the record, past its prompt)."""
    N, T = b.tokens.shape
    shape = [1] * pred.dim()
    shape[row_axis] = N
    valid = (pred < b.lengths.view(shape)) & (pred >= b.prompt_lens.view(shape))
    safe = pred.clamp(max=T - 1)
    rows = torch.arange(N, device=pred.device).view(shape)
    labels = b.tokens[rows.expand_as(safe), safe]
    return labels, valid, target_at(core, b, rows, safe - 1)


@torch.no_grad()
def target_at(core: nn.Module, b: Batch, rows: torch.Tensor, pos: torch.Tensor) -> TargetDist:
    """The target's next-token distribution from the batch's final hidden states [N, T, d] at
    (``rows``, ``pos``) (broadcast together; any shape), over the drafter's vocabulary.

    Computed once per distinct (row, position) and gathered: overlapping blocks (and Eagle3's
    unrolled steps) predict the same positions, and the LM head over the full vocabulary plus
    its softmax is the largest cost of a CPU training step. With a draft vocabulary and the
    cache's target stats only the draft ids' rows of the LM head are needed (8,192 of 49,152
    on SmolLM2)."""
    N, T, d = b.last.shape
    flat = (rows * T + pos).reshape(-1)
    uniq, inverse = torch.unique(flat, return_inverse=True)
    hidden = b.last.reshape(N * T, d).index_select(0, uniq).to(core.lm_head.weight.dtype)
    ids = draft_ids_of(core)
    if ids is not None and b.lse is not None:
        # float32 logits: they are normalized by a float32 lse, not by their own softmax
        with torch.autocast(hidden.device.type, enabled=False):
            logits = F.linear(hidden.float(), core.draft_head.weight.float())
        dist = target_dist_from_lse(logits, b.lse.reshape(-1)[uniq], b.argmax.reshape(-1)[uniq])
    else:
        dist = target_dist(core.lm_head(hidden), ids)
    return dist.take(inverse.view(torch.broadcast_shapes(rows.shape, pos.shape)))


def draft_ids_of(drafter: nn.Module) -> torch.Tensor | None:
    return drafter.draft_ids if drafter.cfg.draft_vocab_size else None


# (the model as wrapped for training, the drafter itself, a batch, the run config, the step's
# generator) -> the loss terms; ``heldout_estimates`` runs the same step without gradients
LossStep = Callable[[nn.Module, nn.Module, Batch, RunConfig, torch.Generator], LossTerms]
