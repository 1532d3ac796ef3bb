// verify.cuh -- the speculative verify step as four small kernels (no framework types).
//
// Semantics: plugins/reference.py `verify()` (temperature only; top-k/top-p rows are
// handled by the reference, see plugins/ops.py). Shapes, R requests, K draft slots,
// vocabulary V:
//   draft_tokens [R, K] int64, draft_probs [R, K, V], target_logits [R, K+1, V],
//   verify_lens [R] int64, temperature / seed / offset [R]
//   -> num_accepted [R], output_tokens [R, K+1] (-1 padded), num_emitted [R].
//
// Passes over the logits (what bounds the speed):
//   1. stats    grid (R, K+1, split): one pass over every verified position j <= l_r.
//               Greedy rows: argmax (first index, NaN counts as largest like torch).
//               Sampled rows: online max + sum of exp((z - max) / T), in base 2.
//   2. accept   one warp per request: merges the split partials, runs the K acceptance
//               tests in parallel (u_j < p_t(x_j) / p_d(x_j), u_j from Philox), finds the
//               first failure n, writes accepted drafts, greedy tokens and counters.
//   3. residual grid (R, split), sampled rows only: one pass over row n of the logits
//               (and of the draft probabilities when a draft was rejected) producing per
//               256-element chunk the mass of p_t and of max(p_t - p_d, 0).
//   4. sample   one warp per sampled request: inverse-CDF over the chunk masses, then
//               inside the one chunk that holds the draw (256 elements re-read).
// So a sampled request reads its verified logits once plus one more row, and a greedy
// request reads them exactly once. Everything is deterministic for a given (seed, offset)
// and device (the split sizes depend on the SM count only).
#pragma once

#include <algorithm>
#include <cstdint>

#include "common.cuh"

