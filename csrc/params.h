// Torch-free parameter structs: what a kernel launch needs, as plain pointers and sizes.
#pragma once
#include <cstddef>
#include <cstdint>

namespace msa {

// Reverse index (kv block -> tokens that selected it). See torch_bindings.cpp for the layout.
struct ReverseIndexParams {
  const int32_t* indices;     // (num_heads, total_tokens, topk), -1 = unused slot
  const int32_t* cu_seqlens;  // (num_seqs + 1)
  int32_t* block_offsets;     // out (num_seqs + 1): first global block of each sequence
  int32_t* offsets;           // out (num_heads * max_blocks + 1)
  int32_t* rows;              // out (num_heads * total_tokens * topk): tokens, grouped by key
  int32_t* keys_in;           // workspace, as rows
  int32_t* keys_out;          // workspace, as rows
  int32_t* rows_in;           // workspace, as rows
  void* sort_temp;            // workspace for the radix sort
  size_t sort_temp_bytes;
  int num_heads;
  int total_tokens;
  int topk;
  int num_seqs;
  int block_size;
  int max_blocks;             // total_tokens / block_size + num_seqs: bound on the global blocks
};

}  // namespace msa

namespace msa {

// Index top-k (SPEC 2). q_idx (T, Hi, Di) and k_idx (T, Hki, Di) with 16-byte aligned rows.
struct IndexTopkParams {
  const void* q_idx;
  const void* k_idx;
  const int32_t* cu_seqlens;  // (num_seqs + 1)
  int32_t* indices;           // out (Hi, T, topk)
  int64_t q_stride_t, q_stride_h;  // in elements
  int64_t k_stride_t, k_stride_h;
  int total_tokens;
  int num_heads;              // Hi
  int num_key_heads;          // Hki
  int num_seqs;
  int max_seqlen;
  int topk;
  int block_size;
  float scale;                // index_scale
};

}  // namespace msa
