// Index top-k (SPEC 2), portable sm80 path: scores on tensor cores (mma.sync), causal max-pool per
// block, streaming exp-free top-k in registers. No score matrix ever reaches global memory.
//
// A CTA owns 64 query rows: TM = 64 / Hr tokens x the Hr = Hi / Hki index heads that share one index
// key head (so one K tile feeds all of them). Every block before a row's own block is fully visible,
// and the own block is forced in, so the CTA scores blocks [0, local block of its last token) with no
// causal mask at all; a row skips the blocks at or past its own (only in tiles that straddle blocks).
// Each row keeps its best k-1 earlier blocks spread over the 4 lanes of its quad (8 slots a lane);
// a block enters when it beats the row's current worst (ties keep the lower block).
#pragma once
#include <cuda_runtime.h>

#include "common/mma_sm80.h"
#include "params.h"

namespace msa::sm80 {

constexpr float kPosInf = __builtin_huge_valf();
constexpr float kNegInf = -__builtin_huge_valf();

struct IndexTopkShape {
  static constexpr int kThreads = 128;  // 4 warps x 16 rows
  static constexpr int kRows = 64;
  static constexpr int kKeys = 64;      // keys per pipelined sub-tile (a block is 1 or 2 of them)
  static constexpr int kSlots = 8;      // list slots per lane; 4 lanes x 8 >= topk - 1 (topk <= 32)
  template <int D, typename T>
  static constexpr int smem_bytes() {   // Q tile + two K stages; the Q area is reused for the output
    return 3 * kRows * D * int(sizeof(T));
  }
};

// One row's streaming top list. Entries order: higher score first, equal scores -> lower block first.
// The "worst" entry is the minimum of that order: lowest score, then highest block.
struct TopList {
  float score[IndexTopkShape::kSlots];
  int block[IndexTopkShape::kSlots];
  float thr;  // the worst active score of the row (quad-wide); +inf when the list has no slot

  __device__ __forceinline__ void init(int lane, int slots) {
#pragma unroll
    for (int j = 0; j < IndexTopkShape::kSlots; ++j) {
      const bool active = j * 4 + (lane & 3) < slots;
      score[j] = active ? kNegInf : kPosInf;  // -inf / +inf
      block[j] = active ? -1 : -2;
    }
    refresh_thr();
  }

  __device__ __forceinline__ void refresh_thr() {
    float m = score[0];
#pragma unroll
    for (int j = 1; j < IndexTopkShape::kSlots; ++j) m = fminf(m, score[j]);
    m = fminf(m, __shfl_xor_sync(0xffffffffu, m, 1));
    m = fminf(m, __shfl_xor_sync(0xffffffffu, m, 2));
    thr = m;
  }

