// The Hopper sparse forward's GEMMs on warpgroup tensor cores (wgmma; A = Q, Q_idx or P from registers,
// B = K, K_idx or V from shared memory in the 128-byte-swizzled K-major layout): the mainloop policy that
// smxx/sparse_fwd/sparse_fwd_body.cuh runs the general sm_90a passes with (sm90/sparse_fwd/sparse_fwd.cuh).
// Warpgroup i (warps 4 i .. 4 i + 3) holds rows [64 i, +64) x all 128 keys.
#pragma once
#include <cuda_runtime.h>

#include <type_traits>

#include "common/mma_sm80.h"
#include "common/wgmma_sm90.h"
#include "params.h"

namespace msa::sm90 {

struct FwdMma {
  static constexpr bool kWgmma = true;      // eight warps in both passes, P kept in registers for P V
  static constexpr int kSmemSlack = 1024;   // room to align the K tile to 1024 bytes
  static constexpr int kKeys = 128, kMaxDi = 128;  // SparseFwdShape's (the body checks)
  template <int kCols>
  using KTile = KMajorSw128<kKeys, kCols>;  // K, V (D columns) and K_idx (Di) tiles
  // The gathered Q rows: the stats pass's are wgmma's A operand from shared memory (128 rows, 128-byte swizzle, each
  // warpgroup's 64 from row 64 wg), the output pass's go to registers by ldmatrix (P V needs the registers).
  template <int D, bool kOut>
  using QTile = std::conditional_t<kOut, sm80::SwizzledTile<D>, KMajorSw128<kKeys, D>>;
  // Tiles written by cp.async (generic proxy) are read by wgmma (async proxy).
  __device__ __forceinline__ static void fence_operands() { fence_proxy_async_smem(); }

  // Index logits: warpgroup w / 4 takes keys [64 (w / 4), +64) of all units (part w / 4): m64n64k16 RS with
  // K_idx by descriptor at row 64 (w / 4). The 32 units fill half of the MMA's 64 rows: warps 0 and 1 of the
  // group hold units 0-15 and 16-31 (Q_idx rows by ldmatrix; slots past nu are zero-filled), warps 2 and 3 zero
  // rows; kOneRow (the stats pass): warp wq holds units [8 wq, +8) in its rows g and zeros in rows g + 8, so
  // that every warp of the group shares the epilogue (each reduces one row per lane, where two warps reduced
  // two while the other two waited at the next wgmma). kBatch (the registers allow it): all of Di in one batch
  // of wgmmas. epi(ci[8][4], m-tile, first key, part, kOneRow).
  template <typename T, bool kBatch, int kKeyGroups, int kWarps, bool kOneRow, class Epilogue>
  __device__ __forceinline__ static void index_logits(const SparseFwdParams& p, const T* sQi, const T* sKi, int warp, int kwi,
                                                      int lane, int ko, int nu, Epilogue& epi) {
    using ITile = sm80::SwizzledTile<kMaxDi>;
    using KiTile = KTile<kMaxDi>;
    const int wg = warp / 4, wq = warp % 4;
    float cw[32];
    const uint32_t ki_addr = sm80::smem_addr(sKi) + wg * 64 * 128;  // row 64 wg of each 128-byte panel
    auto load_qi = [&](uint32_t(&a)[4], int ks) {
      if constexpr (kOneRow) {  // the A fragment's rows g: units 8 wq + g, k halves 2 ks and 2 ks + 1
        uint32_t r[2];
        sm80::ldmatrix_x2(r, sQi + ITile::offset(wq * 8 + lane % 8, ks * 2 + (lane / 8) % 2));
        a[0] = r[0];
        a[1] = 0u;
        a[2] = r[1];
        a[3] = 0u;
      } else if (wq < 2) {
        sm80::ldmatrix_x4(a, sQi + ITile::offset(wq * 16 + lane % 16, ks * 2 + lane / 16));
      } else {
        a[0] = a[1] = a[2] = a[3] = 0u;
      }
    };
    if constexpr (kBatch) {
      wgmma_rs_ksteps<T, 64, kMaxDi / 16>(cw, load_qi, [&](int ks) { return KiTile::desc(ki_addr, ks); }, false);
    } else {
#pragma unroll
      for (int half = 0; half < kMaxDi / 64; ++half) {
        wgmma_rs_k64<T, 64>(
            cw, [&](uint32_t(&a)[4], int k4) { load_qi(a, half * 4 + k4); },
            [&](int k4) { return KiTile::desc(ki_addr, half * 4 + k4); }, half > 0);
      }
    }
    if ((kOneRow || wq < 2) && wg * 64 < p.block_size) {
      float ci[8][4];
#pragma unroll
      for (int n = 0; n < 8; ++n)
#pragma unroll
        for (int e = 0; e < 4; ++e) ci[n][e] = cw[4 * n + e];
      epi(ci, wq, wg * 64, wg, std::bool_constant<kOneRow>{});
    }
  }

