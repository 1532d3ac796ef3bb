"""The target's choice at each verified cell, as CPU kernels: the greedy argmax and the coupled race.

Greedy rows take ``argmax`` of their logits. ``torch.argmax`` over a step's ``[64, 49k]``
logits costs a 2-core CPU several times the plain maximum (it tracks an index per element);
``argmax`` here finds the maximum in 16 vectorised lanes, then the first column holding it
(NaN counts as largest and the first one wins, as in ``torch.argmax``).

Sampled rows race: ``coupled._race`` picks ``argmax_v p(v) / E(key, v)`` with the hashed
exponential noise ``E`` of ``coupled.py``. In torch that is a dozen passes over ``[rows, V]``
(the integer mixer, the conversion to ``(0, 1)``, ``log1p``, the division, the argmax).
``race_argmax`` makes one pass per row and takes the logarithm of a handful of columns:

1. the exact score ``S = p(t) / E(t)`` of the row's most likely column ``t``;
2. one vectorised pass hashing every column's ``w_v`` (the uniform that ``E_v`` is the
   inverse CDF of); since ``E_v = -log(1 - w_v) >= w_v``, a column can reach ``S`` only
   if ``p(v) > w_v * S`` (checked with a relative margin of 2^-20, far wider than float
   rounding), so only those are kept, ``t`` among them;
3. the exact scores of the kept columns, in column order, strictly larger wins: the
   first maximum, as ``torch.argmax``.

The noise is ``coupled.py``'s to the bit: the same integer mixer and the same float32
steps, with ``log1pf`` for the logarithm (torch's vectorised ``log1p`` may differ in the last
bit, which can only swap two scores within one rounding of each other). The winner is the
argmax over every column, so the sample is exact; a row without mass returns column 0, as
``torch.argmax`` of zeros does. Both kernels are built on first use (``cpu_build.py``);
where they cannot be built ``available()`` is False and callers use torch.
"""
from __future__ import annotations

import torch

from .cpu_build import CpuExtension

__all__ = ["available", "argmax", "race_argmax", "KERNEL_SOURCE"]