namespace dspark {
namespace detail {

constexpr int kStatsThreads = 256;
constexpr int kResidualThreads = 256;
constexpr int kChunk = 256;          // elements per chunk of the sampling pass (32 lanes x 8)
constexpr int kStatsTile = kStatsThreads * 8;
constexpr int kMaxSmsForSizing = 256;  // workspace bound holds for devices up to this many SMs

// Per (request, position, split) partial statistics of the target logits.
struct PosStat {
  float m;      // greedy: largest logit; sampled: largest logit (max of z)
  float s;      // sampled: sum_i 2^((z_i - m) * c) with c = log2(e) / T; greedy: unused
  int32_t idx;  // greedy: index of the largest logit (first one); sampled: unused
  int32_t pad;
};

// What the sampling kernels need for request r.
enum RowMode : int32_t { kModeDone = 0, kModeBonus = 1, kModeResidual = 2 };
struct RowState {
  int32_t n;      // stopping position (accepted drafts)
  int32_t mode;   // RowMode
  int32_t x;      // draft token at n (one-hot drafts when draft_probs is null)
  float m;        // max logit at position n
  float inv_s;    // 1 / sum at position n
  float c;        // log2(e) / T
  int32_t pad[2];
};

// torch.argmax order: NaN beats everything, then larger value, then lower index.
__device__ __forceinline__ bool argmax_better(float v, int32_t i, float bv, int32_t bi) {
  const bool vn = v != v, bn = bv != bv;
  if (vn || bn) return vn && (!bn || i < bi);
  return v > bv || (v == bv && i < bi);
}

// Merge two (max, sum) softmax partials in base 2 with scale c.
__device__ __forceinline__ void softmax_merge(float& m, float& s, float m2, float s2, float c) {
  const float mm = fmaxf(m, m2);
  if (mm == -INFINITY) {
    m = mm;
    s = 0.f;
    return;
  }
  const float a = (m == -INFINITY) ? 0.f : s * exp2f((m - mm) * c);
  const float b = (m2 == -INFINITY) ? 0.f : s2 * exp2f((m2 - mm) * c);
  m = mm;
  s = a + b;
}

__device__ __forceinline__ int32_t clamp_len(int64_t l, int32_t K) {
  return static_cast<int32_t>(l < 0 ? 0 : (l > K ? K : l));
}

__device__ __forceinline__ bool row_is_greedy(const float* temperature, int64_t r) {
  return temperature == nullptr || temperature[r] <= 0.f;  // NaN is not greedy (as the reference)
}

// ---------------------------------------------------------------------------------------
// 1. stats: grid = R * (K+1) * S, block = kStatsThreads.
// ---------------------------------------------------------------------------------------
template <typename T>
__global__ void __launch_bounds__(kStatsThreads, 3)  // <= 80 registers: 3 blocks (24 warps) per SM
    stats_kernel(const T* __restrict__ logits,          // [R, K+1, V]
                 const int64_t* __restrict__ verify_lens,  // [R]
                 const float* __restrict__ temperature,    // [R] or null
                 int32_t K, int32_t V, int32_t S, int32_t split_len,
                 PosStat* __restrict__ out) {            // [R, K+1, S]
  const int64_t bid = blockIdx.x;
  const int32_t s = static_cast<int32_t>(bid % S);
  const int64_t rj = bid / S;  // r * (K+1) + j
  const int32_t j = static_cast<int32_t>(rj % (K + 1));
  const int64_t r = rj / (K + 1);
  if (j > clamp_len(verify_lens[r], K)) return;  // position never verified: never read

  const T* row = logits + rj * static_cast<int64_t>(V);
  const bool al = aligned16(row);
  const int32_t lo = s * split_len;
  const int32_t hi = min(V, lo + split_len);  // split_len * S < V + split_len < 2^31
  const bool greedy = row_is_greedy(temperature, r);
  constexpr int kUnroll = 4;
  constexpr int32_t step = kStatsTile;

  __shared__ float sh_m[kStatsThreads / kWarp];
  __shared__ float sh_s[kStatsThreads / kWarp];
  __shared__ int32_t sh_i[kStatsThreads / kWarp];
  const int lane = threadIdx.x & (kWarp - 1), warp = threadIdx.x / kWarp;

  if (greedy) {
    float bv = -INFINITY;
    int32_t bi = INT32_MAX;
    for (int32_t base = lo + static_cast<int32_t>(threadIdx.x) * 8; base < hi; base += kUnroll * step) {
      float v[kUnroll][8];
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) load8(row, base + u * step, hi, al, -INFINITY, v[u]);
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
#pragma unroll
        for (int k = 0; k < 8; ++k) {
          const int32_t i = base + u * step + k;
          if (i < hi && argmax_better(v[u][k], i, bv, bi)) {
            bv = v[u][k];
            bi = i;
          }
        }
      }
    }
#pragma unroll
    for (int d = kWarp / 2; d > 0; d >>= 1) {
      const float ov = shfl_xor(bv, d);
      const int32_t oi = shfl_xor(bi, d);
      if (argmax_better(ov, oi, bv, bi)) { bv = ov; bi = oi; }
    }
    if (lane == 0) { sh_m[warp] = bv; sh_i[warp] = bi; }
    __syncthreads();
    if (threadIdx.x == 0) {
      for (int w = 1; w < kStatsThreads / kWarp; ++w)
        if (argmax_better(sh_m[w], sh_i[w], bv, bi)) { bv = sh_m[w]; bi = sh_i[w]; }
      out[bid] = PosStat{bv, 0.f, bi, 0};
    }
    return;
  }

  const float c = 1.4426950408889634f / temperature[r];  // log2(e) / T
  float m = -INFINITY, sum = 0.f;
  for (int32_t base = lo + static_cast<int32_t>(threadIdx.x) * 8; base < hi; base += kUnroll * step) {
    float v[kUnroll][8];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) load8(row, base + u * step, hi, al, -INFINITY, v[u]);
    float lm = m;
#pragma unroll
    for (int u = 0; u < kUnroll; ++u)
#pragma unroll
      for (int k = 0; k < 8; ++k) lm = fmaxf(lm, v[u][k]);
    if (lm == -INFINITY) continue;  // nothing but -inf so far
    if (lm > m) {
      sum = (m == -INFINITY) ? 0.f : sum * exp2f((m - lm) * c);
      m = lm;
    }
#pragma unroll
    for (int u = 0; u < kUnroll; ++u)
#pragma unroll
      for (int k = 0; k < 8; ++k) sum += exp2f((v[u][k] - m) * c);  // fill -inf adds 0
  }
