"""Training losses. All position-weighted by ``w_k = exp(-(k-1)/gamma)``, k = 1..K.

DSpark: ``ce_weight * CE(corrected logits, x*) + l1_weight * ||p_d - p_t||_1 +
conf_weight * BCE(c_k, c*_k)`` with the confidence target
``c*_k = clamp(1 - 0.5 * ||p_d - p_t||_1, 0, 1)`` (the total-variation acceptance
probability), detached. The L1 term is *not* halved. DFlash: CE only. Eagle3: soft CE
against the target distribution, step k weighted ``step_decay**k``.

With a draft vocabulary (``draft_ids``, training/draft_vocab.py) the drafter's logits cover
those ids only; the target's probability outside them counts fully in the L1 distance (the
drafter puts no mass there), and cross-entropy skips labels outside them.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


def position_weights(K: int, gamma: float, device=None) -> torch.Tensor:
    """w_k = exp(-(k-1)/gamma) for k = 1..K."""
    return torch.exp(-torch.arange(K, dtype=torch.float32, device=device) / gamma)


def confidence_target(p_d: torch.Tensor, p_t: torch.Tensor, outside: torch.Tensor | None = None) -> torch.Tensor:
    """c* = clamp(1 - 0.5 * ||p_d - p_t||_1, 0, 1), detached. [..., V] -> [...]; ``outside``:
    target mass beyond the draft vocabulary (part of the L1 distance)."""
    return (1.0 - 0.5 * l1_distance(p_d, p_t, outside)).clamp(0.0, 1.0).detach()


def l1_distance(p_d: torch.Tensor, p_t: torch.Tensor, outside: torch.Tensor | None = None) -> torch.Tensor:
    """||p_d - p_t||_1 over the last axis, plus the target mass outside the draft vocabulary."""
    l1 = (p_d - p_t).abs().sum(-1)
    return l1 if outside is None else l1 + outside


@dataclass
class TargetDist:
    """The target's next-token distribution as the losses need it, over the draft vocabulary.

    Built once per distinct predicted position (``target_dist``) and gathered per draft slot
    (``take``): blocks that overlap predict the same positions, and the full-vocabulary softmax
    is the costliest part of a training step on CPU."""
    p_t: torch.Tensor  # [..., N] target probabilities at the draft ids (N = V without a draft vocabulary)
    outside: torch.Tensor | None  # [...] target mass outside the draft ids (None: full vocabulary)
    argmax: torch.Tensor  # [...] the target's greedy token (a target id)

    def take(self, index: torch.Tensor) -> "TargetDist":
        """Rows ``index`` (any shape, into the leading axis of a flat TargetDist)."""
        return TargetDist(self.p_t[index], None if self.outside is None else self.outside[index], self.argmax[index])


def target_dist(target_logits: torch.Tensor, draft_ids: torch.Tensor | None) -> TargetDist:
    """target_logits [..., V] -> their TargetDist over ``draft_ids`` (all ids when None)."""
    p_t = F.softmax(target_logits.float(), dim=-1)
    argmax = target_logits.argmax(-1)
    if draft_ids is None:
        return TargetDist(p_t, None, argmax)
    p_in = p_t.index_select(-1, draft_ids)
    return TargetDist(p_in, (1.0 - p_in.sum(-1)).clamp(min=0.0), argmax)


def target_dist_from_lse(draft_logits: torch.Tensor, lse: torch.Tensor, argmax: torch.Tensor) -> TargetDist:
    """The same TargetDist from the target's logits at the draft ids only, [..., N], its full-vocabulary
    log-normalizer ``lse`` [...] and greedy token ``argmax`` [...] (a feature cache's target stats)."""
    p_in = torch.exp(draft_logits.float() - lse.float().unsqueeze(-1))
    return TargetDist(p_in, (1.0 - p_in.sum(-1)).clamp(min=0.0), argmax)


@dataclass
class LabelView:
    """Labels seen from the draft vocabulary."""
    labels: torch.Tensor  # [...] labels as draft indices (clamped into range)
    in_vocab: torch.Tensor  # [...] bool, the label is a draft id


def label_view(labels: torch.Tensor, draft_ids: torch.Tensor | None) -> LabelView:
    """labels [...] target ids (negative = none) -> draft indices and whether each is a draft id."""
    labels = labels.clamp(min=0)
    if draft_ids is None:
        return LabelView(labels, torch.ones_like(labels, dtype=torch.bool))
    idx = torch.searchsorted(draft_ids, labels).clamp(max=draft_ids.numel() - 1)
    return LabelView(idx, draft_ids[idx] == labels)


def _argmax_ids(logits: torch.Tensor, draft_ids: torch.Tensor | None) -> torch.Tensor:
    """The drafter's greedy token as a target id."""
    top = logits.argmax(-1)
    return top if draft_ids is None else draft_ids[top]


@dataclass
class LossTerms:
    total: torch.Tensor
    ce: torch.Tensor
    l1: torch.Tensor
    conf: torch.Tensor
    accept_est: torch.Tensor  # [K] mean c* per position: expected per-position acceptance
    top1_match: torch.Tensor  # [K] argmax(p_d) == argmax(p_t) per position


def _weighted_mean(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return (x * w).sum() / w.sum().clamp(min=1e-8)


def block_loss(logits: torch.Tensor, target: torch.Tensor | TargetDist, labels: torch.Tensor, valid: torch.Tensor,
               conf_logits: torch.Tensor | None, ce_weight: float, l1_weight: float, conf_weight: float,
               gamma: float, draft_ids: torch.Tensor | None = None) -> LossTerms:
    """logits [..., K, N] (N = V without a draft vocabulary); target: the target's logits
    [..., K, V] or their ``TargetDist`` already shaped [..., K]; labels (target ids) / valid
    [..., K]; conf_logits [..., K] or None."""
    K = logits.shape[-2]
    tgt = target if isinstance(target, TargetDist) else target_dist(target, draft_ids)
    w = position_weights(K, gamma, logits.device) * valid.float()  # [..., K]
    logp_d = F.log_softmax(logits.float(), dim=-1)
    p_d = logp_d.exp()
    lab = label_view(labels, draft_ids)
    ce = -logp_d.gather(-1, lab.labels.unsqueeze(-1)).squeeze(-1)
    l1_tok = l1_distance(p_d, tgt.p_t, tgt.outside)
    c_star = confidence_target(p_d, tgt.p_t, tgt.outside)
    ce_m = _weighted_mean(ce, w * lab.in_vocab.float())
    l1_m = _weighted_mean(l1_tok, w)
    conf_m = logits.new_zeros(())
    if conf_logits is not None:
        bce = F.binary_cross_entropy_with_logits(conf_logits.float(), c_star, reduction="none")
        conf_m = _weighted_mean(bce, w)
    total = ce_weight * ce_m + l1_weight * l1_m + conf_weight * conf_m
    vf = valid.float().reshape(-1, K)
    denom = vf.sum(0).clamp(min=1)
    accept_est = (c_star.reshape(-1, K) * vf).sum(0) / denom
    match = (_argmax_ids(logits, draft_ids) == tgt.argmax).float().reshape(-1, K)
    top1 = (match * vf).sum(0) / denom
    return LossTerms(total=total, ce=ce_m.detach(), l1=l1_m.detach(), conf=conf_m.detach(),
                     accept_est=accept_est.detach(), top1_match=top1.detach())


def eagle_loss(step_logits: torch.Tensor, target: torch.Tensor | TargetDist, valid: torch.Tensor,
               step_decay: float, draft_ids: torch.Tensor | None = None) -> LossTerms:
    """Soft CE per unrolled step: step_logits [S, N, T, n] over the draft vocabulary; target:
    the target's logits [S, N, T, V] or their ``TargetDist`` shaped [S, N, T]; valid [S, N, T]."""
    S = step_logits.shape[0]
    tgt = target if isinstance(target, TargetDist) else target_dist(target, draft_ids)
    logp_d = F.log_softmax(step_logits.float(), dim=-1)
    soft_ce = -(tgt.p_t * logp_d).sum(-1)  # [S, N, T]
    vf = valid.float()
    per_step = (soft_ce * vf).sum((1, 2)) / vf.sum((1, 2)).clamp(min=1)
    weights = step_decay ** torch.arange(S, dtype=torch.float32, device=step_logits.device)
    total = (weights * per_step).sum() / weights.sum()
    c_star = confidence_target(logp_d.exp(), tgt.p_t, tgt.outside)
    accept_est = (c_star * vf).sum((1, 2)) / vf.sum((1, 2)).clamp(min=1)
    match = (_argmax_ids(step_logits, draft_ids) == tgt.argmax).float()
    top1 = (match * vf).sum((1, 2)) / vf.sum((1, 2)).clamp(min=1)
    zero = total.new_zeros(())
    return LossTerms(total=total, ce=total.detach(), l1=zero, conf=zero,
                     accept_est=accept_est.detach(), top1_match=top1.detach())
