// schedule.cu -- compiled entry points of the prefix scheduler declared in
// dspark_kernels.h. No framework types.
#include "dspark_kernels.h"

#include "schedule.cuh"

namespace dspark {

int32_t schedule_max_candidates() { return detail::kScheduleMaxCandidates; }

cudaError_t schedule_prefix(const ScheduleParams& p, cudaStream_t stream) {
  if (p.R == 0) return cudaSuccess;
  if ((p.confidence_f32 == nullptr) == (p.confidence_f64 == nullptr)) return cudaErrorInvalidValue;
  if (p.confidence_f32) return detail::launch_schedule(p.confidence_f32, p, stream);
  return detail::launch_schedule(p.confidence_f64, p, stream);
}

}  // namespace dspark
