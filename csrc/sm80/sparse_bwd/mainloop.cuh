// The portable sparse backward's GEMMs (mma.sync m16n8k16, operands by ldmatrix from swizzled tiles): the
// mainloop policy of smxx/sparse_bwd/sparse_bwd_body.cuh on sm80 and later, and the pieces the small-smem
// kernel (sparse_bwd_kernel.cuh) shares with it. The Hopper counterpart (wgmma) is sm90/sparse_bwd/mainloop.cuh.
#pragma once
#include <cuda_runtime.h>

#include "common/mma_sm80.h"

namespace msa::sm80 {

// S = Q K^T and dP = dO V^T of the slab on mma.sync: rows [16 rw, +16) of sQ / sdO and rows [kbase, +32) of
// sK / sV, each tile's element (row, 16-byte chunk) at qoff / koff.
template <typename T, int D, typename QOff, typename KOff>
__device__ __forceinline__ void s_dp_slab_mma(float (&s)[4][4], float (&dp)[4][4], const T* sQ, const T* sdO,
                                              const T* sK, const T* sV, QOff qoff, KOff koff, int rw, int kbase,
                                              int lane) {
  zero_acc(s);
  zero_acc(dp);
#pragma unroll 2
  for (int ks = 0; ks < D / 16; ++ks) {
    uint32_t aq[4], ad[4];
    ldmatrix_x4(aq, sQ + qoff(rw * 16 + lane % 16, ks * 2 + lane / 16));
    ldmatrix_x4(ad, sdO + qoff(rw * 16 + lane % 16, ks * 2 + lane / 16));
#pragma unroll
    for (int np = 0; np < 2; ++np) {
      const int krow = kbase + np * 16 + (lane % 8) + (lane / 16) * 8;
      uint32_t b[4];
      ldmatrix_x4(b, sK + koff(krow, ks * 2 + (lane / 8) % 2));
      MmaOp<T>::run(s[2 * np], aq, b[0], b[1]);
      MmaOp<T>::run(s[2 * np + 1], aq, b[2], b[3]);
      ldmatrix_x4(b, sV + koff(krow, ks * 2 + (lane / 8) % 2));
      MmaOp<T>::run(dp[2 * np], ad, b[0], b[1]);
      MmaOp<T>::run(dp[2 * np + 1], ad, b[2], b[3]);
    }
  }
}

// Key phase on mma.sync: dV += P^T dO and dK += dS^T Q for the warp's keys [16 warp, +16) over the tile's
// kTileRows rows, by transposed ldmatrix reads of the [row][key] tiles sP / sdS (KTile) and the [row][d]
// tiles sdO / sQ (Tile).
template <typename T, int D, int kTileRows, typename KTile, typename Tile>
__device__ __forceinline__ void key_phase_mma(float (&dk)[D / 8][4], float (&dv)[D / 8][4], const T* sP, const T* sdS,
                                              const T* sdO, const T* sQ, int warp, int lane) {
#pragma unroll 1
  for (int kr = 0; kr < kTileRows / 16; ++kr) {  // 16 rows per MMA k-step
    uint32_t ap[4], as[4];
    // A = P^T (m = keys, k = rows) from the [row][key] tile: transposed 8x8 loads.
    const int arow = kr * 16 + (lane % 8) + ((lane / 16) * 8);
    const int acol = warp * 2 + (lane / 8) % 2;
    ldmatrix_x4_trans(ap, sP + KTile::offset(arow, acol));
    ldmatrix_x4_trans(as, sdS + KTile::offset(arow, acol));
#pragma unroll
    for (int dpair = 0; dpair < D / 16; ++dpair) {
      uint32_t b[4];
      const int brow = kr * 16 + (lane % 8) + ((lane / 8) % 2) * 8;
      ldmatrix_x4_trans(b, sdO + Tile::offset(brow, dpair * 2 + lane / 16));
      MmaOp<T>::run(dv[2 * dpair], ap, b[0], b[1]);
      MmaOp<T>::run(dv[2 * dpair + 1], ap, b[2], b[3]);
      ldmatrix_x4_trans(b, sQ + Tile::offset(brow, dpair * 2 + lane / 16));
      MmaOp<T>::run(dk[2 * dpair], as, b[0], b[1]);
      MmaOp<T>::run(dk[2 * dpair + 1], as, b[2], b[3]);
    }
  }
}

struct BwdMma {
  static constexpr bool kWgmma = false;
  static constexpr int kSmemSlack = 0;  // no alignment beyond the 128 bytes of the dynamic shared memory
  static constexpr int kKeys = 128, kRows = 64;  // SparseBwdShape's (the body checks)
  template <int kRowsT, int kCols>
  using OpTile = SwizzledTile<kCols>;  // K / V (kRowsT = 128 keys) and Q / dO (64 rows) tiles
  __device__ __forceinline__ static void fence_operands() {}
  struct DqMap {};  // no tensor reductions here (the kernel's parameter, unused)

  // The row phase's S = Q K^T and dP = dO V^T: the warp's rows [16 rw, +16) x keys [kbase, +32); on_issue() first.
  template <typename T, int D, typename OnIssue>
  __device__ __forceinline__ static void s_dp(float (&s)[4][4], float (&dp)[4][4], const T* sQ, const T* sdO,
                                              const T* sK, const T* sV, int rw, int kbase, int lane,
                                              OnIssue on_issue) {
    on_issue();
    auto off = [](int row, int c) { return SwizzledTile<D>::offset(row, c); };
    s_dp_slab_mma<T, D>(s, dp, sQ, sdO, sK, sV, off, off, rw, kbase, lane);
  }

  // Key phase: dV += P^T dO, dK += dS^T Q for the warp's keys [16 warp, +16) over the tile's 64 rows.
  template <typename T, int D>
  __device__ __forceinline__ static void key_phase(float (&dk)[D / 8][4], float (&dv)[D / 8][4], const T* sP,
                                                   const T* sdS, const T* sdO, const T* sQ, int warp, int lane) {
    key_phase_mma<T, D, kRows, SwizzledTile<kKeys>, SwizzledTile<D>>(dk, dv, sP, sdS, sdO, sQ, warp, lane);
  }
  // dQ = dS K for rows [16 rw, +16) and D columns [c0, c0 + 8 N8) over the 128 keys.
  template <typename T, int D, int N8>
  __device__ __forceinline__ static void dq_cols(float (&dq)[N8][4], const T* sdS, const T* sK, int rw, int c0,
                                                 int lane) {
    static_assert(kKeys == 128, "mma_rows_keys runs over 128 keys");
    zero_acc(dq);
    mma_rows_keys<T, SwizzledTile<D>>(dq, sdS, rw * 16, sK, c0 / 8, lane);
  }
};

}  // namespace msa::sm80
