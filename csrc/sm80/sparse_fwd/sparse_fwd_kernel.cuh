// The portable sparse forward (SPEC 3, with the KL terms of SPEC 4): smxx/sparse_fwd/sparse_fwd_body.cuh's
// passes (the math, work items and tiles are described there) on mma.sync (sm80/sparse_fwd/mainloop.cuh).
// The A100 / Ada / Blackwell path; Hopper runs sm90/sparse_fwd/.
#pragma once
#include <cuda_runtime.h>

#include "params.h"
#include "sm80/sparse_fwd/mainloop.cuh"
#include "sm80/sparse_fwd/sparse_fwd.h"
#include "smxx/sparse_fwd/sparse_fwd_body.cuh"

namespace msa::sm80 {

// kRows: 128-row tiles, or 64 (the output pass in 157 KB of shared memory at D = 128, for the A100);
// kSmall: the small-smem configuration (both passes in 64-row tiles, 99 KB per block).
template <typename T, int D, bool kOut, int kRows = 128, bool kSmall = false>
cudaError_t launch_sparse_fwd_pass(const SparseFwdParams& p, cudaStream_t stream) {
  return smxx::launch_sparse_fwd_pass<FwdMma, T, D, kOut, kRows, 0, kSmall>(p, stream);
}

template <typename T, int D>
cudaError_t launch_sparse_fwd(const SparseFwdParams& p, bool out_pass, cudaStream_t stream) {
  if (p.small_smem) {  // GPUs with 99 KB of shared memory per block: both passes in 64-row tiles
    return out_pass ? launch_sparse_fwd_pass<T, D, true, 64, true>(p, stream)
                    : launch_sparse_fwd_pass<T, D, false, 64, true>(p, stream);
  }
  if (!out_pass) return launch_sparse_fwd_pass<T, D, false>(p, stream);
  return p.out_rows == 64 ? launch_sparse_fwd_pass<T, D, true, 64>(p, stream) : launch_sparse_fwd_pass<T, D, true>(p, stream);
}

}  // namespace msa::sm80
