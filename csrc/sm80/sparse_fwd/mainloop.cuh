// The portable sparse forward's GEMMs (mma.sync m16n8k16, operands by ldmatrix from swizzled tiles): the
// mainloop policy smxx/sparse_fwd/sparse_fwd_body.cuh runs the passes with on sm80 and later. Its Hopper
// counterpart (wgmma) is sm90/sparse_fwd/mainloop.cuh.
#pragma once
#include <cuda_runtime.h>

#include <type_traits>

#include "common/mma_sm80.h"
#include "params.h"

namespace msa::sm80 {

struct FwdMma {
  static constexpr bool kWgmma = false;  // warp pairs in the output pass, P V from shared memory
  static constexpr int kSmemSlack = 0;   // no alignment beyond the 128 bytes of the dynamic shared memory
  static constexpr int kKeys = 128, kMaxDi = 128;  // SparseFwdShape's (the body checks)
  template <int kCols>
  using KTile = SwizzledTile<kCols>;  // K, V (D columns) and K_idx (Di) tiles
  template <int D, bool kOut>
  using QTile = SwizzledTile<D>;  // the gathered Q rows of either pass (read by ldmatrix)
  __device__ __forceinline__ static void fence_operands() {}

  // Index logits: warp w takes the stage's keys [16 kwi, +16) (kwi = w % kKeyGroups: part kwi) and the
  // units' m-tiles w / kKeyGroups, + kWarps / kKeyGroups, ...; epi(ci[2][4], m-tile, first key, part, false):
  // both rows of the lane (g, g + 8) hold units (kOneRow, the Hopper stats pass's layout, is not used here).
  template <typename T, bool kBatch, int kKeyGroups, int kWarps, bool kOneRow, class Epilogue>
  __device__ __forceinline__ static void index_logits(const SparseFwdParams& p, const T* sQi, const T* sKi, int warp, int kwi,
                                                      int lane, int ko, int nu, Epilogue& epi) {
    static_assert(!kOneRow, "one unit row per lane: sm_90a only");
    using ITile = SwizzledTile<kMaxDi>;
    if (ko + kwi * 16 < p.block_size) {
      for (int mt = warp / kKeyGroups; mt * 16 < nu; mt += kWarps / kKeyGroups) {
        float ci[2][4];
        zero_acc(ci);
#pragma unroll
        for (int ks = 0; ks < kMaxDi / 16; ++ks) {
          uint32_t a[4], b[4];
          ldmatrix_x4(a, sQi + ITile::offset(mt * 16 + lane % 16, ks * 2 + lane / 16));
          ldmatrix_x4(b, sKi + ITile::offset(kwi * 16 + (lane % 8) + (lane / 16) * 8, ks * 2 + (lane / 8) % 2));
          MmaOp<T>::run(ci[0], a, b[0], b[1]);
          MmaOp<T>::run(ci[1], a, b[2], b[3]);
        }
        epi(ci, mt, kwi * 16, kwi, std::false_type{});
      }
    }
  }

  // Main logits: rows [16 rg, +16) of Q against keys [kb, kb + 8 kN8) of K.
  template <typename T, int D, int kN8, bool kBatch, bool kOut>
  __device__ __forceinline__ static void main_logits(float (&c)[kN8][4], const T* sQ, const T* sK, int rg, int kb,
                                                     int lane) {
    using Tile = SwizzledTile<D>;
#pragma unroll
    for (int ks = 0; ks < D / 16; ++ks) {
      uint32_t a[4];
      ldmatrix_x4(a, sQ + Tile::offset(rg * 16 + lane % 16, ks * 2 + lane / 16));
#pragma unroll
      for (int np = 0; np < kN8 / 2; ++np) {
        uint32_t b[4];
        ldmatrix_x4(b, sK + Tile::offset(kb + np * 16 + (lane % 8) + (lane / 16) * 8, ks * 2 + (lane / 8) % 2));
        MmaOp<T>::run(c[2 * np], a, b[0], b[1]);
        MmaOp<T>::run(c[2 * np + 1], a, b[2], b[3]);
      }
    }
  }
};

}  // namespace msa::sm80
