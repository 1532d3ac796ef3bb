// common.cuh -- small device helpers shared by the verify and scheduler kernels:
// element loads, the Philox4x32-10 counter-based generator, warp reductions.
// No framework types.
#pragma once

#include <cstdint>

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

namespace dspark {
namespace detail {

constexpr int kWarp = 32;

// ---------------------------------------------------------------------------------------
// Element conversion and 8-wide loads.
// ---------------------------------------------------------------------------------------
__device__ __forceinline__ float to_float(float x) { return x; }
__device__ __forceinline__ float to_float(__half x) { return __half2float(x); }
__device__ __forceinline__ float to_float(__nv_bfloat16 x) { return __bfloat162float(x); }

// True when `p` sits on a 16-byte boundary, so 8 consecutive 16-bit (or 2x4 fp32)
// elements starting at a multiple-of-8 index can be fetched with 128-bit loads.
__device__ __forceinline__ bool aligned16(const void* p) {
  return (reinterpret_cast<uintptr_t>(p) & 15u) == 0;
}

// v[0..8) = row[idx .. idx+8) as float; elements at or past `n` read as `fill`.
// `idx` must be a multiple of 8 and `row_aligned` the result of aligned16(row). Indices
// are within one vocabulary row (V < 2^31).
template <typename T>
__device__ __forceinline__ void load8(const T* __restrict__ row, int32_t idx, int32_t n,
                                      bool row_aligned, float fill, float (&v)[8]) {
  if (row_aligned && idx + 8 <= n) {
    if constexpr (sizeof(T) == 4) {
      const float4 a = *reinterpret_cast<const float4*>(row + idx);
      const float4 b = *reinterpret_cast<const float4*>(row + idx + 4);
      v[0] = a.x; v[1] = a.y; v[2] = a.z; v[3] = a.w;
      v[4] = b.x; v[5] = b.y; v[6] = b.z; v[7] = b.w;
    } else {
      const uint4 raw = *reinterpret_cast<const uint4*>(row + idx);
      const T* e = reinterpret_cast<const T*>(&raw);
#pragma unroll
      for (int k = 0; k < 8; ++k) v[k] = to_float(e[k]);
    }
  } else {
#pragma unroll
    for (int k = 0; k < 8; ++k) v[k] = (idx + k < n) ? to_float(row[idx + k]) : fill;
  }
}

// ---------------------------------------------------------------------------------------
// Philox4x32-10 (Salmon et al., SC'11): a counter-based generator. Given a 128-bit
// counter and a 64-bit key it returns 128 random bits; the same (counter, key) always
// gives the same bits, on any thread, in any launch order.
// ---------------------------------------------------------------------------------------
struct Philox4 {
  uint32_t v[4];
};

__host__ __device__ __forceinline__ void mul_hilo(uint32_t a, uint32_t b, uint32_t& hi, uint32_t& lo) {
#ifdef __CUDA_ARCH__
  hi = __umulhi(a, b);
  lo = a * b;
#else
  const uint64_t p = static_cast<uint64_t>(a) * b;
  hi = static_cast<uint32_t>(p >> 32);
  lo = static_cast<uint32_t>(p);
#endif
}

__host__ __device__ __forceinline__ Philox4 philox4x32_10(uint32_t c0, uint32_t c1, uint32_t c2, uint32_t c3,
                                                          uint32_t k0, uint32_t k1) {
  constexpr uint32_t kM0 = 0xD2511F53u, kM1 = 0xCD9E8D57u;  // round multipliers
  constexpr uint32_t kW0 = 0x9E3779B9u, kW1 = 0xBB67AE85u;  // Weyl key increments
  for (int round = 0; round < 10; ++round) {  // constant trip count: unrolled by the compiler
    uint32_t hi0, lo0, hi1, lo1;
    mul_hilo(kM0, c0, hi0, lo0);
    mul_hilo(kM1, c2, hi1, lo1);
    const uint32_t n0 = hi1 ^ c1 ^ k0, n2 = hi0 ^ c3 ^ k1;
    c0 = n0; c1 = lo1; c2 = n2; c3 = lo0;
    k0 += kW0; k1 += kW1;
  }
  return Philox4{{c0, c1, c2, c3}};
}

// Streams: which draw of a request a counter belongs to (counter word 1).
constexpr uint32_t kStreamAccept = 0x41434350u;  // per-position acceptance tests
constexpr uint32_t kStreamFinal = 0x46494E4Cu;   // the recovered / bonus sample

// One uniform in [0, 1) with 53 random bits for request (seed, offset), stream and index.
// Counter = (index, stream, offset lo, offset hi), key = (seed lo, seed hi).
__host__ __device__ __forceinline__ double uniform53(int64_t seed, int64_t offset, uint32_t stream,
                                                     uint32_t index) {
  const uint64_t s = static_cast<uint64_t>(seed), o = static_cast<uint64_t>(offset);
  const Philox4 r = philox4x32_10(index, stream, static_cast<uint32_t>(o), static_cast<uint32_t>(o >> 32),
                                  static_cast<uint32_t>(s), static_cast<uint32_t>(s >> 32));
  const uint64_t bits = (static_cast<uint64_t>(r.v[0] >> 5) << 26) | (r.v[1] >> 6);  // 27 + 26 bits
  return static_cast<double>(bits) * (1.0 / 9007199254740992.0);                    // * 2^-53
}

// ---------------------------------------------------------------------------------------
// Warp helpers.
// ---------------------------------------------------------------------------------------
template <typename T>
__device__ __forceinline__ T shfl_xor(T v, int mask) {
  return __shfl_xor_sync(0xffffffffu, v, mask);
}

// Inclusive prefix sum over the 32 lanes of a full warp (fixed order: deterministic).
template <typename T>
__device__ __forceinline__ T warp_inclusive_sum(T v) {
  const int lane = threadIdx.x & (kWarp - 1);
#pragma unroll
  for (int d = 1; d < kWarp; d <<= 1) {
    const T o = __shfl_up_sync(0xffffffffu, v, d);
    if (lane >= d) v += o;
  }
  return v;
}

}  // namespace detail
}  // namespace dspark
