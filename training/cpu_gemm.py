"""The float32 ``x @ W^T`` of CPU inference, on weights packed once, the same bits in any batch.

A decode step multiplies a few rows (one per request and draft position) by every weight of
the target, so it is bound by streaming the weights from memory; a step with a prompt
chunk, or 64 requests in flight, is bound by arithmetic. A general BLAS serves both poorly
at these sizes: at 2-8 rows it packs the weight into scratch memory on every call (a
4-token verify cost about twice a 1-token step), and it cannot know that the same weights
come back on every step. Here each weight is packed once (``pack``) into panels of ``NR``
output columns (64 with AVX-512, 32 with AVX2), ``[panels, K, NR]``, so that one call streams
every weight once, contiguously, whatever the row count; a 6-row x 64-column register tile (24 AVX-512
accumulators) takes each input element as a broadcast and each packed row as four vector
loads, which keeps the FMA units busy once there are enough rows to be compute bound; every
cache line of a packed row is prefetched 16 rows ahead, which keeps a 2-6 row tile streaming
at the 1-row rate (``docs/benchmarks/cpu_linear.md``). On a
CPU with AVX2 + FMA and no AVX-512 the panels are 32 columns wide and the tile 3 rows x 32
columns (12 ymm accumulators + 4 panel vectors): every packed row is read in one pass, so a
verify of 2-3 tokens streams the weights at the rate of a 1-token step (with 64-column
panels swept in 2-4 passes of a 16-register tile, a 2-4 token verify cost 1.3-1.5x).

Row invariance: output ``[m, n]`` is one chain of fused multiply-adds over ``k`` in order,
then ``+ bias[n]``, whatever the number of rows, the tile or thread it falls in, or the
``k`` blocks (a partial sum is stored and reloaded exactly). A token's logits are therefore
the same bits alone, in a 64-row batch, at draft position 5 of a verify block, or in a
prompt chunk, which makes "greedy speculative output = target-only output" exact
arithmetic; the tests check it directly.

Built on first use (``cpu_build``) where the CPU has AVX-512F or AVX2 + FMA, registered as
``torch.ops.dspark_gemm.*``; ``available()`` is False elsewhere and ``cpu_linear`` uses
``F.linear``. Both tiles run the same FMA chains in the same order (the same arithmetic). A
packed weight is a second copy of the weight (the modules keep theirs for training, export
and the embedding lookup of tied heads).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from dspark.plugins.cpu_build import CpuExtension

__all__ = ["available", "PackedWeight", "pack", "gemm", "KERNEL_SOURCE"]


KERNEL_SOURCE = r"""
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <algorithm>

