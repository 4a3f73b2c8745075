// index dk's per-tile GEMM on mma.sync (any arch from sm80): the mainloop policy of the portable kernel
// (smxx/index_dk/index_dk_body.cuh, instantiated in smxx/index_dk/index_dk.cu). Warp w holds keys [16 w, +16)
// x all 128 columns of Di: acc[n] is the m16n8 tile of columns [8 n, +8).
#pragma once
#include <cuda_runtime.h>

#include "common/mma_sm80.h"

namespace msa::sm80 {

struct DkMma {
  static constexpr bool kAsync = false;  // mma.sync: the next tile's copies go out before the GEMM
  static constexpr int kDetBlocks = 1;   // the deterministic variant spills at two CTAs per SM (128 registers)
  static constexpr int kStages = 3;      // the ring: 3 x 16 KB
  static constexpr int kAlign = 16;      // the tiles' swizzle is on element offsets
  using Tile = SwizzledTile<128>;        // dsi (units x keys) and q_idx (units x Di) tiles, read by ldmatrix
  __device__ __forceinline__ static void fence_operands() {}

  // acc (+)= dsi^T q_idx over the tile's 32 units (two k-steps): A = dsi^T (m = keys, k = units), B = q_idx,
  // both by ldmatrix.trans. first: acc starts from zero.
  template <typename T>
  __device__ __forceinline__ static void issue(float (&acc)[16][4], const T* ds, const T* qi, int warp, int lane,
                                               bool first) {
    if (first) zero_acc(acc);
#pragma unroll
    for (int ks = 0; ks < 2; ++ks) {
      uint32_t a[4];
      ldmatrix_x4_trans(a, ds + Tile::offset(ks * 16 + (lane % 8) + (lane / 16) * 8, warp * 2 + (lane / 8) % 2));
#pragma unroll
      for (int dp = 0; dp < 8; ++dp) {
        uint32_t b[4];
        ldmatrix_x4_trans(b, qi + Tile::offset(ks * 16 + (lane % 8) + ((lane / 8) % 2) * 8, dp * 2 + lane / 16));
        MmaOp<T>::run(acc[2 * dp], a, b[0], b[1]);
        MmaOp<T>::run(acc[2 * dp + 1], a, b[2], b[3]);
      }
    }
  }
  __device__ __forceinline__ static void wait(float (&)[16][4]) {}
};

}  // namespace msa::sm80