#pragma unroll
  for (int d = kWarp / 2; d > 0; d >>= 1) {
    const float om = shfl_xor(m, d), os = shfl_xor(sum, d);
    softmax_merge(m, sum, om, os, c);
  }
  if (lane == 0) { sh_m[warp] = m; sh_s[warp] = sum; }
  __syncthreads();
  if (threadIdx.x == 0) {
    for (int w = 1; w < kStatsThreads / kWarp; ++w) softmax_merge(m, sum, sh_m[w], sh_s[w], c);
    out[bid] = PosStat{m, sum, -1, 0};
  }
}

// ---------------------------------------------------------------------------------------
// 2. accept: grid = R, block = one warp.
// ---------------------------------------------------------------------------------------
template <typename T, typename TD>
__global__ void __launch_bounds__(kWarp)
    accept_kernel(const int64_t* __restrict__ draft_tokens,  // [R, K]
                  const TD* __restrict__ draft_probs,        // [R, K, V] or null (one-hot)
                  const T* __restrict__ logits,              // [R, K+1, V]
                  const int64_t* __restrict__ verify_lens,   // [R]
                  const float* __restrict__ temperature,     // [R] or null
                  const int64_t* __restrict__ seed,          // [R] or null
                  const int64_t* __restrict__ offset,        // [R] or null
                  const PosStat* __restrict__ stats,         // [R, K+1, S]
                  int32_t K, int32_t V, int32_t S,
                  int64_t* __restrict__ num_accepted,        // [R]
                  int64_t* __restrict__ output_tokens,       // [R, K+1]
                  int64_t* __restrict__ num_emitted,         // [R] or null
                  RowState* __restrict__ rows) {             // [R]
  const int64_t r = blockIdx.x;
  const int lane = threadIdx.x;
  const int32_t l = clamp_len(verify_lens[r], K);
  const bool greedy = row_is_greedy(temperature, r);
  const float c = greedy ? 0.f : 1.4426950408889634f / temperature[r];
  const int64_t sd = seed ? seed[r] : 0, off = offset ? offset[r] : 0;

  int32_t n = l;
  float n_m = 0.f, n_s = 1.f;
  int32_t n_idx = 0;
  for (int32_t base = 0; base <= l; base += kWarp) {
    const int32_t j = base + lane;
    float m = -INFINITY, s = 0.f;
    int32_t idx = INT32_MAX;
    bool fail = false;
    if (j <= l) {
      const PosStat* ps = stats + (r * (K + 1) + j) * S;
      for (int32_t q = 0; q < S; ++q) {
        const PosStat p = ps[q];
        if (greedy) {
          if (argmax_better(p.m, p.idx, m, idx)) { m = p.m; idx = p.idx; }
        } else {
          softmax_merge(m, s, p.m, p.s, c);
        }
      }
      if (j < l) {
        const int64_t x = draft_tokens[r * K + j];
        const bool valid = x >= 0 && x < V;
        if (greedy) {
          fail = !(valid && x == idx);
        } else if (!valid) {
          fail = true;
        } else {
          const float z = to_float(logits[(r * (K + 1) + j) * static_cast<int64_t>(V) + x]);
          const float pt = (s > 0.f && m != -INFINITY) ? exp2f((z - m) * c) / s : 0.f;
          const float pd = draft_probs ? to_float(draft_probs[(r * K + j) * static_cast<int64_t>(V) + x]) : 1.f;
          const double u = uniform53(sd, off, kStreamAccept, static_cast<uint32_t>(j));
          fail = !(pd > 0.f && u * static_cast<double>(pd) < static_cast<double>(pt));
        }
      }
    }
    const unsigned fails = __ballot_sync(0xffffffffu, fail);
    const bool stop_here = fails != 0u || l < base + kWarp;
    if (stop_here) {
      n = fails ? base + __ffs(fails) - 1 : l;
      const int src = n - base;
      n_m = __shfl_sync(0xffffffffu, m, src);
      n_s = __shfl_sync(0xffffffffu, s, src);
      n_idx = __shfl_sync(0xffffffffu, idx, src);
      break;
    }
  }

  int64_t* out = output_tokens + r * (K + 1);
  for (int32_t j = lane; j <= K; j += kWarp) {
    int64_t tok = -1;
    if (j < n) tok = draft_tokens[r * K + j];
    else if (j == n) tok = greedy ? static_cast<int64_t>(n_idx) : -1;  // sampled: written by sample_kernel
    out[j] = tok;
  }
  if (lane == 0) {
    num_accepted[r] = n;
    if (num_emitted) num_emitted[r] = n + 1;
    RowState st{};
    st.n = n;
    st.mode = greedy ? kModeDone : (n < l ? kModeResidual : kModeBonus);
    st.x = (n < K) ? static_cast<int32_t>(draft_tokens[r * K + n]) : -1;
    st.m = n_m;
    st.inv_s = n_s > 0.f ? 1.f / n_s : 0.f;
    st.c = c;
    rows[r] = st;
  }
}

