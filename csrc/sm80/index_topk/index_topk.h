#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime_api.h>

#include "params.h"

namespace msa::sm80 {

// One explicit instantiation per (dtype, Di) in csrc/instantiations/ (scripts/gen_instantiations.py).
template <typename T, int D>
cudaError_t launch_index_topk(const IndexTopkParams& p, cudaStream_t stream);

}  // namespace msa::sm80
