"""Check an export with vLLM's own model classes and loaders, on the CPU, against the kit's drafter.

vLLM's DSpark speculator runs only in its V2 model runner (GPU), but the draft model classes
are PyTorch modules: this builds ``Qwen3DSparkForCausalLM`` / ``Eagle3LlamaForCausalLM`` /
``Eagle3Qwen3ForCausalLM`` from the exported ``config.json`` through vLLM's own config path
(``EngineArgs.create_speculative_config``: its architecture resolution and DSpark / EAGLE-3 key
handling), with a world size of 1, loads ``model.safetensors`` through the class's own
``load_weights`` and runs its own modules (fc, hidden_norm, q/k/v projections, q/k norms, RoPE,
MLP, norms, LM head, Markov head, confidence head, d2t). The one piece replaced is the paged
attention kernel (``Attention``, which needs a running engine's KV cache and metadata): a plain
softmax attention over the keys vLLM's own code computed, with the mask of the speculator's
layout (DSpark: the context before the anchor plus the whole block; EAGLE-3: causal).
vLLM's context K/V come from its own ``precompute_and_store_context_kv``, captured where it
writes the cache.

The speculator's sequential loop (``v1/worker/gpu/spec_decode/dspark/speculator.py``) is
followed step for step with its model calls: ``markov_embed(prev)`` from the anchor,
``compute_draft_logits + markov_bias``, argmax, ``map_draft_to_target``, ``compute_confidence``.

Needs the ``vllm`` package (``scripts/setup_vllm.sh`` builds ``.venv-vllm``); everything is
imported lazily so the kit imports without it.
"""
from __future__ import annotations

import os
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["vllm_missing_reason", "VllmDraft", "load_vllm_draft", "BlockResult", "vllm_dspark_block",
           "vllm_eagle3_chain", "lm_head_noise_floor", "kit_dspark_block", "kit_eagle3_chain", "compare"]


def vllm_missing_reason() -> str | None:
    """None when vLLM's draft model classes can be imported here, else why not (one line)."""
    try:
        import vllm  # noqa: F401
        from vllm.model_executor.models import qwen3_dspark  # noqa: F401
    except Exception as exc:  # an absent or broken install reads the same to the caller
        return f"vLLM is not importable here ({type(exc).__name__}: {str(exc).splitlines()[0][:160]}); " \
               "run scripts/setup_vllm.sh and use .venv-vllm/bin/python"
    return None


class _SdpaAttention(nn.Module):
    """Stands in for vLLM's ``Attention`` kernel: q/k/v ``[tokens, heads * head_dim]`` as vLLM's
    attention layers pass them, keys kept per call in ``self.keys`` (context first)."""

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, causal: bool):
        super().__init__()
        self.h, self.hkv, self.hd, self.causal = num_heads, num_kv_heads, head_dim, causal
        self.keys: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []  # (k, v, positions) per request
        self.positions: torch.Tensor | None = None  # [R, Q] query positions of the current call
        self.context: list[tuple[torch.Tensor, torch.Tensor]] | None = None  # DSpark: per request (k, v)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        R, Q = self.positions.shape
        q = q.view(R, Q, self.h, self.hd).transpose(1, 2)
        k = k.view(R, Q, self.hkv, self.hd).transpose(1, 2)
        v = v.view(R, Q, self.hkv, self.hd).transpose(1, 2)
        outs = []
        for r in range(R):
            if self.causal:  # EAGLE-3: keys of earlier calls, then this call's; key pos <= query pos
                prev_k = [x[0][r] for x in self.keys] + [k[r]]
                prev_v = [x[1][r] for x in self.keys] + [v[r]]
                kpos = torch.cat([x[2][r] for x in self.keys] + [self.positions[r]])
                mask = kpos.view(1, -1) <= self.positions[r].view(-1, 1)
            else:  # DSpark: the whole context before the anchor, then the whole block
                ck, cv = self.context[r]
                prev_k, prev_v = [ck, k[r]], [cv, v[r]]
                mask = torch.ones(Q, ck.shape[1] + Q, dtype=torch.bool)
            kk, vv = torch.cat(prev_k, dim=1), torch.cat(prev_v, dim=1)
            rep = self.h // self.hkv
            kk, vv = kk.repeat_interleave(rep, 0), vv.repeat_interleave(rep, 0)
            outs.append(F.scaled_dot_product_attention(q[r], kk, vv, attn_mask=mask))
        if self.causal:
            self.keys.append((k, v, self.positions))
        return torch.stack(outs).transpose(1, 2).reshape(R * Q, self.h * self.hd)