namespace dspark_gemm {

#if defined(__AVX512F__)
#define DSPARK_GEMM_OK 1
constexpr int64_t NR = 64;   // packed panel width: 4 vectors of 16
constexpr int64_t MR = 6;    // rows per register tile: 6 x 4 = 24 accumulators
constexpr int64_t KC = 384;  // k per block: a [KC, NR] panel slice (96 KiB) stays in L2 across the row tiles
constexpr int64_t PF = 16;   // packed rows prefetched ahead (4 KiB)

// c[m, 0:cols] (=|+=) sum_k a[m, k] * p[k, 0:64] for MB rows: one FMA chain per output element
template <int MB>
static inline void tile(const float* a, int64_t lda, const float* p, int64_t kc, float* c, int64_t ldc, bool first,
                        int64_t cols) {
  __m512 acc[MB][4];
  const __mmask16 m0 = cols >= 16 ? 0xFFFF : (__mmask16)((1u << std::max<int64_t>(cols, 0)) - 1u);
  const __mmask16 m1 = cols >= 32 ? 0xFFFF : (__mmask16)((1u << std::max<int64_t>(cols - 16, 0)) - 1u);
  const __mmask16 m2 = cols >= 48 ? 0xFFFF : (__mmask16)((1u << std::max<int64_t>(cols - 32, 0)) - 1u);
  const __mmask16 m3 = cols >= 64 ? 0xFFFF : (__mmask16)((1u << std::max<int64_t>(cols - 48, 0)) - 1u);
  const __mmask16 mask[4] = {m0, m1, m2, m3};
  for (int m = 0; m < MB; ++m)
    for (int j = 0; j < 4; ++j)
      acc[m][j] = first ? _mm512_setzero_ps() : _mm512_maskz_loadu_ps(mask[j], c + m * ldc + 16 * j);
  for (int64_t k = 0; k < kc; ++k) {
    const float* pk = p + k * NR;
    const __m512 b0 = _mm512_loadu_ps(pk), b1 = _mm512_loadu_ps(pk + 16);
    const __m512 b2 = _mm512_loadu_ps(pk + 32), b3 = _mm512_loadu_ps(pk + 48);
    // all four cache lines of the packed row, PF rows ahead: with 2-6 rows of FMAs per packed row the core
    // does not run far enough ahead to have the lines in flight by itself
    const char* ahead = reinterpret_cast<const char*>(pk + PF * NR);
    for (int line = 0; line < 4; ++line) _mm_prefetch(ahead + 64 * line, _MM_HINT_T0);
    for (int m = 0; m < MB; ++m) {
      const __m512 av = _mm512_set1_ps(a[m * lda + k]);
      acc[m][0] = _mm512_fmadd_ps(av, b0, acc[m][0]);
      acc[m][1] = _mm512_fmadd_ps(av, b1, acc[m][1]);
      acc[m][2] = _mm512_fmadd_ps(av, b2, acc[m][2]);
      acc[m][3] = _mm512_fmadd_ps(av, b3, acc[m][3]);
    }
  }
  for (int m = 0; m < MB; ++m)
    for (int j = 0; j < 4; ++j) _mm512_mask_storeu_ps(c + m * ldc + 16 * j, mask[j], acc[m][j]);
}

static inline void row_tile(int64_t mb, const float* a, int64_t lda, const float* p, int64_t kc, float* c,
                            int64_t ldc, bool first, int64_t cols) {
  switch (mb) {
    case 6: tile<6>(a, lda, p, kc, c, ldc, first, cols); break;
    case 5: tile<5>(a, lda, p, kc, c, ldc, first, cols); break;
    case 4: tile<4>(a, lda, p, kc, c, ldc, first, cols); break;
    case 3: tile<3>(a, lda, p, kc, c, ldc, first, cols); break;
    case 2: tile<2>(a, lda, p, kc, c, ldc, first, cols); break;
    default: tile<1>(a, lda, p, kc, c, ldc, first, cols); break;
  }
}

#elif defined(__AVX2__) && defined(__FMA__)
#define DSPARK_GEMM_OK 1
constexpr int64_t NR = 32;   // packed panel width: 4 vectors of 8, a packed row in one pass of the tile
constexpr int64_t MR = 3;    // rows per register tile: 3 x 4 = 12 accumulators (+ 4 panel vectors = 16 ymm)
constexpr int64_t KC = 768;  // k per block: a [KC, NR] panel slice (96 KiB) stays in L2 across the row tiles
constexpr int64_t PF = 12;   // packed rows prefetched ahead

// lanes start .. start + 7 of a row that has ``cols`` valid columns
static inline __m256i lanes(int64_t cols, int64_t start) {
  const int64_t n = std::max<int64_t>(std::min<int64_t>(cols - start, 8), 0);
  return _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(n)), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}

