"""Training losses. All position-weighted by ``w_k = exp(-(k-1)/gamma)``, k = 1..K.

DSpark: ``ce_weight * CE(corrected logits, x*) + l1_weight * ||p_d - p_t||_1 +
conf_weight * BCE(c_k, c*_k)`` with the confidence target
``c*_k = clamp(1 - 0.5 * ||p_d - p_t||_1, 0, 1)`` (the total-variation acceptance
probability), detached. The L1 term is *not* halved. DFlash: CE only. Eagle3: soft CE
against the target distribution, step k weighted ``step_decay**k``.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


def position_weights(K: int, gamma: float, device=None) -> torch.Tensor:
    """w_k = exp(-(k-1)/gamma) for k = 1..K."""
    return torch.exp(-torch.arange(K, dtype=torch.float32, device=device) / gamma)


def confidence_target(p_d: torch.Tensor, p_t: torch.Tensor) -> torch.Tensor:
    """c* = clamp(1 - 0.5 * ||p_d - p_t||_1, 0, 1), detached. [..., V] -> [...]."""
    return (1.0 - 0.5 * (p_d - p_t).abs().sum(-1)).clamp(0.0, 1.0).detach()


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


def block_loss(logits: torch.Tensor, target_logits: torch.Tensor, labels: torch.Tensor, valid: torch.Tensor,
               conf_logits: torch.Tensor | None, ce_weight: float, l1_weight: float, conf_weight: float,
               gamma: float) -> LossTerms:
    """logits/target_logits [..., K, V]; labels/valid [..., K]; conf_logits [..., K] or None."""
    K = logits.shape[-2]
    w = position_weights(K, gamma, logits.device) * valid.float()  # [..., K]
    logp_d = F.log_softmax(logits.float(), dim=-1)
    p_d = logp_d.exp()
    p_t = F.softmax(target_logits.float(), dim=-1)
    ce = -logp_d.gather(-1, labels.clamp(min=0).unsqueeze(-1)).squeeze(-1)
    l1_tok = (p_d - p_t).abs().sum(-1)
    c_star = confidence_target(p_d, p_t)
    ce_m = _weighted_mean(ce, w)
    l1_m = _weighted_mean(l1_tok, w)
    conf_m = logits.new_zeros(())
    if conf_logits is not None:
        bce = F.binary_cross_entropy_with_logits(conf_logits.float(), c_star, reduction="none")
        conf_m = _weighted_mean(bce, w)
    total = ce_weight * ce_m + l1_weight * l1_m + conf_weight * conf_m
    vf = valid.float().reshape(-1, K)
    denom = vf.sum(0).clamp(min=1)
    accept_est = (c_star.reshape(-1, K) * vf).sum(0) / denom
    match = (logits.argmax(-1) == target_logits.argmax(-1)).float().reshape(-1, K)
    top1 = (match * vf).sum(0) / denom
    return LossTerms(total=total, ce=ce_m.detach(), l1=l1_m.detach(), conf=conf_m.detach(),
                     accept_est=accept_est.detach(), top1_match=top1.detach())


def eagle_loss(step_logits: torch.Tensor, step_target_logits: torch.Tensor, valid: torch.Tensor,
               step_decay: float) -> LossTerms:
    """Soft CE per unrolled step: step_logits/targets [S, N, T, V], valid [S, N, T]."""
    S = step_logits.shape[0]
    logp_d = F.log_softmax(step_logits.float(), dim=-1)
    p_t = F.softmax(step_target_logits.float(), dim=-1)
    soft_ce = -(p_t * logp_d).sum(-1)  # [S, N, T]
    vf = valid.float()
    per_step = (soft_ce * vf).sum((1, 2)) / vf.sum((1, 2)).clamp(min=1)
    weights = step_decay ** torch.arange(S, dtype=torch.float32, device=step_logits.device)
    total = (weights * per_step).sum() / weights.sum()
    c_star = confidence_target(logp_d.exp(), p_t)
    accept_est = (c_star * vf).sum((1, 2)) / vf.sum((1, 2)).clamp(min=1)
    match = (step_logits.argmax(-1) == step_target_logits.argmax(-1)).float()
    top1 = (match * vf).sum((1, 2)) / vf.sum((1, 2)).clamp(min=1)
    zero = total.new_zeros(())
    return LossTerms(total=total, ce=total.detach(), l1=zero, conf=zero,
                     accept_est=accept_est.detach(), top1_match=top1.detach())
