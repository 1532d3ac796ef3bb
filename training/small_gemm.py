"""A row-invariant float32 ``x @ W^T`` for the few-row products of CPU decoding.

A decode or verify step multiplies a few rows (one per request and draft position) by every
weight of the target, so it is bound by streaming the weights from memory, not by
arithmetic. General BLAS kernels are built for the opposite case: at 2-64 rows they pack
the weight into a scratch buffer first (read and write it all again) or fall back to
matrix-vector loops that read it once per row, which made a 4-token verify cost about twice
a 1-token step on the Xeon this kit is measured on. This kernel reads each weight row
once per call, whatever the row count, straight from the ``nn.Linear`` layout ``W [N, K]``
(no second packed copy of the weights): a tile of up to 4 input rows x 4 weight rows keeps
16 accumulators of 16 lanes, the weight rows stream through them, and the input rows stay
in L1 / L2.

Row invariance: output ``[m, n]`` is computed by the same instruction sequence (16 lane
partial sums over ``k`` in order, then one fixed reduction) whatever the number of rows,
the tile it falls in and the thread that runs it. A token's logits are therefore bit for bit
the same alone, in a 64-row batch, or at draft position 5 of a verify block, which makes
"greedy speculative output = target-only output" exact arithmetic rather than a near-tie
argument; the tests check it directly.

Built on first use (``cpu_build``) for AVX-512 or AVX2+FMA, and registered as
``torch.ops.dspark_gemm.small_gemm``. ``available()`` is False where neither
instruction set or no compiler is present; ``cpu_linear.linear`` then uses ``F.linear``.
"""
from __future__ import annotations

import torch

from .cpu_build import CpuExtension

__all__ = ["available", "small_gemm", "KERNEL_SOURCE"]

