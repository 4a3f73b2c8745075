// The Hopper sparse backward's GEMMs on warpgroup tensor cores (wgmma): the mainloop policy that
// smxx/sparse_bwd/sparse_bwd_body.cuh runs the general sm_90a backward with (sm90/sparse_bwd/sparse_bwd.cuh).
// K, V, Q and dO sit in the 128-byte-swizzled K-major layout (KMajorSw128); the accumulators have the
// mma.sync layout per thread (warp w: keys / rows [16 (w % 4) + 64 (w / 4), +16)), so the epilogues are shared.
#pragma once
#include <cuda.h>  // CUtensorMap
#include <cuda_runtime.h>

#include "common/mma_sm80.h"
#include "common/tma_map.h"
#include "common/wgmma_sm90.h"
#include "params.h"

namespace msa::sm90 {

struct BwdMma {
  static constexpr bool kWgmma = true;
  static constexpr int kSmemSlack = 1024;  // room to align the operand tiles to 1024 bytes
  static constexpr int kKeys = 128, kRows = 64;
  template <int kRowsT, int kCols>
  using OpTile = KMajorSw128<kRowsT, kCols>;  // K / V (128 keys) and Q / dO (64 rows) tiles
  // Tiles written by cp.async (generic proxy) are read by wgmma (async proxy).
  __device__ __forceinline__ static void fence_operands() { fence_proxy_async_smem(); }

  // The row phase's S and dP: the warpgroup's 64 rows x keys [kbase, +32), wgmma m64n32k16 with Q / dO and
  // K / V rows from shared memory (both K-major; a 32-row slice of the key tile starts 4 KB-aligned).
  // on_issue() runs while the wgmmas do.
  template <typename T, int D, typename OnIssue>
  __device__ __forceinline__ static void s_dp(float (&s)[4][4], float (&dp)[4][4], const T* sQ, const T* sdO,
                                              const T* sK, const T* sV, int rw, int kbase, int lane,
                                              OnIssue on_issue) {
    using KW = KMajorSw128<kKeys, D>;
    using QW = KMajorSw128<kRows, D>;
    float(&s_w)[16] = *reinterpret_cast<float(*)[16]>(&s[0][0]);
    float(&dp_w)[16] = *reinterpret_cast<float(*)[16]>(&dp[0][0]);
    const uint32_t q_addr = sm80::smem_addr(sQ), do_addr = sm80::smem_addr(sdO);
    const uint32_t k_addr = sm80::smem_addr(sK) + kbase * 128, v_addr = sm80::smem_addr(sV) + kbase * 128;
    wgmma_fence();
#pragma unroll
    for (int ks = 0; ks < D / 16; ++ks)
      WgmmaSS<T, 32>::run(s_w, QW::desc_rebuilt(q_addr, ks), KW::desc_rebuilt(k_addr, ks), ks > 0);
#pragma unroll
    for (int ks = 0; ks < D / 16; ++ks)
      WgmmaSS<T, 32>::run(dp_w, QW::desc_rebuilt(do_addr, ks), KW::desc_rebuilt(v_addr, ks), ks > 0);
    wgmma_commit();
    on_issue();
    wgmma_wait<0>();
    fence_regs(s_w);
    fence_regs(dp_w);
  }

  // dQ = dS K: warpgroup `half` takes D columns [64 half, +64) (D = 64: both take all), m64n64 over the 128
  // keys in one batch of eight k-steps (A = dS by ldmatrix, B = K MN-major); waited for with the key phase's.
  template <typename T, int D>
  __device__ __forceinline__ static void dq_half(float (&dq)[8][4], const T* sdS, const T* sK, int rw, int half,
                                                 int lane) {
    using KW = KMajorSw128<kKeys, D>;
    using KTile = sm80::SwizzledTile<kKeys>;  // P and dS tiles: rows x 128 keys
    float(&dq_w)[32] = *reinterpret_cast<float(*)[32]>(&dq[0][0]);
    const uint32_t k_addr = sm80::smem_addr(sK) + (D == 128 ? half : 0) * (KW::kPanelElems * int(sizeof(T)));
    wgmma_rs_ksteps<T, 64, kKeys / 16, true>(
        dq_w,
        [&](uint32_t(&a)[4], int kk) {
          sm80::ldmatrix_x4(a, sdS + KTile::offset(rw * 16 + lane % 16, kk * 2 + lane / 16));
        },
        [&](int kk) { return KW::desc_mn_rebuilt(k_addr, kk); }, false);
  }
  // Key phase issued (not waited for): keys [16 warp, +16): dV += P^T dO, dK += dS^T Q over the tile's rows.
  // A = P^T and dS^T (m = keys, k = rows) by transposed ldmatrix, all four row steps, then eight wgmma
  // m64nDk16 with B = dO and Q (k = rows, n = D: MN-major).
  template <typename T, int D>
  __device__ __forceinline__ static void key_phase_issue(float (&dk)[D / 8][4], float (&dv)[D / 8][4], const T* sP,
                                                         const T* sdS, const T* sdO, const T* sQ, int warp, int lane) {
    using QW = KMajorSw128<kRows, D>;
    using KTile = sm80::SwizzledTile<kKeys>;
    uint32_t ap[kRows / 16][4], as[kRows / 16][4];
#pragma unroll
    for (int kr = 0; kr < kRows / 16; ++kr) {
      const int arow = kr * 16 + (lane % 8) + ((lane / 16) * 8);
      const int acol = warp * 2 + (lane / 8) % 2;
      sm80::ldmatrix_x4_trans(ap[kr], sP + KTile::offset(arow, acol));
      sm80::ldmatrix_x4_trans(as[kr], sdS + KTile::offset(arow, acol));
    }
    float(&dv_w)[D / 2] = *reinterpret_cast<float(*)[D / 2]>(&dv[0][0]);
    float(&dk_w)[D / 2] = *reinterpret_cast<float(*)[D / 2]>(&dk[0][0]);
    const uint32_t do_addr = sm80::smem_addr(sdO), q_addr = sm80::smem_addr(sQ);
    wgmma_fence();
#pragma unroll
    for (int kr = 0; kr < kRows / 16; ++kr) {
      WgmmaRS<T, D, true>::run(dv_w, ap[kr], QW::desc_mn_rebuilt(do_addr, kr), true);
      WgmmaRS<T, D, true>::run(dk_w, as[kr], QW::desc_mn_rebuilt(q_addr, kr), true);
    }
    wgmma_commit();
  }
  __device__ __forceinline__ static void wait_all() { wgmma_wait<0>(); }

