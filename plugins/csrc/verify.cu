// verify.cu -- compiled entry points of the verify step declared in dspark_kernels.h
// (dtype dispatch, argument checks). No framework types.
#include "dspark_kernels.h"

#include "verify.cuh"

namespace dspark {
namespace {

template <typename T>
cudaError_t dispatch_draft(const VerifyParams& p, void* ws, size_t ws_bytes, cudaStream_t stream) {
  // Draft probabilities come in fp32 or in the logits' own type (5 instantiations, not 9).
  if (p.draft_dtype == DType::kFloat32) return detail::launch_verify<T, float>(p, ws, ws_bytes, stream);
  if (p.draft_dtype == p.logits_dtype) return detail::launch_verify<T, T>(p, ws, ws_bytes, stream);
  return cudaErrorInvalidValue;
}

}  // namespace

size_t verify_workspace_bytes(int32_t R, int32_t K, int32_t V) {
  if (R < 0 || K < 0 || V < 1) return 0;
  return detail::make_verify_plan(R, K, V, detail::kMaxSmsForSizing).bytes;
}

cudaError_t verify(const VerifyParams& p, void* workspace, size_t workspace_bytes, cudaStream_t stream) {
  if (p.R < 0 || p.K < 0 || p.K > 65535 || p.V < 1 || p.V > (1 << 30)) return cudaErrorInvalidValue;
  if (p.R == 0) return cudaSuccess;
  if (p.target_logits == nullptr || p.verify_lens == nullptr || p.num_accepted == nullptr ||
      p.output_tokens == nullptr || (p.K > 0 && p.draft_tokens == nullptr))
    return cudaErrorInvalidValue;
  VerifyParams q = p;
  if (q.temperature == nullptr) q.all_greedy = true;
  if (q.num_sms <= 0) {
    int dev = 0;
    cudaError_t err = cudaGetDevice(&dev);
    if (err == cudaSuccess) err = cudaDeviceGetAttribute(&q.num_sms, cudaDevAttrMultiProcessorCount, dev);
    if (err != cudaSuccess) return err;
  }
  switch (q.logits_dtype) {
    case DType::kFloat32: return dispatch_draft<float>(q, workspace, workspace_bytes, stream);
    case DType::kFloat16: return dispatch_draft<__half>(q, workspace, workspace_bytes, stream);
    case DType::kBFloat16: return dispatch_draft<__nv_bfloat16>(q, workspace, workspace_bytes, stream);
  }
  return cudaErrorInvalidValue;
}

}  // namespace dspark
