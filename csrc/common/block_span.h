// Where a global kv block (a reverse-index key's block) lies in the packed sequences.
#pragma once
#include <cstdint>

namespace msa {

struct BlockSpan {
  int seq_start;  // first token of the block's sequence
  int key0;       // the block's first key, sequence-local
  int blen;       // keys in the block (the last block of a sequence may be short)
};

// The last i in [0, n) with a[i] <= x, for a non-decreasing a with a[0] <= x (offset tables: the
// sequence of a token or block, the key of a reverse-index entry); ties go to the last one.
__device__ __forceinline__ int last_leq(const int32_t* a, int n, int x) {
  int lo = 0, hi = n - 1;
  while (lo < hi) {
    const int mid = (lo + hi + 1) >> 1;
    if (a[mid] <= x) lo = mid; else hi = mid - 1;
  }
  return lo;
}

// block_offsets[s] = first global block of sequence s; the block's sequence is the last s with
// block_offsets[s] <= gb (empty sequences share their offset with the next one).
__device__ __forceinline__ BlockSpan block_span(const int32_t* block_offsets, const int32_t* cu_seqlens,
                                                int num_seqs, int gb, int block_size) {
  const int lo = last_leq(block_offsets, num_seqs, gb);
  BlockSpan b;
  b.seq_start = cu_seqlens[lo];
  b.key0 = (gb - block_offsets[lo]) * block_size;
  const int seq_len = cu_seqlens[lo + 1] - b.seq_start;
  b.blen = seq_len - b.key0 < block_size ? seq_len - b.key0 : block_size;
  return b;
}

}  // namespace msa