@dataclass
class VllmDraft:
    model: nn.Module  # the vLLM draft model class, weights loaded by its own load_weights
    kind: str  # "dspark" | "eagle3"
    architecture: str
    attn: list[_SdpaAttention]


_DIST_READY = False


def _vllm_config(target_dir: Path, draft_dir: Path, method: str, num_speculative_tokens: int):
    """A VllmConfig for the target with the draft's SpeculativeConfig built by vLLM's own code.

    The speculative config is attached after the VllmConfig is validated: its V1 model runner
    (the one the CPU platform uses) refuses ``dspark``, which is about the runner, not the model."""
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    from vllm.engine.arg_utils import EngineArgs

    base = dict(model=str(target_dir), skip_tokenizer_init=True, enforce_eager=True, dtype="float32",
                max_model_len=512, compilation_config={"mode": 0})
    vc = EngineArgs(**base).create_engine_config()
    spec = EngineArgs(**base, speculative_config={"method": method, "model": str(draft_dir),
                                               "num_speculative_tokens": num_speculative_tokens}).create_speculative_config(
        target_model_config=vc.model_config, target_parallel_config=vc.parallel_config)
    vc.speculative_config = spec
    return vc


def _init_dist(vc) -> None:
    global _DIST_READY
    if _DIST_READY:
        return
    from vllm.distributed import init_distributed_environment, initialize_model_parallel

    init_distributed_environment(world_size=1, rank=0, local_rank=0, backend="gloo",
                                 distributed_init_method=f"file://{tempfile.mktemp(prefix='vllm-dist-')}")
    initialize_model_parallel(1, 1)
    _DIST_READY = True


def load_vllm_draft(draft_dir: str | Path, target_dir: str | Path, method: str, num_speculative_tokens: int) -> VllmDraft:
    """Build vLLM's draft class for ``draft_dir`` (``method``: dspark | eagle3; the speculative
    config as ``--speculative-config`` would give it) and load its weights."""
    from safetensors.torch import load_file
    from vllm.config import set_current_vllm_config
    from vllm.model_executor.model_loader.utils import process_weights_after_loading
    from vllm.model_executor.models.registry import ModelRegistry

    vc = _vllm_config(Path(target_dir), Path(draft_dir), method, num_speculative_tokens)
    hf = vc.speculative_config.draft_model_config.hf_config
    arch = vc.speculative_config.draft_model_config.architectures[0]
    with set_current_vllm_config(vc):
        _init_dist(vc)
        cls, _ = ModelRegistry.resolve_model_cls([arch], vc.speculative_config.draft_model_config)
        model = cls(vllm_config=vc).eval()
        model.load_weights(load_file(str(Path(draft_dir) / "model.safetensors")).items())
        # what vLLM's model loader does next (on CPU it binds the GEMM kernels here)
        process_weights_after_loading(model, vc.speculative_config.draft_model_config, torch.device("cpu"))
    attn = []
    for layer in model.model.layers:
        sa = layer.self_attn
        heads = sa.num_heads
        kv = getattr(sa, "num_kv_heads", None) or heads
        a = _SdpaAttention(heads, kv, sa.head_dim, causal=(method == "eagle3"))
        if method == "dspark":
            a._orig = sa.attn  # vLLM's Attention; its impl writes the context K/V we capture
        sa.attn = a
        attn.append(a)
    return VllmDraft(model=model, kind=method, architecture=f"{cls.__module__}.{cls.__name__} ({arch})",
                     attn=attn)


@dataclass
class BlockResult:
    logits: torch.Tensor  # [R, K, n] corrected draft logits (draft vocabulary), step by step
    bias: torch.Tensor | None  # [R, K, n] Markov bias, None without a Markov head
    confidence: torch.Tensor | None  # [R, K] acceptance probabilities, None without a confidence head
    drafts: torch.Tensor  # [R, K] greedy drafts, target ids
    hidden: torch.Tensor | None = None  # [R, K, d] the LM head's inputs (vLLM side), for the fp32 noise floor