// Sampling weights of 8 elements of row n: p_t and the residual max(p_t - p_d, 0).
template <typename T, typename TD>
__device__ __forceinline__ void weights8(const T* trow, bool tal, const TD* drow, bool dal, int32_t idx, int32_t V,
                                         const RowState& st, bool residual, float (&pt)[8], float (&res)[8]) {
  float z[8];
  load8(trow, idx, V, tal, -INFINITY, z);
#pragma unroll
  for (int k = 0; k < 8; ++k) pt[k] = (z[k] == -INFINITY) ? 0.f : exp2f((z[k] - st.m) * st.c) * st.inv_s;
  if (!residual) return;
  float d[8];
  if (drow) {
    load8(drow, idx, V, dal, 0.f, d);
  } else {
#pragma unroll
    for (int k = 0; k < 8; ++k) d[k] = (idx + k == st.x) ? 1.f : 0.f;
  }
#pragma unroll
  for (int k = 0; k < 8; ++k) res[k] = fmaxf(pt[k] - d[k], 0.f);
}

// ---------------------------------------------------------------------------------------
// 3. residual: grid = R * S3, block = kResidualThreads; chunk masses of row n.
// ---------------------------------------------------------------------------------------
template <typename T, typename TD>
__global__ void __launch_bounds__(kResidualThreads)
    residual_kernel(const T* __restrict__ logits,       // [R, K+1, V]
                    const TD* __restrict__ draft_probs,  // [R, K, V] or null
                    const RowState* __restrict__ rows,   // [R]
                    int32_t K, int32_t V, int32_t S3, int32_t chunks_per_split,
                    float* __restrict__ mass_pt,         // [R, n_chunks]
                    float* __restrict__ mass_res) {      // [R, n_chunks]
  const int64_t r = blockIdx.x / S3;
  const int32_t s = blockIdx.x % S3;
  const RowState st = rows[r];
  if (st.mode == kModeDone) return;
  const bool residual = st.mode == kModeResidual;
  const int32_t n_chunks = (V + kChunk - 1) / kChunk;
  const T* trow = logits + (r * (K + 1) + st.n) * static_cast<int64_t>(V);
  const TD* drow = (residual && draft_probs) ? draft_probs + (r * K + st.n) * static_cast<int64_t>(V) : nullptr;
  const bool tal = aligned16(trow), dal = drow ? aligned16(drow) : false;
  const int lane = threadIdx.x & (kWarp - 1), warp = threadIdx.x / kWarp;
  constexpr int kWarps = kResidualThreads / kWarp;
  const int32_t c_lo = s * chunks_per_split;
  const int32_t c_hi = min(n_chunks, c_lo + chunks_per_split);
  float* out_pt = mass_pt + r * n_chunks;
  float* out_res = mass_res + r * n_chunks;

  // Two chunks per warp per iteration keep two loads per lane in flight.
  for (int32_t c0 = c_lo + warp; c0 < c_hi; c0 += 2 * kWarps) {
    float pt[2][8], res[2][8];
#pragma unroll
    for (int u = 0; u < 2; ++u) {
      const int32_t ch = c0 + u * kWarps;
      if (ch < c_hi) {
        weights8(trow, tal, drow, dal, ch * kChunk + lane * 8, V, st, residual, pt[u], res[u]);
      } else {
#pragma unroll
        for (int k = 0; k < 8; ++k) pt[u][k] = res[u][k] = 0.f;
      }
    }
#pragma unroll
    for (int u = 0; u < 2; ++u) {
      float a = 0.f, b = 0.f;
#pragma unroll
      for (int k = 0; k < 8; ++k) { a += pt[u][k]; b += residual ? res[u][k] : 0.f; }
#pragma unroll
      for (int d = kWarp / 2; d > 0; d >>= 1) { a += shfl_xor(a, d); b += shfl_xor(b, d); }
      const int32_t ch = c0 + u * kWarps;
      if (lane == 0 && ch < c_hi) {
        out_pt[ch] = a;
        out_res[ch] = b;
      }
    }
  }
}

