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

import copy
import os
import tempfile
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["vllm_missing_reason", "VllmDraft", "load_vllm_draft", "BlockResult", "vllm_dspark_block",
           "vllm_eagle3_chain", "lm_head_noise_floor", "kit_dspark_block", "kit_eagle3_chain", "compare",
           "GEMM_DISPATCH", "kit_float64", "bisect_dspark_block"]

# vLLM's CPU GEMM dispatch for unquantized fp32 linears (``dispatch_cpu_unquantized_gemm``): "vllm" = what
# it picks on this machine (oneDNN ``onednn_mm`` where its oneDNN build is present), "torch" = its own
# fallback branch (``torch.nn.functional.linear``), taken where oneDNN is unavailable
GEMM_DISPATCH = ("vllm", "torch")


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


@contextmanager
def _gemm_dispatch(gemm: str):
    """Weights bound to GEMM kernels inside this block get ``gemm`` (see ``GEMM_DISPATCH``)."""
    if gemm not in GEMM_DISPATCH:
        raise ValueError(f"gemm must be one of {', '.join(GEMM_DISPATCH)}, got {gemm!r}")
    from vllm import _custom_ops as ops

    saved = ops._supports_onednn
    if gemm == "torch":
        ops._supports_onednn = False
    try:
        yield
    finally:
        ops._supports_onednn = saved


def load_vllm_draft(draft_dir: str | Path, target_dir: str | Path, method: str, num_speculative_tokens: int,
                    gemm: str = "vllm") -> VllmDraft:
    """Build vLLM's draft class for ``draft_dir`` (``method``: dspark | eagle3; the speculative
    config as ``--speculative-config`` would give it) and load its weights; ``gemm`` picks the
    branch of vLLM's CPU GEMM dispatch its linears are bound to (``GEMM_DISPATCH``)."""
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
        with _gemm_dispatch(gemm):
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
    # vLLM's own context K/V path, captured where it writes the cache: one call over every request's
    # context tokens, as its speculator makes it for a batch
    captured = []
    for att in d.attn:
        att._orig.impl.do_kv_cache_update = lambda _layer, k, v, _cache, _slots: captured.append((k.clone(), v.clone()))
    ctx = m.combine_hidden_states(aux.reshape(R * a, -1))
    m.precompute_and_store_context_kv(ctx, torch.arange(a).repeat(R), torch.zeros(R * a, dtype=torch.long))
    for att, (k, v) in zip(d.attn, captured):  # [R*a, Hkv, hd] -> per request [Hkv, a, hd]
        att.context = [(k.view(R, a, att.hkv, att.hd)[r].transpose(0, 1), v.view(R, a, att.hkv, att.hd)[r].transpose(0, 1))
                       for r in range(R)]
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


def kit_float64(drafter):
    """A float64 copy of a kit drafter, its frozen embedding and LM heads too: the exact reference
    that both fp32 implementations are measured against (vLLM's CPU kernels have no float64)."""
    d64 = copy.deepcopy(drafter).double()
    d64._frozen = {k: copy.deepcopy(m).double() for k, m in drafter._frozen.items()}
    return d64


def _out(x):
    """A module's output, first element of vLLM's (out, bias) / (normed, residual) pairs."""
    return x[0] if isinstance(x, tuple) else x