KERNEL_SOURCE = r"""
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <algorithm>

#if defined(__AVX512F__)
// 16 lanes in one register
struct Acc {
  __m512 v;
  inline void zero() { v = _mm512_setzero_ps(); }
  static inline __m512 load(const float* p) { return _mm512_loadu_ps(p); }
  static inline __m512 load_tail(const float* p, int n) {
    return _mm512_maskz_loadu_ps((__mmask16)((1u << n) - 1u), p);
  }
  inline void fma(__m512 a, __m512 b) { v = _mm512_fmadd_ps(a, b, v); }
  // the sums of four accumulators, each by one fixed tree: lanes i + i+8, then + (i+4 + i+12),
  // then (0 + 2) + (1 + 3); every output element gets it, whichever three others share the call
  static inline void sum4(const Acc& a, const Acc& b, const Acc& c, const Acc& d, float* s) {
    const __m512 ab = _mm512_add_ps(_mm512_shuffle_f32x4(a.v, b.v, 0x44), _mm512_shuffle_f32x4(a.v, b.v, 0xEE));
    const __m512 cd = _mm512_add_ps(_mm512_shuffle_f32x4(c.v, d.v, 0x44), _mm512_shuffle_f32x4(c.v, d.v, 0xEE));
    const __m512 u = _mm512_add_ps(_mm512_shuffle_f32x4(ab, cd, 0x88), _mm512_shuffle_f32x4(ab, cd, 0xDD));
    const __m512 p = _mm512_add_ps(u, _mm512_permute_ps(u, 0x4E));
    const __m512 q = _mm512_add_ps(p, _mm512_permute_ps(p, 0xB1));
    alignas(64) float lanes[16];
    _mm512_store_ps(lanes, q);
    s[0] = lanes[0]; s[1] = lanes[4]; s[2] = lanes[8]; s[3] = lanes[12];
  }
};
typedef __m512 Vec;
#define DSPARK_SMALL_GEMM_OK 1
#elif defined(__AVX2__) && defined(__FMA__)
// 16 lanes in two registers
struct Vec { __m256 lo, hi; };
struct Acc {
  __m256 lo, hi;
  inline void zero() { lo = _mm256_setzero_ps(); hi = _mm256_setzero_ps(); }
  static inline Vec load(const float* p) { return Vec{_mm256_loadu_ps(p), _mm256_loadu_ps(p + 8)}; }
  static inline Vec load_tail(const float* p, int n) {
    alignas(32) float buf[16] = {0};
    for (int i = 0; i < n; ++i) buf[i] = p[i];
    return Vec{_mm256_load_ps(buf), _mm256_load_ps(buf + 8)};
  }
  inline void fma(Vec a, Vec b) { lo = _mm256_fmadd_ps(a.lo, b.lo, lo); hi = _mm256_fmadd_ps(a.hi, b.hi, hi); }
  inline float sum() const {
    __m256 s = _mm256_add_ps(lo, hi);
    __m128 q = _mm_add_ps(_mm256_castps256_ps128(s), _mm256_extractf128_ps(s, 1));
    q = _mm_add_ps(q, _mm_movehl_ps(q, q));
    q = _mm_add_ss(q, _mm_movehdup_ps(q));
    return _mm_cvtss_f32(q);
  }
  static inline void sum4(const Acc& a, const Acc& b, const Acc& c, const Acc& d, float* s) {
    s[0] = a.sum(); s[1] = b.sum(); s[2] = c.sum(); s[3] = d.sum();
  }
};
#define DSPARK_SMALL_GEMM_OK 1
#endif

#ifdef DSPARK_SMALL_GEMM_OK
// out[m, n] = sum_k x[m, k] * w[n, k] (+ bias[n]) for m < MB rows of x, n < NB rows of w.
// Every output element runs the same sequence: lane partial sums over k in order, one reduction.
template <int MB, int NB>
static inline void tile(const float* x, int64_t ldx, const float* w, int64_t ldw, int64_t K,
                        const float* bias, float* out, int64_t ldo) {
  Acc acc[MB][NB];
  for (int m = 0; m < MB; ++m)
    for (int n = 0; n < NB; ++n) acc[m][n].zero();
  const int64_t K16 = K & ~int64_t(15);
  for (int64_t k = 0; k < K16; k += 16) {
    Vec wv[NB];
    for (int n = 0; n < NB; ++n) {
      wv[n] = Acc::load(w + n * ldw + k);
      _mm_prefetch(reinterpret_cast<const char*>(w + (n + NB) * ldw + k), _MM_HINT_T0);
    }
    for (int m = 0; m < MB; ++m) {
      const Vec xv = Acc::load(x + m * ldx + k);
      for (int n = 0; n < NB; ++n) acc[m][n].fma(xv, wv[n]);
    }
  }
  if (K16 < K) {
    const int rest = static_cast<int>(K - K16);
    Vec wv[NB];
    for (int n = 0; n < NB; ++n) wv[n] = Acc::load_tail(w + n * ldw + K16, rest);
    for (int m = 0; m < MB; ++m) {
      const Vec xv = Acc::load_tail(x + m * ldx + K16, rest);
      for (int n = 0; n < NB; ++n) acc[m][n].fma(xv, wv[n]);
    }
  }
  Acc zero;
  zero.zero();
  for (int m = 0; m < MB; ++m)
    for (int n = 0; n < NB; n += 4) {
      float s[4];
      Acc::sum4(acc[m][n], n + 1 < NB ? acc[m][n + 1] : zero, n + 2 < NB ? acc[m][n + 2] : zero,
                n + 3 < NB ? acc[m][n + 3] : zero, s);
      for (int j = 0; j < 4 && n + j < NB; ++j) out[m * ldo + n + j] = bias ? s[j] + bias[n + j] : s[j];
    }
}

// rows m0..m1 (at most 6) of x against weight rows n0..n0+nb (at most NB)
template <int NB>
static inline void row_tile(const float* x, int64_t K, const float* w, const float* bias, float* out, int64_t N,
                            int64_t m0, int64_t mb, int64_t n0) {
  const float* xm = x + m0 * K;
  const float* wn = w + n0 * K;
  const float* bn = bias ? bias + n0 : nullptr;
  float* on = out + m0 * N + n0;
  switch (mb) {
    case 6: tile<6, NB>(xm, K, wn, K, K, bn, on, N); break;
    case 5: tile<5, NB>(xm, K, wn, K, K, bn, on, N); break;
    case 4: tile<4, NB>(xm, K, wn, K, K, bn, on, N); break;
    case 3: tile<3, NB>(xm, K, wn, K, K, bn, on, N); break;
    case 2: tile<2, NB>(xm, K, wn, K, K, bn, on, N); break;
    default: tile<1, NB>(xm, K, wn, K, K, bn, on, N); break;
  }
}

// rows m0..m1 of x against weight rows n0..n1, NB weight rows at a time, then the rest
template <int NB>
static inline void rows_block(const float* x, int64_t K, const float* w, const float* bias, float* out, int64_t N,
                              int64_t m0, int64_t m1, int64_t n0, int64_t n1) {
  const int64_t mb = m1 - m0;
  int64_t n = n0;
  for (; n + NB <= n1; n += NB) row_tile<NB>(x, K, w, bias, out, N, m0, mb, n);
  if (NB > 4 && n + 4 <= n1) { row_tile<4>(x, K, w, bias, out, N, m0, mb, n); n += 4; }
  switch (n1 - n) {
    case 3: row_tile<3>(x, K, w, bias, out, N, m0, mb, n); break;
    case 2: row_tile<2>(x, K, w, bias, out, N, m0, mb, n); break;
    case 1: row_tile<1>(x, K, w, bias, out, N, m0, mb, n); break;
    default: break;
  }
}
#endif

static bool small_gemm_supported() {
#ifdef DSPARK_SMALL_GEMM_OK
  return true;
#else
  return false;
#endif
}

// x [M, K], w [N, K] (both row-major, float32), bias [N] or undefined -> [M, N]
static at::Tensor small_gemm(const at::Tensor& x, const at::Tensor& w, const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(x.dim() == 2 && w.dim() == 2 && x.size(1) == w.size(1), "small_gemm: x [M, K], w [N, K]");
  TORCH_CHECK(x.scalar_type() == at::kFloat && w.scalar_type() == at::kFloat, "small_gemm: float32 tensors");
  TORCH_CHECK(w.is_contiguous(), "small_gemm: the weight must be contiguous");
  const at::Tensor xc = x.contiguous();
  const int64_t M = xc.size(0), K = xc.size(1), N = w.size(0);
  at::Tensor out = at::empty({M, N}, xc.options());
  const float* bp = nullptr;
  at::Tensor bc;
  if (bias.has_value() && bias->defined()) {
    bc = bias->contiguous();
    TORCH_CHECK(bc.numel() == N && bc.scalar_type() == at::kFloat, "small_gemm: bias [N] float32");
    bp = bc.data_ptr<float>();
  }
#ifdef DSPARK_SMALL_GEMM_OK
  const float* xp = xc.data_ptr<float>();
  const float* wp = w.data_ptr<float>();
  float* op = out.data_ptr<float>();
  // Threads split the weight rows into chunks small enough to stay in L2 while every 6-row
  // tile of x passes over them: the weights are read from memory once per call.
  const int64_t chunk = std::max<int64_t>(8, ((int64_t(192) << 10) / (4 * K)) & ~int64_t(7));
  const int64_t chunks = (N + chunk - 1) / chunk;
  at::parallel_for(0, chunks, 1, [&](int64_t c0, int64_t c1) {
    for (int64_t c = c0; c < c1; ++c) {
      const int64_t n0 = c * chunk, n1 = std::min<int64_t>(N, n0 + chunk);
      for (int64_t m = 0; m < M; m += 6) {
        const int64_t m1 = std::min<int64_t>(M, m + 6);
        if (M <= 2) rows_block<8>(xp, K, wp, bp, op, N, m, m1, n0, n1);
        else rows_block<4>(xp, K, wp, bp, op, N, m, m1, n0, n1);
      }
    }
  });
#else
  TORCH_CHECK(false, "small_gemm: built without AVX-512 or AVX2+FMA");
#endif
  return out;
}
"""