@torch.no_grad()
def vllm_dspark_block(d: VllmDraft, aux: torch.Tensor, anchor: torch.Tensor, block_size: int,
                      mask_token_id: int) -> BlockResult:
    """One DSpark block per request: context features aux [R, a, m*d] at positions 0..a-1, the anchor
    [R] at position a; greedy drafts through the speculator's sequential loop."""
    m = d.model
    R, a, _ = aux.shape
    K = block_size
    for att in d.attn:
        att.context = [None] * R
    for r in range(R):  # vLLM's own context K/V path, captured where it writes the cache
        captured = []
        for att in d.attn:
            impl = att._orig.impl
            impl.do_kv_cache_update = lambda _layer, k, v, _cache, _slots, out=captured: out.append((k.clone(), v.clone()))
        ctx = m.combine_hidden_states(aux[r])
        m.precompute_and_store_context_kv(ctx, torch.arange(a), torch.zeros(a, dtype=torch.long))
        for att, (k, v) in zip(d.attn, captured):  # [a, Hkv, hd] -> [Hkv, a, hd]
            att.context[r] = (k.view(a, att.hkv, att.hd).transpose(0, 1), v.view(a, att.hkv, att.hd).transpose(0, 1))
    ids = torch.full((R, K), mask_token_id, dtype=torch.long)
    ids[:, 0] = anchor
    pos = a + torch.arange(K).expand(R, K)
    for att in d.attn:
        att.positions = pos
    hidden = m(ids.reshape(-1), pos.reshape(-1))  # [R*K, d], vLLM's final norm applied
    base = m.compute_draft_logits(hidden).view(R, K, -1).float()
    hidden = hidden.view(R, K, -1)
    has_markov = int(getattr(m.config, "markov_rank", 0) or 0) > 0
    has_conf = m.model.confidence_head is not None
    prev = anchor.clone()
    logits, biases, confs, drafts = [], [], [], []
    for i in range(K):
        emb = m.markov_embed(prev)
        bias = m.markov_bias(emb).float()
        li = base[:, i] + bias
        if has_conf:
            confs.append(m.compute_confidence(hidden[:, i], emb).float())
        x = m.map_draft_to_target(li.argmax(-1))
        logits.append(li), biases.append(bias), drafts.append(x)
        prev = x
    return BlockResult(logits=torch.stack(logits, 1), bias=torch.stack(biases, 1) if has_markov else None,
                       confidence=torch.stack(confs, 1) if has_conf else None, drafts=torch.stack(drafts, 1),
                       hidden=hidden)


@torch.no_grad()
def vllm_eagle3_chain(d: VllmDraft, aux: torch.Tensor, tokens: torch.Tensor, block_size: int) -> BlockResult:
    """EAGLE-3 drafting: entries i = 0..T-1 pair the fused feature of aux [R, T, m*d] with token
    tokens[:, i + 1] (tokens [R, T + 1]) at position i; the last entry's output predicts draft 1,
    then each step feeds (own pre-norm hidden, previous draft) at the next position."""
    m = d.model
    R, T, _ = aux.shape
    for att in d.attn:
        att.keys = []
    pos = torch.arange(T).expand(R, T)
    for att in d.attn:
        att.positions = pos
    feat = m.combine_hidden_states(aux.reshape(R * T, -1))
    normed, pre = m(tokens[:, 1:].reshape(-1), pos.reshape(-1), feat)
    normed, pre = normed.view(R, T, -1)[:, -1], pre.view(R, T, -1)[:, -1]
    n = int(m.config.draft_vocab_size)
    targets = torch.arange(n) if m.draft_id_to_target_id is None else torch.arange(n) + m.draft_id_to_target_id
    logits, drafts, hiddens = [], [], []
    for k in range(block_size):
        full = m.compute_logits(normed).float()  # [R, V], -inf outside the draft vocabulary (its d2t)
        x = full.argmax(-1)
        logits.append(full[:, targets]), drafts.append(x), hiddens.append(normed)
        if k == block_size - 1:
            break
        p = torch.full((R, 1), T + k)
        for att in d.attn:
            att.positions = p
        normed, pre = m(x, p.reshape(-1), pre)
    return BlockResult(logits=torch.stack(logits, 1), bias=None, confidence=None, drafts=torch.stack(drafts, 1),
                       hidden=torch.stack(hiddens, 1))


