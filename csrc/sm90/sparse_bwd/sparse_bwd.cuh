// The sparse backward's launcher on Hopper (sm_90a builds only): the warp-specialized kernel of
// sparse_bwd_ws.cuh where it applies (SparseBwdParams::ws), else the general kernel,
// smxx/sparse_bwd/sparse_bwd_body.cuh with every GEMM on wgmma (sm90/sparse_bwd/mainloop.cuh).
#pragma once
#include "sm90/sparse_bwd/mainloop.cuh"
#include "sm90/sparse_bwd/sparse_bwd.h"
#include "sm90/sparse_bwd/sparse_bwd_ws.cuh"
#include "smxx/sparse_bwd/sparse_bwd_body.cuh"

namespace msa::sm90 {
template <typename T, int D>
cudaError_t launch_sparse_bwd(const SparseBwdParams& p, cudaStream_t stream) {
  if (bwd_ws::applies(p)) return bwd_ws::launch<T, D>(p, stream);
  return smxx::launch_sparse_bwd_pass<BwdMma, T, D>(p, stream);
}
}  // namespace msa::sm90
