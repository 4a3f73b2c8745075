// The portable sparse backward: smxx/sparse_bwd/sparse_bwd_body.cuh's kernel (the math and work items are
// described there) on mma.sync (sm80/sparse_bwd/mainloop.cuh), and the small-smem kernel.
//
// Small-smem configuration (sparse_bwd_small_kernel, SparseBwdParams::small_smem: GPUs with 99 KB of
// shared memory per block, sm_86 / sm_89 / sm_120): 99072 bytes at D = 128. The whole 128-key block stays
// resident as above, so dK / dV stay in registers for the item and dQ is added once per (row, block);
// what shrinks is the row tile: 32 rows in one stage, the next tile's Q / dO fetched once the key phase
// is done with this one's, overlapping the dQ phase. Rows are the item's (unit, head) pairs in order,
// cut into tiles of 32 (a unit's heads may straddle two tiles: Gu up to 64).
#pragma once
#include <cuda_runtime.h>

#include "common/mma_sm80.h"
#include "params.h"
#include "sm80/sparse_bwd/mainloop.cuh"
#include "sm80/sparse_bwd/sparse_bwd.h"
#include "smxx/sparse_bwd/sparse_bwd_body.cuh"

namespace msa::sm80 {
using smxx::bwd_item;
using smxx::BwdItem;
using smxx::flush_dkv;
using smxx::p_ds_slab;
using smxx::zero_p_ds_slab;

struct SparseBwdSmallShape {
  static constexpr int kThreads = 256;
  static constexpr int kKeys = 128;
  static constexpr int kRows = 32;
  template <typename T, int D>
  struct Smem {
    static constexpr int k = 0;
    static constexpr int v = k + kKeys * D * int(sizeof(T));
    static constexpr int q = v + kKeys * D * int(sizeof(T));           // one stage
    static constexpr int dout = q + kRows * D * int(sizeof(T));        // one stage
    static constexpr int p = dout + kRows * D * int(sizeof(T));
    static constexpr int ds = p + kRows * kKeys * int(sizeof(T));
    static constexpr int lse = ds + kRows * kKeys * int(sizeof(T));    // one stage
    static constexpr int delta = lse + kRows * 4;                      // one stage
    static constexpr int tok = delta + kRows * 4;                      // two stages: tiles i, i + 1
    static constexpr int head = tok + 2 * kRows * 4;                   // two stages
    static constexpr int bytes = head + 2 * kRows * 4;
  };
};
static_assert(SparseBwdSmallShape::kKeys == kBwdKeys, "sparse_bwd.h sizes the deterministic partials");

// The small-smem backward (see the top of the file). Per tile of 32 rows, eight warps:
//   row phase  (warp: 16 rows x 32 keys): S, P, dP, dS as in the default kernel;
//   key phase  (warp: 16 keys x D):        dV += P^T dO, dK += dS^T Q, as there over 32 rows;
//   dQ         (warp: 16 rows x D / 4):    dQ = dS K over the 128 keys.
// kDet as in the default kernel.
template <typename T, int D, bool kDet>
__global__ void __launch_bounds__(SparseBwdSmallShape::kThreads, 1) sparse_bwd_small_kernel(SparseBwdParams p) {
  using Sh = SparseBwdSmallShape;
  using L = typename Sh::template Smem<T, D>;
  using Tile = SwizzledTile<D>;
  using KTile = SwizzledTile<Sh::kKeys>;  // P and dS tiles: rows x 128 keys
  constexpr int kChunks = Tile::kChunks;
  constexpr int kR = Sh::kRows;
  constexpr int kThreads = Sh::kThreads;
  extern __shared__ __align__(128) unsigned char smem[];
  T* sK = reinterpret_cast<T*>(smem + L::k);
  T* sV = reinterpret_cast<T*>(smem + L::v);
  T* sQ = reinterpret_cast<T*>(smem + L::q);
  T* sdO = reinterpret_cast<T*>(smem + L::dout);
  T* sP = reinterpret_cast<T*>(smem + L::p);
  T* sdS = reinterpret_cast<T*>(smem + L::ds);
  float* sLse = reinterpret_cast<float*>(smem + L::lse);
  float* sDelta = reinterpret_cast<float*>(smem + L::delta);
  int* sTok = reinterpret_cast<int*>(smem + L::tok);    // [2][kR]: token of each tile row, -1 past the item
  int* sHead = reinterpret_cast<int*>(smem + L::head);  // [2][kR]: head in unit of each tile row

  BwdItem bi;
  if (!bwd_item(p, bi)) return;
  const int item = bi.item, r = bi.r, u_begin = bi.u_begin, u_end = bi.u_end;
  const int krow0 = bi.krow0, kpos0 = bi.kpos0, blen = bi.blen;
  const int G = bi.G, J = bi.J, Gu = bi.Gu;
  // The item's rows: unit u_begin + i / Gu, head i % Gu, for i < n_rows; tile t holds rows [32 t, +32).
  const int n_rows = (u_end - u_begin) * Gu;
  const int n_tiles = (n_rows + kR - 1) / kR;

  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
  const int g = lane / 4, tq = lane % 4;
  // Row phase: rows [16 rw, +16) x keys [32 kq, +32). dQ: rows [16 rw, +16) x D columns [D / 4 kq, +D / 4).
  const int rw = warp % 2, kq = warp / 2;
  const T* Q = static_cast<const T*>(p.q);
  const T* K = static_cast<const T*>(p.k);
  const T* V = static_cast<const T*>(p.v);
  const T* dO = static_cast<const T*>(p.dout);

  // Token (-1: past the item's rows) and head in unit of row `row` of tile `tile`.
  auto row_token = [&](int tile, int row, int& head) -> int {
    const int i = tile * kR + row;
    head = 0;
    if (tile >= n_tiles || i >= n_rows) return -1;
    const int u = i / Gu;
    head = i - u * Gu;
    return p.tokens[u_begin + u];
  };

  for (int j = 0; j < J; ++j) {
    const int h0 = r * G + j * Gu;
    const int kvh = h0 / (p.hq / p.hkv);
    float dk[D / 8][4], dv[D / 8][4];
#pragma unroll
    for (int n = 0; n < D / 8; ++n)
#pragma unroll
      for (int e = 0; e < 4; ++e) dk[n][e] = dv[n][e] = 0.f;

    __syncthreads();  // the previous kv head is done with every buffer
    {
      const T* ks = K + int64_t(krow0) * p.k_stride_t + int64_t(kvh) * p.k_stride_h;
      const T* vs = V + int64_t(krow0) * p.v_stride_t + int64_t(kvh) * p.v_stride_h;
      for (int i = tid; i < Sh::kKeys * kChunks; i += kThreads) {
        const int row = i / kChunks, c = i % kChunks;
        const bool ok = row < blen;
        const int rr = ok ? row : 0;
        cp_async_16(sK + Tile::offset(row, c), ks + int64_t(rr) * p.k_stride_t + c * 8, ok);
        cp_async_16(sV + Tile::offset(row, c), vs + int64_t(rr) * p.v_stride_t + c * 8, ok);
      }
    }
    for (int row = tid; row < kR; row += kThreads) {
      int hd;
      sTok[row] = row_token(0, row, hd);
      sHead[row] = hd;
      sTok[kR + row] = row_token(1, row, hd);
      sHead[kR + row] = hd;
    }
    __syncthreads();
    // The rows of the tile whose row tables are in stage b into the single Q / dO / lse / delta stage
    // (rows past the item: zeros).
    auto fetch = [&](int b) {
      const int* toks = sTok + b * kR;
      const int* heads = sHead + b * kR;
      for (int i = tid; i < kR * kChunks; i += kThreads) {
        const int row = i / kChunks, c = i % kChunks;
        const int t = toks[row];
        const bool ok = t >= 0;
        const int64_t h = h0 + heads[row];
        cp_async_16(sQ + Tile::offset(row, c), Q + int64_t(ok ? t : 0) * p.q_stride_t + h * p.q_stride_h + c * 8, ok);
        cp_async_16(sdO + Tile::offset(row, c), dO + int64_t(ok ? t : 0) * p.do_stride_t + h * p.do_stride_h + c * 8,
                    ok);
      }
      for (int row = tid; row < kR; row += kThreads) {
        const int t = toks[row];
        const int64_t o = t >= 0 ? int64_t(h0 + heads[row]) * p.total_tokens + t : 0;
        cp_async_4(sLse + row, p.lse + o, t >= 0);
        cp_async_4(sDelta + row, p.delta + o, t >= 0);
      }
    };
    fetch(0);
    cp_async_commit();  // with K and V
    for (int tile = 0; tile < n_tiles; ++tile) {
      const int buf = tile & 1;
      cp_async_wait<0>();
      __syncthreads();  // the tile's rows (and K / V) have landed; its row table is visible
      const int* sTokb = sTok + buf * kR;
      const int* sHeadb = sHead + buf * kR;

      // Row phase: rows [16 rw, +16), keys [32 kq, +32).
      const int row0 = rw * 16 + g, row1 = row0 + 8;
      const int tr0 = sTokb[row0], tr1 = sTokb[row1];
      const int lim0 = tr0 >= 0 ? min(blen - 1, tr0 - kpos0) : -1;
      const int lim1 = tr1 >= 0 ? min(blen - 1, tr1 - kpos0) : -1;
      // Tokens are in ascending order: when the tile's first token sees the whole block, every row does
      // and no mask is needed (rows past the item have zero Q, dO, lse and delta: their dK/dV terms are 0).
      const bool full = blen == Sh::kKeys && sTokb[0] >= 0 && sTokb[0] - kpos0 >= Sh::kKeys - 1;
      const int kbase = kq * 32;
      if (kbase >= p.block_size) {
        zero_p_ds_slab<T, KTile>(sP, sdS, row0, row1, kbase, tq);
      } else {
        float s[4][4], dp[4][4];
        auto off = [](int row, int c) { return Tile::offset(row, c); };
        s_dp_slab_mma<T, D>(s, dp, sQ, sdO, sK, sV, off, off, rw, kbase, lane);
        const float e0 = sLse[row0] * kLog2e, e1 = sLse[row1] * kLog2e;
        const float d0 = sDelta[row0], d1 = sDelta[row1];
        // P and dS of the warp's 16 x 32 slab.
        p_ds_slab<T, KTile>(full, s, dp, p.scale_log2, e0, e1, d0, d1, row0, row1, kbase, tq, lim0, lim1, sP, sdS);
      }
      __syncthreads();  // P and dS of the tile

      // Key phase: keys [16 warp, +16): dV += P^T dO, dK += dS^T Q over the tile's rows.
      if (warp * 16 < p.block_size) key_phase_mma<T, D, kR, KTile, Tile>(dk, dv, sP, sdS, sdO, sQ, warp, lane);
      __syncthreads();  // Q, dO, lse and delta are free: the next tile's rows come in during dQ
      if (tile + 1 < n_tiles) fetch(buf ^ 1);
      cp_async_commit();
      int head_next = 0;
      const int tok_next = tid < kR ? row_token(tile + 2, tid, head_next) : -1;

      // dQ = scale * dS K for rows [16 rw, +16) x D columns [D / 4 kq, +D / 4), added to the fp32
      // accumulator: one 16-byte atomic per lane and n-tile (even tq lanes add row0's 4 columns, odd ones
      // row1's); deterministic mode: the exact hi / lo split of common/det_sum.h.
      {
        constexpr int kN8 = D / 32;
        float dq[kN8][4];
        zero_acc(dq);
        mma_rows_keys<T, Tile>(dq, sdS, rw * 16, sK, kq * kN8, lane);  // dS is zero past block_size
        const bool odd = (tq & 1) != 0;
        const int tr = odd ? tr1 : tr0;
        const int64_t o =
            (int64_t(tr >= 0 ? tr : 0) * p.hq + h0 + sHeadb[odd ? row1 : row0]) * D + kq * (D / 4) + 2 * (tq & ~1);
#pragma unroll
        for (int n = 0; n < kN8; ++n) {
          const float4 v = quad_rows4(dq[n], tq);
          const float4 x = make_float4(v.x * p.scale, v.y * p.scale, v.z * p.scale, v.w * p.scale);
          if (tr >= 0) {
            if constexpr (kDet) det_add4(p.dq_accum + o + n * 8, p.dq_lo + o + n * 8, x, __ldg(p.dq_grid));
            else atomic_add4(p.dq_accum + o + n * 8, x);
          }
        }
      }
      __syncthreads();  // dS is free for the next row phase; this tile's row table is read
      if (tid < kR) {
        sTok[buf * kR + tid] = tok_next;  // tile + 2's
        sHead[buf * kR + tid] = head_next;
      }
    }

    flush_dkv<D, kDet>(p, dk, dv, warp, g, tq, item * J + j, blen, krow0, kvh);
  }
}

template <typename T, int D>
cudaError_t launch_sparse_bwd_small(const SparseBwdParams& p, cudaStream_t stream) {
  const int64_t grid = p.max_items;  // an upper bound on item_offsets[num_keys]
  if (grid == 0) return cudaSuccess;
  constexpr int smem = SparseBwdSmallShape::Smem<T, D>::bytes;
  auto kernel = p.dq_lo != nullptr ? sparse_bwd_small_kernel<T, D, true> : sparse_bwd_small_kernel<T, D, false>;
  cudaError_t err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
  if (err != cudaSuccess) return err;
  kernel<<<unsigned(grid), SparseBwdSmallShape::kThreads, smem, stream>>>(p);
  return cudaGetLastError();
}

template <typename T, int D>
cudaError_t launch_sparse_bwd(const SparseBwdParams& p, cudaStream_t stream) {
  if (p.small_smem) return launch_sparse_bwd_small<T, D>(p, stream);  // GPUs with 99 KB per block
  return smxx::launch_sparse_bwd_pass<BwdMma, T, D>(p, stream);
}

}  // namespace msa::sm80
