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
from typing import Callable

import torch
from torch import nn

from dspark.plugins.coupled import RaceNoise

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
    state: torch.Tensor | None = None  # [..., r] the Markov head's state after position K (RNN head), or None


@dataclass
class BlockInputs:
    """What the draft layers read for ``nb`` blocks per row, flattened to ``Q = nb * K`` queries."""
    tokens: torch.Tensor  # [N, Q] per block [anchor, mask, ..., mask]
    positions: torch.Tensor  # [N, Q] per block a .. a+K-1
    mask: torch.Tensor  # [N, Q, T + Q] bool: the block's visible context ; its own block's queries


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

    # -- the block layout, for training, proposing and export alike ------------------------------
    def block_inputs(self, anchor: torch.Tensor, anchor_pos: torch.Tensor, visible: torch.Tensor) -> BlockInputs:
        """anchor / anchor_pos [N, nb] (token and position of each block's anchor), visible
        [N, nb, T] bool (the context positions each block may see) -> the blocks' inputs.

        Block ``b`` is ``[anchor, mask x (K-1)]`` at positions ``a_b .. a_b+K-1``; its queries see
        ``visible[:, b]`` of the context and every query of their own block (non-causal), never
        another block. Written with broadcasts only, so it exports to ONNX as it runs."""
        K = self.cfg.block_size
        offs = torch.arange(K, device=anchor.device)
        a = anchor.unsqueeze(-1)
        tokens = torch.where(offs == 0, a, torch.full_like(a, self.cfg.mask_token_id))  # [N, nb, K]
        positions = anchor_pos.unsqueeze(-1) + offs  # [N, nb, K]
        ctx = visible.unsqueeze(2).expand(-1, -1, K, -1).flatten(1, 2)  # [N, Q, T]
        # [Q]: the block of each query
        blk = torch.arange(anchor.shape[1], device=anchor.device).view(-1, 1).expand(-1, K).reshape(-1)
        own = (blk.unsqueeze(-1) == blk.unsqueeze(0)).expand(ctx.shape[0], -1, -1)  # [N, Q, Q]
        return BlockInputs(tokens.flatten(1, 2), positions.flatten(1, 2), torch.cat([ctx, own], dim=-1))

    def label_positions(self, anchors: torch.Tensor) -> torch.Tensor:
        """anchors [...] -> [..., K]: output k (0-based) of the block at ``a`` predicts token ``a+k+1``
        (and reads ``x_{k}`` = the token at ``a+k`` through the Markov head, ``x_0`` = the anchor)."""
        return anchors.unsqueeze(-1) + 1 + torch.arange(self.cfg.block_size, device=anchors.device)

    def block_hidden(self, inputs: BlockInputs, ctx_kv: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
        """The draft layers over ``inputs`` with the context's K/V -> normed hidden [N, Q, d]."""
        h = self.embed(inputs.tokens)
        cos, sin = self.rope(inputs.positions, h.dtype)
        for layer, (k, v) in zip(self.layers, ctx_kv):
            h = layer(h, cos, sin, k, v, inputs.mask)
        return self.norm(h)

    def heads(self, hidden: torch.Tensor, prev_tokens: torch.Tensor, base: torch.Tensor | None = None,
              state: torch.Tensor | None = None) -> BlockOutput:
        """The heads over K positions given their previous tokens (teacher-forced in training; one
        position at a time in ``sample_sequential``): hidden [..., K, d], prev_tokens x_{k-1} [..., K]
        (target ids); ``base`` [..., K, N]: the block's logits when already computed; ``state``: the
        Markov head's state before position 1 (``BlockOutput.state`` of the previous call).
        Logits are over the draft vocabulary."""
        logits = self.draft_logits(hidden) if base is None else base
        conf = None
        if self.markov is not None:
            feat, emb, state = self.markov.features(self.to_draft(prev_tokens), hidden, state)
            logits = logits + self.markov.bias(feat)
        else:
            emb = hidden.new_zeros(hidden.shape[:-1] + (0,))
        if self.confidence is not None:
            conf = self.confidence(hidden, emb)
        return BlockOutput(logits=logits, conf_logits=conf, hidden=hidden, state=state)

    # -- training -----------------------------------------------------------------------------
    def forward_train(self, aux: torch.Tensor, tokens: torch.Tensor, anchors: torch.Tensor) -> BlockOutput:
        """aux [N, T, m*d], tokens [N, T], anchors [N, nb] (positions, all < T).

        Returns outputs shaped [N, nb, K, ...]; block b's output k predicts
        ``tokens[label_positions(anchors)[:, b, k]]``.
        """
        N, T = tokens.shape
        nb, K = anchors.shape[1], self.cfg.block_size
        ctx_pos = torch.arange(T, device=tokens.device)
        ctx_kv = self.context_kv(self.context(aux), ctx_pos.expand(N, T))
        visible = ctx_pos.view(1, 1, T) < anchors.unsqueeze(-1)  # block b sees positions < a_b
        inputs = self.block_inputs(tokens.gather(1, anchors), anchors, visible)
        hidden = self.block_hidden(inputs, ctx_kv).view(N, nb, K, -1)
        # teacher forcing: x_{k-1} = the token before the one output k predicts (x_0 = anchor)
        prev_pos = (self.label_positions(anchors) - 1).clamp(max=T - 1)
        prev = tokens.gather(1, prev_pos.reshape(N, -1)).view(N, nb, K)
        return self.heads(hidden, prev)

    # -- inference ----------------------------------------------------------------------------
    def draft_block(self, anchor: torch.Tensor, anchor_pos: torch.Tensor,
                    ctx_kv: list[tuple[torch.Tensor, torch.Tensor]], ctx_valid: torch.Tensor,
                    choose: "Chooser") -> "SequentialDraft":
        """One parallel pass over the block, then the heads left to right (``sample_sequential``)
        with ``choose`` picking each draft: the engine's ``propose`` and the ONNX step both run this.

        anchor/anchor_pos [R]; ctx_kv per layer [R, Hkv, T, hd]; ctx_valid [R, T] bool."""
        inputs = self.block_inputs(anchor.unsqueeze(-1), anchor_pos.unsqueeze(-1), ctx_valid.unsqueeze(1))
        hidden = self.block_hidden(inputs, ctx_kv)  # [R, K, d]
        base = self.draft_logits(hidden).float()  # [R, K, N]
        return sample_sequential(self, base, hidden, anchor, choose)

    @torch.no_grad()
    def propose(self, anchor: torch.Tensor, anchor_pos: torch.Tensor,
                ctx_kv: list[tuple[torch.Tensor, torch.Tensor]], ctx_valid: torch.Tensor,
                temperature: torch.Tensor, noise: RaceNoise | None = None) -> "Proposal":
        """Draft K tokens for R requests (``draft_block``) at their temperatures.

        temperature [R] (0 = greedy drafts); ``noise``: the sampled drafts' race noise (see
        ``draw``). Draft probabilities are those of the corrected logits at the request's
        temperature (what rejection sampling needs), over the target's vocabulary; drafts
        are target ids.
        """
        draft = self.draft_block(anchor, anchor_pos, ctx_kv, ctx_valid, engine_chooser(self, temperature, noise))
        return to_target_vocab(self, Proposal(tokens=draft.tokens, probs=draft.kept, conf_logits=draft.conf_logits))


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


def _greedy_or_sampled(scores: torch.Tensor, temperature: torch.Tensor,
                       sample: Callable[[torch.Tensor | None], torch.Tensor]) -> torch.Tensor:
    """One token per row: the argmax of ``scores`` [R, V] for greedy rows, ``sample(rows)`` for the
    sampled ones (``rows`` their indices, or None when every row is sampled), which is then the only
    work spent on a draw: a greedy row's distribution is one-hot at its argmax."""
    sampled = temperature > 0
    if not bool(sampled.any()):
        return scores.argmax(-1)
    if bool(sampled.all()):
        return sample(None)
    rows = sampled.nonzero().squeeze(-1)
    x = scores.argmax(-1)
    x[rows] = sample(rows)
    return x


def draw(probs: torch.Tensor, temperature: torch.Tensor, noise: RaceNoise | None, k: int = 0,
         ids: torch.Tensor | None = None) -> torch.Tensor:
    """One draft token per row of ``draft_distribution(logits, temperature)``: the argmax for greedy
    rows, a draw for the sampled rows only (a draw over the vocabulary costs as much as the
    Markov bias on CPU, wasted on a one-hot).

    With ``noise`` the draw is the exponential race of ``plugins/coupled.py`` at draft offset
    ``k`` (columns at target ids ``ids``): an exact sample, and under the coupled verify rule
    the very noise the target's own choice at that position uses. Without it, a multinomial
    draw from torch's global generator (tools that only need a sample)."""
    def sample(rows: torch.Tensor | None) -> torch.Tensor:
        sub = probs if rows is None else probs[rows]
        if noise is not None:
            return noise.draw(sub, k, rows, ids)
        return torch.multinomial(sub, 1).squeeze(-1)
    return _greedy_or_sampled(probs, temperature, sample)


def draw_coupled(logits: torch.Tensor, temperature: torch.Tensor, noise: RaceNoise, k: int = 0,
                 ids: torch.Tensor | None = None) -> torch.Tensor:
    """One draft token per row for drafts judged by the coupled rule (``noise.coupled``): the argmax
    for greedy rows; for sampled rows the race among their likeliest candidates
    (``RaceNoise.draw_top``), which needs neither a softmax over the vocabulary nor noise for all of it."""
    def sample(rows: torch.Tensor | None) -> torch.Tensor:
        sel = slice(None) if rows is None else rows
        return noise.draw_top(logits[sel], temperature[sel], k, rows, ids)
    return _greedy_or_sampled(logits, temperature, sample)


def pick(logits: torch.Tensor, temperature: torch.Tensor, noise: RaceNoise | None,
         all_greedy: bool, k: int = 0, ids: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One draft per row at offset ``k`` -> (tokens [R], their distributions [R, V] or None).

    None for an all-greedy batch (which skips a softmax and a one-hot over the vocabulary per
    position) and for drafts judged by the coupled rule (``draw_coupled``), which never reads
    them; otherwise ``draw`` from ``draft_distribution``, whose law rejection sampling needs."""
    if all_greedy:
        return logits.argmax(-1), None
    if noise is not None and noise.coupled:
        return draw_coupled(logits, temperature, noise, k, ids), None
    p = draft_distribution(logits, temperature)
    return draw(p, temperature, noise, k, ids), p


# choose(corrected logits [R, N] of draft k, k) -> (draft indices [R], what to keep of position k or None)
Chooser = Callable[[torch.Tensor, int], tuple[torch.Tensor, "torch.Tensor | None"]]


@dataclass
class SequentialDraft:
    tokens: torch.Tensor  # [R, K] drafts as draft-vocabulary indices
    kept: torch.Tensor | None  # [R, K, ...] what the chooser kept per position (None if it kept nothing)
    conf_logits: torch.Tensor | None  # [R, K] confidence logits, or None without a confidence head


def engine_chooser(model, temperature: torch.Tensor, noise: RaceNoise | None) -> Chooser:
    """The engine's choice (``pick``): greedy or sampled per row, keeping the draft distributions
    (none for an all-greedy batch)."""
    all_greedy = not bool((temperature > 0).any())
    ids = noise_ids(model)
    return lambda logits, k: pick(logits, temperature, noise, all_greedy, k, ids)


def sample_sequential(model: BlockDrafter, base: torch.Tensor, hidden: torch.Tensor, anchor: torch.Tensor,
                      choose: Chooser) -> SequentialDraft:
    """Left-to-right drafting through the heads: x_k = choose(U_k + W2(W1[x_{k-1}])), x_0 = the anchor.

    The one sequential loop of the kit: the engine (``propose``, sampled or greedy), the ONNX
    step (argmax, or the race against fed noise) and tests run it. ``base`` [R, K, N] are the
    block's parallel logits over the draft vocabulary, ``hidden`` [R, K, d] its hidden states,
    ``anchor`` [R] a target id; each position runs ``model.heads`` on that one position (the
    Markov head carries its own state)."""
    K = base.shape[1]
    tokens, kept, confs = [], [], []
    prev, state = anchor, None
    for k in range(K):
        out = model.heads(hidden[:, k:k + 1], prev.unsqueeze(-1), base[:, k:k + 1], state)
        state = out.state
        x, keep = choose(out.logits[:, 0].float(), k)
        tokens.append(x)
        kept.append(keep)
        if out.conf_logits is not None:
            confs.append(out.conf_logits[:, 0])
        prev = model.to_target(x)
    return SequentialDraft(tokens=torch.stack(tokens, 1),
                           kept=None if kept[0] is None else torch.stack(kept, 1),
                           conf_logits=torch.stack(confs, 1) if confs else None)


def to_target_vocab(model, proposal: Proposal) -> Proposal:
    """A proposal over the draft vocabulary -> target ids and target-vocabulary probabilities."""
    if not model.cfg.draft_vocab_size:
        return proposal
    return Proposal(tokens=model.to_target(proposal.tokens),
                    probs=None if proposal.probs is None else
                    scatter_to_vocab(proposal.probs, model.draft_ids, model.lm_head.weight.shape[0]),
                    conf_logits=proposal.conf_logits)