// ---------------------------------------------------------------------------------------
// 4. sample: grid = R, block = one warp; inverse CDF over chunk masses, then in the chunk.
// ---------------------------------------------------------------------------------------
template <typename T, typename TD>
__global__ void __launch_bounds__(kWarp)
    sample_kernel(const T* __restrict__ logits,       // [R, K+1, V]
                  const TD* __restrict__ draft_probs,  // [R, K, V] or null
                  const RowState* __restrict__ rows,   // [R]
                  const int64_t* __restrict__ seed,    // [R] or null
                  const int64_t* __restrict__ offset,  // [R] or null
                  const float* __restrict__ mass_pt,   // [R, n_chunks]
                  const float* __restrict__ mass_res,  // [R, n_chunks]
                  int32_t K, int32_t V,
                  int64_t* __restrict__ output_tokens) {  // [R, K+1]
  const int64_t r = blockIdx.x;
  const RowState st = rows[r];
  if (st.mode == kModeDone) return;
  const int lane = threadIdx.x;
  const int32_t n_chunks = (V + kChunk - 1) / kChunk;
  const int32_t per = (n_chunks + kWarp - 1) / kWarp;
  const int32_t my_lo = min(n_chunks, lane * per), my_hi = min(n_chunks, my_lo + per);

  // Residual unless the residual has no mass (p_t == p_d): then p_t, as the reference.
  bool residual = st.mode == kModeResidual;
  const float* mass = residual ? mass_res : mass_pt;
  double mine = 0.0, incl = 0.0, total = 0.0;
  for (int pass = 0; pass < 2; ++pass) {
    mine = 0.0;
    for (int32_t ch = my_lo; ch < my_hi; ++ch) mine += mass[r * n_chunks + ch];
    incl = warp_inclusive_sum(mine);
    total = __shfl_sync(0xffffffffu, incl, kWarp - 1);
    if (total > 0.0 || !residual) break;
    residual = false;
    mass = mass_pt;
  }
  const int64_t sd = seed ? seed[r] : 0, off = offset ? offset[r] : 0;
  const double target = uniform53(sd, off, kStreamFinal, 0u) * total;

  // Chunk holding the draw: first lane whose inclusive mass passes the target, then its
  // first chunk that does; rounding fallbacks pick the last chunk with mass.
  unsigned cross = __ballot_sync(0xffffffffu, incl > target);
  int src;
  if (cross) {
    src = __ffs(cross) - 1;
  } else {
    const unsigned pos = __ballot_sync(0xffffffffu, mine > 0.0);
    src = pos ? 31 - __clz(pos) : 0;
  }
  int32_t chunk = 0;
  double before = 0.0;
  const double excl = __shfl_up_sync(0xffffffffu, incl, 1);
  if (lane == src) {
    double cum = lane == 0 ? 0.0 : excl;
    int32_t last_pos = -1;
    double last_before = cum;
    chunk = -1;
    for (int32_t ch = my_lo; ch < my_hi; ++ch) {
      const double w = mass[r * n_chunks + ch];
      if (w > 0.0) { last_pos = ch; last_before = cum; }
      if (cum + w > target && w > 0.0) { chunk = ch; before = cum; break; }
      cum += w;
    }
    if (chunk < 0) {
      chunk = last_pos < 0 ? my_lo : last_pos;
      before = last_before;
    }
  }
  chunk = __shfl_sync(0xffffffffu, chunk, src);
  before = __shfl_sync(0xffffffffu, before, src);

  // Inside the chunk: 8 elements per lane.
  const T* trow = logits + (r * (K + 1) + st.n) * static_cast<int64_t>(V);
  const TD* drow = (residual && draft_probs) ? draft_probs + (r * K + st.n) * static_cast<int64_t>(V) : nullptr;
  const int32_t idx0 = chunk * kChunk + lane * 8;
  float pt[8], res[8];
  weights8(trow, aligned16(trow), drow, drow ? aligned16(drow) : false, idx0, V, st, residual, pt, res);
  float w[8];
#pragma unroll
  for (int k = 0; k < 8; ++k) w[k] = residual ? res[k] : pt[k];
  double lane_sum = 0.0;
#pragma unroll
  for (int k = 0; k < 8; ++k) lane_sum += w[k];
  const double lane_incl = warp_inclusive_sum(lane_sum);
  const double lane_excl = __shfl_up_sync(0xffffffffu, lane_incl, 1);
  const double t_in = target - before;
  int64_t token = -1;
  cross = __ballot_sync(0xffffffffu, lane_incl > t_in);
  if (cross) {
    const int src2 = __ffs(cross) - 1;
    if (lane == src2) {
      double cum = lane == 0 ? 0.0 : lane_excl;
      for (int k = 0; k < 8 && token < 0; ++k) {
        if (w[k] > 0.f && cum + w[k] > t_in) token = idx0 + k;
        cum += w[k];
      }
      if (token < 0)
        for (int k = 7; k >= 0 && token < 0; --k)
          if (w[k] > 0.f) token = idx0 + k;
    }
    token = __shfl_sync(0xffffffffu, token, src2);
  }
  if (token < 0) {  // rounding: take the last element with mass in the chunk
    const unsigned pos = __ballot_sync(0xffffffffu, lane_sum > 0.0);
    const int src3 = pos ? 31 - __clz(pos) : 0;
    if (lane == src3) {
      for (int k = 7; k >= 0 && token < 0; --k)
        if (w[k] > 0.f) token = idx0 + k;
      if (token < 0) token = static_cast<int64_t>(chunk) * kChunk;
    }
    token = __shfl_sync(0xffffffffu, token, src3);
  }
  if (lane == 0) output_tokens[r * (K + 1) + st.n] = token;
}

