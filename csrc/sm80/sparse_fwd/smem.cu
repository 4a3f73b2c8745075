// Shared memory of the portable sparse kernels (sparse_fwd.h: sparse_smem_bytes), from their Smem layouts.
// msa/info.py calls this function by its mangled name (msa::sm80::sparse_smem_bytes).
#include "sm80/sparse_bwd/sparse_bwd_kernel.cuh"
#include "sm80/sparse_fwd/sparse_fwd.h"
#include "sm80/sparse_fwd/sparse_fwd_kernel.cuh"

namespace msa::sm80 {
namespace {

// The small-smem configuration fits the 99 KB per block of sm_86 / sm_89 / sm_120 (no static shared memory).
constexpr int kSmallSmemLimit = 101376;
static_assert(smxx::SparseFwdShape::Smem<__nv_bfloat16, 128, false, 64, true>::bytes <= kSmallSmemLimit, "small stats pass");
static_assert(smxx::SparseFwdShape::Smem<__nv_bfloat16, 128, true, 64, true>::bytes <= kSmallSmemLimit, "small output pass");
static_assert(SparseBwdSmallShape::Smem<__nv_bfloat16, 128>::bytes <= kSmallSmemLimit, "small backward");

}  // namespace

int sparse_smem_bytes(int d, int pass, int rows, bool small) {
  // Shared memory depends on the element size (2 bytes for bf16 and fp16), D and the row tile only.
  using T = __nv_bfloat16;
  using S = smxx::SparseFwdShape;
  if (small) {
    switch (pass) {
      case 0: return d == 64 ? S::Smem<T, 64, false, 64, true>::bytes : S::Smem<T, 128, false, 64, true>::bytes;
      case 1: return d == 64 ? S::Smem<T, 64, true, 64, true>::bytes : S::Smem<T, 128, true, 64, true>::bytes;
      default: return d == 64 ? SparseBwdSmallShape::Smem<T, 64>::bytes : SparseBwdSmallShape::Smem<T, 128>::bytes;
    }
  }
  switch (pass) {
    case 0: return d == 64 ? S::Smem<T, 64, false>::bytes : S::Smem<T, 128, false>::bytes;
    case 1:
      if (rows == 64) return d == 64 ? S::Smem<T, 64, true, 64>::bytes : S::Smem<T, 128, true, 64>::bytes;
      return d == 64 ? S::Smem<T, 64, true>::bytes : S::Smem<T, 128, true>::bytes;
    default: return d == 64 ? smxx::SparseBwdShape::Smem<T, 64>::bytes : smxx::SparseBwdShape::Smem<T, 128>::bytes;
  }
}

}  // namespace msa::sm80