KERNEL_SOURCE = r"""
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

namespace {

inline uint32_t mix32(uint32_t x) {
  x ^= x >> 16;
  x *= 0x7FEB352Du;
  x ^= x >> 15;
  x *= 0x846CA68Bu;
  x ^= x >> 16;
  return x;
}

// the uniform in (0, 1) behind a hash, before the clamp (coupled._noise_from's float32 steps)
inline float uniform_of(uint32_t h) {
  return (static_cast<float>(static_cast<int32_t>(h & 0x7FFFFFFFu)) + 0.5f) * 0x1p-31f;
}

inline float exp_noise(uint32_t h) {
  const float w = std::fmin(uniform_of(h), 1.0f - 0x1p-24f);
  return -std::log1p(-w);
}

constexpr int64_t BLOCK = 1024;

// the first column holding the row's largest value (NaN counts as largest: its first column). The
// maximum and a sum (NaN shows in it) run in 16 independent lanes, which the compiler vectorises.
int64_t first_max(const float* p, int64_t V) {
  float lane[16], total[16];
  for (int j = 0; j < 16; ++j) lane[j] = p[0], total[j] = 0.0f;
  int64_t v = 0;
  for (; v + 16 <= V; v += 16)
    for (int j = 0; j < 16; ++j) {
      const float x = p[v + j];
      total[j] += x;
      lane[j] = x > lane[j] ? x : lane[j];
    }
  float m = lane[0], sum = 0.0f;
  for (int j = 0; j < 16; ++j) m = lane[j] > m ? lane[j] : m, sum += total[j];
  for (; v < V; ++v) m = p[v] > m ? p[v] : m, sum += p[v];
  if (sum != sum) {  // a NaN, or infinities of both signs: look for the first NaN
    for (int64_t i = 0; i < V; ++i) if (p[i] != p[i]) return i;
  }
  int64_t i = 0;
  while (i < V - 1 && !(p[i] == m)) ++i;
  return i;
}

int64_t race_row(const float* p, const int32_t* idm, int64_t V, uint32_t key) {
  const int64_t top = first_max(p, V);
  if (p[top] != p[top]) return top;  // a NaN weight: its score is NaN, which torch.argmax takes as largest
  if (!(p[top] > 0.0f)) return 0;  // no mass: every score is 0, argmax is column 0
  const float best0 = p[top] / exp_noise(mix32(key ^ static_cast<uint32_t>(idm[top])));
  const float bar = best0 * (1.0f - 0x1p-20f);
  float best = -std::numeric_limits<float>::infinity();
  int64_t arg = top;
  int32_t keep[BLOCK];
  for (int64_t lo = 0; lo < V; lo += BLOCK) {
    const int64_t n = std::min(BLOCK, V - lo);
    const float* pb = p + lo;
    const int32_t* ib = idm + lo;
    for (int64_t i = 0; i < n; ++i) {  // branch-free: vectorised
      const float w = uniform_of(mix32(key ^ static_cast<uint32_t>(ib[i])));
      keep[i] = pb[i] > w * bar;
    }
    for (int64_t i = 0; i < n; ++i) {
      if (!keep[i]) continue;
      const float s = pb[i] / exp_noise(mix32(key ^ static_cast<uint32_t>(ib[i])));
      if (s > best) { best = s; arg = lo + i; }
    }
  }
  return arg;
}

}  // namespace

static at::Tensor coupled_race(const at::Tensor& probs, const at::Tensor& keys, const at::Tensor& idm) {
  TORCH_CHECK(probs.dim() == 2 && probs.scalar_type() == at::kFloat && probs.is_contiguous(),
              "coupled_race: probs must be a contiguous float32 [n, V]");
  TORCH_CHECK(keys.dim() == 1 && keys.scalar_type() == at::kInt && keys.size(0) == probs.size(0),
              "coupled_race: keys must be int32 [n]");
  TORCH_CHECK(idm.dim() == 1 && idm.scalar_type() == at::kInt && idm.size(0) == probs.size(1) && idm.is_contiguous(),
              "coupled_race: mixed ids must be a contiguous int32 [V]");
  const int64_t n = probs.size(0), V = probs.size(1);
  auto out = at::empty({n}, probs.options().dtype(at::kLong));
  const float* p = probs.data_ptr<float>();
  const int32_t* k = keys.contiguous().data_ptr<int32_t>();
  const int32_t* ids = idm.data_ptr<int32_t>();
  int64_t* o = out.data_ptr<int64_t>();
  at::parallel_for(0, n, 1, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) o[r] = race_row(p + r * V, ids, V, static_cast<uint32_t>(k[r]));
  });
  return out;
}

static at::Tensor row_argmax(const at::Tensor& x) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous() && x.size(1) > 0,
              "row_argmax: x must be a contiguous float32 [n, V] with V >= 1");
  const int64_t n = x.size(0), V = x.size(1);
  auto out = at::empty({n}, x.options().dtype(at::kLong));
  const float* p = x.data_ptr<float>();
  int64_t* o = out.data_ptr<int64_t>();
  at::parallel_for(0, n, 1, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) o[r] = first_max(p + r * V, V);
  });
  return out;
}

TORCH_LIBRARY_FRAGMENT(dspark, m) {
  m.def("coupled_race(Tensor probs, Tensor keys, Tensor idm) -> Tensor");
  m.impl("coupled_race", c10::DispatchKey::CPU, &coupled_race);
  m.def("row_argmax(Tensor x) -> Tensor");
  m.impl("row_argmax", c10::DispatchKey::CPU, &row_argmax);
}
"""

_EXTENSION = CpuExtension("dspark_cpu_choice", lambda: KERNEL_SOURCE, "the target's choices run in torch")


def available() -> bool:
    """Build the kernel on first use; False where it cannot be built."""
    return bool(_EXTENSION.load())


def argmax(x: torch.Tensor) -> torch.Tensor:
    """``x.argmax(-1)`` of a CPU ``[n, V]`` (any float dtype, read as float32) -> [n] int64.
    Call ``available()`` first."""
    return torch.ops.dspark.row_argmax(x.float().contiguous())


def race_argmax(probs: torch.Tensor, keys: torch.Tensor, idm: torch.Tensor) -> torch.Tensor:
    """``argmax_v probs[i, v] / E(keys[i], v)`` per row -> [n] int64 (``coupled._race`` on the CPU).

    probs [n, V] (non-negative weights), keys [n] int32 (``coupled._row_keys``), idm [V] int32
    (the columns' mixed token ids, ``coupled._id_mix``). Call ``available()`` first."""
    return torch.ops.dspark.coupled_race(probs.float().contiguous(), keys.to(torch.int32), idm.contiguous())
