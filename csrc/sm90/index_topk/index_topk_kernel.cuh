// Index top-k (SPEC 2), Hopper path (sm90a): the scores on warpgroup tensor cores (wgmma), the same
// causal max-pool and streaming exp-free top list as the portable kernel (sm80/index_topk).
//
// A CTA owns 256 query rows: TM = 256 / Hr tokens x the Hr = Hi / Hki index heads of one index key
// head, in 4 warpgroups of 64 rows. Each warpgroup keeps its rows' Q in registers (the A operand of an
// RS wgmma, loaded once) and multiplies it by 128-key sub-tiles of K (one block of 128 or two of 64)
// that all 512 threads stream into shared memory (cp.async, 4 stages, one barrier per sub-tile) in
// the 128-byte-swizzled K-major layout wgmma reads. Per sub-tile a warpgroup issues D / 16 wgmma
// m64n128k16 and waits; the four warpgroups' MMAs queue on the tensor cores, so one group's row-max
// epilogue overlaps the others' MMAs.
// As in the portable kernel, every block before a row's own block is fully visible and the own block
// is forced in, so no causal mask is needed: the CTA scores blocks [0, block of its last token) and a
// row ignores the blocks at or past its own.
// A negative index scale is folded into Q (sign flip, exact): the block score is then |scale| times
// the max of the flipped dot products, with no per-element select.
#pragma once
#include <cuda_runtime.h>

#include "common/mma_sm80.h"
#include "common/top_list.cuh"
#include "common/wgmma_sm90.h"
#include "params.h"

