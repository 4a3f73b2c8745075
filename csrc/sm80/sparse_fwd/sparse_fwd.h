#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime_api.h>

#include "params.h"

namespace msa::sm80 {

// Largest forward work item in units (one CTA; the kernel's shared-memory unit tables hold this many):
// SparseFwdParams::work.units_per_item must not exceed it.
constexpr int kFwdMaxItemUnits = 512;

// One explicit instantiation per (dtype, D) in csrc/instantiations/ (scripts/gen_instantiations.py).
template <typename T, int D>
cudaError_t launch_sparse_fwd(const SparseFwdParams& p, bool out_pass, cudaStream_t stream);
// Dynamic shared memory of the sparse kernels for head dim d: pass 0 = forward stats pass, 1 = forward
// output pass (portable: `rows` = 128 or 64 rows per tile), 2 = backward. small = true: the small-smem
// configuration (SparseFwdParams / SparseBwdParams::small_smem; `rows` is then ignored), <= 101376 bytes
// (the 99 KB per block of sm_86 / sm_89 / sm_120) for every pass and d; the kernels use no static shared
// memory. (sm80/sparse_fwd/smem.cu)
int sparse_smem_bytes(int d, int pass, int rows = 128, bool small = false);

}  // namespace msa::sm80
