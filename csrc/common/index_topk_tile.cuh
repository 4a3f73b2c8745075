// What the index top-k kernels (sm80 and sm90) share before their main loops: which query rows a CTA
// owns, and the gather of those rows' Q into shared memory.
#pragma once
#include <cstdint>

#include "common/mma_sm80.h"
#include "common/top_list.cuh"
#include "params.h"

namespace msa {

// blockIdx.x enumerates (tile, sequence) with the longest tiles (last in the sequence) first,
// blockIdx.y the index key head kh. A tile is tm = rows / hr tokens x the hr = Hi / Hki index heads
// that share kh (so one K tile feeds all of them): CTA row r is token tok0 + r / hr, head kh * hr + r % hr.
// Tokens are query rows seq_start + tok (tok < n); token tok is at position tok + shift, whose keys are
// the rows k_start + j (shift = len_k - len_q: queries are the last positions of their keys; 0 and
// k_start = seq_start where the keys have the queries' layout).
struct IndexTopkTile {
  int hr, tm, kh, seq_start, n, tok0, rows_used, last_tok, k_start, shift;
  __device__ __forceinline__ static IndexTopkTile make(const IndexTopkParams& p, int rows) {
    IndexTopkTile t;
    t.hr = p.num_heads / p.num_key_heads;
    t.tm = rows / t.hr;
    const int tiles_max = (p.max_seqlen + t.tm - 1) / t.tm;
    const int seq = blockIdx.x % p.num_seqs;
    const int tile = tiles_max - 1 - int(blockIdx.x / p.num_seqs);
    t.kh = blockIdx.y;
    t.seq_start = p.cu_seqlens[seq];
    t.n = p.cu_seqlens[seq + 1] - t.seq_start;
    t.k_start = p.cu_seqlens_k[seq];
    t.shift = p.cu_seqlens_k[seq + 1] - t.k_start - t.n;
    t.tok0 = tile * t.tm;
    t.rows_used = t.tm * t.hr;
    t.last_tok = min(t.tok0 + t.tm, t.n) - 1;
    return t;
  }
  __device__ __forceinline__ bool empty() const { return tok0 >= n; }
};

// cp.async of the tile's `rows` rows of q_idx (zeros for padding rows and tokens past the sequence)
// into a row-major swizzled tile (sm80::SwizzledTile<D>); the caller commits and waits.
template <typename T, int D>
__device__ __forceinline__ void gather_index_q(T* sQ, const IndexTopkParams& p, const IndexTopkTile& t, int rows,
                                               int tid, int threads) {
  constexpr int kChunks = D / 8;
  const T* q_base = static_cast<const T*>(p.q_idx);
  for (int i = tid; i < rows * kChunks; i += threads) {
    const int r = i / kChunks, c = i % kChunks;
    const int tok = t.tok0 + r / t.hr;
    const bool valid = r < t.rows_used && tok < t.n;
    const T* src = q_base + int64_t(t.seq_start + (valid ? tok : 0)) * p.q_stride_t +
                   int64_t(t.kh * t.hr + r % t.hr) * p.q_stride_h + c * 8;
    sm80::cp_async_16(sQ + sm80::SwizzledTile<D>::offset(r, c), src, valid);
  }
}

// After the main loop and a CTA barrier, thread `row` writes row `row`'s list (SPEC 2 order: the kept
// blocks ascending, the local block, -1 padding) from its heap in shared memory; kSum: first the kept
// blocks' (max, sum) to p.sel_stats.
template <bool kSum = false>
__device__ __forceinline__ void write_index_row(const IndexTopkParams& p, const IndexTopkTile& t, float* sScore,
                                                int* sBlock, int row, float* sSum = nullptr) {
  if (row >= t.rows_used) return;
  const int tok = t.tok0 + row / t.hr;
  if (tok >= t.n) return;
  const int64_t at = int64_t(t.kh * t.hr + row % t.hr) * p.total_tokens + t.seq_start + tok;
  TopHeap<kSum> heap(sScore, sBlock, row, p.topk, sSum);
  if constexpr (kSum) p.sel_stats[at] = heap.kept_max_sum();
  heap.write_sorted(p.indices + at * p.topk, p.topk, (tok + t.shift) / p.block_size);
}

}  // namespace msa
