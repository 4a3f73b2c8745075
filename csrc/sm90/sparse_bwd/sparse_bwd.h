// The sparse backward on Hopper: the launcher's declaration (sparse_bwd.cuh defines it).
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime_api.h>

#include "params.h"

namespace msa::sm90 {
// The same backward with its key phase and dQ on wgmma (sm_90a builds only: MSA_WITH_SM90).
template <typename T, int D>
cudaError_t launch_sparse_bwd(const SparseBwdParams& p, cudaStream_t stream);
}  // namespace msa::sm90
