// Index top-k (SPEC 2), portable sm80 path: scores on tensor cores (mma.sync), causal max-pool per
// block, streaming exp-free top-k. No score matrix ever reaches global memory.
//
// A CTA owns 256 query rows (128 when the grid is under one wave): TM = rows / Hr tokens x the
// Hr = Hi / Hki index heads that share one index key head (so one K tile feeds all of them). Every
// block before a row's own block is fully visible, and the own block is forced in, so the CTA scores
// blocks [0, local block of its last token) with no causal mask at all; a row skips the blocks at or
// past its own (only in tiles that straddle blocks).
// Each row keeps its best k-1 earlier blocks in a shared-memory heap and only its threshold in
// registers: after the first k-1 blocks an insertion is rare (about k ln(blocks / k) per row) and costs
// one sift-down; a block enters when it beats the row's current worst (ties keep the lower block).
#pragma once
#include <cuda_runtime.h>

#include "common/mma_sm80.h"
#include "common/index_topk_tile.cuh"
#include "common/top_list.cuh"
#include "params.h"

namespace msa::sm80 {

template <int Warps>
struct IndexTopkShape {
  // A warp owns 32 rows (two m16 tiles: every K fragment feeds two MMAs, a quarter of an ldmatrix per
  // MMA with the rows' Q in registers). 8 warps (256 rows, one CTA per SM) share every K tile; 4 warps
  // (128 rows, two CTAs per SM) when the grid is small.
  static constexpr int kWarps = Warps;
  static constexpr int kThreads = kWarps * 32;
  static constexpr int kRows = kWarps * 32;
  static constexpr int kKeys = 64;      // keys per pipelined sub-tile (a block is 1 or 2 of them)
  static constexpr int kStages = 3;     // K sub-tiles in flight: one barrier per sub-tile
  static constexpr int kSlots = SmemTopHeap::kSlots;
  template <int D, typename T>
  static constexpr int q_bytes() { return kRows * D * int(sizeof(T)); }
  template <int D, typename T>
  static constexpr int k_bytes() { return kStages * kKeys * D * int(sizeof(T)); }
  static constexpr int list_bytes() { return kRows * kSlots * 8; }
  template <int D, typename T>
  static constexpr int smem_bytes() { return q_bytes<D, T>() + k_bytes<D, T>() + list_bytes(); }
};

template <typename T, int D, int Warps>
__global__ void __launch_bounds__(IndexTopkShape<Warps>::kThreads, 8 / Warps) index_topk_kernel(IndexTopkParams p) {
  using S = IndexTopkShape<Warps>;
  using Tile = SwizzledTile<D>;
  constexpr int kChunks = Tile::kChunks;
  extern __shared__ __align__(128) unsigned char smem_raw[];
  T* sQ = reinterpret_cast<T*>(smem_raw);
  T* sK = reinterpret_cast<T*>(smem_raw + S::template q_bytes<D, T>());
  float* sScore = reinterpret_cast<float*>(smem_raw + S::template q_bytes<D, T>() + S::template k_bytes<D, T>());
  int* sBlock = reinterpret_cast<int*>(sScore + S::kRows * S::kSlots);

  const IndexTopkTile tl = IndexTopkTile::make(p, S::kRows);
  if (tl.empty()) return;
  // Positions of the tile's first and last tokens (blocks count keys: IndexTopkTile).
  const int hr = tl.hr, kh = tl.kh, k_start = tl.k_start, pos0 = tl.tok0 + tl.shift, last_pos = tl.last_tok + tl.shift;
  const int sub = p.block_size / S::kKeys;
  const int total = (last_pos / p.block_size) * sub;  // sub-tiles of the blocks before the last token's

  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
  const T* k_base = static_cast<const T*>(p.k_idx);

  gather_index_q<T, D>(sQ, p, tl, S::kRows, tid, S::kThreads);
  cp_async_commit();
  auto load_k = [&](int it, int stage) {
    const int b = it / sub, part = it % sub;
    const T* src = k_base + int64_t(k_start + b * p.block_size + part * S::kKeys) * p.k_stride_t +
                   int64_t(kh) * p.k_stride_h;
    T* dst = sK + stage * S::kKeys * D;
    for (int i = tid; i < S::kKeys * kChunks; i += S::kThreads) {
      const int r = i / kChunks, c = i % kChunks;
      cp_async_16(dst + Tile::offset(r, c), src + int64_t(r) * p.k_stride_t + c * 8, true);
    }
  };
  if (total > 0) load_k(0, 0);
  cp_async_commit();
  if (total > 1) load_k(1, 1);
  cp_async_commit();
  if (tid < S::kRows) SmemTopHeap(sScore, sBlock, tid, p.topk).init();
  cp_async_wait<2>();  // Q
  __syncthreads();

  // This warp's 32 query rows (two m-tiles), all of Di, in registers for the whole loop.
  uint32_t a[2][D / 16][4];
#pragma unroll
  for (int mt = 0; mt < 2; ++mt)
#pragma unroll
    for (int ks = 0; ks < D / 16; ++ks)
      ldmatrix_x4(a[mt][ks], sQ + Tile::offset(warp * 32 + mt * 16 + (lane % 16), ks * 2 + lane / 16));

  // Lane tq of each quad keeps the list of row g + 8 (tq & 1) of m-tile tq / 2 (SPEC 2 order).
  const int g = lane / 4, tq = lane % 4;
  const int my_row = warp * 32 + (tq / 2) * 16 + g + 8 * (tq & 1);
  const int my_local = (pos0 + my_row / hr) / p.block_size;
  SmemTopHeap heap(sScore, sBlock, my_row, p.topk);
  static_assert(S::kSlots >= 31, "heap must hold topk - 1 <= 31 entries");
  float thr[4], bmax[4];
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    thr[i] = p.topk > 1 ? kNegInf : kPosInf;
    bmax[i] = kNegInf;
  }
  const bool positive = p.scale >= 0.f;  // S = scale * <q, k>: max of S is scale * (max or min) of <q, k>

