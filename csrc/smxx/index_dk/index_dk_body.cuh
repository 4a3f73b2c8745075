// The KL's k_idx gradient (SPEC 4) for one query chunk and d_kl = 1 (scale = index_scale / rows):
//   dki[j] += scale * sum over the entries (unit u) that selected j's block of dsi[u, j] * q_idx[u],
// shared by the portable kernel (sm80/index_dk/mainloop.cuh: mma.sync, smxx/index_dk/index_dk.cu) and the
// Hopper one (sm90/index_dk/mainloop.cuh: wgmma, sm90/index_dk/index_dk.cu), which differ only in the
// shared-memory layout of the tiles and the per-tile GEMM (the mainloop policy Mma).
// The grid is two CTAs per SM (as many as fit: the accumulator's registers), and CTA c takes the c-th
// equal share of the chunk's entries in key order (the reverse index's CSR), so every CTA streams the
// same number of units whatever the keys' sizes; its share splits into key segments (a hot key is
// spread over several CTAs). Per segment the block's 128 x Di accumulator stays in
// registers (warp w: keys [16w, 16w + 16)) while the segment's units stream through in tiles of 32 (two
// MMA k-steps), later tiles' dsi rows and q_idx rows fetched while this one computes; the segment
// ends with one atomic add of the accumulator. Di = 64 is zero-padded to 128 in shared memory.
// The kernel streams dsi and q_idx rows (512 B per unit) through an Mma::kStages-deep cp.async ring (one
// CTA barrier per tile: 16 KB per barrier; tiles of 16 units ran at ~1.2 TB/s, NOTES s27). dsi rows
// are in reverse-index order (the output pass writes them so), so a tile's 32 rows are one
// contiguous 8 KB read; only q_idx is gathered by token (chunk_begin + entry / topk % chunk_tokens: FastDiv, no runtime
// division).
#pragma once
#include <cuda_runtime.h>

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>

#include "common/block_span.h"
#include "common/fast_div.h"
#include "common/mma_sm80.h"
#include "params.h"