  // All 32 lanes call this together; (s, b, allowed) are uniform within each quad.
  __device__ __forceinline__ void offer(float s, int b, bool allowed, int lane) {
    int wj = 0;
    float ws = score[0];
    int wb = block[0];
#pragma unroll
    for (int j = 1; j < IndexTopkShape::kSlots; ++j) {
      if (score[j] < ws || (score[j] == ws && block[j] > wb)) {
        wj = j;
        ws = score[j];
        wb = block[j];
      }
    }
    int owner = lane;
#pragma unroll
    for (int off = 1; off <= 2; off <<= 1) {  // quad-wide worst: (score asc, block desc, lane asc)
      const float os = __shfl_xor_sync(0xffffffffu, ws, off);
      const int ob = __shfl_xor_sync(0xffffffffu, wb, off);
      const int ol = __shfl_xor_sync(0xffffffffu, owner, off);
      if (os < ws || (os == ws && (ob > wb || (ob == wb && ol < owner)))) {
        ws = os;
        wb = ob;
        owner = ol;
      }
    }
    if (allowed && s > thr && owner == lane) {
#pragma unroll
      for (int j = 0; j < IndexTopkShape::kSlots; ++j) {
        if (j == wj) {
          score[j] = s;
          block[j] = b;
        }
      }
    }
    refresh_thr();
  }
};

template <typename T, int D>
__global__ void __launch_bounds__(IndexTopkShape::kThreads, 3) index_topk_kernel(IndexTopkParams p) {
  using S = IndexTopkShape;
  using Tile = SwizzledTile<D>;
  constexpr int kChunks = Tile::kChunks;
  extern __shared__ __align__(128) unsigned char smem_raw[];
  T* sQ = reinterpret_cast<T*>(smem_raw);
  T* sK = sQ + S::kRows * D;

  // blockIdx.x enumerates (tile, sequence) with the longest tiles (last in the sequence) first.
  const int seq = blockIdx.x % p.num_seqs;
  const int tiles_max = (p.max_seqlen + (S::kRows / (p.num_heads / p.num_key_heads)) - 1) /
                        (S::kRows / (p.num_heads / p.num_key_heads));
  const int tile = tiles_max - 1 - int(blockIdx.x / p.num_seqs);
  const int kh = blockIdx.y;
  const int hr = p.num_heads / p.num_key_heads;
  const int tm = S::kRows / hr;
  const int seq_start = p.cu_seqlens[seq];
  const int n = p.cu_seqlens[seq + 1] - seq_start;
  const int tok0 = tile * tm;
  if (tok0 >= n) return;
  const int rows_used = tm * hr;
  const int last_tok = min(tok0 + tm, n) - 1;
  const int sub = p.block_size / S::kKeys;
  const int total = (last_tok / p.block_size) * sub;  // sub-tiles of the blocks before the last token's

  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
  const T* q_base = static_cast<const T*>(p.q_idx);
  const T* k_base = static_cast<const T*>(p.k_idx);

  for (int i = tid; i < S::kRows * kChunks; i += S::kThreads) {
    const int r = i / kChunks, c = i % kChunks;
    const int tok = tok0 + r / hr;
    const bool valid = r < rows_used && tok < n;
    const T* src = q_base + int64_t(seq_start + (valid ? tok : 0)) * p.q_stride_t +
                   int64_t(kh * hr + r % hr) * p.q_stride_h + c * 8;
    cp_async_16(sQ + Tile::offset(r, c), src, valid);
  }
  cp_async_commit();
  auto load_k = [&](int it, int stage) {
    const int b = it / sub, part = it % sub;
    const T* src = k_base + int64_t(seq_start + b * p.block_size + part * S::kKeys) * p.k_stride_t +
                   int64_t(kh) * p.k_stride_h;
    T* dst = sK + stage * S::kKeys * D;
    for (int i = tid; i < S::kKeys * kChunks; i += S::kThreads) {
      const int r = i / kChunks, c = i % kChunks;
      cp_async_16(dst + Tile::offset(r, c), src + int64_t(r) * p.k_stride_t + c * 8, true);
    }
  };
  if (total > 0) load_k(0, 0);
  cp_async_commit();
  cp_async_wait<1>();
  __syncthreads();

  uint32_t a[D / 16][4];  // this warp's 16 query rows, all of Di, in registers for the whole loop
#pragma unroll
  for (int ks = 0; ks < D / 16; ++ks)
    ldmatrix_x4(a[ks], sQ + Tile::offset(warp * 16 + (lane % 16), ks * 2 + lane / 16));

  const int row_lo = warp * 16 + lane / 4;
  int local[2];
#pragma unroll
  for (int i = 0; i < 2; ++i) local[i] = (tok0 + (row_lo + 8 * i) / hr) / p.block_size;
  TopList list[2];
  list[0].init(lane, p.topk - 1);
  list[1].init(lane, p.topk - 1);
  float bmax[2] = {kNegInf, kNegInf};

  for (int it = 0; it < total; ++it) {
    if (it + 1 < total) load_k(it + 1, (it + 1) & 1);
    cp_async_commit();
    cp_async_wait<1>();
    __syncthreads();
    const T* k = sK + (it & 1) * S::kKeys * D;
    float c[8][4];
#pragma unroll
    for (int n8 = 0; n8 < 8; ++n8)
#pragma unroll
      for (int e = 0; e < 4; ++e) c[n8][e] = 0.f;
#pragma unroll
    for (int ks = 0; ks < D / 16; ++ks) {
#pragma unroll
      for (int np = 0; np < 4; ++np) {
        uint32_t b[4];
        ldmatrix_x4(b, k + Tile::offset(np * 16 + (lane % 8) + (lane / 16) * 8, ks * 2 + (lane / 8) % 2));
        MmaOp<T>::run(c[2 * np], a[ks], b[0], b[1]);
        MmaOp<T>::run(c[2 * np + 1], a[ks], b[2], b[3]);
      }
    }
    __syncthreads();  // the stage read here is refilled by the next iteration's load
    float m0 = kNegInf, m1 = kNegInf;
#pragma unroll
    for (int n8 = 0; n8 < 8; ++n8) {  // SPEC 2: S = index_scale * <q, k>, then the max
      m0 = fmaxf(m0, fmaxf(p.scale * c[n8][0], p.scale * c[n8][1]));
      m1 = fmaxf(m1, fmaxf(p.scale * c[n8][2], p.scale * c[n8][3]));
    }
    m0 = fmaxf(m0, __shfl_xor_sync(0xffffffffu, m0, 1));
    m0 = fmaxf(m0, __shfl_xor_sync(0xffffffffu, m0, 2));
    m1 = fmaxf(m1, __shfl_xor_sync(0xffffffffu, m1, 1));
    m1 = fmaxf(m1, __shfl_xor_sync(0xffffffffu, m1, 2));
    bmax[0] = fmaxf(bmax[0], m0);
    bmax[1] = fmaxf(bmax[1], m1);
    if (it % sub == sub - 1) {
      const int b = it / sub;
      list[0].offer(bmax[0], b, b < local[0], lane);
      list[1].offer(bmax[1], b, b < local[1], lane);
      bmax[0] = bmax[1] = kNegInf;
    }
  }

  // Output: gather each row's slots, sort ascending, append the local block, pad with -1.
  cp_async_wait<0>();
  __syncthreads();
  int* sOut = reinterpret_cast<int*>(smem_raw);  // kRows x 32 ints over the Q area
#pragma unroll
  for (int i = 0; i < 2; ++i)
#pragma unroll
    for (int j = 0; j < S::kSlots; ++j) sOut[(row_lo + 8 * i) * 32 + j * 4 + (lane & 3)] = list[i].block[j];
  __syncthreads();
  if (tid < rows_used) {
    const int tok = tok0 + tid / hr;
    if (tok < n) {
      int* v = sOut + tid * 32;
      int cnt = 0;
      for (int j = 0; j < 32; ++j) {
        const int x = v[j];
        if (x >= 0) v[cnt++] = x;
      }
      for (int j = 1; j < cnt; ++j) {  // at most 31 entries
        const int x = v[j];
        int m = j - 1;
        while (m >= 0 && v[m] > x) {
          v[m + 1] = v[m];
          --m;
        }
        v[m + 1] = x;
      }
      int32_t* out = p.indices + (int64_t(kh * hr + tid % hr) * p.total_tokens + seq_start + tok) * p.topk;
      for (int j = 0; j < cnt; ++j) out[j] = v[j];
      out[cnt] = tok / p.block_size;
      for (int j = cnt + 1; j < p.topk; ++j) out[j] = -1;
    }
  }
}

template <typename T, int D>
cudaError_t launch_index_topk(const IndexTopkParams& p, cudaStream_t stream) {
  const int hr = p.num_heads / p.num_key_heads;
  const int tm = IndexTopkShape::kRows / hr;
  const int tiles = (p.max_seqlen + tm - 1) / tm;
  const dim3 grid(unsigned(tiles) * unsigned(p.num_seqs), unsigned(p.num_key_heads));
  constexpr int smem = IndexTopkShape::smem_bytes<D, T>();
  auto kernel = index_topk_kernel<T, D>;
  cudaError_t err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
  if (err != cudaSuccess) return err;
  kernel<<<grid, IndexTopkShape::kThreads, smem, stream>>>(p);
  return cudaGetLastError();
}

}  // namespace msa::sm80
