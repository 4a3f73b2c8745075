// The sparse forward's launcher on Hopper (sm_90a builds only): the stats pass and the general output
// pass are the sm80 templates with their GEMMs on wgmma (kWgmma); the output pass of the Gu = 4 layout
// with the index branch is the warp-specialized kernel of out_pass_ws.cuh.
#pragma once
#include "sm90/sparse_fwd/sparse_fwd.h"
#include "sm80/sparse_fwd/sparse_fwd_kernel.cuh"
#include "sm90/sparse_fwd/out_pass_ws.cuh"
#include "sm90/sparse_fwd/stats_pass_ws.cuh"

namespace msa::sm90 {
// Both passes with Gu = 4 heads per unit (the bench configuration) fixed at compile time when the host
// asks for it (SparseFwdParams::fixed_gu: J = 1, G = 4).
template <typename T, int D>
cudaError_t launch_sparse_fwd(const SparseFwdParams& p, bool out_pass, cudaStream_t stream) {
  if (!out_pass && stats_ws::applies(p)) return stats_ws::launch<T, D>(p, stream);
  if (!out_pass)
    return p.fixed_gu == 4 ? sm80::launch_sparse_fwd_pass<T, D, false, true, 128, 4>(p, stream)
                           : sm80::launch_sparse_fwd_pass<T, D, false, true>(p, stream);
  if (out_ws::applies(p)) return out_ws::launch<T, D>(p, stream);
  return p.fixed_gu == 4 ? sm80::launch_sparse_fwd_pass<T, D, true, true, 128, 4>(p, stream)
                         : sm80::launch_sparse_fwd_pass<T, D, true, true>(p, stream);
}
}  // namespace msa::sm90
