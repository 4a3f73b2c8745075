// The sparse forward on Hopper: the launcher's declaration (sparse_fwd.cuh defines it).
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime_api.h>

#include "params.h"

namespace msa::sm90 {
// Both passes with their Q K^T on wgmma: sm_90a builds only (MSA_WITH_SM90).
template <typename T, int D>
cudaError_t launch_sparse_fwd(const SparseFwdParams& p, bool out_pass, cudaStream_t stream);
}  // namespace msa::sm90
