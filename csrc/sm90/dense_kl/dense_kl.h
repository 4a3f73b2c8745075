#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime_api.h>

#include "params.h"

namespace msa::sm90 {

// Warmup's KL pass (SPEC 4 and 5) over the full causal set, on wgmma: kl_fixed, dq_idx and dk_idx for
// d_kl = 1. Requires J = 1 (every head of an index group on one kv head). One explicit instantiation per
// (dtype, D, Di) in csrc/instantiations/dense_kl_sm90_*.cu.
template <typename T, int D, int Di>
cudaError_t launch_dense_kl(const DenseKlParams& p, cudaStream_t stream);
// kl_rows (Hi, T) = ln 2 * kl_fixed * 2^-32 + lse_idx (NaN where kl_bad: a non-finite partial sum).
cudaError_t launch_dense_kl_finish(const unsigned long long* kl_fixed, const unsigned int* kl_bad, const float* lse_idx,
                                   float* kl_rows, int64_t n, cudaStream_t stream);
// Dynamic shared memory of launch_dense_kl for G query heads per index group.
int dense_kl_smem_bytes(int d, int di, int g);

}  // namespace msa::sm90
