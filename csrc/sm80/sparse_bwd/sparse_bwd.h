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

}  // namespace msa::sm80