namespace msa::smxx {
using namespace sm80;  // common/mma_sm80.h: cp.async, fragments and atomics (sm80 and later)

constexpr int kDkThreads = 256;
constexpr int kDkKeys = 128;
constexpr int kDkUnits = 32;  // per tile: two MMA k-steps
constexpr int kDkDi = 128;    // shared-memory width of the q_idx tile (Di = 64: zeros)
constexpr int kDkTileBytes = kDkUnits * (kDkKeys + kDkDi) * 2;  // one stage: dsi and q_idx rows, 16 KB
// Dynamic shared memory of Mma's ring: Mma::kStages stages, + Mma::kAlign - 16 bytes to align them to kAlign (1024
// for wgmma tiles, whose swizzle is on address bits; the base is 16-byte aligned).
template <class Mma>
constexpr int dk_smem_bytes() { return Mma::kStages * kDkTileBytes + Mma::kAlign - 16; }

// kDet (deterministic mode): CTA i takes the chunk's work item i (one key, at most units_per_item of its
// units) and stores its sum in dki_part[i]; item_reduce adds the items in order. Mma::kDetBlocks: CTAs per
// SM of that variant (the portable one spills at two).
// Mma: Tile (the dsi and q_idx tiles' layout: 32 rows x 128 16-bit elements, offset(row, 16-byte chunk)),
// fence_operands() (after the tile's copies landed, before the CTA barrier), issue(acc, dsi tile, q_idx tile,
// warp, lane, first) (first: the segment's first tile overwrites acc) and wait(acc) (acc readable); kAsync:
// issue() only starts the GEMM, so the next tile's copies go out between issue and wait (else before issue).
template <class Mma, typename T, bool kDet>
__global__ void __launch_bounds__(kDkThreads, kDet ? Mma::kDetBlocks : 2)
    index_dk_kernel(IndexDkParams p, FastDiv by_topk, FastDiv by_chunk) {
  using Tile = typename Mma::Tile;
  constexpr int kDkStages = Mma::kStages;
  // The ring in dynamic shared memory, Mma::kAlign-byte aligned: stage b's dsi tile, then its q_idx tile.
  extern __shared__ __align__(16) unsigned char dk_smem_raw[];
  constexpr uint32_t kMask = Mma::kAlign - 1;
  unsigned char* const dk_smem = dk_smem_raw + ((Mma::kAlign - (smem_addr(dk_smem_raw) & kMask)) & kMask);
  auto sDs = reinterpret_cast<T(*)[kDkUnits * (kDkKeys + kDkDi)]>(dk_smem);
  auto sQi = [&](int b) { return sDs[b] + kDkUnits * kDkKeys; };
  const SparseWork& w = p.work;
  int e_begin, e_end, key;
  if constexpr (kDet) {
    if (int(blockIdx.x) >= w.item_offsets[w.num_keys]) return;
    const int2 it = w.items[blockIdx.x];
    key = it.x;
    e_begin = it.y;
    e_end = min(e_begin + w.units_per_item, w.offsets[key + 1]);
  } else {
    const int total = w.offsets[w.num_keys];  // valid entries of the chunk
    const int share = int((int64_t(total) + gridDim.x - 1) / gridDim.x);
    e_begin = int(min(int64_t(total), int64_t(blockIdx.x) * share));
    e_end = min(total, e_begin + share);
    if (e_begin >= e_end) return;
    key = last_leq(w.offsets, w.num_keys, e_begin);  // the key holding entry e_begin
  }
  const int di = p.di, di_chunks = di / 8;
  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
  const int g = lane / 4, tq = lane % 4;
  const T* QI = static_cast<const T*>(p.q_idx);
  const T* DS = static_cast<const T*>(p.dsi_part);
  // The warp's 16 keys take part (block_size 64: warps 0-3). The wgmma policy issues for every warpgroup
  // (its keys past block_size have dsi = 0 and are not stored).
  const bool active = Mma::kAsync || warp * 16 < p.block_size;
  float acc[16][4];
  sm80::zero_acc(acc);

  for (int pos = e_begin; pos < e_end;) {
    // One key segment: this CTA's entries of one key.
    while (w.offsets[key + 1] <= pos) ++key;  // empty keys
    const int u_begin = pos, u_end = min(e_end, w.offsets[key + 1]);
    pos = u_end;
    const int r = key / w.max_blocks, gb = key % w.max_blocks;
    const BlockSpan span = block_span(w.block_offsets, p.cu_seqlens, p.cu_seqlens_k, p.num_seqs, gb, p.block_size);
    const int n_tiles = (u_end - u_begin + kDkUnits - 1) / kDkUnits;

    // Tile t's dsi rows and q_idx rows into buffer b: thread = (units tid / 16 + 16 i, 16-byte chunk
    // tid % 16). The q_idx gather needs each unit's entry (entries[]: its token): entries() loads tile
    // t's into registers one fetch ahead, so that load's latency passes under a tile's MMAs instead of
    // holding the thread before its copies.
    constexpr int kPer = kDkUnits / (kDkThreads / 16);  // units per thread and tile
    auto unit = [&](int i) { return tid / 16 + i * (kDkThreads / 16); };  // the thread's i-th unit of a tile
    auto entries = [&](int t, int (&ent)[kPer]) {
#pragma unroll
      for (int i = 0; i < kPer; ++i) {
        const int ue = u_begin + t * kDkUnits + unit(i);
        ent[i] = ue < u_end ? w.entries[ue] : 0;  // ue < u_end: t < n_tiles
      }
    };
    auto fetch = [&](int t, int b, auto entry) {  // entry(i, ue): unit ue's entry (the thread's i-th unit)
      const int c = tid % 16;
#pragma unroll(kDet ? 1 : kPer)
      for (int i = 0; i < kPer; ++i) {
        const int u = unit(i);
        const int ue = u_begin + t * kDkUnits + u;
        const bool ok = ue < u_end;
        const int64_t tok = ok ? p.chunk_begin + fast_mod(fast_div(entry(i, ue), by_topk), by_chunk) : 0;
        cp_async_16(&sDs[b][Tile::offset(u, c)], DS + (ok ? int64_t(ue) * kDkKeys + c * 8 : 0), ok);
        const bool qok = ok && c < di_chunks;
        cp_async_16(sQi(b) + Tile::offset(u, c),
                    QI + (qok ? tok * p.qi_stride_t + int64_t(r) * p.qi_stride_h + c * 8 : 0), qok);
      }
    };

    // fetch_next(t, b): tile t into buffer b; ent holds tile t's entries before, tile t + 1's after.
    // kDet loads them in place and does not unroll fetch's loop: at its ~240 registers (portable) either spilled.
    int ent[kPer];
    if constexpr (!kDet) entries(0, ent);
    auto fetch_next = [&](int t, int b) {
      if constexpr (kDet) {
        fetch(t, b, [&](int, int ue) { return w.entries[ue]; });
      } else {
        fetch(t, b, [&](int i, int) { return ent[i]; });
        entries(t + 1, ent);
      }
    };
    __syncthreads();  // the previous segment is done with every buffer
#pragma unroll
    for (int s = 0; s < kDkStages - 1; ++s) {
      if (s < n_tiles) fetch_next(s, s);
      cp_async_commit();
    }
    for (int t = 0; t < n_tiles; ++t) {
      cp_async_wait<kDkStages - 2>();  // tile t has landed (this thread's copies)
      Mma::fence_operands();
      __syncthreads();                 // ... every thread's; and tile t - 1's buffer is free
      const int f = t + kDkStages - 1;
      auto next = [&] {
        if (f < n_tiles) fetch_next(f, f % kDkStages);
        cp_async_commit();
      };
      if constexpr (!Mma::kAsync) next();
      if (active) Mma::template issue<T>(acc, sDs[t % kDkStages], sQi(t % kDkStages), warp, lane, t == 0);
      if constexpr (Mma::kAsync) next();
      if (active) Mma::wait(acc);
    }

    if (active) {
      const int kih = r / (p.hi / p.hki);
#pragma unroll
      for (int n = 0; n < 16; ++n) {
        const int col = n * 8 + 2 * tq;
        if (col < di) {
#pragma unroll
          for (int half = 0; half < 2; ++half) {
            const int kr = warp * 16 + g + 8 * half;
            if constexpr (kDet) {
              *reinterpret_cast<float2*>(p.dki_part + (int64_t(blockIdx.x) * kDkKeys + kr) * di + col) =
                  make_float2(acc[n][2 * half] * p.scale, acc[n][2 * half + 1] * p.scale);
            } else if (kr < span.blen) {
              float* d = p.dki_accum + (int64_t(span.k_start + span.key0 + kr) * p.hki + kih) * di + col;
              atomic_add2(d, acc[n][2 * half] * p.scale, acc[n][2 * half + 1] * p.scale);
            }
          }
        }
      }
    }
  }
}

// The launch: deterministic mode one CTA per work item, else two CTAs per SM (fewer when the chunk has fewer
// than 256 entries per CTA: an upper bound, the kernel shares out the valid entries it finds).
template <class Mma>
cudaError_t launch_index_dk_with(const IndexDkParams& p, bool bf16, cudaStream_t stream) {
  int device = 0, sms = 0;
  cudaError_t err = cudaGetDevice(&device);
  if (err == cudaSuccess) err = cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device);
  if (err != cudaSuccess) return err;
  const FastDiv by_topk = make_fast_div(p.topk), by_chunk = make_fast_div(std::max(p.chunk_tokens, 1));
  const bool det = p.dki_part != nullptr;
  const int64_t entries = int64_t(p.hi) * p.chunk_tokens * p.topk;
  const int64_t grid = det ? int64_t(p.work.max_items) : std::min<int64_t>(2 * sms, (entries + 255) / 256);
  if (grid == 0) return cudaSuccess;
  auto kernel = det ? (bf16 ? index_dk_kernel<Mma, __nv_bfloat16, true> : index_dk_kernel<Mma, __half, true>)
                    : (bf16 ? index_dk_kernel<Mma, __nv_bfloat16, false> : index_dk_kernel<Mma, __half, false>);
  constexpr int smem = dk_smem_bytes<Mma>();
  err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
  if (err != cudaSuccess) return err;
  kernel<<<unsigned(grid), kDkThreads, smem, stream>>>(p, by_topk, by_chunk);
  return cudaGetLastError();
}

}  // namespace msa::smxx