  // The warp's 16 x 64 dQ slab (accumulator layout: rows g, g + 8, columns 8 n + 2 tq), times scale, added
  // to global memory by bulk reductions through its staging slab `stage` (16 rows of `stride` floats):
  // lane l < 16 adds row l to dst (its row's 64 floats; `ok`: the row is a token's). The slab is rewritten
  // once the previous tile's reductions have read it.
  __device__ __forceinline__ static void reduce_dq_slab(const float (&dq)[8][4], float scale, float* stage, int stride,
                                                        float* dst, bool ok, int lane) {
    const int g = lane / 4, tq = lane % 4;
    if (lane < 16) bulk_wait<0, true>();
    __syncwarp();
#pragma unroll
    for (int n = 0; n < 8; ++n) {
      const int col = n * 8 + 2 * tq;
      *reinterpret_cast<float2*>(stage + g * stride + col) = make_float2(dq[n][0] * scale, dq[n][1] * scale);
      *reinterpret_cast<float2*>(stage + (g + 8) * stride + col) = make_float2(dq[n][2] * scale, dq[n][3] * scale);
    }
    fence_proxy_async_smem();
    __syncwarp();
    if (lane < 16) {
      if (ok) bulk_reduce_add_f32(dst, stage + lane * stride, 64 * 4);
      bulk_commit();
    }
  }
  // dQ by tensor bulk reductions, one per 4 rows of one unit (the launcher's choice where units have a multiple of 4
  // heads): fewer and larger operations than one per row. The descriptor of dq_accum as (T Hq rows, D) travels as a
  // kernel parameter.
  struct DqMap {
    CUtensorMap map;
  };
  static cudaError_t make_dq_map(const SparseBwdParams& p, int d, DqMap* m) {
    return make_f32_rows_reduce_map(p.dq_accum, d, int64_t(p.total_tokens) * p.hq, 4, &m->map);
  }
  // The warp's 16 x 64 dQ slab (as reduce_dq_slab's), times scale, staged in `stage` (4 KB, 1024-byte aligned) as
  // the map's boxes: row r, columns [32 s, +32) of the slab on 128-byte line L = 2 r + s, 16-byte chunk j at
  // j ^ (L % 8) (a half warp's float2 stores, rows g = 0..3, hit every bank once). Returns lane i < 4's box row in
  // the map (rows [4 i, +4), one unit's: token toks[4 i], heads from h0 + rowh[4 i]; -1: none) for
  // issue_dq_chunks, which the caller defers to the next tile's S / dP wgmmas; it has waited (reduce_dq_wait) for
  // the previous boxes to be read before the CTA barrier that precedes this.
  __device__ __forceinline__ static int stage_dq_chunks(const float (&dq)[8][4], float scale, float* stage,
                                                        const int* toks, const int* rowh, int hq, int h0, int lane) {
    const int g = lane / 4, tq = lane % 4;
    char* base = reinterpret_cast<char*>(stage);
#pragma unroll
    for (int n = 0; n < 8; ++n) {
      const int line = 2 * g + n / 4;  // row g; row g + 8 is 16 lines on, in the same swizzle phase
      const int off = line * 128 + ((((n % 4) * 2 + tq / 2) ^ (line % 8)) * 16) + (tq % 2) * 8;
      *reinterpret_cast<float2*>(base + off) = make_float2(dq[n][0] * scale, dq[n][1] * scale);
      *reinterpret_cast<float2*>(base + off + 16 * 128) = make_float2(dq[n][2] * scale, dq[n][3] * scale);
    }
    fence_proxy_async_smem();
    __syncwarp();
    const int tok = lane < 4 ? toks[4 * lane] : -1;
    return tok >= 0 ? tok * hq + h0 + rowh[4 * lane] : -1;
  }
  // Lane i < 4 adds box i of the staged slab (row y, from stage_dq_chunks; none where y < 0) at D columns
  // [32 seg0, +64), in a bulk group of its own.
  __device__ __forceinline__ static void issue_dq_chunks(const CUtensorMap* map, const float* stage, int y, int seg0,
                                                         int lane) {
    if (lane < 4) {
      if (y >= 0) tma_reduce_add_3d(map, reinterpret_cast<const char*>(stage) + lane * 1024, 0, seg0, y);
      bulk_commit();
    }
  }
  // The boxes issued so far have been read (each issuing lane waits for its own).
  __device__ __forceinline__ static void reduce_dq_wait(int lane) {
    if (lane < 4) bulk_wait<0, true>();
  }
  // Before the CTA exits: the staged reductions are done.
  __device__ __forceinline__ static void reduce_dq_drain(int lane) {
    if (lane < 16) bulk_wait<0, false>();
  }
};

}  // namespace msa::sm90
