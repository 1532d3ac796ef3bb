"""The target's decoder layers as one C++ call per step, for float32 targets on the CPU.

A SmolLM2-size step runs 30 layers of about 35 small PyTorch operators each (norms, three
projections, rotary embedding, cache writes, attention, residuals, the gated MLP). One
request at a time that is about a thousand dispatches whose bookkeeping costs a third as
much as streaming the weights. ``DecoderStack`` holds the layers' weights (the target's own
tensors, not copies) and runs the whole stack in C++: RMSNorm, the q/k/v/o and MLP products
on weights packed once and shared by the engines on one target (``cpu_gemm``,
``shared_stack``), the Qwen3 per-head q/k norms where the target has them, rotary embedding,
the cache writes and the packed varlen attention of ``cpu_attention``, with the arithmetic of
the Python layer (``TargetRunner._layer``): the same operations in the same order per element,
so the two agree to float32 rounding of the reductions (norm means, softmax sums), which the
tests check along with identical greedy decoding.

Built on first use like the kernels it includes (``plugins/cpu_build.py``);
``available()`` says whether it built. ``supports(target)`` says whether a target's layers
have the shape this stack computes (Llama-family attention, SiLU-gated MLP, float32 on the
CPU); the runner keeps its Python layer for every other case.
"""
from __future__ import annotations

import weakref

import torch

from dspark.training import cpu_gemm, cpu_linear
from dspark.plugins.cpu_build import CpuExtension

from . import cpu_attention

__all__ = ["available", "supports", "shared_stack", "DecoderStack"]