namespace msa::sm90 {

struct IndexTopkShape {
  static constexpr int kWarpgroups = 4;
  static constexpr int kThreads = kWarpgroups * 128;
  static constexpr int kRows = kWarpgroups * 64;
  static constexpr int kKeys = 128;  // keys per sub-tile: one block of 128 or two of 64
  static constexpr int kStages = 4;  // K sub-tiles in flight
  static constexpr int kSlots = SmemTopHeap::kSlots;
  template <int D, typename T>
  static constexpr int k_bytes() { return kStages * kKeys * D * int(sizeof(T)); }
  // Q is staged once (then kept in registers) in the space the top lists use afterwards.
  template <int D, typename T>
  static constexpr int q_bytes() { return kRows * D * int(sizeof(T)); }
  static constexpr int list_bytes() { return kRows * kSlots * 8; }
  template <int D, typename T>
  static constexpr int q_or_list_bytes() { return q_bytes<D, T>() > list_bytes() ? q_bytes<D, T>() : list_bytes(); }
  // + 1 KB: the K stages must start 1024-byte aligned (the swizzle is on address bits).
  template <int D, typename T>
  static constexpr int smem_bytes() { return 1024 + k_bytes<D, T>() + q_or_list_bytes<D, T>(); }
};

template <typename T, int D>
__global__ void __launch_bounds__(IndexTopkShape::kThreads, 1) index_topk_sm90_kernel(IndexTopkParams p) {
  using S = IndexTopkShape;
  using KTile = KMajorSw128<S::kKeys, D>;
  using QTile = sm80::SwizzledTile<D>;
  constexpr int kChunks = D / 8;
  extern __shared__ unsigned char smem_raw[];
  unsigned char* smem = smem_raw + ((1024 - (sm80::smem_addr(smem_raw) & 1023)) & 1023);
  T* sK = reinterpret_cast<T*>(smem);
  T* sQ = reinterpret_cast<T*>(smem + S::k_bytes<D, T>());
  float* sScore = reinterpret_cast<float*>(smem + S::k_bytes<D, T>());  // after Q is in registers
  int* sBlock = reinterpret_cast<int*>(sScore + S::kRows * S::kSlots);

  // blockIdx.x enumerates (tile, sequence) with the longest tiles (last in the sequence) first.
  const int hr = p.num_heads / p.num_key_heads;
  const int tm = S::kRows / hr;
  const int tiles_max = (p.max_seqlen + tm - 1) / tm;
  const int seq = blockIdx.x % p.num_seqs;
  const int tile = tiles_max - 1 - int(blockIdx.x / p.num_seqs);
  const int kh = blockIdx.y;
  const int seq_start = p.cu_seqlens[seq];
  const int n = p.cu_seqlens[seq + 1] - seq_start;
  const int tok0 = tile * tm;
  if (tok0 >= n) return;
  const int rows_used = tm * hr;
  const int last_tok = min(tok0 + tm, n) - 1;
  const int nb = S::kKeys / p.block_size;  // blocks per sub-tile
  const int blocks = last_tok / p.block_size;  // the blocks before the last token's
  const int total = (blocks + nb - 1) / nb;    // sub-tiles

  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
  const T* q_base = static_cast<const T*>(p.q_idx);
  const T* k_base = static_cast<const T*>(p.k_idx);

  for (int i = tid; i < S::kRows * kChunks; i += S::kThreads) {
    const int r = i / kChunks, c = i % kChunks;
    const int tok = tok0 + r / hr;
    const bool valid = r < rows_used && tok < n;
    const T* src = q_base + int64_t(seq_start + (valid ? tok : 0)) * p.q_stride_t +
                   int64_t(kh * hr + r % hr) * p.q_stride_h + c * 8;
    sm80::cp_async_16(sQ + QTile::offset(r, c), src, valid);
  }
  sm80::cp_async_commit();
  auto load_k = [&](int it, int stage) {
    const int key0 = it * S::kKeys;  // a last half-used sub-tile (two blocks of 64) reads zeros past n
    const T* src = k_base + int64_t(seq_start + key0) * p.k_stride_t + int64_t(kh) * p.k_stride_h;
    T* dst = sK + stage * S::kKeys * D;
    for (int i = tid; i < S::kKeys * kChunks; i += S::kThreads) {
      const int r = i / kChunks, c = i % kChunks;
      const bool valid = key0 + r < n;
      sm80::cp_async_16(dst + KTile::offset(r, c), src + int64_t(valid ? r : 0) * p.k_stride_t + c * 8, valid);
    }
  };
#pragma unroll
  for (int s = 0; s < S::kStages - 1; ++s) {
    if (s < total) load_k(s, s);
    sm80::cp_async_commit();
  }
  sm80::cp_async_wait<S::kStages - 1>();  // Q
  __syncthreads();

  // This warp's 16 rows of Q, all of Di, in registers for the whole loop (the wgmma A operand).
  const uint32_t flip = p.scale < 0.f ? 0x80008000u : 0u;  // negate both 16-bit halves
  uint32_t a[D / 16][4];
#pragma unroll
  for (int ks = 0; ks < D / 16; ++ks) {
    sm80::ldmatrix_x4(a[ks], sQ + QTile::offset(warp * 16 + (lane % 16), ks * 2 + lane / 16));
#pragma unroll
    for (int e = 0; e < 4; ++e) a[ks][e] ^= flip;
  }
  const float abs_scale = fabsf(p.scale);
  __syncthreads();  // Q is in registers: its space now holds the top lists (first used after the loop's barrier)
  if (tid < S::kRows) SmemTopHeap{sScore + tid * S::kSlots, sBlock + tid * S::kSlots, p.topk - 1}.init();

  // Lanes t = 0 and 1 of each quad keep the lists of rows g and g + 8 of the warp's 16 (SPEC 2 order).
  const int g = lane / 4, tq = lane % 4;
  const bool owner = tq < 2;
  const int my_row = warp * 16 + g + 8 * (tq & 1);
  const int my_local = (tok0 + my_row / hr) / p.block_size;
  SmemTopHeap heap{sScore + my_row * S::kSlots, sBlock + my_row * S::kSlots, p.topk - 1};
  float thr = p.topk > 1 ? kNegInf : kPosInf;

  float c[S::kKeys / 2];
#pragma unroll
  for (int e = 0; e < S::kKeys / 2; ++e) c[e] = 0.f;
  for (int it = 0; it < total; ++it) {
    // Sub-tile it has landed; after the barrier every warpgroup is done with it - 1, whose stage the
    // load of it + kStages - 1 refills. The fence hands the cp.async bytes to wgmma's (async) proxy.
    sm80::cp_async_wait<S::kStages - 2>();
    fence_proxy_async_smem();
    __syncthreads();
    if (it + S::kStages - 1 < total) load_k(it + S::kStages - 1, (it + S::kStages - 1) % S::kStages);
    sm80::cp_async_commit();
    const uint32_t k_addr = sm80::smem_addr(sK + (it % S::kStages) * S::kKeys * D);
    wgmma_fence();
#pragma unroll
    for (int ks = 0; ks < D / 16; ++ks) WgmmaRS<T, S::kKeys>::run(c, a[ks], KTile::desc(k_addr, ks), ks > 0);
    wgmma_commit();
    wgmma_wait<0>();
    // Row max of each 64-key half: m[h][0] for row g, m[h][1] for row g + 8 (8-column slices 8h..8h+7).
    float m[2][2];
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      m[h][0] = m[h][1] = kNegInf;
#pragma unroll
      for (int j = 8 * h; j < 8 * h + 8; ++j) {
        m[h][0] = fmaxf(m[h][0], fmaxf(c[4 * j], c[4 * j + 1]));
        m[h][1] = fmaxf(m[h][1], fmaxf(c[4 * j + 2], c[4 * j + 3]));
      }
    }
    if (nb == 1) {
      m[0][0] = fmaxf(m[0][0], m[1][0]);
      m[0][1] = fmaxf(m[0][1], m[1][1]);
    }
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      if (h < nb) {  // warp-uniform
#pragma unroll
        for (int off = 1; off <= 2; off <<= 1) {
          m[h][0] = fmaxf(m[h][0], __shfl_xor_sync(0xffffffffu, m[h][0], off));
          m[h][1] = fmaxf(m[h][1], __shfl_xor_sync(0xffffffffu, m[h][1], off));
        }
        const float s = abs_scale * ((tq & 1) ? m[h][1] : m[h][0]);
        const int b = it * nb + h;  // blocks are offered in ascending order
        if (owner && b < my_local && s > thr) thr = heap.replace_root(s, b);
      }
    }
  }

  // Output: each row's list sorted ascending, then the local block, then -1 padding.
  __syncthreads();
  if (tid < rows_used) {
    const int tok = tok0 + tid / hr;
    if (tok < n) {
      SmemTopHeap{sScore + tid * S::kSlots, sBlock + tid * S::kSlots, p.topk - 1}.write_sorted(
          topk_out_row(p, seq_start, tok, kh * hr + tid % hr), p.topk, tok / p.block_size);
    }
  }
}

// Fails (cudaErrorInvalidValue) when the GPU offers less shared memory per block than the kernel needs;
// the caller then takes the portable kernel (see index_topk_fits).
template <typename T, int D>
cudaError_t launch_index_topk(const IndexTopkParams& p, cudaStream_t stream) {
  using S = IndexTopkShape;
  const int hr = p.num_heads / p.num_key_heads;
  const int tm = S::kRows / hr;
  if (tm == 0) return cudaErrorInvalidValue;
  const int tiles = (p.max_seqlen + tm - 1) / tm;
  const dim3 grid(unsigned(tiles) * unsigned(p.num_seqs), unsigned(p.num_key_heads));
  constexpr int smem = S::smem_bytes<D, T>();
  auto kernel = index_topk_sm90_kernel<T, D>;
  cudaError_t err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
  if (err != cudaSuccess) return err;
  kernel<<<grid, S::kThreads, smem, stream>>>(p);
  return cudaGetLastError();
}

}  // namespace msa::sm90