// ---------------------------------------------------------------------------------------
// Host-side sizing.
// ---------------------------------------------------------------------------------------
struct VerifyPlan {
  int32_t S1, split_len;          // stats: vocab splits per position and their length
  int32_t S3, chunks_per_split;   // residual: splits per request
  int32_t n_chunks;
  size_t off_stats, off_rows, off_pt, off_res, bytes;
};

inline int32_t ceil_div(int64_t a, int64_t b) { return static_cast<int32_t>((a + b - 1) / b); }
inline size_t align256(size_t x) { return (x + 255) & ~static_cast<size_t>(255); }

// Splits follow the number of SMs so that small batches still cover the device; the
// workspace is sized for the largest split count any device up to kMaxSmsForSizing SMs
// could pick, so it does not depend on the device.
inline VerifyPlan make_verify_plan(int32_t R, int32_t K, int32_t V, int32_t num_sms) {
  VerifyPlan p{};
  const int64_t positions = static_cast<int64_t>(R) * (K + 1);
  const int32_t max_s1 = std::max(1, ceil_div(V, 2 * kStatsTile));   // >= 4096 elements a split
  auto s1_for = [&](int32_t sms) {
    const int64_t want = positions > 0 ? (4LL * sms + positions - 1) / positions : 1;
    return static_cast<int32_t>(std::max<int64_t>(1, std::min<int64_t>(max_s1, want)));
  };
  const int32_t s1_bound = s1_for(kMaxSmsForSizing);
  p.S1 = std::min(s1_for(std::max(1, num_sms)), s1_bound);
  p.split_len = ceil_div(ceil_div(V, p.S1), kStatsTile) * kStatsTile;
  p.S1 = std::max(1, ceil_div(V, p.split_len));
  p.n_chunks = ceil_div(V, kChunk);
  const int32_t max_s3 = std::max(1, p.n_chunks / 16);                 // >= 4096 elements a split
  const int64_t want3 = R > 0 ? (4LL * std::max(1, num_sms) + R - 1) / R : 1;
  p.S3 = static_cast<int32_t>(std::max<int64_t>(1, std::min<int64_t>(max_s3, want3)));
  p.chunks_per_split = ceil_div(p.n_chunks, p.S3);
  p.S3 = std::max(1, ceil_div(p.n_chunks, p.chunks_per_split));

  p.off_stats = 0;
  p.off_rows = align256(p.off_stats + sizeof(PosStat) * static_cast<size_t>(positions) * s1_bound);
  p.off_pt = align256(p.off_rows + sizeof(RowState) * static_cast<size_t>(R));
  p.off_res = align256(p.off_pt + sizeof(float) * static_cast<size_t>(R) * p.n_chunks);
  p.bytes = align256(p.off_res + sizeof(float) * static_cast<size_t>(R) * p.n_chunks);
  return p;
}

