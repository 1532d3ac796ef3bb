"""DSpark / DFlash block drafter: one parallel pass drafts a whole block.

Context: target features from ``layer_ids`` (pre final norm) concatenated ->
``fc (m*d -> d, no bias)`` -> RMSNorm = ``H_ctx``. Every draft layer sees
``[K/V of H_ctx ; K/V of the block]``; queries come from the block only; attention is
non-causal inside a block; a block anchored at position ``a`` sees context ``< a`` only.

Block input: ``[anchor, mask x (B-1)]`` at positions ``a .. a+B-1``; output ``k``
(``k = 1..B``) predicts token ``a+k``. The embedding and LM head are the target's, frozen.
DFlash is this model with the Markov and confidence heads switched off.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from dspark.plugins.coupled import RaceNoise

from ..cpu_linear import project
from ..draft_vocab import scatter_to_vocab
from ..heads import ConfidenceHead, MarkovHead
from .layers import TargetTiedDrafter


@dataclass
class DrafterConfig:
    algo: str  # dspark | dflash | eagle3
    hidden_size: int
    vocab_size: int
    num_aux_layers: int  # m, number of target layers fused
    num_layers: int  # draft layers
    block_size: int
    mask_token_id: int
    markov_head: str  # vanilla | rnn | none
    markov_rank: int
    confidence_head: bool
    draft_vocab_size: int = 0  # 0: draft over the target's whole vocabulary (training/draft_vocab.py)
    # decoder-layer style (layers.py): qwen3 | llama | target. "target" is the style of the
    # checkpoints written before the field existed, so a drafter.json without it loads as they were
    layer_style: str = "target"


@dataclass
class BlockOutput:
    logits: torch.Tensor  # [..., K, V] corrected logits (Markov bias added when present)
    conf_logits: torch.Tensor | None  # [..., K] confidence logits, or None
    hidden: torch.Tensor  # [..., K, d]


class BlockDrafter(TargetTiedDrafter):
    """Parallel block drafter with optional Markov and confidence heads (DSpark / DFlash)."""

    def __init__(self, cfg: DrafterConfig, hf_config, embed: nn.Embedding, lm_head: nn.Linear):
        super().__init__(cfg, hf_config, embed, lm_head)
        d = cfg.hidden_size
        n = cfg.draft_vocab_size or cfg.vocab_size
        self.markov = (MarkovHead(n, d, cfg.markov_rank, cfg.markov_head, n + 1 if cfg.draft_vocab_size else n)
                       if cfg.markov_head != "none" else None)
        rank = cfg.markov_rank if self.markov is not None else 0
        self.confidence = ConfidenceHead(d, rank) if cfg.confidence_head else None

    def context(self, aux: torch.Tensor) -> torch.Tensor:
        """Target features [N, T, m*d] -> H_ctx [N, T, d]."""
        return self.fuse(aux)

    def context_kv(self, h_ctx: torch.Tensor, positions: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per-layer K/V of the context, [N, Hkv, T, hd] each; cacheable (depends only on the target)."""
        cos, sin = self.rope(positions, h_ctx.dtype)
        return [layer.kv(h_ctx, cos, sin) for layer in self.layers]

    def block_hidden(self, block_tokens: torch.Tensor, block_pos: torch.Tensor,
                     ctx_kv: list[tuple[torch.Tensor, torch.Tensor]], mask: torch.Tensor) -> torch.Tensor:
        """block_tokens/pos [N, Q]; mask [N, Q, T+Q] -> normed hidden [N, Q, d]."""
        h = self.embed(block_tokens)
        cos, sin = self.rope(block_pos, h.dtype)
        for layer, (k, v) in zip(self.layers, ctx_kv):
            h = layer(h, cos, sin, k, v, mask)
        return self.norm(h)

    def block_tokens(self, anchor: torch.Tensor) -> torch.Tensor:
        """anchor [...] -> [..., K] = [anchor, mask, ..., mask]."""
        K = self.cfg.block_size
        out = torch.full(anchor.shape + (K,), self.cfg.mask_token_id, dtype=torch.long, device=anchor.device)
        out[..., 0] = anchor
        return out

    def heads(self, hidden: torch.Tensor, prev_tokens: torch.Tensor) -> BlockOutput:
        """Teacher-forced heads: hidden [..., K, d], prev_tokens x_{k-1} [..., K] (target ids).
        Logits are over the draft vocabulary."""
        logits = project(self.draft_head, hidden)
        conf = None
        if self.markov is not None:
            feat, emb = self.markov.features(self.to_draft(prev_tokens), hidden)
            logits = logits + self.markov.bias(feat)
        else:
            emb = hidden.new_zeros(hidden.shape[:-1] + (0,))
        if self.confidence is not None:
            conf = self.confidence(hidden, emb)
        return BlockOutput(logits=logits, conf_logits=conf, hidden=hidden)

    # -- training -----------------------------------------------------------------------------
    def forward_train(self, aux: torch.Tensor, tokens: torch.Tensor, anchors: torch.Tensor) -> BlockOutput:
        """aux [N, T, m*d], tokens [N, T], anchors [N, nb] (positions, all < T).

        Returns outputs shaped [N, nb, K, ...]; block b's output k predicts tokens[a_b + k].
        """
        N, T = tokens.shape
        nb, K = anchors.shape[1], self.cfg.block_size
        h_ctx = self.context(aux)
        ctx_pos = torch.arange(T, device=tokens.device).expand(N, T)
        ctx_kv = self.context_kv(h_ctx, ctx_pos)
        anchor_tok = tokens.gather(1, anchors)  # [N, nb]
        blk = self.block_tokens(anchor_tok).reshape(N, nb * K)
        offs = torch.arange(K, device=tokens.device)
        blk_pos = (anchors.unsqueeze(-1) + offs).reshape(N, nb * K)
        # context visibility: block b sees positions < a_b; own keys: same block only
        q_anchor = anchors.repeat_interleave(K, dim=1)  # [N, Q]
        ctx_mask = torch.arange(T, device=tokens.device).view(1, 1, T) < q_anchor.unsqueeze(-1)
        blk_id = torch.arange(nb, device=tokens.device).repeat_interleave(K)
        own = (blk_id.view(-1, 1) == blk_id.view(1, -1)).expand(N, -1, -1)
        mask = torch.cat([ctx_mask, own], dim=-1)
        hidden = self.block_hidden(blk, blk_pos, ctx_kv, mask).view(N, nb, K, -1)
        # teacher forcing: x_{k-1} = tokens[a + k - 1] (x_0 = anchor)
        prev_pos = (anchors.unsqueeze(-1) + offs).clamp(max=T - 1)
        prev = tokens.gather(1, prev_pos.reshape(N, -1)).view(N, nb, K)
        return self.heads(hidden, prev)

    # -- inference ----------------------------------------------------------------------------
    @torch.no_grad()
    def propose(self, anchor: torch.Tensor, anchor_pos: torch.Tensor,
                ctx_kv: list[tuple[torch.Tensor, torch.Tensor]], ctx_valid: torch.Tensor,
                temperature: torch.Tensor, noise: RaceNoise | None = None) -> "Proposal":
        """Draft K tokens for R requests in one parallel pass, then the sequential heads.

        anchor/anchor_pos [R]; ctx_kv per layer [R, Hkv, T, hd]; ctx_valid [R, T] bool;
        temperature [R] (0 = greedy drafts); ``noise``: the sampled drafts' race noise (see
        ``draw``). Draft probabilities are those of the corrected logits at the request's
        temperature (what rejection sampling needs), over the target's vocabulary; drafts
        are target ids.
        """
        K = self.cfg.block_size
        R = anchor.shape[0]
        blk = self.block_tokens(anchor)
        pos = anchor_pos.unsqueeze(-1) + torch.arange(K, device=anchor.device)
        mask = torch.cat([ctx_valid.unsqueeze(1).expand(R, K, -1),
                          torch.ones(R, K, K, dtype=torch.bool, device=anchor.device)], dim=-1)
        hidden = self.block_hidden(blk, pos, ctx_kv, mask)  # [R, K, d]
        base = project(self.draft_head, hidden).float()  # [R, K, N]
        return sample_sequential(self, base, hidden, anchor, temperature, noise)


