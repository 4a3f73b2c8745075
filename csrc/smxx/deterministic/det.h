// The deterministic mode's small kernels (params.h: DetGridParams, AbsMaxParams, ItemReduceParams).
#pragma once
#include <cuda_runtime_api.h>

#include "params.h"

namespace msa::smxx {

// *p.out = max(*p.out, finite max |x|) as fp32 bits; bf16 (or fp16) elements, dim a multiple of 8.
cudaError_t launch_absmax(const AbsMaxParams& p, bool bf16, cudaStream_t stream);
// One thread: the grid (1 / u, u, 1 / w, w) from the bound B of p.mode.
cudaError_t launch_det_grid(const DetGridParams& p, cudaStream_t stream);
cudaError_t launch_item_reduce(const ItemReduceParams& p, cudaStream_t stream);

}  // namespace msa::smxx
