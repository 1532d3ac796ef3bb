"""Attention over each query's true context, straight from the slot KV cache, on the CPU.

Each packed query token ``n`` (cache slot ``slot[n]``, absolute position ``pos[n]``) attends
exactly the keys ``0..pos[n]`` of its own slot (causal inside a verify block falls out of
the positions). Tokens of one slot at consecutive positions (a verify block, or up to 16
tokens of a prompt chunk) form a block whose keys and values are streamed from memory once
for all of them: decode attention is bound by reading the cache, so a verify block's drafts
add arithmetic, not another pass over the row's context. One C++ loop runs parallel over
(block, KV head) on torch's intra-op threads. There is no mask tensor and no padding, so a
step costs the keys its tokens really read: a long request in the batch does not make every
other row pay its context (as masked attention over a [rows, longest row] grid would), and
no [rows, queries, context] mask is built and converted on each step. Each token's
arithmetic (dot products, softmax, weighted sum, in key order) is the same whatever block
it is in, so its output does not depend on the other tokens of the step.

The kernel is built on first use (``plugins/cpu_build.py``: once per machine, cached on
disk) and registered as ``torch.ops.dspark.varlen_attention``, with a fake kernel, so
``torch.compile`` keeps it inside a compiled graph. ``available()`` says whether it could
be built; the engine then uses ``scaled_dot_product_attention`` and says so in its log.
``reference()`` is the same computation in PyTorch, one token at a time, for tests.
"""
from __future__ import annotations

import torch

from dspark.plugins.cpu_build import CpuExtension

__all__ = ["available", "varlen_attention", "reference", "KERNEL_SOURCE", "BLOCK"]

BLOCK = 16  # most query tokens per block (the kernel's kAttentionBlock)

KERNEL_SOURCE = r"""
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <cmath>
#include <vector>
#include <algorithm>

// Most query tokens of one block by default: a verify block (1 + drafts) fits whole; a prompt chunk is cut
// into blocks of this many, so that its attention still spreads over the threads.
static constexpr int64_t kAttentionBlock = 16;

// q [N, Hq, D]; k, v [S, Hkv, C, D] (the cache of one layer); slot, pos [N] int64.
// Token n attends keys 0..min(pos[n], limit - 1) of cache slot slot[n]. Up to `block` tokens of one slot at
// consecutive positions form a block whose keys are read once for all of them; work items are (block, KV head).
static at::Tensor varlen_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                            const at::Tensor& slot, const at::Tensor& pos, double scale, int64_t limit,
                            int64_t block = kAttentionBlock) {
  TORCH_CHECK(block >= 1, "varlen_attention: block must be >= 1");
  TORCH_CHECK(q.dim() == 3 && k.dim() == 4 && v.dim() == 4, "varlen_attention: q [N,Hq,D], k/v [S,Hkv,C,D]");
  TORCH_CHECK(q.scalar_type() == at::kFloat && k.scalar_type() == at::kFloat && v.scalar_type() == at::kFloat,
              "varlen_attention: float32 tensors");
  TORCH_CHECK(k.sizes() == v.sizes(), "varlen_attention: k and v differ in shape");
  TORCH_CHECK(k.stride(3) == 1 && v.stride(3) == 1 && k.stride(2) == k.size(3) && v.stride(2) == v.size(3),
              "varlen_attention: each cache row must be contiguous");
  const at::Tensor qc = q.contiguous();
  const at::Tensor sl = slot.to(at::kLong).contiguous(), ps = pos.to(at::kLong).contiguous();
  const int64_t N = qc.size(0), Hq = qc.size(1), D = qc.size(2), Hkv = k.size(1), C = k.size(2);
  TORCH_CHECK(k.size(3) == D && Hq % Hkv == 0 && sl.numel() == N && ps.numel() == N,
              "varlen_attention: shapes disagree");
  const int64_t G = Hq / Hkv;
  const int64_t lim = std::min<int64_t>(limit > 0 ? limit : C, C);
  at::Tensor out = at::empty({N, Hq, D}, qc.options());
  const float* qp = qc.data_ptr<float>();
  const float* kp = k.data_ptr<float>();
  const float* vp = v.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const int64_t* sp = sl.data_ptr<int64_t>();
  const int64_t* pp = ps.data_ptr<int64_t>();
  for (int64_t n = 0; n < N; ++n)
    TORCH_CHECK(sp[n] >= 0 && sp[n] < k.size(0) && std::min<int64_t>(pp[n] + 1, lim) >= 1,
                "varlen_attention: slot or position out of range");
  std::vector<int64_t> starts;  // block b holds tokens starts[b] .. starts[b + 1] - 1
  for (int64_t n = 0; n < N; ++n)
    if (n == 0 || sp[n] != sp[n - 1] || pp[n] != pp[n - 1] + 1 || n - starts.back() == block)
      starts.push_back(n);
  starts.push_back(N);
  const int64_t B = static_cast<int64_t>(starts.size()) - 1;
  const int64_t ks0 = k.stride(0), ks1 = k.stride(1), vs0 = v.stride(0), vs1 = v.stride(1);
  const float sc = static_cast<float>(scale);
  at::parallel_for(0, B * Hkv, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> score;
    std::vector<float> acc;
    std::vector<int64_t> len;
    for (int64_t i = begin; i < end; ++i) {
      const int64_t b = i / Hkv, h = i % Hkv;
      const int64_t n0 = starts[b], M = starts[b + 1] - n0;
      const int64_t s = sp[n0];
      len.resize(M);
      int64_t T = 0;  // keys of the block: the most any of its tokens reads
      for (int64_t m = 0; m < M; ++m) {
        len[m] = std::min<int64_t>(pp[n0 + m] + 1, lim);
        T = std::max(T, len[m]);
      }
      const float* K = kp + s * ks0 + h * ks1;
      const float* V = vp + s * vs0 + h * vs1;
      // row (m, g): token n0 + m, query head h * G + g; its scores over keys 0..len[m] - 1
      score.resize(M * G * T);
      for (int64_t t = 0; t < T; ++t) {
        const float* kr = K + t * D;
        for (int64_t m = 0; m < M; ++m) {
          if (t >= len[m]) continue;
          const float* Q = qp + ((n0 + m) * Hq + h * G) * D;
          for (int64_t g = 0; g < G; ++g) {
            const float* qr = Q + g * D;
            float dot = 0.f;
#pragma omp simd reduction(+:dot)
            for (int64_t d = 0; d < D; ++d) dot += qr[d] * kr[d];
            score[(m * G + g) * T + t] = dot * sc;
          }
        }
      }
      std::vector<float> inv(M * G);
      for (int64_t m = 0; m < M; ++m) {
        const int64_t Tm = len[m];
        for (int64_t g = 0; g < G; ++g) {
          float* row = score.data() + (m * G + g) * T;
          float mx = row[0];
          for (int64_t t = 1; t < Tm; ++t) mx = std::max(mx, row[t]);
          float sum = 0.f;
          for (int64_t t = 0; t < Tm; ++t) { row[t] = std::exp(row[t] - mx); sum += row[t]; }
          inv[m * G + g] = 1.f / sum;
        }
      }
      acc.assign(M * G * D, 0.f);
      for (int64_t t = 0; t < T; ++t) {
        const float* vr = V + t * D;
        for (int64_t m = 0; m < M; ++m) {
          if (t >= len[m]) continue;
          for (int64_t g = 0; g < G; ++g) {
            const float p = score[(m * G + g) * T + t];
            float* a = acc.data() + (m * G + g) * D;
#pragma omp simd
            for (int64_t d = 0; d < D; ++d) a[d] += p * vr[d];
          }
        }
      }
      for (int64_t m = 0; m < M; ++m)
        for (int64_t g = 0; g < G; ++g) {
          float* o = op + ((n0 + m) * Hq + h * G + g) * D;
          const float* a = acc.data() + (m * G + g) * D;
          const float iv = inv[m * G + g];
          for (int64_t d = 0; d < D; ++d) o[d] = a[d] * iv;
        }
    }
  });
  return out;
}
"""

