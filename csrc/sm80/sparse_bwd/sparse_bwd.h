#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime_api.h>

#include "params.h"

namespace msa::sm80 {

// Keys per backward work item's block tile (the deterministic mode's dK / dV partials are 128 rows).
constexpr int kBwdKeys = 128;

// One explicit instantiation per (dtype, D) in csrc/instantiations/ (scripts/gen_instantiations.py).
template <typename T, int D>
cudaError_t launch_sparse_bwd(const SparseBwdParams& p, cudaStream_t stream);
// delta = rowsum(dout * out) per (head, token); bf16 or fp16 by `bf16`.
cudaError_t launch_bwd_delta(const BwdDeltaParams& p, bool bf16, cudaStream_t stream);
// out (bf16 or fp16, n elements) = in (fp32) * scale[0], scale a device scalar; n a multiple of 4.
cudaError_t launch_scale_cast(const float* in, const float* scale, void* out, int64_t n, bool bf16,
                              cudaStream_t stream);

}  // namespace msa::sm80

namespace msa::sm90 {
// The same backward with its key phase and dQ on wgmma (sm_90a builds only: MSA_WITH_SM90).
template <typename T, int D>
cudaError_t launch_sparse_bwd(const SparseBwdParams& p, cudaStream_t stream);
}  // namespace msa::sm90