@torch.no_grad()
def bisect_dspark_block(d: VllmDraft, drafter, aux: torch.Tensor, anchor: torch.Tensor) -> list[dict]:
    """Where do vLLM's and the kit's fp32 numbers part? One DSpark block (as ``vllm_dspark_block``),
    every intermediate captured on both sides and compared, first the context path (fc,
    hidden_norm, context K/V after k_norm and RoPE), then per draft layer (input_layernorm,
    q/k/v projections, q and k after q/k norm and RoPE, attention, o_proj, the residual sum,
    post_attention_layernorm, MLP), the final norm and the LM head.

    Rows ``{stage, max_abs_diff, max_abs_value, local_diff}``: ``max_abs_diff`` compares the two
    runs (differences upstream included); ``local_diff``, where given, runs vLLM's op on the
    kit's own input to that stage, so it is that one op's disagreement alone."""
    m, R, a = d.model, aux.shape[0], aux.shape[1]
    K = drafter.cfg.block_size
    got: dict[str, object] = {}
    kit: dict[str, object] = {}
    hooks = []

    def grab(store, name, module):
        hooks.append(module.register_forward_hook(lambda _m, i, o: store.__setitem__(name, (i, o))))

    for i, (vl, kl) in enumerate(zip(m.model.layers, drafter.layers)):
        sa = vl.self_attn
        for name, mod in (("in_norm", vl.input_layernorm), ("qkv", sa.qkv_proj), ("rope", sa.rotary_emb),
                          ("o_proj", sa.o_proj), ("post_norm", vl.post_attention_layernorm), ("mlp", vl.mlp)):
            grab(got, f"{i}.{name}", mod)
        for name, mod in (("in_norm", kl.input_layernorm), ("q", kl.q_proj), ("k", kl.k_proj), ("v", kl.v_proj),
                          ("q_norm", kl.q_norm), ("k_norm", kl.k_norm), ("o_proj", kl.o_proj),
                          ("post_norm", kl.post_attention_layernorm), ("mlp", kl.mlp)):
            grab(kit, f"{i}.{name}", mod)
    grab(kit, "fc", drafter.fc)
    grab(kit, "norm", drafter.norm)
    try:
        vres = vllm_dspark_block(d, aux, anchor, K, drafter.cfg.mask_token_id)
        ctx = [att.context for att in d.attn]  # per layer, per request (k, v) [Hkv, a, hd]
        h_ctx = drafter.context(aux)
        ctx_kv = drafter.context_kv(h_ctx, torch.arange(a).expand(R, a))
        kit_fc = kit.pop("fc")[1]
        drafter.propose(anchor, torch.full((R,), a), ctx_kv, torch.ones(R, a, dtype=torch.bool), torch.zeros(R))
    finally:
        for h in hooks:
            h.remove()
    from vllm import _custom_ops as ops

    rows = []

    def row(stage, mine, ref, local=None):
        rows.append({"stage": stage, "max_abs_diff": float((mine.double() - ref.double()).abs().max()),
                     "max_abs_value": float(ref.abs().max()),
                     "local_diff": None if local is None else float((local.double() - ref.double()).abs().max())})

    v_fc = m.combine_hidden_states(aux.reshape(R * a, -1)).view(R, a, -1)
    row("fc (context)", v_fc, kit_fc)

    def v_hidden_norm(x):
        out = torch.empty_like(x)
        ops.rms_norm(out, x.contiguous(), m.model._hidden_norm_weight, m.model._rms_norm_eps)
        return out

    row("hidden_norm (context; vLLM's ops.rms_norm)", v_hidden_norm(v_fc.reshape(R * a, -1)).view(R, a, -1), h_ctx,
        v_hidden_norm(kit_fc.reshape(R * a, -1)).view(R, a, -1))
    for i, ((kk, kv), per_req) in enumerate(zip(ctx_kv, ctx)):
        row(f"layer {i}: context K (k_proj, k_norm, RoPE)", torch.stack([c[0] for c in per_req]), kk)
        row(f"layer {i}: context V", torch.stack([c[1] for c in per_req]), kv)
    pos = a + torch.arange(K).expand(R, K)
    cos, sin = drafter.rope(pos, h_ctx.dtype)
    from dspark.training.models.layers import apply_rope

    for i, vl in enumerate(m.model.layers):
        sa, L = vl.self_attn, f"layer {i}: "
        H, Hkv, hd = sa.num_heads, sa.num_kv_heads, sa.head_dim

        def heads(x, n):  # vLLM [R*K, n*hd] -> the kit's [R, n, K, hd]
            return x.reshape(R, K, n, hd).transpose(1, 2)

        k_in = kit[f"{i}.in_norm"][1]
        row(L + "input_layernorm", _out(got[f"{i}.in_norm"][1]).view(R, K, -1), k_in)
        q, k, v = _out(got[f"{i}.qkv"][1]).split([sa.q_size, sa.kv_size, sa.kv_size], dim=-1)
        local_q = _out(sa.qkv_proj(k_in.reshape(R * K, -1)))[:, : sa.q_size]
        row(L + "q_proj", q.view(R, K, -1), kit[f"{i}.q"][1], local_q.view(R, K, -1))
        row(L + "k_proj", k.view(R, K, -1), kit[f"{i}.k"][1])
        row(L + "v_proj", v.view(R, K, -1), kit[f"{i}.v"][1])
        kq = apply_rope(kit[f"{i}.q_norm"][1], cos, sin)
        kk = apply_rope(kit[f"{i}.k_norm"][1], cos, sin)
        vq, vk = got[f"{i}.rope"][1]
        local_q, local_k = sa.rotary_emb(pos.reshape(-1), kit[f"{i}.q_norm"][1].transpose(1, 2).reshape(R * K, -1).clone(),
                                         kit[f"{i}.k_norm"][1].transpose(1, 2).reshape(R * K, -1).clone())
        row(L + "q after q_norm + RoPE", heads(vq, H), kq, heads(local_q, H))
        row(L + "k after k_norm + RoPE", heads(vk, Hkv), kk, heads(local_k, Hkv))
        row(L + "attention", got[f"{i}.o_proj"][0][0].view(R, K, -1), kit[f"{i}.o_proj"][0][0])
        row(L + "o_proj", _out(got[f"{i}.o_proj"][1]).view(R, K, -1), kit[f"{i}.o_proj"][1])
        # vLLM adds the residual inside post_attention_layernorm: its second output is the sum
        k_sum = kit[f"{i}.post_norm"][0][0]
        row(L + "residual + attention", got[f"{i}.post_norm"][1][1].view(R, K, -1), k_sum)
        row(L + "post_attention_layernorm", _out(got[f"{i}.post_norm"][1]).view(R, K, -1), kit[f"{i}.post_norm"][1],
            _out(vl.post_attention_layernorm(k_sum.reshape(R * K, -1))).view(R, K, -1))
        row(L + "mlp", got[f"{i}.mlp"][1].view(R, K, -1), kit[f"{i}.mlp"][1],
            vl.mlp(kit[f"{i}.mlp"][0][0].reshape(R * K, -1)).view(R, K, -1))
    k_hidden = kit["norm"][1]
    row("final norm (the LM head's input)", vres.hidden, k_hidden)
    k_logits = drafter.draft_logits(k_hidden).float()
    row("draft logits (LM head)", m.compute_draft_logits(vres.hidden.reshape(R * K, -1)).view(R, K, -1), k_logits,
        m.compute_draft_logits(k_hidden.reshape(R * K, -1)).view(R, K, -1))
    return rows


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
