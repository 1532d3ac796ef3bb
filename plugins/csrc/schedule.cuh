// schedule.cuh -- the hardware-aware prefix scheduler (report Algorithm 1) in one block.
//
// Semantics and bit-exactness: plugins/reference.py `schedule_prefix()`.
//   a[r, j] = prod_{i<=j} clamp(c[r, i], 0, 1)        (double, left to right)
//   candidates (r, j) with a > 0 and j < cap[r], ranked by descending a, ties by lower
//   r then lower j (a stable radix sort of the flat (r, j) order);
//   admitting the k-th candidate gives B = R + k + 1 batch tokens and
//   tau = R + sum of the first k+1 survival values, each rounded to a multiple of 2^-36
//   (so the sum is exact and a parallel scan returns the reference's bits);
//   Theta_k = tau * SPS[B] (-inf past the table). With the early stop we keep the
//   candidates before the first k whose Theta does not beat Theta_{k-1}; without it we
//   keep those up to the first maximum. verify_lens[r] = admitted drafts of request r.
//
// One block: candidate keys are sorted in shared memory with cub::BlockRadixSort (64-bit
// keys on 62 bits, 5 bits a pass), then one block scan and two block reductions.
//
// The largest R*K it takes is plugins/contract.py's SCHEDULE_MAX_CANDIDATES, passed by every
// build as -DDSPARK_SCHEDULE_MAX_CANDIDATES (plugins/ops.py, plugins/CMakeLists.txt); it must
// fit the largest launch below (checked at compile time).
#pragma once

#ifndef DSPARK_SCHEDULE_MAX_CANDIDATES
#error "DSPARK_SCHEDULE_MAX_CANDIDATES is not defined: compile with plugins/contract.py kernel_define_flags()"
#endif

#include <algorithm>
#include <cstdint>

#include <cub/block/block_radix_sort.cuh>
#include <cub/block/block_reduce.cuh>
#include <cub/block/block_scan.cuh>

#include "common.cuh"