  for (int it = 0; it < total; ++it) {
    // Sub-tile it has landed (it + 1 may still be in flight); after the barrier every warp is done
    // with it - 1, whose stage the load of it + 2 refills.
    cp_async_wait<1>();
    __syncthreads();
    if (it + 2 < total) load_k(it + 2, (it + 2) % S::kStages);
    cp_async_commit();
    const T* k = sK + (it % S::kStages) * S::kKeys * D;
    float c[2][8][4];
#pragma unroll
    for (int mt = 0; mt < 2; ++mt)
#pragma unroll
      for (int n8 = 0; n8 < 8; ++n8)
#pragma unroll
        for (int e = 0; e < 4; ++e) c[mt][n8][e] = 0.f;
#pragma unroll
    for (int ks = 0; ks < D / 16; ++ks) {
#pragma unroll
      for (int np = 0; np < 4; ++np) {
        uint32_t b[4];
        ldmatrix_x4(b, k + Tile::offset(np * 16 + (lane % 8) + (lane / 16) * 8, ks * 2 + (lane / 8) % 2));
#pragma unroll
        for (int mt = 0; mt < 2; ++mt) {
          MmaOp<T>::run(c[mt][2 * np], a[mt][ks], b[0], b[1]);
          MmaOp<T>::run(c[mt][2 * np + 1], a[mt][ks], b[2], b[3]);
        }
      }
    }
    // Row max (min for a negative scale) of the sub-tile: m[2 mt + h] for row g + 8 h of m-tile mt.
    float m[4];
#pragma unroll
    for (int i = 0; i < 4; ++i) m[i] = positive ? kNegInf : kPosInf;
#pragma unroll
    for (int mt = 0; mt < 2; ++mt)
#pragma unroll
      for (int n8 = 0; n8 < 8; ++n8) {
        if (positive) {
          m[2 * mt] = fmaxf(m[2 * mt], fmaxf(c[mt][n8][0], c[mt][n8][1]));
          m[2 * mt + 1] = fmaxf(m[2 * mt + 1], fmaxf(c[mt][n8][2], c[mt][n8][3]));
        } else {
          m[2 * mt] = fminf(m[2 * mt], fminf(c[mt][n8][0], c[mt][n8][1]));
          m[2 * mt + 1] = fminf(m[2 * mt + 1], fminf(c[mt][n8][2], c[mt][n8][3]));
        }
      }
#pragma unroll
    for (int off = 1; off <= 2; off <<= 1)
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const float o = __shfl_xor_sync(0xffffffffu, m[i], off);
        m[i] = positive ? fmaxf(m[i], o) : fminf(m[i], o);
      }
#pragma unroll
    for (int i = 0; i < 4; ++i) bmax[i] = fmaxf(bmax[i], p.scale * m[i]);
    if (it % sub == sub - 1) {
      const int b = it / sub;
      // Selects, not a runtime index: keeps the arrays in registers.
      const float s = tq == 0 ? bmax[0] : tq == 1 ? bmax[1] : tq == 2 ? bmax[2] : bmax[3];
      float t = tq == 0 ? thr[0] : tq == 1 ? thr[1] : tq == 2 ? thr[2] : thr[3];
      if (b < my_local && s > t) t = heap.replace_root(s, b);
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        thr[i] = __shfl_sync(0xffffffffu, t, (lane & ~3) | i);
        bmax[i] = kNegInf;
      }
    }
  }

  __syncthreads();
  write_index_row(p, tl, sScore, sBlock, tid);
}

