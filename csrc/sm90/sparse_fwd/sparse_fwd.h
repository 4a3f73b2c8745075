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

// Query heads per unit of the warp-specialized output pass (out_pass_ws.cuh's kGu).
constexpr int kOutWsGu = 4;
// Whether the output pass runs the warp-specialized kernel (out_pass_ws.cuh): Gu = kOutWsGu with J = 1, the index
// branch and the main output.
inline bool out_ws_applies(const SparseFwdParams& p) {
  return p.out_ws && p.fixed_gu == kOutWsGu && p.q_idx != nullptr && p.write_out && !p.small_smem;
}
// ... and, with the index gradient (dki_accum set), computes dk_idx itself: no index dk launch (dsi_part is then
// not written).
inline bool out_ws_fuses_index_dk(const SparseFwdParams& p) { return out_ws_applies(p) && p.dki_accum != nullptr; }
}  // namespace msa::sm90