_STACK_SOURCE = r"""
#include <pybind11/stl.h>
#include <ATen/record_function.h>

namespace {

using OptT = c10::optional<at::Tensor>;

// x [N, d] -> w * (x * rsqrt(mean(x^2) + eps)), the Llama-family RMSNorm, row by row
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& w, double eps) {
  const int64_t N = x.size(0), d = x.size(1);
  at::Tensor out = at::empty_like(x);
  const float* xp = x.data_ptr<float>();
  const float* wp = w.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const float e = static_cast<float>(eps);
  at::parallel_for(0, N, 16, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const float* xr = xp + r * d;
      float ss = 0.f;
#pragma omp simd reduction(+:ss)
      for (int64_t k = 0; k < d; ++k) ss += xr[k] * xr[k];
      const float inv = 1.f / std::sqrt(ss / static_cast<float>(d) + e);
      float* orow = op + r * d;
#pragma omp simd
      for (int64_t k = 0; k < d; ++k) orow[k] = wp[k] * (xr[k] * inv);
    }
  });
  return out;
}

// q [N, H, D] in place: q * cos + rotate_half(q) * sin, cos / sin [N, D]
void rotate(at::Tensor& q, const at::Tensor& cos, const at::Tensor& sin) {
  const int64_t N = q.size(0), H = q.size(1), D = q.size(2), half = D / 2;
  float* qp = q.data_ptr<float>();
  const float* cp = cos.data_ptr<float>();
  const float* sp = sin.data_ptr<float>();
  at::parallel_for(0, N * H, 64, [&](int64_t i0, int64_t i1) {
    std::vector<float> x(D);
    for (int64_t i = i0; i < i1; ++i) {
      float* row = qp + i * D;
      const float* c = cp + (i / H) * D;
      const float* s = sp + (i / H) * D;
      std::copy(row, row + D, x.begin());
      for (int64_t k = 0; k < half; ++k) row[k] = x[k] * c[k] + (-x[k + half]) * s[k];
      for (int64_t k = half; k < D; ++k) row[k] = x[k] * c[k] + x[k - half] * s[k];
    }
  });
}

struct Layer {
  at::Tensor norm1, wq, wk, wv, wo, norm2, wg, wu, wd;
  OptT bq, bk, bv, bo, q_norm, k_norm;
  at::Tensor pq, pk, pv, po, pg, pu, pd;  // the projections packed for dspark_gemm::gemm
};

class DecoderStack {
 public:
  // pack: keep packed copies of the projections (else every product is at::linear on the weights)
  DecoderStack(std::vector<std::vector<OptT>> layers, double eps, double qk_eps, int64_t n_heads, int64_t n_kv,
               int64_t head_dim, double scale, std::vector<int64_t> capture, bool pack)
      : eps_(eps), qk_eps_(qk_eps), hq_(n_heads), hkv_(n_kv), hd_(head_dim), scale_(scale),
        capture_(std::move(capture)), packed_(pack) {
    for (auto& t : layers) {
      TORCH_CHECK(t.size() == 15, "DecoderStack: 15 tensors per layer");
      Layer l{*t[0], *t[1], *t[2], *t[3], *t[4], *t[5], *t[6], *t[7], *t[8], t[9], t[10], t[11], t[12], t[13], t[14]};
      if (pack) {
        l.pq = dspark_gemm::pack(l.wq); l.pk = dspark_gemm::pack(l.wk); l.pv = dspark_gemm::pack(l.wv);
        l.po = dspark_gemm::pack(l.wo); l.pg = dspark_gemm::pack(l.wg); l.pu = dspark_gemm::pack(l.wu);
        l.pd = dspark_gemm::pack(l.wd);
      }
      layers_.push_back(std::move(l));
    }
  }

  // h [N, d] packed tokens; cos / sin [N, D]; caches [L, S, Hkv, C, D]; dest [N * Hkv] flat cache rows
  // of each token's heads in one layer's cache; rows / apos [N]: each token's slot and attention limit.
  // -> (h after the last layer, h after each captured layer)
  std::tuple<at::Tensor, std::vector<at::Tensor>> forward(
      at::Tensor h, const at::Tensor& cos, const at::Tensor& sin, const at::Tensor& kcache,
      const at::Tensor& vcache, const at::Tensor& dest, const at::Tensor& rows, const at::Tensor& apos,
      int64_t limit, int64_t block) {
    TORCH_CHECK(h.dim() == 2 && h.scalar_type() == at::kFloat, "DecoderStack: h [N, d] float32");
    TORCH_CHECK(kcache.size(0) == static_cast<int64_t>(layers_.size()), "DecoderStack: one cache per layer");
    const at::Tensor c = cos.contiguous(), s = sin.contiguous();
    h = h.contiguous();
    const int64_t N = h.size(0);
    std::vector<at::Tensor> captured;
    for (size_t li = 0; li < layers_.size(); ++li) {
      const Layer& L = layers_[li];
      // named scopes: what torch.profiler shows of the stack (free when no profiler runs)
      at::Tensor x, q, k, v, o;
      {
        RECORD_FUNCTION("dspark_stack::norm_qkv", std::vector<c10::IValue>());
        x = rms_norm(h, L.norm1, eps_);
        q = proj(x, L.wq, L.pq, L.bq).view({N, hq_, hd_});
        k = proj(x, L.wk, L.pk, L.bk).view({N, hkv_, hd_});
        v = proj(x, L.wv, L.pv, L.bv).view({N, hkv_, hd_});
      }
      at::Tensor kc = kcache.select(0, li), vc = vcache.select(0, li);
      {
        RECORD_FUNCTION("dspark_stack::rope_cache_write", std::vector<c10::IValue>());
        if (L.q_norm.has_value()) {
          q = rms_norm(q.view({N * hq_, hd_}), *L.q_norm, qk_eps_).view({N, hq_, hd_});
          k = rms_norm(k.view({N * hkv_, hd_}), *L.k_norm, qk_eps_).view({N, hkv_, hd_});
        }
        rotate(q, c, s);
        rotate(k, c, s);
        kc.view({-1, hd_}).index_copy_(0, dest, k.view({-1, hd_}));
        vc.view({-1, hd_}).index_copy_(0, dest, v.view({-1, hd_}));
      }
      {
        RECORD_FUNCTION("dspark_stack::attention", std::vector<c10::IValue>());
        o = varlen_attention(q, kc, vc, rows, apos, scale_, limit, block).view({N, hq_ * hd_});
      }
      {
        RECORD_FUNCTION("dspark_stack::o_proj", std::vector<c10::IValue>());
        h = proj(o, L.wo, L.po, L.bo).add_(h);
      }
      at::Tensor g;
      {
        RECORD_FUNCTION("dspark_stack::norm_gate_up", std::vector<c10::IValue>());
        x = rms_norm(h, L.norm2, eps_);
        g = proj(x, L.wg, L.pg, c10::nullopt);
        at::Tensor u = proj(x, L.wu, L.pu, c10::nullopt);
        silu_mul(g, u);
      }
      {
        RECORD_FUNCTION("dspark_stack::down", std::vector<c10::IValue>());
        h = proj(g, L.wd, L.pd, c10::nullopt).add_(h);
      }
      if (std::find(capture_.begin(), capture_.end(), static_cast<int64_t>(li)) != capture_.end())
        captured.push_back(h);
    }
    return {h, captured};
  }

 private:
  at::Tensor proj(const at::Tensor& x, const at::Tensor& w, const at::Tensor& packed, const OptT& b) const {
    if (packed_) return dspark_gemm::gemm(x, packed, w.size(0), b);
    return at::linear(x, w, b);
  }

  // g = silu(g) * u, in place (the gated MLP's act_fn(gate) * up)
  static void silu_mul(at::Tensor& g, const at::Tensor& u) {
    float* gp = g.data_ptr<float>();
    const float* up = u.data_ptr<float>();
    at::parallel_for(0, g.numel(), 4096, [&](int64_t i0, int64_t i1) {
      for (int64_t i = i0; i < i1; ++i) gp[i] = gp[i] / (1.f + std::exp(-gp[i])) * up[i];
    });
  }

  std::vector<Layer> layers_;
  double eps_, qk_eps_;
  int64_t hq_, hkv_, hd_;
  double scale_;
  std::vector<int64_t> capture_;
  bool packed_;
};

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  pybind11::class_<DecoderStack>(m, "DecoderStack")
      .def(pybind11::init<std::vector<std::vector<OptT>>, double, double, int64_t, int64_t, int64_t, double,
                          std::vector<int64_t>, bool>())
      .def("forward", &DecoderStack::forward, pybind11::call_guard<pybind11::gil_scoped_release>());
}
"""