@dataclass
class Proposal:
    tokens: torch.Tensor  # [R, K] drafts
    probs: torch.Tensor | None  # [R, K, V] distributions the drafts were drawn from; None when every
    # row is greedy (one-hot at the drafts, which verification assumes for None)
    conf_logits: torch.Tensor | None  # [R, K]


def draft_distribution(logits: torch.Tensor, temperature: torch.Tensor) -> torch.Tensor:
    """logits [R, V], temperature [R] -> probs [R, V] (one-hot argmax where temperature is 0)."""
    t = temperature.float().unsqueeze(-1)
    probs = torch.softmax(logits.float() / torch.where(t > 0, t, torch.ones_like(t)), dim=-1)
    onehot = torch.nn.functional.one_hot(logits.argmax(-1), logits.shape[-1]).to(probs.dtype)
    return torch.where(t > 0, probs, onehot)


def noise_ids(model) -> torch.Tensor | None:
    """The target ids of the drafter's output columns (None: the whole vocabulary, in order):
    the race noise of a draft is the noise of the target token it stands for."""
    return model.draft_ids if model.cfg.draft_vocab_size else None


def draw(probs: torch.Tensor, temperature: torch.Tensor, noise: RaceNoise | None, k: int = 0,
         ids: torch.Tensor | None = None) -> torch.Tensor:
    """One draft token per row of ``draft_distribution(logits, temperature)``: the argmax for greedy
    rows (their distribution is one-hot), a draw for the sampled rows only (a draw over the
    vocabulary costs as much as the Markov bias on CPU, wasted on a one-hot).

    With ``noise`` the draw is the exponential race of ``plugins/coupled.py`` at draft offset
    ``k`` (columns at target ids ``ids``): an exact sample, and under the coupled verify rule
    the very noise the target's own choice at that position uses. Without it, a multinomial
    draw from torch's global generator (tools that only need a sample)."""
    sampled = temperature > 0
    if not bool(sampled.any()):
        return probs.argmax(-1)
    rows = None if bool(sampled.all()) else sampled.nonzero().squeeze(-1)
    sub = probs if rows is None else probs[rows]
    if noise is not None:
        picked = noise.draw(sub, k, rows, ids)
    else:
        picked = torch.multinomial(sub, 1).squeeze(-1)
    if rows is None:
        return picked
    x = probs.argmax(-1)  # greedy rows are one-hot at the logits' argmax
    x[rows] = picked
    return x