@torch.no_grad()
def lm_head_noise_floor(d: VllmDraft, hidden: torch.Tensor) -> float:
    """Max abs error of vLLM's own fp32 draft LM head against float64 on ``hidden`` [..., d]: how
    far any fp32 implementation's logits may sit from exact ones on these inputs."""
    m = d.model
    n = int(m.config.draft_vocab_size)
    h = hidden.reshape(-1, hidden.shape[-1]).float()
    got = m.logits_processor(m.lm_head, h)[:, :n].double()
    exact = h.double() @ m.lm_head.weight[:n].double().T
    return float((got - exact).abs().max())


@torch.no_grad()
def kit_dspark_block(drafter, aux: torch.Tensor, anchor: torch.Tensor) -> BlockResult:
    """The kit's side of :func:`vllm_dspark_block`: greedy drafts from the engine path
    (``propose``), then logits / bias / confidences from the training path (``forward_train``,
    teacher-forced with those drafts), so both of the kit's paths are held to vLLM's numbers."""
    R, a, w = aux.shape
    K = drafter.cfg.block_size
    h_ctx = drafter.context(aux)
    ctx_kv = drafter.context_kv(h_ctx, torch.arange(a).expand(R, a))
    prop = drafter.propose(anchor, torch.full((R,), a), ctx_kv, torch.ones(R, a, dtype=torch.bool),
                           torch.zeros(R))
    tokens = torch.cat([torch.zeros(R, a, dtype=torch.long), anchor.view(R, 1), prop.tokens], dim=1)  # [R, a+1+K]
    aux_full = torch.cat([aux, aux.new_zeros(R, 1 + K, w)], dim=1)  # positions >= a are never visible
    out = drafter.forward_train(aux_full, tokens, torch.full((R, 1), a))
    prev = torch.cat([anchor.view(R, 1), prop.tokens[:, :-1]], dim=1)
    bias = torch.zeros_like(out.logits[:, 0].float())  # DFlash: no Markov head, a zero bias
    conf = None
    if drafter.markov is not None:
        bias = drafter.markov.bias(drafter.markov.features(drafter.to_draft(prev), out.hidden[:, 0])[0]).float()
    if out.conf_logits is not None:
        conf = torch.sigmoid(out.conf_logits[:, 0].float())
    return BlockResult(logits=out.logits[:, 0].float(), bias=bias, confidence=conf, drafts=prop.tokens)


@torch.no_grad()
def kit_eagle3_chain(drafter, aux: torch.Tensor, tokens: torch.Tensor) -> BlockResult:
    """The kit's side of :func:`vllm_eagle3_chain`: drafts from the engine path (``run_layers`` +
    ``propose_from``), logits from the training path (``forward_train`` unrolled over the drafts)."""
    R, T, w = aux.shape
    K = drafter.cfg.block_size
    x = drafter.entry(drafter.fuse(aux), tokens[:, 1:])
    pos = torch.arange(T).expand(R, T)
    causal = torch.ones(T, T, dtype=torch.bool).tril().expand(R, T, T)
    out, kv = drafter.run_layers(x, pos, None, causal)
    prop = drafter.propose_from(out[:, -1], kv, torch.ones(R, T, dtype=torch.bool), torch.full((R,), T),
                                torch.zeros(R))
    full = torch.cat([tokens, prop.tokens], dim=1)  # [R, T + 1 + K]; chain of entry T-1 reads the drafts
    aux_full = torch.cat([aux, aux.new_zeros(R, 1 + K, w)], dim=1)
    hidden = drafter.forward_train(aux_full, full, K, torch.full((R, 1), T - 1))  # [K, R, 1, d]
    logits = torch.stack([drafter.draft_head(hidden[k, :, 0]).float() for k in range(K)], 1)
    return BlockResult(logits=logits, bias=None, confidence=None, drafts=prop.tokens)


def compare(a: BlockResult, b: BlockResult) -> dict:
    """Max abs differences and draft identity of two results of the same block."""
    def diff(x, y):
        if x is None and y is None:
            return None
        if (x is None) != (y is None):
            return float("inf")
        return float((x.float() - y.float()).abs().max())

    return {"logits_max_abs_diff": diff(a.logits, b.logits), "markov_bias_max_abs_diff": diff(a.bias, b.bias),
            "confidence_max_abs_diff": diff(a.confidence, b.confidence),
            "drafts_identical": bool(torch.equal(a.drafts, b.drafts))}
