// The sparse forward's launcher on Hopper (sm_90a builds only): the output pass of the Gu = 4 layout with
// the index branch is the warp-specialized kernel of out_pass_ws.cuh (and the stats pass stats_pass_ws.cuh's
// where it applies, opt-in); every other layout runs the general passes, smxx/sparse_fwd/sparse_fwd_body.cuh
// on wgmma (sm90/sparse_fwd/mainloop.cuh).
#pragma once
#include "sm90/sparse_fwd/mainloop.cuh"
#include "sm90/sparse_fwd/out_pass_ws.cuh"
#include "sm90/sparse_fwd/sparse_fwd.h"
#include "sm90/sparse_fwd/stats_pass_ws.cuh"
#include "smxx/sparse_fwd/sparse_fwd_body.cuh"

namespace msa::sm90 {

// kGu > 0: Gu = kGu heads per unit and J = 1 fixed at compile time (SparseFwdParams::fixed_gu; the
// register KL path then has compile-time loops).
template <typename T, int D, bool kOut, int kGu = 0>
cudaError_t launch_sparse_fwd_pass(const SparseFwdParams& p, cudaStream_t stream) {
  return smxx::launch_sparse_fwd_pass<FwdMma, T, D, kOut, 128, kGu>(p, stream);
}

// Both passes with Gu = 4 heads per unit (the bench configuration) fixed at compile time when the host
// asks for it (SparseFwdParams::fixed_gu: J = 1, G = 4).
template <typename T, int D>
cudaError_t launch_sparse_fwd(const SparseFwdParams& p, bool out_pass, cudaStream_t stream) {
  if (!out_pass && stats_ws::applies(p) && !p.idx_own_only) return stats_ws::launch<T, D>(p, stream);
  if (!out_pass) return p.fixed_gu == 4 ? launch_sparse_fwd_pass<T, D, false, 4>(p, stream) : launch_sparse_fwd_pass<T, D, false>(p, stream);
  if (out_ws_applies(p)) return out_ws::launch<T, D>(p, stream);
  return p.fixed_gu == 4 ? launch_sparse_fwd_pass<T, D, true, 4>(p, stream) : launch_sparse_fwd_pass<T, D, true>(p, stream);
}

}  // namespace msa::sm90
