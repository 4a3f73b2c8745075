// Where a global kv block (a reverse-index key's block) lies in the packed sequences.
#pragma once
#include <cstdint>

namespace msa {

struct BlockSpan {
  int k_start;   // first key row of the block's sequence
  // Query row t of the sequence is at position t - q_origin (queries are the last positions of the
  // sequence's keys: q_origin = first query row - (len_k - len_q)); a query sees the block's keys up to
  // t - q_origin - key0.
  int q_origin;
  int key0;      // the block's first key, sequence-local
  int blen;      // keys in the block (the last block of a sequence may be short)
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

// block_offsets[s] = first global block of sequence s (blocks of its keys); the block's sequence is the
// last s with block_offsets[s] <= gb (empty sequences share their offset with the next one). cu_k is cu_q
// itself where the keys have the queries' layout: then q_origin = k_start = cu_q[s].
__device__ __forceinline__ BlockSpan block_span(const int32_t* block_offsets, const int32_t* cu_q,
                                                const int32_t* cu_k, int num_seqs, int gb, int block_size) {
  const int lo = last_leq(block_offsets, num_seqs, gb);
  BlockSpan b;
  b.k_start = cu_k[lo];
  const int len_k = cu_k[lo + 1] - b.k_start;
  b.q_origin = cu_q[lo + 1] - len_k;
  b.key0 = (gb - block_offsets[lo]) * block_size;
  b.blen = len_k - b.key0 < block_size ? len_k - b.key0 : block_size;
  return b;
}

}  // namespace msa