_EXTENSION = CpuExtension("dspark_decoder_stack",
                          lambda: cpu_gemm.KERNEL_SOURCE + cpu_attention.KERNEL_SOURCE + _STACK_SOURCE,
                          "the layers run in PyTorch", python_module=True)


def available() -> bool:
    """Build the stack on first use (``plugins/cpu_build.py``); False where it or the kernels
    it includes cannot be built."""
    return cpu_gemm.available() and cpu_attention.available() and _EXTENSION.load() is not None


def supports(target) -> str | None:
    """None when ``DecoderStack`` computes this target's layers exactly as they are; else why not."""
    p = next(target.model.parameters())
    if p.device.type != "cpu" or p.dtype != torch.float32:
        return "the fused stack runs float32 targets on the CPU"
    cfg = target.config
    if getattr(cfg, "hidden_act", "silu") != "silu":
        return f"hidden_act {cfg.hidden_act!r} (the fused stack has SiLU)"
    for layer in target.layers:
        attn, mlp = layer.self_attn, layer.mlp
        if not all(hasattr(mlp, n) for n in ("gate_proj", "up_proj", "down_proj")):
            return "a layer without the gated MLP"
        if any(getattr(mlp, n).bias is not None for n in ("gate_proj", "up_proj", "down_proj")):
            return "MLP biases"
        if hasattr(attn, "q_norm") != hasattr(attn, "k_norm"):
            return "a q norm without a k norm"
        if getattr(attn, "sliding_window", None):
            return "sliding-window attention"
    return None


def _norm_eps(norm: torch.nn.Module) -> float:
    return float(getattr(norm, "variance_epsilon", getattr(norm, "eps", 1e-6)))