namespace dspark {
namespace detail {

constexpr double kTauScale = 68719476736.0;  // 2^36: survival values are summed on this grid
constexpr uint64_t kNoCandidate = ~0ull;     // key of an invalid slot: sorts after every candidate

__device__ __forceinline__ double quantize_tau(double a) { return rint(a * kTauScale) / kTauScale; }

// tau contribution of a sort key (0 for an empty slot).
__device__ __forceinline__ double key_tau(uint64_t key) {
  return key == kNoCandidate ? 0.0 : quantize_tau(__longlong_as_double(static_cast<long long>(~key)));
}

// The survival value a[r, j] as the reference computes it (sequential double products).
template <typename TC>
__device__ __forceinline__ double survival(const TC* __restrict__ conf, int64_t r, int32_t j, int32_t K) {
  double a = 1.0;
  for (int32_t i = 0; i <= j; ++i) {
    double c = static_cast<double>(conf[r * K + i]);
    c = c < 0.0 ? 0.0 : (c > 1.0 ? 1.0 : c);  // keeps NaN, as torch.clamp
    a = a * c;
  }
  return a;
}

struct ThetaArg {
  double theta;
  int32_t k;  // rank (-1 = nothing admitted)
};

struct ThetaArgMax {
  __device__ __forceinline__ ThetaArg operator()(const ThetaArg& x, const ThetaArg& y) const {
    if (x.theta > y.theta) return x;
    if (y.theta > x.theta) return y;
    return x.k <= y.k ? x : y;
  }
};

struct MinI32 {
  __device__ __forceinline__ int32_t operator()(int32_t x, int32_t y) const { return x < y ? x : y; }
};

template <int THREADS, int ITEMS, typename TC>
__global__ void __launch_bounds__(THREADS)
    schedule_kernel(const TC* __restrict__ conf,          // [R, K]
                    const double* __restrict__ sps,       // [n_sps]
                    const int64_t* __restrict__ max_lens, // [R] or null
                    int32_t R, int32_t K, int32_t n_sps, bool early_stop,
                    int64_t* __restrict__ verify_lens) {  // [R]
  using Sort = cub::BlockRadixSort<uint64_t, THREADS, ITEMS, int32_t, 5>;
  using Scan = cub::BlockScan<double, THREADS>;
  using ReduceI = cub::BlockReduce<int32_t, THREADS>;
  using ReduceT = cub::BlockReduce<ThetaArg, THREADS>;
  extern __shared__ __align__(16) unsigned char smem[];
  auto& sort_tmp = *reinterpret_cast<typename Sort::TempStorage*>(smem);
  int32_t* lens = reinterpret_cast<int32_t*>(smem);  // reused after the sort: [R]
  __shared__ typename Scan::TempStorage scan_tmp;
  __shared__ typename ReduceI::TempStorage red_i_tmp;
  __shared__ typename ReduceT::TempStorage red_t_tmp;
  __shared__ double last_theta[THREADS];
  __shared__ int32_t admitted_sh;

  const int32_t n_max = n_sps - 1;
  const int32_t N = R * K;
  const int tid = threadIdx.x;

  // 1. Keys in the flat (r, j) order, blocked: thread t holds slots t*ITEMS .. t*ITEMS+ITEMS-1.
  uint64_t key[ITEMS];
  int32_t slot[ITEMS];
#pragma unroll
  for (int i = 0; i < ITEMS; ++i) {
    const int32_t f = tid * ITEMS + i;
    slot[i] = f;
    key[i] = kNoCandidate;
    if (f < N) {
      const int32_t r = f / K, j = f % K;
      int64_t cap = max_lens ? max_lens[r] : K;
      cap = cap < 0 ? 0 : (cap > K ? K : cap);
      if (j < cap) {
        const double a = survival(conf, r, j, K);
        if (a > 0.0) key[i] = ~static_cast<uint64_t>(__double_as_longlong(a));  // ascending key = descending a
      }
    }
  }
  // Candidate keys have bits 62 and 63 set (0 < a <= 1), like kNoCandidate: sort bits [0, 62).
  Sort(sort_tmp).Sort(key, slot, 0, 62);
  __syncthreads();  // sort storage is free again
  for (int32_t r = tid; r < R; r += THREADS) lens[r] = 0;

  // 2. tau prefix sums over ranks (exact on the 2^-36 grid, so any order gives the same bits).
  double thread_sum = 0.0;
#pragma unroll
  for (int i = 0; i < ITEMS; ++i) thread_sum += key_tau(key[i]);
  double prefix;
  Scan(scan_tmp).ExclusiveSum(thread_sum, prefix);
  const double base_tau = static_cast<double>(R) + prefix;
  // Theta_k for rank k, given tau after admitting it.
  auto theta_at = [&](int i, double tau) -> double {
    const int64_t B = static_cast<int64_t>(R) + static_cast<int64_t>(tid) * ITEMS + i + 1;
    return (key[i] != kNoCandidate && B <= n_max) ? tau * sps[B] : -INFINITY;
  };
  last_theta[tid] = theta_at(ITEMS - 1, base_tau + thread_sum);
  __syncthreads();
  const double theta0 = static_cast<double>(R) * sps[R];  // nothing admitted

  // 3. Number of admitted candidates.
  int32_t admitted;
  if (early_stop) {
    int32_t first_fail = INT32_MAX;
    double prev = tid == 0 ? theta0 : last_theta[tid - 1];
    double tau = base_tau;
#pragma unroll
    for (int i = 0; i < ITEMS; ++i) {
      tau += key_tau(key[i]);
      const double th = theta_at(i, tau);
      const int32_t k = tid * ITEMS + i;
      if (!(th > prev) && k < first_fail) first_fail = k;  // also ends the candidate list
      prev = th;
    }
    const int32_t m = ReduceI(red_i_tmp).Reduce(first_fail, MinI32());
    if (tid == 0) admitted_sh = m == INT32_MAX ? THREADS * ITEMS : m;
  } else {
    ThetaArg best{-INFINITY, INT32_MAX};
    double tau = base_tau;
#pragma unroll
    for (int i = 0; i < ITEMS; ++i) {
      tau += key_tau(key[i]);
      const double th = theta_at(i, tau);
      best = ThetaArgMax()(best, ThetaArg{th != th ? -INFINITY : th, tid * ITEMS + i});
    }
    const ThetaArg b = ReduceT(red_t_tmp).Reduce(best, ThetaArgMax());
    if (tid == 0) admitted_sh = (b.theta > theta0) ? b.k + 1 : 0;
  }
  __syncthreads();
  admitted = admitted_sh;

  // 4. Verify lengths: request r gets its admitted candidates (always a prefix of its drafts).
#pragma unroll
  for (int i = 0; i < ITEMS; ++i) {
    const int32_t k = tid * ITEMS + i;
    if (k < admitted && key[i] != kNoCandidate) {
      const int32_t r = slot[i] / K, j = slot[i] % K;
      atomicMax(&lens[r], j + 1);
    }
  }
  __syncthreads();
  for (int32_t r = tid; r < R; r += THREADS) verify_lens[r] = lens[r];
}

__global__ void fill_zero_kernel(int64_t* __restrict__ out, int32_t n) {
  for (int32_t i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x) out[i] = 0;
}

template <int THREADS, int ITEMS, typename TC>
cudaError_t launch_schedule_cfg(const TC* conf, const ScheduleParams& p, cudaStream_t stream) {
  using Sort = cub::BlockRadixSort<uint64_t, THREADS, ITEMS, int32_t, 5>;
  const size_t smem = std::max(sizeof(typename Sort::TempStorage), sizeof(int32_t) * static_cast<size_t>(p.R));
  auto kernel = schedule_kernel<THREADS, ITEMS, TC>;
  cudaError_t err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem));
  if (err != cudaSuccess) return err;
  kernel<<<1, THREADS, smem, stream>>>(conf, p.sps, p.max_lens, p.R, p.K, p.n_sps, p.early_stop, p.verify_lens);
  return cudaGetLastError();
}

