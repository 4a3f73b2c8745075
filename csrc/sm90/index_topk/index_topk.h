#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime_api.h>

#include "params.h"

namespace msa::sm90 {

// Hopper index top-k (wgmma). Built only when MSA_CUDA_ARCHS has 90a (MSA_WITH_SM90); one explicit
// instantiation per (dtype, Di) in csrc/instantiations/index_topk_sm90_*.cu.
template <typename T, int D>
cudaError_t launch_index_topk(const IndexTopkParams& p, cudaStream_t stream);

// The top-k on FP8 (e4m3) q_idx / k_idx (Di = 128; p.sel_stats unused): cudaErrorInvalidValue for odd strides,
// cudaErrorNotSupported (nothing launched) where no TMA descriptor fits k_idx.
template <int Di>
cudaError_t launch_index_topk_fp8(const IndexTopkParams& p, cudaStream_t stream);

// The index branch's lse (warmup's lse_idx) on the same kernel: p.lse (Hi, T), natural log of the scaled logits
// over every causally visible key. cudaErrorNotSupported (nothing launched) where no TMA descriptor fits k_idx.
template <typename T, int D>
cudaError_t launch_index_lse(const IndexTopkParams& p, cudaStream_t stream);

}  // namespace msa::sm90
