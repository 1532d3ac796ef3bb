"""Eagle3-style baseline: an autoregressive drafter on fused target features.

Entry ``i`` of the drafter's sequence combines a feature ``f_i`` with the embedding of
token ``x_{i+1}`` and predicts ``x_{i+2}``. For context entries ``f_i`` is the fused target
feature at position ``i`` (``fc`` of the concatenated ``layer_ids`` outputs, as DSpark);
while drafting, step ``k`` uses the drafter's own previous output hidden state instead.
Training unrolls this ("training-time test") for ``ttt_steps`` steps: query ``(i, k)``
sees the true entries ``<= i`` and its own chain ``(i, 1..k)``, exactly what it sees at
inference.

Two layouts, by ``layer_style``:

- ``llama`` / ``qwen3`` (new drafters): the EAGLE-3 layout. ``f_i = fc(aux_i)`` (no norm) and
  the first layer is an :class:`~.layers.Eagle3Layer` over ``[f_i ; embed(x_{i+1})]``, so the
  weights are those vLLM's and SGLang's EAGLE-3 models load (engine/export/eagle3_export.py).
- ``target`` (checkpoints from before the field): ``f_i = RMSNorm(fc(aux_i))`` and an entry is
  ``combine([f_i ; emb_norm(embed(x_{i+1}))])`` feeding a plain decoder layer; no engine loads it.
"""
from __future__ import annotations

import torch
from torch import nn

from .block_drafter import DrafterConfig, Proposal, noise_ids, pick, to_target_vocab
from .layers import DraftLayer, Eagle3Layer, TargetTiedDrafter