// The largest launch: one block of 1024 threads, 16 candidates each.
constexpr int kScheduleMaxThreads = 1024;
constexpr int kScheduleMaxItems = 16;
constexpr int32_t kScheduleMaxCandidates = DSPARK_SCHEDULE_MAX_CANDIDATES;
static_assert(kScheduleMaxCandidates >= 1 && kScheduleMaxCandidates <= kScheduleMaxThreads * kScheduleMaxItems,
              "SCHEDULE_MAX_CANDIDATES (plugins/contract.py) must fit one block of the largest launch");

template <typename TC>
cudaError_t launch_schedule(const TC* conf, const ScheduleParams& p, cudaStream_t stream) {
  if (p.R < 0 || p.K < 0 || p.n_sps < 1 || p.sps == nullptr || (p.R > 0 && p.verify_lens == nullptr))
    return cudaErrorInvalidValue;
  if (p.R == 0) return cudaSuccess;
  const int64_t n = static_cast<int64_t>(p.R) * p.K;
  if (n > kScheduleMaxCandidates) return cudaErrorInvalidValue;
  if (p.K == 0 || p.R > p.n_sps - 1) {  // nothing to admit, or even B = R is past the table
    fill_zero_kernel<<<(p.R + 255) / 256, 256, 0, stream>>>(p.verify_lens, p.R);
    return cudaGetLastError();
  }
  if (n <= 256 * 8) return launch_schedule_cfg<256, 8>(conf, p, stream);
  if (n <= 512 * 16) return launch_schedule_cfg<512, 16>(conf, p, stream);
  return launch_schedule_cfg<kScheduleMaxThreads, kScheduleMaxItems>(conf, p, stream);
}

}  // namespace detail
}  // namespace dspark