template <typename T, typename TD>
cudaError_t launch_verify(const VerifyParams& a, void* workspace, size_t workspace_bytes, cudaStream_t stream) {
  const VerifyPlan p = make_verify_plan(a.R, a.K, a.V, a.num_sms);
  if (workspace_bytes < p.bytes || (a.R > 0 && workspace == nullptr)) return cudaErrorInvalidValue;
  if (a.R == 0) return cudaSuccess;
  char* ws = static_cast<char*>(workspace);
  auto* stats = reinterpret_cast<PosStat*>(ws + p.off_stats);
  auto* rows = reinterpret_cast<RowState*>(ws + p.off_rows);
  auto* m_pt = reinterpret_cast<float*>(ws + p.off_pt);
  auto* m_res = reinterpret_cast<float*>(ws + p.off_res);
  const T* logits = static_cast<const T*>(a.target_logits);
  const TD* dprobs = static_cast<const TD*>(a.draft_probs);
  const float* temp = a.all_greedy ? nullptr : a.temperature;

  const int64_t g1 = static_cast<int64_t>(a.R) * (a.K + 1) * p.S1;
  stats_kernel<T><<<static_cast<unsigned>(g1), kStatsThreads, 0, stream>>>(logits, a.verify_lens, temp, a.K, a.V,
                                                                            p.S1, p.split_len, stats);
  accept_kernel<T, TD><<<a.R, kWarp, 0, stream>>>(a.draft_tokens, dprobs, logits, a.verify_lens, temp, a.seed,
                                                  a.offset, stats, a.K, a.V, p.S1, a.num_accepted, a.output_tokens,
                                                  a.num_emitted, rows);
  if (temp != nullptr) {
    const int64_t g3 = static_cast<int64_t>(a.R) * p.S3;
    residual_kernel<T, TD><<<static_cast<unsigned>(g3), kResidualThreads, 0, stream>>>(
        logits, dprobs, rows, a.K, a.V, p.S3, p.chunks_per_split, m_pt, m_res);
    sample_kernel<T, TD><<<a.R, kWarp, 0, stream>>>(logits, dprobs, rows, a.seed, a.offset, m_pt, m_res, a.K, a.V,
                                                    a.output_tokens);
  }
  return cudaGetLastError();
}

}  // namespace detail
}  // namespace dspark