_OP_SOURCE = r"""
TORCH_LIBRARY(dspark_gemm, m) {
  m.def("small_gemm(Tensor x, Tensor w, Tensor? bias) -> Tensor");
  m.def("supported() -> bool");
  m.impl("small_gemm", c10::DispatchKey::CPU, &small_gemm);
  m.impl("supported", c10::DispatchKey::CatchAll, &small_gemm_supported);
}
"""

def _check(_) -> str | None:
    if not torch.ops.dspark_gemm.supported():
        return "this CPU has neither AVX-512 nor AVX2+FMA"
    _register_fake()
    return None


_EXTENSION = CpuExtension("dspark_small_gemm", lambda: KERNEL_SOURCE + _OP_SOURCE, "products run on F.linear",
                          check=_check)


def available() -> bool:
    """Build the kernel on first use (see ``cpu_build``); False without a C++ toolchain or
    without AVX-512 / AVX2+FMA (``cpu_linear`` then uses ``F.linear``)."""
    return _EXTENSION.load() is not None


def _register_fake() -> None:
    @torch.library.register_fake("dspark_gemm::small_gemm")
    def _(x, w, bias):
        return x.new_empty(x.shape[0], w.shape[0])


def small_gemm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x [M, K] @ weight[N, K]^T (+ bias [N])`` -> ``[M, N]`` (float32, CPU; ``available()`` first).

    Row ``m`` of the result does not depend on the other rows of ``x`` (see the module
    docstring); it agrees with ``F.linear`` to float32 rounding."""
    return torch.ops.dspark_gemm.small_gemm(x, weight, bias)
