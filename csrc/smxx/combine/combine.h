// The sparse forward's combines of one query chunk's per-entry results (math: combine_out.cuh), any arch.
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime_api.h>

#include "params.h"

namespace msa::smxx {

// out[t, h] = sum of the slots' partials; one explicit instantiation per (dtype, D) in csrc/instantiations/.
template <typename T, int D>
cudaError_t launch_sparse_combine_out(const SparseCombineParams& p, cudaStream_t stream);
cudaError_t launch_sparse_combine_stats(const SparseCombineParams& p, cudaStream_t stream);
cudaError_t launch_sparse_combine_kl(const SparseCombineParams& p, cudaStream_t stream);

}  // namespace msa::smxx
