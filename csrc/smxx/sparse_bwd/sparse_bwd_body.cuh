// Sparse backward of the main branch (SPEC 3), KV-outer: the kernel shared by the portable path and the
// general Hopper kernel, templated on the mainloop Mma that runs its GEMMs (sm80/sparse_bwd/mainloop.cuh:
// mma.sync; sm90/sparse_bwd/mainloop.cuh: wgmma), with the pieces the other backward kernels share (the
// work item, P / dS of a slab, the dK / dV flush). Launchers: sm80/sparse_bwd/sparse_bwd_kernel.cuh (also the
// small-smem kernel) and sm90/sparse_bwd/sparse_bwd.cuh (also the warp-specialized kernel).
//
//
// A CTA owns one work item: a key of the reverse index (index group r, kv block) and up to
// units_per_item of the units that selected it, for each of the group's kv heads in turn; dK and dV of
// the block stay in registers for the whole item (warp w owns keys [16w, 16w + 16)) and leave the CTA
// once, added to the fp32 accumulators. Per tile of R = 64 gathered rows:
//   row phase  (warp: 16 rows x 64 keys): S = Q K^T, P = exp(S - lse), dP = dO V^T,
//              dS = P (dP - delta); P and dS go to shared memory in the input dtype;
//   key phase  (warp: 16 keys): dV += P^T dO, dK += dS^T Q   (transposed ldmatrix reads);
//   dQ         (warp: 16 rows x 64 of D): dQ = dS K, added to the fp32 dq accumulator.
// The per-row softmax statistics come from the forward (lse) and a preprocess (delta = rowsum(dO O)).
//
// Mma::kWgmma (sm90::BwdMma, sm_90a builds): all five GEMMs run on wgmma. The row phase's S and dP read both operands
// from shared memory (SS, m64n32 per warpgroup and 32-key step); the key phase and dQ take A from
// registers (the same ldmatrix fragments of P^T, dS^T and dS) and B from shared memory: dO and Q read
// MN-major for dV and dK, K read MN-major for dQ. dQ comes before the key phase, whose wgmmas then run
// while dQ is staged in a slab per warp for bulk reductions: where units have a multiple of 4 heads, TMA tensor
// reductions of one unit's 4 rows, issued under the next tile's S / dP wgmmas; else one bulk copy per row.
// K, V, Q and dO sit in the 128-byte-swizzled K-major layout wgmma reads (KMajorSw128), and every tile's
// gathered rows are fenced to the async proxy before the CTA barrier. The accumulators have the same per-thread layout
// as the mma.sync ones (warp w: keys / rows [16 (w % 4) + 64 (w / 4), +16)), so the epilogues are shared.
#pragma once
#include <cuda_runtime.h>

#include <type_traits>

#include "common/block_span.h"
#include "common/det_sum.h"
#include "common/mma_sm80.h"
#include "params.h"
#include "sm80/sparse_bwd/sparse_bwd.h"

namespace msa::smxx {
using namespace sm80;  // common/mma_sm80.h: tiles, cp.async, ldmatrix, mma.sync and fragment helpers

struct SparseBwdShape {
  static constexpr int kThreads = 256;
  static constexpr int kKeys = 128;
  static constexpr int kRows = 64;
  // The sm_90a kernel's dQ staging (non-deterministic mode), from Smem's bytes rounded up to 1024: per warp
  // kDqStageWarp bytes (1024-byte aligned), holding 16 rows of 64 fp32 either at a stride of 72 (per-row bulk
  // reductions; the float2 stores of a half warp, rows g = 0..3, land in distinct banks) or as the tensor
  // reductions' swizzled boxes (4 KB; sm90/sparse_bwd/mainloop.cuh stage_dq_chunks).
  static constexpr int kDqStage = 72;
  static constexpr int kDqStageWarp = 5120;
  static_assert(16 * kDqStage * 4 <= kDqStageWarp && 16 * 64 * 4 <= kDqStageWarp && kDqStageWarp % 1024 == 0,
                "a warp's dQ staging holds either layout");
  static_assert(kDqStage * 4 % 16 == 0, "bulk reductions read 16-byte aligned rows");

