// The sparse backward's launcher on Hopper (sm_90a builds only): the warp-specialized kernel of
// sparse_bwd_ws.cuh by default (SparseBwdParams::ws), else the general kernel (the sm80 template with every
// GEMM on wgmma, kWgmma).
#pragma once
#include "sm90/sparse_bwd/sparse_bwd.h"
#include "sm80/sparse_bwd/sparse_bwd_kernel.cuh"
#include "sm90/sparse_bwd/sparse_bwd_ws.cuh"

namespace msa::sm90 {
template <typename T, int D>
cudaError_t launch_sparse_bwd(const SparseBwdParams& p, cudaStream_t stream) {
  if (bwd_ws::applies(p)) return bwd_ws::launch<T, D>(p, stream);
  return sm80::launch_sparse_bwd_kernel<T, D, true>(p, stream);
}
}  // namespace msa::sm90
