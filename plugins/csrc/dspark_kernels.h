// dspark_kernels.h -- the framework-free entry points of the DSpark verify-step kernels.
//
// Plain C++ (no CUDA language extensions, no torch, no TensorRT): the PyTorch binding
// (verify_torch.cpp) and the TensorRT plugin (trt/dspark_plugin.cpp) both include this
// header and link the one compiled implementation in kernels.cu. Semantics are those of
// plugins/reference.py (`verify`, `schedule_prefix`); see docs/plugins.md.
//
// Every launcher returns a cudaError_t: cudaSuccess, cudaErrorInvalidValue for bad
// arguments (checked on the host, no device sync), or the launch error.
#pragma once

#include <cstddef>
#include <cstdint>

#include <cuda_runtime_api.h>

namespace dspark {

// Element type of a floating-point tensor.
enum class DType : int32_t { kFloat32 = 0, kFloat16 = 1, kBFloat16 = 2 };

// ---------------------------------------------------------------------------------------
// Verification (greedy + rejection sampling, ragged verify lengths).
// ---------------------------------------------------------------------------------------
struct VerifyParams {
  int32_t R = 0;  // requests
  int32_t K = 0;  // draft slots per request (block size)
  int32_t V = 0;  // vocabulary size

  const int64_t* draft_tokens = nullptr;  // [R, K]
  const void* draft_probs = nullptr;      // [R, K, V] in draft_dtype; nullptr = one-hot drafts
  DType draft_dtype = DType::kFloat32;
  const void* target_logits = nullptr;    // [R, K+1, V] in logits_dtype
  DType logits_dtype = DType::kFloat32;
  const int64_t* verify_lens = nullptr;   // [R], values in [0, K] (clamped on device)
  const float* temperature = nullptr;     // [R], <= 0 means greedy; nullptr = all greedy
  const int64_t* seed = nullptr;          // [R]; nullptr = 0
  const int64_t* offset = nullptr;        // [R]; nullptr = 0

  int64_t* num_accepted = nullptr;   // [R] out: accepted drafts n
  int64_t* output_tokens = nullptr;  // [R, K+1] out: accepted drafts, then one more token, -1 padded
  int64_t* num_emitted = nullptr;    // [R] out (optional): n + 1

  // Host-side promise that every row is greedy: the sampling kernels are not launched.
  bool all_greedy = false;
  // Streaming multiprocessors of the device (sizes the vocab split); <= 0: query it.
  int32_t num_sms = 0;
};

// Device workspace (bytes) that verify() needs for these sizes; independent of num_sms.
size_t verify_workspace_bytes(int32_t R, int32_t K, int32_t V);

// Enqueue the verify step on `stream`. `workspace` must hold verify_workspace_bytes(R, K, V)
// bytes, 256-byte aligned; its content on entry does not matter.
cudaError_t verify(const VerifyParams& p, void* workspace, size_t workspace_bytes, cudaStream_t stream);

// ---------------------------------------------------------------------------------------
// Prefix scheduler (report Algorithm 1 with the early stop).
// ---------------------------------------------------------------------------------------
struct ScheduleParams {
  int32_t R = 0;
  int32_t K = 0;
  int32_t n_sps = 0;                 // entries of the SPS table = N + 1 (index = batch tokens)
  const float* confidence_f32 = nullptr;   // [R, K]; exactly one of the two confidence
  const double* confidence_f64 = nullptr;  // [R, K]  pointers is set
  const double* sps = nullptr;       // [n_sps] steps/s by batch tokens (entry 0 unused)
  const int64_t* max_lens = nullptr; // [R] cap per request, nullptr = K
  int64_t* verify_lens = nullptr;    // [R] out
  bool early_stop = true;
};

// Largest R*K the single-block scheduler takes (larger batches: cudaErrorInvalidValue).
int32_t schedule_max_candidates();

cudaError_t schedule_prefix(const ScheduleParams& p, cudaStream_t stream);

}  // namespace dspark