  template <typename T, int D>
  struct Smem {
    static constexpr int k = 0;
    static constexpr int v = k + kKeys * D * int(sizeof(T));
    static constexpr int q = v + kKeys * D * int(sizeof(T));           // two stages
    static constexpr int dout = q + 2 * kRows * D * int(sizeof(T));    // two stages
    static constexpr int p = dout + 2 * kRows * D * int(sizeof(T));
    static constexpr int ds = p + kRows * kKeys * int(sizeof(T));
    static constexpr int lse = ds + kRows * kKeys * int(sizeof(T));    // two stages
    static constexpr int delta = lse + 2 * kRows * 4;                  // two stages
    static constexpr int tok = delta + 2 * kRows * 4;                  // two stages
    static constexpr int rowh = tok + 2 * kRows * 4;                   // row -> head in unit
    static constexpr int bytes = rowh + kRows * 4;
  };
  template <typename T, int D>
  static constexpr int dq_stage_offset() { return (Smem<T, D>::bytes + 1023) / 1024 * 1024; }
};

static_assert(SparseBwdShape::kKeys == kBwdKeys, "sparse_bwd.h sizes the deterministic partials");

// P and dS of a row-phase slab, shared by every backward kernel: rows row0 = 16 rw + g and row1 = row0 + 8 of
// the tile, keys [kbase, +32); lane (g = lane / 4, tq = lane % 4) holds columns kbase + 8 n + 2 tq, + 1 (n < 4)
// of both rows. sP and sdS are KTile tiles.

// P = exp2(S scale_log2 - e) and dS = P (dP - d) of the slab into sP and sdS in the input dtype (e0 / d0:
// row0's lse log2 e and delta, e1 / d1 row1's); kMasked: a column past the row's last visible key (lim0 /
// lim1, -1 for padding rows) gets 0. Called through p_ds_slab.
template <typename T, typename KTile, bool kMasked>
__device__ __forceinline__ void p_ds_slab_masked(const float (&s)[4][4], const float (&dp)[4][4], float scale_log2,
                                                 float e0, float e1, float d0, float d1, int row0, int row1,
                                                 int kbase, int tq, int lim0, int lim1, T* sP, T* sdS) {
#pragma unroll
  for (int n = 0; n < 4; ++n) {
    const int col = kbase + n * 8 + 2 * tq;
    const float p00 = !kMasked || col <= lim0 ? fast_exp2(fmaf(s[n][0], scale_log2, -e0)) : 0.f;
    const float p01 = !kMasked || col + 1 <= lim0 ? fast_exp2(fmaf(s[n][1], scale_log2, -e0)) : 0.f;
    const float p10 = !kMasked || col <= lim1 ? fast_exp2(fmaf(s[n][2], scale_log2, -e1)) : 0.f;
    const float p11 = !kMasked || col + 1 <= lim1 ? fast_exp2(fmaf(s[n][3], scale_log2, -e1)) : 0.f;
    const int c8 = col / 8;
    *reinterpret_cast<uint32_t*>(sP + KTile::offset(row0, c8) + 2 * tq) = pack2<T>(p00, p01);
    *reinterpret_cast<uint32_t*>(sP + KTile::offset(row1, c8) + 2 * tq) = pack2<T>(p10, p11);
    *reinterpret_cast<uint32_t*>(sdS + KTile::offset(row0, c8) + 2 * tq) =
        pack2<T>(p00 * (dp[n][0] - d0), p01 * (dp[n][1] - d0));
    *reinterpret_cast<uint32_t*>(sdS + KTile::offset(row1, c8) + 2 * tq) =
        pack2<T>(p10 * (dp[n][2] - d1), p11 * (dp[n][3] - d1));
  }
}

// The same, unmasked when every row of the tile sees every key (full: two copies, most tiles are full).
template <typename T, typename KTile>
__device__ __forceinline__ void p_ds_slab(bool full, const float (&s)[4][4], const float (&dp)[4][4], float scale_log2,
                                          float e0, float e1, float d0, float d1, int row0, int row1, int kbase,
                                          int tq, int lim0, int lim1, T* sP, T* sdS) {
  if (full) {
    p_ds_slab_masked<T, KTile, false>(s, dp, scale_log2, e0, e1, d0, d1, row0, row1, kbase, tq, lim0, lim1, sP, sdS);
  } else {
    p_ds_slab_masked<T, KTile, true>(s, dp, scale_log2, e0, e1, d0, d1, row0, row1, kbase, tq, lim0, lim1, sP, sdS);
  }
}

// block_size 64: the slab's sP and sdS set to 0 (keys that do not exist), so that dQ (and the wgmma key
// phase) runs over a fixed 128 keys.
template <typename T, typename KTile>
__device__ __forceinline__ void zero_p_ds_slab(T* sP, T* sdS, int row0, int row1, int kbase, int tq) {
#pragma unroll
  for (int n = 0; n < 4; ++n) {
    const int c8 = (kbase + n * 8) / 8;
    *reinterpret_cast<uint32_t*>(sdS + KTile::offset(row0, c8) + 2 * tq) = 0u;
    *reinterpret_cast<uint32_t*>(sdS + KTile::offset(row1, c8) + 2 * tq) = 0u;
    *reinterpret_cast<uint32_t*>(sP + KTile::offset(row0, c8) + 2 * tq) = 0u;
    *reinterpret_cast<uint32_t*>(sP + KTile::offset(row1, c8) + 2 * tq) = 0u;
  }
}

// A backward work item (params.h: SparseBwdParams' reverse index) as the backward kernels' CTAs read it: one kv
// block of index group r and the units [u_begin, u_end) of p.tokens that selected it (a hot key, e.g. an
// attention sink selected by every token, is split over several CTAs; their dK / dV meet in the fp32
// accumulators), the block's keys (block_span: krow0 its first key row in k / v, kpos0 the query row at its
// first key's position, one value without a key layout: a query row t sees the block's keys up to t - kpos0;
// blen its keys), and the head layout: G query heads per index group, J kv heads per group, Gu heads per unit.
struct BwdItem {
  int item, r, u_begin, u_end;
  int krow0, kpos0, blen;
  int G, J, Gu;
};

// J, the kv heads of an index group (bwd_item; the launcher's Gu = G / J).
__host__ __device__ __forceinline__ int bwd_kv_per_group(const SparseBwdParams& p) {
  return p.hkv > p.hi ? p.hkv / p.hi : 1;
}

// The item of this CTA (item_order: largest first); false past the last item (the grid is an upper bound).
__device__ __forceinline__ bool bwd_item(const SparseBwdParams& p, BwdItem& b) {
  b.item = p.item_order != nullptr ? p.item_order[blockIdx.x] : int(blockIdx.x);
  if (b.item >= p.item_offsets[p.num_keys]) return false;
  const int2 it = p.items[b.item];
  const int key = it.x;
  b.u_begin = it.y;
  b.u_end = min(b.u_begin + p.units_per_item, p.offsets[key + 1]);
  const int gb = key % p.max_blocks;
  b.r = key / p.max_blocks;
  const BlockSpan span = block_span(p.block_offsets, p.cu_seqlens, p.cu_seqlens_k, p.num_seqs, gb, p.block_size);
  b.krow0 = span.k_start + span.key0;
  b.kpos0 = span.q_origin + span.key0;
  b.blen = span.blen;
  b.G = p.hq / p.hi;
  b.J = bwd_kv_per_group(p);
  b.Gu = b.G / b.J;
  return true;
}

// The block's dK (scaled) and dV of one kv head from a warp's accumulators (keys [16 warp, +16) of the
// block, the mma.sync C layout: rows g, g + 8, column pairs 8 n + 2 tq), added to the fp32 accumulators (other
// groups on the same kv head add theirs); kDet: stored as partial `part` (item * J + j), summed in item
// order by item_reduce. tok0: the block's first token.
template <int D, bool kDet>
__device__ __forceinline__ void flush_dkv(const SparseBwdParams& p, const float (&dk)[D / 8][4], const float (&dv)[D / 8][4],
                                          int warp, int g, int tq, int part, int blen, int tok0, int kvh) {
  if (warp * 16 >= p.block_size) return;
  const int k0 = warp * 16 + g, k1 = k0 + 8;
  if constexpr (kDet) {
    float* dst = p.dkv_part + int64_t(part) * 2 * kBwdKeys * D;
#pragma unroll
    for (int n = 0; n < D / 8; ++n) {
      const int col = n * 8 + 2 * tq;
      *reinterpret_cast<float2*>(dst + k0 * D + col) = make_float2(dk[n][0] * p.scale, dk[n][1] * p.scale);
      *reinterpret_cast<float2*>(dst + k1 * D + col) = make_float2(dk[n][2] * p.scale, dk[n][3] * p.scale);
      *reinterpret_cast<float2*>(dst + (kBwdKeys + k0) * D + col) = make_float2(dv[n][0], dv[n][1]);
      *reinterpret_cast<float2*>(dst + (kBwdKeys + k1) * D + col) = make_float2(dv[n][2], dv[n][3]);
    }
  } else {
#pragma unroll
    for (int n = 0; n < D / 8; ++n) {
      const int col = n * 8 + 2 * tq;
      if (k0 < blen) {
        const int64_t o = (int64_t(tok0 + k0) * p.hkv + kvh) * D + col;
        atomic_add2(p.dk_accum + o, dk[n][0] * p.scale, dk[n][1] * p.scale);
        atomic_add2(p.dv_accum + o, dv[n][0], dv[n][1]);
      }
      if (k1 < blen) {
        const int64_t o = (int64_t(tok0 + k1) * p.hkv + kvh) * D + col;
        atomic_add2(p.dk_accum + o, dk[n][2] * p.scale, dk[n][3] * p.scale);
        atomic_add2(p.dv_accum + o, dv[n][2], dv[n][3]);
      }
    }
  }
}

// kDet: the deterministic mode (params.h): dQ by exact hi / lo sums, dK / dV stored as item partials. A
// template parameter: the branch would cost the default kernel registers (252 -> 255 and a spill).
// kDqMap (sm_90a, not kDet): dQ by tensor reductions through dq_map (Mma::stage_dq_chunks), else per row.
template <class Mma, typename T, int D, bool kDet, bool kDqMap = false>
__global__ void __launch_bounds__(SparseBwdShape::kThreads, 1)
    sparse_bwd_kernel(SparseBwdParams p, const __grid_constant__ typename Mma::DqMap dq_map) {
  constexpr bool kWgmma = Mma::kWgmma;
  static_assert(Mma::kKeys == SparseBwdShape::kKeys && Mma::kRows == SparseBwdShape::kRows, "the mainloop's tile extents");
  using Sh = SparseBwdShape;
  using L = typename Sh::template Smem<T, D>;
  using Tile = SwizzledTile<D>;
  using KTile = SwizzledTile<Sh::kKeys>;  // P and dS tiles: rows x 128 keys
  using KvTile = typename Mma::template OpTile<Sh::kKeys, D>;  // K and V
  using QTile = typename Mma::template OpTile<Sh::kRows, D>;   // Q and dO
  constexpr int kChunks = Tile::kChunks;
  // Element offsets of 16-byte chunk c of row `row` in the K/V tiles and in the Q/dO tiles.
  auto koff = [](int row, int c) { return KvTile::offset(row, c); };
  auto qoff = [](int row, int c) { return QTile::offset(row, c); };
  extern __shared__ __align__(128) unsigned char smem_raw[];
  // wgmma operand tiles start 1024-byte aligned (the swizzle is on address bits); every offset in L is a
  // multiple of 1024 up to the P tile.
  unsigned char* smem = kWgmma ? smem_raw + ((1024 - (smem_addr(smem_raw) & 1023)) & 1023) : smem_raw;
  T* sK = reinterpret_cast<T*>(smem + L::k);
  T* sV = reinterpret_cast<T*>(smem + L::v);
  T* sQ = reinterpret_cast<T*>(smem + L::q);
  T* sdO = reinterpret_cast<T*>(smem + L::dout);
  T* sP = reinterpret_cast<T*>(smem + L::p);
  T* sdS = reinterpret_cast<T*>(smem + L::ds);
  float* sLse = reinterpret_cast<float*>(smem + L::lse);
  float* sDelta = reinterpret_cast<float*>(smem + L::delta);
  int* sTok = reinterpret_cast<int*>(smem + L::tok);
  // kWgmma, non-deterministic: each warp's 16 x 64 fp32 dQ slab staged here (past L's bytes) for the
  // mainloop's bulk reductions.
  [[maybe_unused]] float* sDqW =
      reinterpret_cast<float*>(smem + Sh::template dq_stage_offset<T, D>() + (threadIdx.x / 32) * Sh::kDqStageWarp);

  BwdItem bi;
  if (!bwd_item(p, bi)) return;
  const int item = bi.item, r = bi.r, u_begin = bi.u_begin, u_end = bi.u_end;
  const int krow0 = bi.krow0, kpos0 = bi.kpos0, blen = bi.blen;
  const int G = bi.G, J = bi.J, Gu = bi.Gu;
  const int U = Sh::kRows / Gu;  // units per tile (Gu <= 64)
  int* sRowH = reinterpret_cast<int*>(smem + L::rowh);
  for (int row = threadIdx.x; row < Sh::kRows; row += Sh::kThreads) sRowH[row] = row % Gu;  // no division below

  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
  const int g = lane / 4, tq = lane % 4;
  const int rw = warp % 4, half = warp / 4;  // row phase / dQ: 16-row slab, half of the keys / of D
  const T* Q = static_cast<const T*>(p.q);
  const T* K = static_cast<const T*>(p.k);
  const T* V = static_cast<const T*>(p.v);
  const T* dO = static_cast<const T*>(p.dout);
  // kDqMap: the map row of the box this lane (< 4) staged last tile, added under the next tile's S / dP wgmmas
  // (or after the last tile); -1: none.
  [[maybe_unused]] int dq_pending = -1;
  [[maybe_unused]] auto issue_dq = [&]() {
    if constexpr (kDqMap) {
      Mma::issue_dq_chunks(&dq_map.map, sDqW, dq_pending, D == 128 ? 2 * half : 0, lane);
      dq_pending = -1;
    }
  };

  for (int j = 0; j < J; ++j) {
    const int h0 = r * G + j * Gu;
    const int kvh = h0 / (p.hq / p.hkv);
    float dk[D / 8][4], dv[D / 8][4];
#pragma unroll
    for (int n = 0; n < D / 8; ++n)
#pragma unroll
      for (int e = 0; e < 4; ++e) dk[n][e] = dv[n][e] = 0.f;

    __syncthreads();  // the previous kv head is done with the K/V tiles
    {
      const T* ks = K + int64_t(krow0) * p.k_stride_t + int64_t(kvh) * p.k_stride_h;
      const T* vs = V + int64_t(krow0) * p.v_stride_t + int64_t(kvh) * p.v_stride_h;
      for (int i = tid; i < Sh::kKeys * kChunks; i += Sh::kThreads) {
        const int row = i / kChunks, c = i % kChunks;
        const bool ok = row < blen;
        const int rr = ok ? row : 0;
        cp_async_16(sK + koff(row, c), ks + int64_t(rr) * p.k_stride_t + c * 8, ok);
        cp_async_16(sV + koff(row, c), vs + int64_t(rr) * p.v_stride_t + c * 8, ok);
      }
    }
    // Tiles of U units; tile i + 1's rows are fetched while tile i computes, and tile i + 2's tokens
    // are read from global memory meanwhile (they are only stored once tile i is done).
    const int n_tiles = (u_end - u_begin + U - 1) / U;
    auto unit_token = [&](int tile, int row) {
      const int u = tile * U + row / Gu;
      return (tile < n_tiles && row < U * Gu && u_begin + u < u_end) ? p.tokens[u_begin + u] : -1;
    };
    // A thread's rows are kThreads / kChunks apart (chunk tid % kChunks); where Gu divides that, they
    // all have one head, and the head and chunk part of each address is computed once.
    constexpr int kRowStep = Sh::kThreads / kChunks;
    const bool one_head = kRowStep % Gu == 0;
    const int64_t h_own = h0 + (tid / kChunks) % Gu;
    const T* q_own = Q + h_own * p.q_stride_h + (tid % kChunks) * 8;
    const T* do_own = dO + h_own * p.do_stride_h + (tid % kChunks) * 8;
    auto fetch = [&](int b) {
      const int* toks = sTok + b * Sh::kRows;
      if (one_head) {  // CTA-uniform
        const int c = tid % kChunks;
#pragma unroll
        for (int row = tid / kChunks; row < Sh::kRows; row += kRowStep) {
          const int t = toks[row];
          const bool ok = t >= 0;
          cp_async_16(sQ + b * Sh::kRows * D + qoff(row, c), q_own + int64_t(ok ? t : 0) * p.q_stride_t, ok);
          cp_async_16(sdO + b * Sh::kRows * D + qoff(row, c), do_own + int64_t(ok ? t : 0) * p.do_stride_t, ok);
        }
      } else {
        for (int i = tid; i < Sh::kRows * kChunks; i += Sh::kThreads) {
          const int row = i / kChunks, c = i % kChunks;
          const int t = toks[row];
          const bool ok = t >= 0;
          const int64_t h = h0 + sRowH[row];
          cp_async_16(sQ + b * Sh::kRows * D + qoff(row, c),
                      Q + int64_t(ok ? t : 0) * p.q_stride_t + h * p.q_stride_h + c * 8, ok);
          cp_async_16(sdO + b * Sh::kRows * D + qoff(row, c),
                      dO + int64_t(ok ? t : 0) * p.do_stride_t + h * p.do_stride_h + c * 8, ok);
        }
      }
      for (int row = tid; row < Sh::kRows; row += Sh::kThreads) {
        const int t = toks[row];
        const int64_t o = t >= 0 ? int64_t(h0 + sRowH[row]) * p.total_tokens + t : 0;
        cp_async_4(sLse + b * Sh::kRows + row, p.lse + o, t >= 0);
        cp_async_4(sDelta + b * Sh::kRows + row, p.delta + o, t >= 0);
      }
    };
    for (int row = tid; row < Sh::kRows; row += Sh::kThreads) {
      sTok[row] = unit_token(0, row);
      sTok[Sh::kRows + row] = unit_token(1, row);
    }
    __syncthreads();
    fetch(0);
    cp_async_commit();
    for (int tile = 0; tile < n_tiles; ++tile) {
      const int buf = tile & 1;
      __syncthreads();  // the previous tile is done with its buffers; tile + 1's tokens are visible
      if (tile + 1 < n_tiles) fetch(buf ^ 1);
      cp_async_commit();
      const int tok_next = tid < Sh::kRows ? unit_token(tile + 2, tid) : -1;
      cp_async_wait<1>();
      if constexpr (kWgmma) Mma::fence_operands();  // this thread's rows (and K) -> wgmma
      __syncthreads();
      const T* sQb = sQ + buf * Sh::kRows * D;
      const T* sdOb = sdO + buf * Sh::kRows * D;
      const int* sTokb = sTok + buf * Sh::kRows;
      const float* sLseb = sLse + buf * Sh::kRows;
      const float* sDeltab = sDelta + buf * Sh::kRows;

      // Row phase: rows [16 rw, +16), keys [64 half, +64) in two steps of 32 (registers: dK and dV
      // already hold 128 per thread).
      const int row0 = rw * 16 + g, row1 = row0 + 8;
      const int tr0 = sTokb[row0], tr1 = sTokb[row1];
      const int lim0 = tr0 >= 0 ? min(blen - 1, tr0 - kpos0) : -1;
      const int lim1 = tr1 >= 0 ? min(blen - 1, tr1 - kpos0) : -1;
      // Tokens are in ascending order: when the tile's first token sees the whole block, every row does
      // and no mask is needed (padding rows have zero Q, dO, lse and delta, so their dK/dV terms are 0).
      const bool full = blen == Sh::kKeys && sTokb[0] >= 0 && sTokb[0] - kpos0 >= Sh::kKeys - 1;
#pragma unroll 1
      for (int kq = 0; kq < 2; ++kq) {
        const int kbase = half * 64 + kq * 32;
        if (kbase >= p.block_size) {
          if (kq == 0) issue_dq();
          zero_p_ds_slab<T, KTile>(sP, sdS, row0, row1, kbase, tq);
          continue;
        }
        float s[4][4], dp[4][4];
        Mma::template s_dp<T, D>(s, dp, sQb, sdOb, sK, sV, rw, kbase, lane, [&] {
          if (kq == 0) issue_dq();
        });
        const float e0 = sLseb[row0] * kLog2e, e1 = sLseb[row1] * kLog2e;
        const float d0 = sDeltab[row0], d1 = sDeltab[row1];
        // P and dS of the warp's 16 x 32 slab.
        p_ds_slab<T, KTile>(full, s, dp, p.scale_log2, e0, e1, d0, d1, row0, row1, kbase, tq, lim0, lim1, sP, sdS);
      }
      if constexpr (kDqMap) Mma::reduce_dq_wait(lane);  // the dQ stage is rewritten after this barrier
      __syncthreads();

      // dQ = scale * dS K for rows [16 rw, +16), added to the fp32 accumulator: one 16-byte atomic per
      // lane and n-tile of the warp's columns from c0 on (even tq lanes add row0's 4 columns, odd ones row1's).
      // Deterministic mode: the exact hi / lo split of common/det_sum.h instead.
      auto add_dq = [&](auto& dq, int c0) {
        const bool odd = (tq & 1) != 0;
        const int tr = odd ? tr1 : tr0;
        const int64_t o = (int64_t(tr >= 0 ? tr : 0) * p.hq + h0 + sRowH[odd ? row1 : row0]) * D + c0 + 2 * (tq & ~1);
        constexpr int kN8 = sizeof(dq) / sizeof(dq[0]);
#pragma unroll
        for (int n = 0; n < kN8; ++n) {
          const float4 v = quad_rows4(dq[n], tq);
          const float4 x = make_float4(v.x * p.scale, v.y * p.scale, v.z * p.scale, v.w * p.scale);
          if (tr >= 0) {
            if constexpr (kDet) det_add4(p.dq_accum + o + n * 8, p.dq_lo + o + n * 8, x, __ldg(p.dq_grid));
            else atomic_add4(p.dq_accum + o + n * 8, x);
          }
        }
      };
      // dQ and the key phase (dV += P^T dO, dK += dS^T Q over the tile's rows, warp w: keys [16 w, +16)).
      if constexpr (kWgmma) {
        // dQ first; then the key phase's wgmmas are issued, and this warp's dQ slab is staged for its bulk
        // reductions (deterministic: this thread's hi / lo sums go out) while they run. Both run unconditionally
        // (ptxas serialises wgmmas whose wait sits in a branch): with D = 64 both warpgroups compute the same dQ and warpgroup 0 adds it; with
        // block_size 64 warpgroup 1's dK and dV (keys past the block) are computed and never stored.
        float dq[8][4];
        Mma::template dq_half<T, D>(dq, sdS, sK, rw, half, lane);
        Mma::template key_phase_issue<T, D>(dk, dv, sP, sdS, sdOb, sQb, warp, lane);
        if (D == 128 || half == 0) {
          if constexpr (kDet) {
            add_dq(dq, half * 64);
          } else if constexpr (kDqMap) {
            dq_pending = Mma::stage_dq_chunks(dq, p.scale, sDqW, sTokb + rw * 16, sRowH + rw * 16, p.hq, h0, lane);
          } else {
            // The warp's rows [16 rw, +16) x columns [64 half, +64), scaled, to (token, head) by bulk reductions.
            const int row = rw * 16 + lane % 16, tr = sTokb[row];
            float* dst = p.dq_accum + (int64_t(tr >= 0 ? tr : 0) * p.hq + h0 + sRowH[row]) * D + half * 64;
            Mma::reduce_dq_slab(dq, p.scale, sDqW, Sh::kDqStage, dst, tr >= 0, lane);
          }
        }
        Mma::wait_all();
      } else {
        if (warp * 16 < p.block_size) Mma::template key_phase<T, D>(dk, dv, sP, sdS, sdOb, sQb, warp, lane);
        // dQ, warp: D columns [D/2 half, +D/2) in steps of D/4 (registers).
        constexpr int kQuarter = D / 4;
#pragma unroll 1
        for (int dh = 0; dh < 2; ++dh) {
          const int c0 = half * (D / 2) + dh * kQuarter;
          float dq[kQuarter / 8][4];
          Mma::template dq_cols<T, D>(dq, sdS, sK, rw, c0, lane);  // dS is zero past block_size (row phase)
          add_dq(dq, c0);
        }
      }
      __syncthreads();  // every read of this tile's token row is done: it now takes tile + 2's
      if (tid < Sh::kRows) sTok[buf * Sh::kRows + tid] = tok_next;
    }

    flush_dkv<D, kDet>(p, dk, dv, warp, g, tq, item * J + j, blen, krow0, kvh);
  }
  if constexpr (kWgmma && !kDet) {
    issue_dq();  // the last tile's boxes
    Mma::reduce_dq_drain(threadIdx.x % 32);
  }
}

// One launch of the kernel with the mainloop Mma (sm80::BwdMma or sm90::BwdMma) over the backward's items.
template <class Mma, typename T, int D>
cudaError_t launch_sparse_bwd_pass(const SparseBwdParams& p, cudaStream_t stream) {
  const int64_t grid = p.max_items;  // an upper bound on item_offsets[num_keys]
  if (grid == 0) return cudaSuccess;
  using Sh = SparseBwdShape;
  const bool det = p.dq_lo != nullptr;
  // The alignment slack and (sm_90a, non-deterministic mode) the dQ staging slabs, one per warp.
  const int smem = (Mma::kWgmma && !det ? Sh::dq_stage_offset<T, D>() + (Sh::kThreads / 32) * Sh::kDqStageWarp
                                        : Sh::Smem<T, D>::bytes) +
                   Mma::kSmemSlack;
  auto kernel = det ? sparse_bwd_kernel<Mma, T, D, true> : sparse_bwd_kernel<Mma, T, D, false>;
  typename Mma::DqMap dq_map{};
  if constexpr (Mma::kWgmma) {
    // dQ by tensor reductions of 4 rows where units have a multiple of 4 heads (each run of 4 rows is one unit's,
    // its box 1024-byte aligned) and the map's rows (T Hq) have int coordinates.
    const int gu = p.hq / p.hi / bwd_kv_per_group(p);  // bwd_item's Gu
    if (!det && gu % 4 == 0 && int64_t(p.total_tokens) * p.hq <= INT32_MAX) {
      const cudaError_t err = Mma::make_dq_map(p, D, &dq_map);
      if (err != cudaSuccess) return err;
      kernel = sparse_bwd_kernel<Mma, T, D, false, true>;
    }
  }
  cudaError_t err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
  if (err != cudaSuccess) return err;
  kernel<<<unsigned(grid), SparseBwdShape::kThreads, smem, stream>>>(p, dq_map);
  return cudaGetLastError();
}

}  // namespace msa::smxx