  // Main logits: warp w's 16 rows are rg * 16 (as in the mma.sync path; the accumulator layout is c's) x
  // all 128 keys. The output pass: Q goes to registers in two halves of D / 2, or (kBatch) all of D in one batch
  // of wgmmas. The stats pass (!kOut): Q read from shared memory by descriptor (QTile), all of D in one batch
  // (s48: in halves from registers, each half's wait was ~3.5% of its stall samples, ncu at 32K).
  template <typename T, int D, int kN8, bool kBatch, bool kOut>
  __device__ __forceinline__ static void main_logits(float (&c)[kN8][4], const T* sQ, const T* sK, int rg, int kb,
                                                     int lane) {
    static_assert(kN8 * 8 == kKeys, "a wgmma warp holds all keys");
    using Tile = sm80::SwizzledTile<D>;
    using KT = KTile<D>;
    float cw[4 * kN8];
    const uint32_t k_addr = sm80::smem_addr(sK);
    if constexpr (!kOut) {
      using QT = QTile<D, kOut>;
      const uint32_t q_addr = sm80::smem_addr(sQ) + (rg / 4) * 64 * 128;  // row 64 wg of each 128-byte panel
      wgmma_fence();
#pragma unroll
      for (int ks = 0; ks < D / 16; ++ks)
        WgmmaSS<T, kKeys>::run(cw, QT::desc(q_addr, ks), KT::desc(k_addr, ks), ks > 0);
      wgmma_commit();
      wgmma_wait<0>();
      fence_regs(cw);  // no use of the accumulators moves above the wait
    } else {
      // A fragment of Q, k-step ks (16 columns) of the warp's 16 rows.
      auto load_q = [&](uint32_t(&a)[4], int ks) {
        sm80::ldmatrix_x4(a, sQ + Tile::offset(rg * 16 + lane % 16, ks * 2 + lane / 16));
      };
      if constexpr (kBatch) {
        wgmma_rs_ksteps<T, kKeys, D / 16>(cw, load_q, [&](int ks) { return KT::desc(k_addr, ks); }, false);
      } else {
#pragma unroll
        for (int half = 0; half < D / 64; ++half) {
          wgmma_rs_k64<T, kKeys>(
              cw, [&](uint32_t(&a)[4], int k4) { load_q(a, half * 4 + k4); },
              [&](int k4) { return KT::desc(k_addr, half * 4 + k4); }, half > 0);
        }
      }
    }
#pragma unroll
    for (int n = 0; n < kN8; ++n)
#pragma unroll
      for (int e = 0; e < 4; ++e) c[n][e] = cw[4 * n + e];
  }

  // One 64-column panel of O = P V issued and committed (P in registers: pa[kk] is the A fragment of keys
  // [16 kk, +16); V read MN-major); wait<N>() waits for all but N committed groups.
  template <typename T, int D>
  __device__ __forceinline__ static void pv_issue(float (&ow)[32], const uint32_t (&pa)[kKeys / 16][4], uint32_t v_addr,
                                                  int panel) {
    using VT = KTile<D>;
    wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < kKeys / 16; ++kk)
      WgmmaRS<T, 64, true>::run(ow, pa[kk], VT::desc_mn(v_addr + panel * VT::kPanelElems * 2, kk), kk > 0);
    wgmma_commit();
  }
  template <int N>
  __device__ __forceinline__ static void wait() { wgmma_wait<N>(); }
};

}  // namespace msa::sm90