template <typename T, int D, int Warps>
cudaError_t launch_index_topk_shape(const IndexTopkParams& p, cudaStream_t stream, int tiles) {
  using S = IndexTopkShape<Warps>;
  const dim3 grid(unsigned(tiles) * unsigned(p.num_seqs), unsigned(p.num_key_heads));
  constexpr int smem = S::template smem_bytes<D, T>();
  auto kernel = index_topk_kernel<T, D, Warps>;
  cudaError_t err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
  if (err != cudaSuccess) return err;
  kernel<<<grid, S::kThreads, smem, stream>>>(p);
  return cudaGetLastError();
}

template <typename T, int D>
cudaError_t launch_index_topk(const IndexTopkParams& p, cudaStream_t stream) {
  const int hr = p.num_heads / p.num_key_heads;
  // 256-row tiles move half the K bytes per FLOP of 128-row ones, but a grid of them under one wave
  // (1 CTA per SM) is dominated by its longest tiles: use 128-row tiles there (benchmarks/NOTES.md).
  // The 256-row tile needs 176 KB of shared memory (D = 128): GPUs that offer less per block (A100: 163
  // KB) take the 128-row tile (112 KB).
  int device = 0, sms = 0, smem_optin = 0;
  cudaError_t err = cudaGetDevice(&device);
  if (err == cudaSuccess) err = cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device);
  if (err == cudaSuccess) err = cudaDeviceGetAttribute(&smem_optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, device);
  if (err != cudaSuccess) return err;
  const bool fits8 = IndexTopkShape<8>::template smem_bytes<D, T>() <= smem_optin;
  const int tm8 = IndexTopkShape<8>::kRows / hr;
  const int64_t ctas8 = int64_t((p.max_seqlen + tm8 - 1) / tm8) * p.num_seqs * p.num_key_heads;
  if (fits8 && !p.small_smem && (ctas8 >= int64_t(sms) || IndexTopkShape<4>::kRows / hr == 0)) {
    return launch_index_topk_shape<T, D, 8>(p, stream, (p.max_seqlen + tm8 - 1) / tm8);
  }
  // GPUs with 99 KB per block (sm_86, sm_89, sm_120) take the 64-row tile at D = 128 (the 128-row one
  // needs 112 KB); p.small_smem (MSA_SMALL_SMEM=1) forces it, so the tests run it on Hopper.
  const bool fits4 = IndexTopkShape<4>::template smem_bytes<D, T>() <= smem_optin;
  if (fits4 && !p.small_smem) {
    const int tm4 = IndexTopkShape<4>::kRows / hr;
    if (tm4 == 0) return cudaErrorInvalidValue;  // more than 128 index heads per key head
    return launch_index_topk_shape<T, D, 4>(p, stream, (p.max_seqlen + tm4 - 1) / tm4);
  }
  static_assert(IndexTopkShape<2>::template smem_bytes<D, T>() <= 101376, "the 64-row tile fits 99 KB");
  const int tm2 = IndexTopkShape<2>::kRows / hr;
  if (tm2 == 0) return cudaErrorInvalidValue;  // more than 64 index heads per key head
  return launch_index_topk_shape<T, D, 2>(p, stream, (p.max_seqlen + tm2 - 1) / tm2);
}

}  // namespace msa::sm80