class Eagle3Drafter(TargetTiedDrafter):
    def __init__(self, cfg: DrafterConfig, hf_config, embed: nn.Embedding, lm_head: nn.Linear):
        eagle3_layout = getattr(cfg, "layer_style", "target") != "target"
        super().__init__(cfg, hf_config, embed, lm_head, fuse_norm=not eagle3_layout,
                         first_layer=Eagle3Layer if eagle3_layout else DraftLayer)
        self.eagle3_layout = eagle3_layout
        d = cfg.hidden_size
        if not self.eagle3_layout:
            self.emb_norm = nn.RMSNorm(d, eps=self.shape.rms_eps)
            self.combine = nn.Linear(2 * d, d, bias=False)
        self.markov = None
        self.confidence = None

    def entry(self, feature: torch.Tensor, next_tokens: torch.Tensor) -> torch.Tensor:
        """feature [N, T, d] (fused target feature or own hidden), next_tokens [N, T] -> the first
        layer's input: [N, T, 2d] = [feature ; embedding] (EAGLE-3 layout) or [N, T, d] (legacy)."""
        emb = self.embed(next_tokens)
        if self.eagle3_layout:
            return torch.cat([feature, emb.to(feature.dtype)], dim=-1)
        return self.combine(torch.cat([feature, self.emb_norm(emb)], dim=-1))

    def run_layers(self, x: torch.Tensor, pos: torch.Tensor, past: list[tuple[torch.Tensor, torch.Tensor]] | None,
                   mask: torch.Tensor) -> tuple[torch.Tensor, list[tuple[torch.Tensor, torch.Tensor]]]:
        """x [N, Q, d] at pos [N, Q] over past K/V (per layer) -> (pre-norm hidden, this call's K/V)."""
        cos, sin = self.rope(pos, x.dtype)
        new_kv = []
        for i, layer in enumerate(self.layers):
            new_kv.append(layer.kv(layer.attn_input(x), cos, sin))
            k, v = past[i] if past is not None else (None, None)
            x = layer(x, cos, sin, k, v, mask)
        return x, new_kv

    # -- training -----------------------------------------------------------------------------
    @staticmethod
    def entries_for(anchors: torch.Tensor) -> torch.Tensor:
        """The entries whose step 0 predicts what a block anchored at ``anchors`` predicts first
        (token ``a+1``): entry ``a-1`` (entry 0 for an anchor at 0)."""
        return (anchors - 1).clamp(min=0)

    @staticmethod
    def label_positions(entries: torch.Tensor, steps: int) -> torch.Tensor:
        """entries [...] -> [steps, ...]: step k's output at entry i predicts token ``i + 2 + k``."""
        return entries.unsqueeze(0) + 2 + torch.arange(steps, device=entries.device).view(-1, *([1] * entries.dim()))

    def forward_train(self, aux: torch.Tensor, tokens: torch.Tensor, steps: int,
                      positions: torch.Tensor | None = None) -> torch.Tensor:
        """aux [N, T, m*d], tokens [N, T] -> normed hidden [steps, N, P, d] (LM head input) at
        the entries ``positions`` [N, P] (all T when None).

        Step k's output at entry i predicts ``tokens[i + 2 + k]``; the caller applies the LM
        head where it computes a loss. Step 0 runs the layers over every true entry (their
        K/V are every chain's context); steps 1.. unroll only the chains of ``positions``: the
        chain of entry i sees the true entries ``<= i`` and its own earlier steps, never another
        chain, so the chains nobody scores are not computed.
        """
        N, T = tokens.shape
        dev = tokens.device
        nxt = torch.cat([tokens[:, 1:], tokens[:, -1:]], dim=1)  # x_{i+1}
        pos = torch.arange(T, device=dev).expand(N, T)
        causal = torch.ones(T, T, dtype=torch.bool, device=dev).tril()
        x0 = self.entry(self.fuse(aux), nxt)
        h, true_kv = self.run_layers(x0, pos, None, causal.expand(N, T, T))
        if positions is None:
            positions = pos
        P = positions.shape[1]
        h = h.gather(1, positions.unsqueeze(-1).expand(-1, -1, h.shape[-1]))  # [N, P, d]
        outs = [self.norm(h)]
        sees_true = torch.arange(T, device=dev).view(1, 1, T) <= positions.unsqueeze(-1)  # [N, P, T]
        eye = torch.eye(P, dtype=torch.bool, device=dev).expand(N, P, P)
        past = true_kv  # per layer: the true entries, then each unrolled step's chain entries
        for k in range(1, steps):
            xk = self.entry(h, tokens.gather(1, (positions + 1 + k).clamp(max=T - 1)))  # x_{i+1+k}
            # keys: true entries <= i, then this chain's steps 1..k-1, then its own entry
            mask = torch.cat([sees_true] + [eye] * k, dim=-1)
            h, kv_k = self.run_layers(xk, positions + k, past, mask)
            past = [(torch.cat([pk, nk], dim=2), torch.cat([pv, nv], dim=2)) for (pk, pv), (nk, nv) in zip(past, kv_k)]
            outs.append(self.norm(h))
        return torch.stack(outs)

    # -- inference ----------------------------------------------------------------------------
    @torch.no_grad()
    def propose_from(self, last_hidden: torch.Tensor, past: list[tuple[torch.Tensor, torch.Tensor]],
                     past_valid: torch.Tensor, next_pos: torch.Tensor, temperature: torch.Tensor,
                     noise=None) -> Proposal:
        """Draft K tokens autoregressively.

        last_hidden [R, d]: pre-norm output of the last true entry (it predicts draft 1);
        past per layer [R, Hkv, T, hd] with past_valid [R, T]; next_pos [R] = position of
        the first chain entry; ``noise``: the sampled drafts' race noise (``block_drafter.draw``).
        """
        K = self.cfg.block_size
        R = last_hidden.shape[0]
        V = self.draft_vocab_size
        all_greedy = not bool((temperature > 0).any())
        ids = noise_ids(self)
        tokens = torch.empty(R, K, dtype=torch.long, device=last_hidden.device)
        probs = None  # [R, K, V] once the first pick keeps its distributions (``pick``)
        h = last_hidden
        keys = [list(kv) for kv in past]
        valid = past_valid
        for k in range(K):
            x, p = pick(self.draft_logits(self.norm(h)).float(), temperature, noise, all_greedy, k, ids)
            tokens[:, k] = x
            if p is not None:
                if probs is None:
                    probs = torch.empty(R, K, V, dtype=torch.float32, device=last_hidden.device)
                probs[:, k] = p
            if k == K - 1:
                break
            xin = self.entry(h.unsqueeze(1), self.to_target(x).unsqueeze(1))
            pos = (next_pos + k).unsqueeze(1)
            mask = torch.cat([valid, torch.ones(R, 1, dtype=torch.bool, device=valid.device)], dim=-1).unsqueeze(1)
            out, kv = self.run_layers(xin, pos, [tuple(kv_) for kv_ in keys], mask)
            for li in range(len(keys)):
                keys[li][0] = torch.cat([keys[li][0], kv[li][0]], dim=2)
                keys[li][1] = torch.cat([keys[li][1], kv[li][1]], dim=2)
            valid = torch.cat([valid, torch.ones(R, 1, dtype=torch.bool, device=valid.device)], dim=-1)
            h = out[:, 0]
        return to_target_vocab(self, Proposal(tokens=tokens, probs=probs, conf_logits=None))