_OP_SOURCE = r"""
TORCH_LIBRARY(dspark, m) {
  m.def("varlen_attention(Tensor q, Tensor k, Tensor v, Tensor slot, Tensor pos, float scale, int limit, "
        "int block) -> Tensor");
  m.impl("varlen_attention", c10::DispatchKey::CPU, &varlen_attention);
}
"""

def _check(_) -> None:
    _register_fake()


_EXTENSION = CpuExtension("dspark_varlen_attention", lambda: KERNEL_SOURCE + _OP_SOURCE,
                          "attention runs on a padded grid", check=_check)


def available() -> bool:
    """Build the kernel on first use (``plugins/cpu_build.py``); False where it cannot be built."""
    return _EXTENSION.load() is not None


def _register_fake() -> None:
    @torch.library.register_fake("dspark::varlen_attention")
    def _(q, k, v, slot, pos, scale, limit, block):
        return q.new_empty(q.shape)


def varlen_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slot: torch.Tensor, pos: torch.Tensor,
                     scale: float, limit: int = 0, block: int = BLOCK) -> torch.Tensor:
    """Attention of packed queries ``q [N, Hq, D]`` over their own cache rows -> ``[N, Hq, D]``.

    ``k, v [S, Hkv, C, D]`` are one layer's cache (each (slot, head) a contiguous [C, D]
    block), ``slot [N]`` each token's cache slot and ``pos [N]`` its absolute position: token
    ``n`` attends keys ``0..pos[n]`` (at most the first ``limit`` > 0), its own K/V included,
    so they must be written first. Grouped-query heads: q head ``j`` reads KV head ``j // (Hq / Hkv)``.
    ``block``: most tokens that share one read of their row's keys (1: every token reads its own)."""
    return torch.ops.dspark.varlen_attention(q, k, v, slot, pos, float(scale), int(limit), int(block))


def reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slot: torch.Tensor, pos: torch.Tensor,
              scale: float, limit: int = 0) -> torch.Tensor:
    """``varlen_attention`` in PyTorch, one token at a time (tests)."""
    N, Hq, D = q.shape
    G = Hq // k.shape[1]
    out = torch.empty_like(q)
    for n in range(N):
        T = int(pos[n]) + 1
        if limit > 0:
            T = min(T, limit)
        keys = k[int(slot[n]), :, :T].repeat_interleave(G, dim=0)  # [Hq, T, D]
        vals = v[int(slot[n]), :, :T].repeat_interleave(G, dim=0)
        w = torch.softmax((keys @ q[n].unsqueeze(-1)).squeeze(-1) * scale, dim=-1)  # [Hq, T]
        out[n] = (w.unsqueeze(1) @ vals).squeeze(1)
    return out