def pick(logits: torch.Tensor, temperature: torch.Tensor, noise: RaceNoise | None,
         all_greedy: bool, k: int = 0, ids: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One draft per row (``draw`` at offset ``k``) -> (tokens [R], their distributions [R, V] or
    None for an all-greedy batch, which skips a softmax and a one-hot over the vocabulary per position)."""
    if all_greedy:
        return logits.argmax(-1), None
    p = draft_distribution(logits, temperature)
    return draw(p, temperature, noise, k, ids), p


def sample_sequential(model: BlockDrafter, base: torch.Tensor, hidden: torch.Tensor, anchor: torch.Tensor,
                      temperature: torch.Tensor, noise: RaceNoise | None) -> Proposal:
    """Left-to-right sampling through the Markov head: x_k ~ softmax(U_k + W2(W1[x_{k-1}])).

    ``base`` [R, K, N] are the parallel logits over the draft vocabulary; draft k draws with
    ``noise`` at offset k (``draw``); the proposal is mapped to target ids and
    target-vocabulary probabilities."""
    R, K, V = base.shape
    all_greedy = not bool((temperature > 0).any())
    tokens = torch.empty(R, K, dtype=torch.long, device=base.device)
    probs = None if all_greedy else torch.empty(R, K, V, dtype=torch.float32, device=base.device)
    confs = [] if model.confidence is not None else None
    ids = noise_ids(model)
    prev = model.to_draft(anchor)
    state = None
    for k in range(K):
        logits = base[:, k]
        if model.markov is not None:
            feat, emb = model.markov.features(prev.unsqueeze(-1), hidden[:, k:k + 1], state)
            feat, emb = feat[:, 0], emb[:, 0]
            state = feat if model.markov.kind == "rnn" else None
            logits = logits + model.markov.bias(feat).float()
        else:
            emb = hidden.new_zeros(R, 0)
        if confs is not None:
            confs.append(model.confidence(hidden[:, k], emb))
        x, p = pick(logits, temperature, noise, all_greedy, k, ids)
        tokens[:, k] = x
        if probs is not None:
            probs[:, k] = p
        prev = x
    return to_target_vocab(model, Proposal(tokens=tokens, probs=probs,
                                           conf_logits=torch.stack(confs, -1) if confs is not None else None))


def to_target_vocab(model, proposal: Proposal) -> Proposal:
    """A proposal over the draft vocabulary -> target ids and target-vocabulary probabilities."""
    if not model.cfg.draft_vocab_size:
        return proposal
    return Proposal(tokens=model.to_target(proposal.tokens),
                    probs=None if proposal.probs is None else
                    scatter_to_vocab(proposal.probs, model.draft_ids, model.lm_head.weight.shape[0]),
                    conf_logits=proposal.conf_logits)
