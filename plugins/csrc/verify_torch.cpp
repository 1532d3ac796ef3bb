// verify_torch.cpp -- PyTorch binding of the DSpark verify-step kernels.
//
// Registers the ops dspark::verify and dspark::schedule_prefix (CUDA + Meta kernels).
// This file only checks tensors (device, rank, sizes, dtypes), converts what can be
// converted losslessly, allocates outputs and workspace, and calls dspark_kernels.h.
// The documented Python API is plugins/ops.py.
#include <ATen/ATen.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <limits>
#include <tuple>

#include "dspark_kernels.h"

namespace {

using at::Tensor;

void check_cuda_ok(cudaError_t err, const char* what) {
  TORCH_CHECK(err == cudaSuccess, what, " failed: ", cudaGetErrorString(err));
}

dspark::DType to_dtype(at::ScalarType t) {
  switch (t) {
    case at::kFloat: return dspark::DType::kFloat32;
    case at::kHalf: return dspark::DType::kFloat16;
    case at::kBFloat16: return dspark::DType::kBFloat16;
    default: TORCH_CHECK(false, "unsupported floating dtype ", t);
  }
  return dspark::DType::kFloat32;
}

void check_on(const Tensor& t, const char* name, const at::Device& dev) {
  TORCH_CHECK(t.device() == dev, name, " must be on ", dev, ", got ", t.device());
}

void check_vector(const Tensor& t, const char* name, int64_t R) {
  TORCH_CHECK(t.dim() == 1 && t.size(0) == R, name, " must be [R]=[", R, "], got ", t.sizes());
}

Tensor as_long(const Tensor& t, const char* name) {
  TORCH_CHECK(!at::isFloatingType(t.scalar_type()) && t.scalar_type() != at::kBool,
              name, " must be an integer tensor, got ", t.scalar_type());
  return t.to(at::kLong).contiguous();
}

// draft_tokens [R, K] int, draft_probs [R, K, V] or None, target_logits [R, K+1, V],
// verify_lens / temperature / seed / offset [R] -> (num_accepted [R], output_tokens [R, K+1],
// num_emitted [R]), int64. draft_probs None means one-hot drafts; the Python layer only
// passes None when every row is greedy.
std::tuple<Tensor, Tensor, Tensor> verify_cuda(const Tensor& draft_tokens, const c10::optional<Tensor>& draft_probs,
                                               const Tensor& target_logits, const Tensor& verify_lens,
                                               const Tensor& temperature, const Tensor& seed, const Tensor& offset) {
  TORCH_CHECK(draft_tokens.dim() == 2, "draft_tokens must be [R, K], got ", draft_tokens.sizes());
  const int64_t R = draft_tokens.size(0), K = draft_tokens.size(1);
  TORCH_CHECK(target_logits.dim() == 3 && target_logits.size(0) == R && target_logits.size(1) == K + 1,
              "target_logits must be [R, K+1, V] = [", R, ", ", K + 1, ", V], got ", target_logits.sizes());
  const int64_t V = target_logits.size(2);
  TORCH_CHECK(V >= 1 && V <= std::numeric_limits<int32_t>::max(), "vocabulary size out of range: ", V);
  TORCH_CHECK(R <= std::numeric_limits<int32_t>::max() && K < 65536, "R or K out of range");
  const at::Device dev = target_logits.device();
  TORCH_CHECK(dev.is_cuda(), "target_logits must be a CUDA tensor");
  for (auto [t, name] : {std::pair<const Tensor*, const char*>{&draft_tokens, "draft_tokens"},
                         {&verify_lens, "verify_lens"}, {&temperature, "temperature"},
                         {&seed, "seed"}, {&offset, "offset"}})
    check_on(*t, name, dev);
  check_vector(verify_lens, "verify_lens", R);
  check_vector(temperature, "temperature", R);
  check_vector(seed, "seed", R);
  check_vector(offset, "offset", R);
  TORCH_CHECK(at::isFloatingType(temperature.scalar_type()), "temperature must be floating point");

  const Tensor logits = target_logits.contiguous();
  const dspark::DType logits_dtype = to_dtype(logits.scalar_type());
  Tensor probs;
  if (draft_probs.has_value()) {
    const Tensor& dp = *draft_probs;
    check_on(dp, "draft_probs", dev);
    TORCH_CHECK(dp.dim() == 3 && dp.size(0) == R && dp.size(1) == K && dp.size(2) == V,
                "draft_probs must be [R, K, V] = [", R, ", ", K, ", ", V, "], got ", dp.sizes());
    TORCH_CHECK(at::isFloatingType(dp.scalar_type()), "draft_probs must be floating point");
    // Kernels read draft probabilities in fp32 or in the logits' dtype; anything else -> fp32.
    probs = (dp.scalar_type() == at::kFloat || dp.scalar_type() == logits.scalar_type()) ? dp.contiguous()
                                                                                         : dp.to(at::kFloat).contiguous();
  }
  const Tensor tokens = as_long(draft_tokens, "draft_tokens");
  const Tensor lens = as_long(verify_lens, "verify_lens");
  const Tensor seeds = as_long(seed, "seed");
  const Tensor offsets = as_long(offset, "offset");
  const Tensor temps = temperature.to(at::kFloat).contiguous();

  const c10::cuda::CUDAGuard guard(dev);
  const auto opts = at::TensorOptions().device(dev).dtype(at::kLong);
  Tensor num_accepted = at::empty({R}, opts);
  Tensor output_tokens = at::empty({R, K + 1}, opts);
  Tensor num_emitted = at::empty({R}, opts);
  if (R == 0) return {num_accepted, output_tokens, num_emitted};
  const size_t ws_bytes = dspark::verify_workspace_bytes(static_cast<int32_t>(R), static_cast<int32_t>(K),
                                                         static_cast<int32_t>(V));
  Tensor ws = at::empty({static_cast<int64_t>(ws_bytes)}, at::TensorOptions().device(dev).dtype(at::kByte));

  dspark::VerifyParams p;
  p.R = static_cast<int32_t>(R);
  p.K = static_cast<int32_t>(K);
  p.V = static_cast<int32_t>(V);
  p.draft_tokens = tokens.data_ptr<int64_t>();
  p.draft_probs = probs.defined() ? probs.data_ptr() : nullptr;
  p.draft_dtype = probs.defined() ? to_dtype(probs.scalar_type()) : dspark::DType::kFloat32;
  p.target_logits = logits.data_ptr();
  p.logits_dtype = logits_dtype;
  p.verify_lens = lens.data_ptr<int64_t>();
  p.temperature = temps.data_ptr<float>();
  p.seed = seeds.data_ptr<int64_t>();
  p.offset = offsets.data_ptr<int64_t>();
  p.num_accepted = num_accepted.data_ptr<int64_t>();
  p.output_tokens = output_tokens.data_ptr<int64_t>();
  p.num_emitted = num_emitted.data_ptr<int64_t>();
  p.all_greedy = false;  // per-row temperature decides; greedy rows skip the sampling kernels' work
  check_cuda_ok(dspark::verify(p, ws.data_ptr(), ws_bytes, c10::cuda::getCurrentCUDAStream()), "dspark::verify");
  return {num_accepted, output_tokens, num_emitted};
}

// confidence [R, K] float, sps [N+1] float (batch tokens -> steps/s), max_lens [R] int or
// None -> verify_lens [R] int64.
Tensor schedule_prefix_cuda(const Tensor& confidence, const Tensor& sps, const c10::optional<Tensor>& max_lens,
                            bool early_stop) {
  TORCH_CHECK(confidence.dim() == 2, "confidence must be [R, K], got ", confidence.sizes());
  TORCH_CHECK(sps.dim() == 1 && sps.size(0) >= 1, "sps must be [N+1], got ", sps.sizes());
  const int64_t R = confidence.size(0), K = confidence.size(1);
  TORCH_CHECK(R * K <= dspark::schedule_max_candidates(), "R*K = ", R * K, " exceeds the scheduler kernel's ",
              dspark::schedule_max_candidates(), " candidates");
  TORCH_CHECK(sps.size(0) <= std::numeric_limits<int32_t>::max(), "sps table too long");
  const at::Device dev = confidence.device();
  TORCH_CHECK(dev.is_cuda(), "confidence must be a CUDA tensor");
  TORCH_CHECK(at::isFloatingType(confidence.scalar_type()) && at::isFloatingType(sps.scalar_type()),
              "confidence and sps must be floating point");
  const c10::cuda::CUDAGuard guard(dev);
  // fp32 stays fp32 (exact in the kernel's double arithmetic); other types go to fp64.
  const Tensor conf = confidence.scalar_type() == at::kFloat ? confidence.contiguous()
                                                            : confidence.to(at::kDouble).contiguous();
  const Tensor table = sps.to(dev, at::kDouble).contiguous();
  Tensor caps;
  if (max_lens.has_value()) {
    check_on(*max_lens, "max_lens", dev);
    check_vector(*max_lens, "max_lens", R);
    caps = as_long(*max_lens, "max_lens");
  }
  Tensor out = at::empty({R}, at::TensorOptions().device(dev).dtype(at::kLong));
  if (R == 0) return out;
  dspark::ScheduleParams p;
  p.R = static_cast<int32_t>(R);
  p.K = static_cast<int32_t>(K);
  p.n_sps = static_cast<int32_t>(table.size(0));
  if (conf.scalar_type() == at::kFloat) p.confidence_f32 = conf.data_ptr<float>();
  else p.confidence_f64 = conf.data_ptr<double>();
  p.sps = table.data_ptr<double>();
  p.max_lens = caps.defined() ? caps.data_ptr<int64_t>() : nullptr;
  p.verify_lens = out.data_ptr<int64_t>();
  p.early_stop = early_stop;
  check_cuda_ok(dspark::schedule_prefix(p, c10::cuda::getCurrentCUDAStream()), "dspark::schedule_prefix");
  return out;
}

// Shape-only kernels so the ops can be traced (torch.compile, fake tensors).
std::tuple<Tensor, Tensor, Tensor> verify_meta(const Tensor& draft_tokens, const c10::optional<Tensor>&,
                                               const Tensor& target_logits, const Tensor&, const Tensor&,
                                               const Tensor&, const Tensor&) {
  const auto R = draft_tokens.sym_size(0), K = draft_tokens.sym_size(1);
  const auto opts = target_logits.options().dtype(at::kLong);
  return {at::empty_symint({R}, opts), at::empty_symint({R, K + 1}, opts), at::empty_symint({R}, opts)};
}

Tensor schedule_prefix_meta(const Tensor& confidence, const Tensor&, const c10::optional<Tensor>&, bool) {
  return at::empty_symint({confidence.sym_size(0)}, confidence.options().dtype(at::kLong));
}

}  // namespace

TORCH_LIBRARY(dspark, m) {
  m.def(
      "verify(Tensor draft_tokens, Tensor? draft_probs, Tensor target_logits, Tensor verify_lens, "
      "Tensor temperature, Tensor seed, Tensor offset) -> (Tensor, Tensor, Tensor)");
  m.def("schedule_prefix(Tensor confidence, Tensor sps, Tensor? max_lens, bool early_stop=True) -> Tensor");
}

TORCH_LIBRARY_IMPL(dspark, CUDA, m) {
  m.impl("verify", &verify_cuda);
  m.impl("schedule_prefix", &schedule_prefix_cuda);
}

TORCH_LIBRARY_IMPL(dspark, Meta, m) {
  m.impl("verify", &verify_meta);
  m.impl("schedule_prefix", &schedule_prefix_meta);
}
