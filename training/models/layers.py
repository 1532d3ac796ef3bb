"""Target-shaped decoder layers for drafters.

A ``DraftLayer`` has the target's attention/MLP shapes (heads, kv heads, head dim,
intermediate size, norm eps, RoPE of the target config) but its keys/values are the
concatenation of an *external context* (projected target features) and the layer's own
queries' hidden states. Masks are boolean, True = may attend.

Layer styles (``DrafterConfig.layer_style``, recorded in ``drafter.json``):

- ``qwen3``: per-head RMSNorm on q and k whatever the target family: the Qwen3 / DeepSpec
  decoder layer the deployed DSpark loaders (vLLM, TensorRT-LLM) build, so any drafter
  exports without renaming. The default for new drafters (configs/algos/).
- ``llama``: no q/k norm: the Llama decoder layer (the EAGLE-3 midlayer SGLang and vLLM load).
- ``target``: q/k norm exactly when the target family has it. Checkpoints written before the
  field existed are this style (their drafter.json has no ``layer_style``).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


from ..config import LAYER_STYLES
from ..cpu_linear import project


@dataclass
class LayerShape:
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    rms_eps: float
    qk_norm: bool  # Qwen3-style per-head RMSNorm on q and k

    @classmethod
    def from_hf_config(cls, cfg, layer_style: str = "target") -> "LayerShape":
        """The target's shapes; q/k norm from ``layer_style`` (see the module docstring)."""
        if layer_style not in LAYER_STYLES:
            raise ValueError(f"layer_style must be one of {', '.join(LAYER_STYLES)}, got {layer_style!r}")
        heads = cfg.num_attention_heads
        family_qk = getattr(cfg, "model_type", "") in ("qwen3", "qwen3_moe", "gemma3", "gemma3_text")
        return cls(
            hidden_size=cfg.hidden_size,
            num_heads=heads,
            num_kv_heads=getattr(cfg, "num_key_value_heads", None) or heads,
            head_dim=getattr(cfg, "head_dim", None) or cfg.hidden_size // heads,
            intermediate_size=cfg.intermediate_size,
            rms_eps=float(getattr(cfg, "rms_norm_eps", 1e-6)),
            qk_norm={"qwen3": True, "llama": False, "target": family_qk}[layer_style],
        )


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [N, H, T, hd]; cos/sin [N, T, hd]."""
    return x * cos.unsqueeze(1) + rotate_half(x) * sin.unsqueeze(1)


class Rope(nn.Module):
    """RoPE tables computed by the target's own rotary class (handles its scaling type)."""

    def __init__(self, hf_config):
        super().__init__()
        from transformers import AutoModel  # noqa: F401  (ensures the model registry is loaded)
        from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
        params = getattr(hf_config, "rope_parameters", None) or {}
        rope_type = params.get("rope_type", "default") if isinstance(params, dict) else "default"
        if rope_type == "default":
            base = float(params.get("rope_theta", getattr(hf_config, "rope_theta", 10000.0)))
            dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // hf_config.num_attention_heads
            inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
            self.scaling = 1.0
        else:
            inv_freq, self.scaling = ROPE_INIT_FUNCTIONS[rope_type](hf_config, "cpu")
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [N, T] -> cos, sin [N, T, hd]."""
        freqs = positions.float().unsqueeze(-1) * self.inv_freq
        emb = torch.cat([freqs, freqs], dim=-1)
        return (emb.cos() * self.scaling).to(dtype), (emb.sin() * self.scaling).to(dtype)


class SwiGLU(nn.Module):
    def __init__(self, d: int, inter: int):
        super().__init__()
        self.gate_proj = nn.Linear(d, inter, bias=False)
        self.up_proj = nn.Linear(d, inter, bias=False)
        self.down_proj = nn.Linear(inter, d, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, groups: int) -> torch.Tensor:
    """Masked attention: q [N, H, Q, hd], k/v [N, H / groups, S, hd], mask [N, Q, S] bool
    (True = may attend) -> [N, H, Q, hd]; ``groups`` query heads share each K/V head.

    Grouped K/V heads use SDPA's ``enable_gqa``, which the ONNX exporter cannot convert; while
    exporting they are repeated to H heads instead, the same product written out."""
    if groups > 1 and torch.onnx.is_in_onnx_export():
        k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
        groups = 1
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask.unsqueeze(1), enable_gqa=groups > 1)


class DraftLayer(nn.Module):
    """Pre-norm decoder layer attending over [external context K/V ; own K/V]."""

    def __init__(self, s: LayerShape):
        super().__init__()
        self.s = s
        d, hd = s.hidden_size, s.head_dim
        self.q_proj = nn.Linear(d, s.num_heads * hd, bias=False)
        self.k_proj = nn.Linear(d, s.num_kv_heads * hd, bias=False)
        self.v_proj = nn.Linear(d, s.num_kv_heads * hd, bias=False)
        self.o_proj = nn.Linear(s.num_heads * hd, d, bias=False)
        self.q_norm = nn.RMSNorm(hd, eps=s.rms_eps) if s.qk_norm else nn.Identity()
        self.k_norm = nn.RMSNorm(hd, eps=s.rms_eps) if s.qk_norm else nn.Identity()
        self.input_layernorm = nn.RMSNorm(d, eps=s.rms_eps)
        self.post_attention_layernorm = nn.RMSNorm(d, eps=s.rms_eps)
        self.mlp = SwiGLU(d, s.intermediate_size)

    def _heads(self, x: torch.Tensor, n: int) -> torch.Tensor:
        N, T, _ = x.shape
        return x.view(N, T, n, self.s.head_dim).transpose(1, 2)  # (N, n, T, hd)

    def attn_input(self, h: torch.Tensor) -> torch.Tensor:
        """What the q/k/v projections read from the layer input ``h``: its pre-norm."""
        return self.input_layernorm(h)

    def kv(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys/values of hidden states x [N, T, d] at RoPE (cos, sin) -> 2 x [N, Hkv, T, hd]."""
        k = apply_rope(self.k_norm(self._heads(self.k_proj(x), self.s.num_kv_heads)), cos, sin)
        v = self._heads(self.v_proj(x), self.s.num_kv_heads)
        return k, v

    def forward(
        self,
        h: torch.Tensor,  # [N, Q, d_in] layer input at the query positions
        cos: torch.Tensor, sin: torch.Tensor,  # [N, Q, hd] RoPE at the query positions
        ctx_k: torch.Tensor | None, ctx_v: torch.Tensor | None,  # [N, Hkv, T, hd] external context
        mask: torch.Tensor,  # [N, Q, T + Q] bool over [context ; own keys]
    ) -> torch.Tensor:
        x = self.attn_input(h)
        q = apply_rope(self.q_norm(self._heads(self.q_proj(x), self.s.num_heads)), cos, sin)
        k, v = self.kv(x, cos, sin)
        if ctx_k is not None:
            k = torch.cat([ctx_k, k], dim=2)
            v = torch.cat([ctx_v, v], dim=2)
        attn = attend(q, k, v, mask, self.s.num_heads // self.s.num_kv_heads)
        N, _, Q, _ = attn.shape
        h = self.residual(h) + self.o_proj(attn.transpose(1, 2).reshape(N, Q, -1))
        return h + self.mlp(self.post_attention_layernorm(h))

    def residual(self, h: torch.Tensor) -> torch.Tensor:
        """The part of the layer input the attention output is added to (all of it here)."""
        return h


class Eagle3Layer(DraftLayer):
    """The EAGLE-3 first decoder layer: its input is ``[feature ; token embedding]`` (2d wide).

    The q/k/v projections read ``[input_layernorm(embedding) ; hidden_norm(feature)]`` and the
    attention output is added to the un-normed feature; the rest is a ``DraftLayer``. This is
    the ``midlayer`` vLLM's and SGLang's EAGLE-3 models build, so its weights copy over as they are.
    """

    def __init__(self, s: LayerShape):
        super().__init__(s)
        d, hd = s.hidden_size, s.head_dim
        self.q_proj = nn.Linear(2 * d, s.num_heads * hd, bias=False)
        self.k_proj = nn.Linear(2 * d, s.num_kv_heads * hd, bias=False)
        self.v_proj = nn.Linear(2 * d, s.num_kv_heads * hd, bias=False)
        self.hidden_norm = nn.RMSNorm(d, eps=s.rms_eps)

    def attn_input(self, h: torch.Tensor) -> torch.Tensor:
        """h [N, T, 2d] = [feature ; embedding] -> [N, T, 2d] = [norm(embedding) ; norm(feature)]."""
        feature, emb = h.chunk(2, dim=-1)
        return torch.cat([self.input_layernorm(emb), self.hidden_norm(feature)], dim=-1)

    def residual(self, h: torch.Tensor) -> torch.Tensor:
        return h[..., : self.s.hidden_size]


class TargetTiedDrafter(nn.Module):
    """Base of every drafter: target-feature fusion (fc, then RMSNorm unless ``fuse_norm`` is
    False) and the target's frozen embedding and LM head, held outside the module tree so they
    are never saved or trained. ``first_layer``: the class of draft layer 0."""

    def __init__(self, cfg, hf_config, embed: nn.Embedding, lm_head: nn.Linear, fuse_norm: bool = True,
                 first_layer: type[DraftLayer] = DraftLayer):
        super().__init__()
        self.cfg = cfg
        self.shape = LayerShape.from_hf_config(hf_config, getattr(cfg, "layer_style", "target"))
        d = cfg.hidden_size
        self.fc = nn.Linear(cfg.num_aux_layers * d, d, bias=False)
        self.ctx_norm = nn.RMSNorm(d, eps=self.shape.rms_eps) if fuse_norm else None
        self.layers = nn.ModuleList((first_layer if i == 0 else DraftLayer)(self.shape) for i in range(cfg.num_layers))
        self.norm = nn.RMSNorm(d, eps=self.shape.rms_eps)
        self.rope = Rope(hf_config)
        self._frozen = {"embed": embed, "lm_head": lm_head, "draft_head": lm_head}
        self._to_draft: torch.Tensor | None = None  # target id -> draft index (a draft vocabulary only)
        if cfg.draft_vocab_size:
            # the ids are data (chosen from the training records), saved with the weights
            self.register_buffer("draft_ids", torch.arange(cfg.draft_vocab_size, device=lm_head.weight.device))
            self.register_load_state_dict_post_hook(lambda module, _keys: module.set_draft_vocab(module.draft_ids))
            self.set_draft_vocab(self.draft_ids)

    @property
    def embed(self) -> nn.Embedding:
        return self._frozen["embed"]

    @property
    def lm_head(self) -> nn.Linear:
        """The target's LM head (full vocabulary)."""
        return self._frozen["lm_head"]

    @property
    def draft_head(self) -> nn.Linear:
        """The LM head the drafter predicts with: the target's rows at ``draft_ids`` (all of them
        without a draft vocabulary). Frozen, never saved."""
        return self._frozen["draft_head"]

    @property
    def draft_vocab_size(self) -> int:
        return self.draft_head.weight.shape[0]

    def set_draft_vocab(self, ids: torch.Tensor) -> None:
        """Draft over the target ids ``ids`` (sorted, ``cfg.draft_vocab_size`` of them)."""
        from ..draft_vocab import check_draft_ids, target_to_draft

        V = self.lm_head.weight.shape[0]
        ids = ids.to(device=self.lm_head.weight.device, dtype=torch.long)
        check_draft_ids(ids, self.cfg.draft_vocab_size, V)
        with torch.no_grad():
            self.draft_ids.copy_(ids)
            head = nn.Linear(self.lm_head.in_features, ids.numel(), bias=False,
                             device=ids.device, dtype=self.lm_head.weight.dtype)
            head.weight.copy_(self.lm_head.weight.index_select(0, ids))
        head.requires_grad_(False)
        self._frozen["draft_head"] = head
        self._to_draft = target_to_draft(ids, V)

    def to_draft(self, tokens: torch.Tensor) -> torch.Tensor:
        """Target ids -> draft indices (``draft_vocab_size`` for an id outside the draft vocabulary)."""
        return tokens if self._to_draft is None else self._to_draft.to(tokens.device)[tokens]

    def to_target(self, indices: torch.Tensor) -> torch.Tensor:
        """Draft indices -> target ids."""
        return indices if self._to_draft is None else self.draft_ids.to(indices.device)[indices]

    def draft_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Normed hidden [..., d] -> logits over the draft vocabulary [..., N].

        The LM head is the largest product of a drafting step, so this one place runs it through
        ``cpu_linear.project`` (the small-row kernel on CPU inference; ``F.linear`` under
        autograd, on GPUs and while exporting) rather than each caller choosing."""
        return project(self.draft_head, hidden)

    def fuse(self, aux: torch.Tensor) -> torch.Tensor:
        """Target features [N, T, m*d] -> fused context [N, T, d]."""
        h = self.fc(aux)
        return h if self.ctx_norm is None else self.ctx_norm(h)


def copy_target_layers(layers: nn.ModuleList, target_layers: nn.ModuleList) -> list[int]:
    """Start draft layers from the target's top decoder layers (draft layer i <- target layer
    L - n + i), the layers nearest to what the drafter predicts. On SmolLM2 this was within the
    noise of random weights (docs/benchmarks/train_probe_recipe.md); it is an option, not the
    default. Returns the target layer ids used.

    The target layers follow transformers' decoder-layer naming (``self_attn.{q,k,v,o}_proj``,
    optional ``self_attn.{q,k}_norm``, ``mlp``, the two layer norms). Every shape is checked
    before anything is copied, so a target that does not fit is refused, not half copied."""
    n, L = len(layers), len(target_layers)
    if n > L:
        raise ValueError(f"cannot start {n} draft layers from a {L}-layer target")
    ids = list(range(L - n, L))
    pairs = []  # (draft module, target module, target layer id)
    for draft, i in zip(layers, ids):
        src = target_layers[i]
        attn = src.self_attn
        mods = [(draft.q_proj, attn.q_proj), (draft.k_proj, attn.k_proj), (draft.v_proj, attn.v_proj),
                (draft.o_proj, attn.o_proj), (draft.input_layernorm, src.input_layernorm),
                (draft.post_attention_layernorm, src.post_attention_layernorm),
                (draft.mlp.gate_proj, src.mlp.gate_proj), (draft.mlp.up_proj, src.mlp.up_proj),
                (draft.mlp.down_proj, src.mlp.down_proj)]
        if draft.s.qk_norm and hasattr(attn, "q_norm"):  # a target without q/k norms leaves them at 1
            mods += [(draft.q_norm, attn.q_norm), (draft.k_norm, attn.k_norm)]
        pairs += [(dst, s, i) for dst, s in mods]
    for dst, s, i in pairs:
        if dst.weight.shape != s.weight.shape:
            raise ValueError(f"target layer {i}: {type(s).__name__} weight {tuple(s.weight.shape)} does not fit "
                             f"the draft layer's {tuple(dst.weight.shape)}")
    with torch.no_grad():
        for dst, s, _ in pairs:
            dst.weight.copy_(s.weight.to(dst.weight.dtype))
    return ids