// MB rows x NV 8-lane vectors of accumulators, the 32-column panel in 4 / NV passes of 8 * NV
// columns (one pass at NV = 4). The same FMA chain per output element as the AVX-512 tile.
template <int MB, int NV>
static inline void tile(const float* a, int64_t lda, const float* p, int64_t kc, float* c, int64_t ldc, bool first,
                        int64_t cols) {
  for (int64_t c0 = 0; c0 < std::min<int64_t>(cols, NR); c0 += 8 * NV) {
    __m256i mask[NV];
    __m256 acc[MB][NV];
    for (int j = 0; j < NV; ++j) mask[j] = lanes(cols, c0 + 8 * j);
    for (int m = 0; m < MB; ++m)
      for (int j = 0; j < NV; ++j)
        acc[m][j] = first ? _mm256_setzero_ps() : _mm256_maskload_ps(c + m * ldc + c0 + 8 * j, mask[j]);
    for (int64_t k = 0; k < kc; ++k) {
      const float* pk = p + k * NR + c0;
      // the whole packed row (two cache lines) PF rows ahead
      const char* ahead = reinterpret_cast<const char*>(p + (k + PF) * NR);
      _mm_prefetch(ahead, _MM_HINT_T0);
      _mm_prefetch(ahead + 64, _MM_HINT_T0);
      __m256 b[NV];
      for (int j = 0; j < NV; ++j) b[j] = _mm256_loadu_ps(pk + 8 * j);
      for (int m = 0; m < MB; ++m) {
        const __m256 av = _mm256_broadcast_ss(a + m * lda + k);
        for (int j = 0; j < NV; ++j) acc[m][j] = _mm256_fmadd_ps(av, b[j], acc[m][j]);
      }
    }
    for (int m = 0; m < MB; ++m)
      for (int j = 0; j < NV; ++j) _mm256_maskstore_ps(c + m * ldc + c0 + 8 * j, mask[j], acc[m][j]);
  }
}

static inline void row_tile(int64_t mb, const float* a, int64_t lda, const float* p, int64_t kc, float* c,
                            int64_t ldc, bool first, int64_t cols) {
  switch (mb) {
    case 3: tile<3, 4>(a, lda, p, kc, c, ldc, first, cols); break;
    case 2: tile<2, 4>(a, lda, p, kc, c, ldc, first, cols); break;
    default: tile<1, 4>(a, lda, p, kc, c, ldc, first, cols); break;
  }
}
#else
constexpr int64_t NR = 64, MR = 6, KC = 384;  // no kernel here (supported() is false); pack keeps its layout
#endif

static bool supported() {
#ifdef DSPARK_GEMM_OK
  return true;
#else
  return false;
#endif
}

// w [N, K] -> [ceil(N / NR), K, NR], column n of panel p holding w[p * NR + n] (zero padding)
static at::Tensor pack(const at::Tensor& w) {
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == at::kFloat, "cpu_gemm.pack: a [N, K] float32 weight");
  const at::Tensor wc = w.contiguous();
  const int64_t N = wc.size(0), K = wc.size(1), panels = (N + NR - 1) / NR;
  at::Tensor out = at::zeros({panels, K, NR}, wc.options());
  const float* wp = wc.data_ptr<float>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, panels, 1, [&](int64_t p0, int64_t p1) {
    for (int64_t p = p0; p < p1; ++p)
      for (int64_t n = 0; n < std::min<int64_t>(NR, N - p * NR); ++n) {
        const float* row = wp + (p * NR + n) * K;
        float* col = op + p * K * NR + n;
        for (int64_t k = 0; k < K; ++k) col[k * NR] = row[k];
      }
  });
  return out;
}

// x [M, K] (row-major float32) @ packed [panels, K, NR] -> [M, n] (+ bias [n])
static at::Tensor gemm(const at::Tensor& x, const at::Tensor& packed, int64_t n,
                       const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat, "cpu_gemm: x [M, K] float32");
  TORCH_CHECK(packed.dim() == 3 && packed.size(2) == NR && packed.is_contiguous() && packed.size(1) == x.size(1) &&
              n > (packed.size(0) - 1) * NR && n <= packed.size(0) * NR,
              "cpu_gemm: x [M, K] against a weight packed by cpu_gemm.pack with the same K and n columns");
  const at::Tensor xc = x.contiguous();
  const int64_t M = xc.size(0), K = xc.size(1), panels = packed.size(0);
  at::Tensor out = at::empty({M, n}, xc.options());
  const float* bp = nullptr;
  at::Tensor bc;
  if (bias.has_value() && bias->defined()) {
    bc = bias->contiguous();
    TORCH_CHECK(bc.numel() == n && bc.scalar_type() == at::kFloat, "cpu_gemm: bias [n] float32");
    bp = bc.data_ptr<float>();
  }
  if (M == 0) return out;
