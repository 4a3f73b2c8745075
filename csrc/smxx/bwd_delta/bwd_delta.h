// The backward's small kernels (bwd_delta.cu), any arch.
#pragma once
#include <cuda_runtime_api.h>

#include <cstdint>

#include "params.h"

namespace msa::smxx {
// delta = rowsum(dout * out) per (head, token); bf16 or fp16 by `bf16`.
cudaError_t launch_bwd_delta(const BwdDeltaParams& p, bool bf16, cudaStream_t stream);
// out (bf16 or fp16, n elements) = in (fp32) * scale[0], scale a device scalar; n a multiple of 4.
cudaError_t launch_scale_cast(const float* in, const float* scale, void* out, int64_t n, bool bf16,
                              cudaStream_t stream);
}  // namespace msa::smxx