def _layer_tensors(target) -> list[list[torch.Tensor | None]]:
    """Per layer the 15 tensors ``DecoderStack`` takes, in its order."""
    layers = []
    for layer in target.layers:
        a, m = layer.self_attn, layer.mlp
        qn, kn = getattr(a, "q_norm", None), getattr(a, "k_norm", None)
        layers.append([layer.input_layernorm.weight, a.q_proj.weight, a.k_proj.weight, a.v_proj.weight,
                       a.o_proj.weight, layer.post_attention_layernorm.weight, m.gate_proj.weight,
                       m.up_proj.weight, m.down_proj.weight, a.q_proj.bias, a.k_proj.bias, a.v_proj.bias,
                       a.o_proj.bias, None if qn is None else qn.weight, None if kn is None else kn.weight])
    return layers


# target -> (n_heads, n_kv, head_dim, capture, packed) -> (the weights' fingerprint, a weak reference to its stack)
_SHARED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def shared_stack(target, n_heads: int, n_kv: int, head_dim: int, capture: list[int]) -> DecoderStack:
    """The target's ``DecoderStack``: every runner on one target gets the same stack while any
    holds it (it holds weights only; each runner passes its own caches).

    One packed copy per target, not per engine: engines that run side by side in one process (the
    lockstep benchmarks, a target-only and a speculative engine on one loaded target) then read
    the same weight memory, and a copy's own speed does not enter their comparison (separately
    packed copies of one target ran a step 1-6% apart on a 2-core host, the first packed the
    slowest), nor does a second copy's memory. Held weakly here: a target that runs no engine
    keeps no packed copy. Rebuilt when the target's weights were replaced or changed in place
    since it was packed (their storage or version counters), or when the packing choice
    (``DSPARK_CPU_LINEAR``) differs."""
    layers = _layer_tensors(target)
    fingerprint = tuple((t.data_ptr(), t._version) for ts in layers for t in ts if t is not None)
    key = (n_heads, n_kv, head_dim, tuple(capture), cpu_linear.mode() == "kernel")
    stacks = _SHARED.setdefault(target, {})
    held = stacks.get(key)
    stack = held[1]() if held is not None and held[0] == fingerprint else None
    if stack is None:
        stack = DecoderStack(target, n_heads, n_kv, head_dim, capture)
        stacks[key] = (fingerprint, weakref.ref(stack))
    return stack


class DecoderStack:
    """The target's decoder layers as one C++ call (``available()`` and ``supports`` first;
    runners take theirs from ``shared_stack``)."""

    def __init__(self, target, n_heads: int, n_kv: int, head_dim: int, capture: list[int]):
        """Packs the projections once (``cpu_gemm``) unless ``DSPARK_CPU_LINEAR=flinear``."""
        layers = _layer_tensors(target)
        for tensors in layers:
            for t in tensors:
                if t is not None and not t.is_contiguous():
                    raise ValueError("DecoderStack: the target's weights must be contiguous")
        first = target.layers[0]
        qk_eps = _norm_eps(first.self_attn.q_norm) if hasattr(first.self_attn, "q_norm") else 0.0
        # the packing choice is made here, once: DSPARK_CPU_LINEAR set later does not change a built stack
        self._stack = _EXTENSION.load().DecoderStack(layers, _norm_eps(first.input_layernorm), qk_eps, n_heads, n_kv,
                                                  head_dim, float(first.self_attn.scaling), list(capture),
                                                  cpu_linear.mode() == "kernel")

    def forward(self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                dest: torch.Tensor, rows: torch.Tensor, apos: torch.Tensor, limit: int,
                block: int = cpu_attention.BLOCK) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """``h [N, d]`` through every layer -> (h after the last, h after each captured layer).

        ``cos, sin [N, head_dim]``; ``k, v`` the runner's caches ``[L, slots, kv heads, C,
        head_dim]``; ``dest [N * kv heads]`` each token's cache rows in one layer's cache seen
        as ``[slots * kv heads * C, head_dim]``; ``rows, apos [N]`` each token's slot and the
        last position it attends; ``block`` as in ``cpu_attention.varlen_attention``."""
        return self._stack.forward(h, cos, sin, k, v, dest, rows, apos, int(limit), int(block))