#ifdef DSPARK_GEMM_OK
  const float* xp = xc.data_ptr<float>();
  const float* pp = packed.data_ptr<float>();
  float* op = out.data_ptr<float>();
  // threads split the panels: each streams its share of the weight once per call
  at::parallel_for(0, panels, 1, [&](int64_t q0, int64_t q1) {
    for (int64_t q = q0; q < q1; ++q) {
      const int64_t cols = std::min<int64_t>(NR, n - q * NR);
      const float* panel = pp + q * K * NR;
      float* oc = op + q * NR;
      for (int64_t k0 = 0; k0 < K; k0 += KC) {
        const int64_t kc = std::min<int64_t>(KC, K - k0);
        for (int64_t m0 = 0; m0 < M; m0 += MR)
          row_tile(std::min<int64_t>(MR, M - m0), xp + m0 * K + k0, K, panel + k0 * NR, kc, oc + m0 * n, n,
                   k0 == 0, cols);
      }
      if (bp)
        for (int64_t m = 0; m < M; ++m)
          for (int64_t j = 0; j < cols; ++j) oc[m * n + j] += bp[q * NR + j];
    }
  });
#else
  TORCH_CHECK(false, "cpu_gemm: built without AVX-512 or AVX2 + FMA");
#endif
  return out;
}

}  // namespace dspark_gemm
"""

_OP_SOURCE = r"""
TORCH_LIBRARY(dspark_gemm, m) {
  m.def("pack(Tensor w) -> Tensor");
  m.def("gemm(Tensor x, Tensor packed, int n, Tensor? bias) -> Tensor");
  m.def("supported() -> bool");
  m.impl("pack", c10::DispatchKey::CPU, &dspark_gemm::pack);
  m.impl("gemm", c10::DispatchKey::CPU, &dspark_gemm::gemm);
  m.impl("supported", c10::DispatchKey::CatchAll, &dspark_gemm::supported);
}
"""


def _check(_) -> str | None:
    if not torch.ops.dspark_gemm.supported():
        return "this CPU has neither AVX-512 nor AVX2 + FMA"
    return None


_EXTENSION = CpuExtension("dspark_cpu_gemm", lambda: KERNEL_SOURCE + _OP_SOURCE, "products run on F.linear",
                          check=_check)


def available() -> bool:
    """Build the kernel on first use (``cpu_build``); False without a C++ toolchain or AVX-512 / AVX2
    (``cpu_linear`` then uses ``F.linear``)."""
    return _EXTENSION.load() is not None


@dataclass(frozen=True)
class PackedWeight:
    """A ``[n, K]`` weight packed for ``gemm``: ``data [ceil(n / NR), K, NR]`` (``NR`` = the kernel's panel width)."""

    data: torch.Tensor
    n: int


def pack(weight: torch.Tensor) -> PackedWeight:
    """Pack an ``nn.Linear``-layout weight ``[n, K]`` (float32, CPU) once for ``gemm``."""
    return PackedWeight(torch.ops.dspark_gemm.pack(weight.detach()), weight.shape[0])


def gemm(x: torch.Tensor, weight: PackedWeight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x [M, K] @ W^T (+ bias [n])`` -> ``[M, n]`` for a packed ``W`` (``available()`` first).

    Row ``m`` of the result does not depend on the other rows of ``x`` (module docstring); it
    agrees with ``F.linear`` to float32 rounding."""
    return torch.ops.dspark_gemm.gemm(x, weight.data, weight.n, bias)
