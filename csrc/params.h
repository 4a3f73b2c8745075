// Torch-free parameter structs: what a kernel launch needs, as plain pointers and sizes.
#pragma once
#include <cuda_runtime_api.h>  // int2

#include <cstddef>
#include <cstdint>

namespace msa {

// Reverse index (kv block -> tokens that selected it). See torch_bindings.cpp for the layout.
struct ReverseIndexParams {
  const int32_t* indices;     // (num_heads, total_tokens, topk), -1 = unused slot
  const int32_t* cu_seqlens;  // (num_seqs + 1) queries
  // (num_seqs + 1) keys: cu_seqlens itself where the keys have the queries' layout; else each sequence's
  // queries are the last positions of its keys (docs/semantics.md), and blocks are key blocks.
  const int32_t* cu_seqlens_k;
  int32_t* block_offsets;     // out (num_seqs + 1): first global (key) block of each sequence
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
  int max_blocks;             // key tokens / block_size + num_seqs: bound on the global blocks
  // Only the tokens [token_begin, token_end) enter (the sparse kernels work per query chunk); the
  // positions in rows/keys are then local to the chunk.
  int token_begin;
  int token_end;
  // rows hold the chunk's entry ids e = (r * chunk + t - token_begin) * topk + slot (chunk = token_end -
  // token_begin) instead of tokens (token and slot follow): int32 per chunk, whatever the sequence's length.
  bool emit_entries;
  // Dense (warmup, SPEC 5): no indices; slot b selects block b for every b up to the token's own.
  bool dense;
  // Work list (nullable): item_offsets[key] = sum over earlier keys of ceil(count / units_per_item);
  // item_offsets[num_keys] = number of items. Hot keys are split into items of <= units_per_item.
  int32_t* item_offsets;
  int2* items;                // (key, first unit) per item, nullable with item_offsets
  int units_per_item;
  // Launch order (nullable, with items): item_order[i] = the item CTA i runs, max_items slots: the full
  // items in key order, then the partial ones (one per key at most) by size descending in 64 classes (key
  // order within a class), then the unused slots (values >= the item count).
  int32_t* item_order;
  int max_items;
};

}  // namespace msa

namespace msa {

// Index top-k (SPEC 2). q_idx (T, Hi, Di) and k_idx (Tk, Hki, Di) with 16-byte aligned rows.
struct IndexTopkParams {
  const void* q_idx;
  const void* k_idx;
  const int32_t* cu_seqlens;    // (num_seqs + 1) queries
  const int32_t* cu_seqlens_k;  // (num_seqs + 1) keys (cu_seqlens itself: the queries' layout)
  int32_t* indices;           // out (Hi, T, topk)
  float* lse;                 // out (Hi, T): sm90::launch_index_lse only (warmup's lse_idx)
  // out (Hi, T), nullable, sm90::launch_index_topk only: each row's kept blocks (all but its own) as the
  // (max, sum) of 2^x of their index logits x = index_scale * q_idx . k_idx * log2(e), as the sparse
  // forward's stats pass writes per slot; (-inf, 0) when no block is kept.
  float2* sel_stats;
  int64_t q_stride_t, q_stride_h;  // in elements
  int64_t k_stride_t, k_stride_h;
  int total_tokens;
  int total_tokens_k;         // Tk (rows of k_idx)
  int num_heads;              // Hi
  int num_key_heads;          // Hki
  int num_seqs;
  int max_seqlen;
  int topk;
  int block_size;
  float scale;                // index_scale
  bool small_smem;            // the portable kernel's 64-row tile (81 KB at Di = 128: 99 KB GPUs; tests)
};

}  // namespace msa

namespace msa {

// The reverse index of one query chunk as the sparse kernels read it (see ReverseIndexParams).
struct SparseWork {
  const int32_t* offsets;        // (num_keys + 1) CSR over keys r * max_blocks + global block
  const int32_t* entries;        // the chunk's entry ids (r * chunk + t - chunk_begin) * topk + slot, grouped by
                                 // key, ascending
  const int32_t* item_offsets;   // (num_keys + 1) first item of each key
  const int2* items;             // (key, first unit) of each item: no search in the kernels
  // CTA -> item (nullable: CTA i runs item i): large items first, so a launch ends on small ones.
  const int32_t* item_order;
  const int32_t* block_offsets;  // (num_seqs + 1) first global block of each sequence
  int num_keys;
  int max_blocks;
  int units_per_item;
  int max_items;                 // grid size: an upper bound on item_offsets[num_keys]
};

// Sparse forward (SPEC 3) and the KL terms (SPEC 4), KV-outer. Two passes over the same work items of
// one query chunk [chunk_begin, chunk_begin + chunk_tokens): the stats pass writes per (entry, head)
// the running max and sum (log2 domain); after the stats combine has turned them into lse, the output
// pass writes per (entry, head) the partial output sum_j exp(s_j - lse) v_j and per entry the KL terms
// sum_j P (ln P - S_idx). An entry's local id is (r * chunk_tokens + t - chunk_begin) * topk + slot.
struct SparseFwdParams {
  const void* q;
  const void* k;
  const void* v;
  const void* q_idx;  // nullptr: no index branch (sparse_attention)
  const void* k_idx;
  int64_t q_stride_t, q_stride_h, k_stride_t, k_stride_h, v_stride_t, v_stride_h;
  int64_t qi_stride_t, qi_stride_h, ki_stride_t, ki_stride_h;  // in elements
  const int32_t* cu_seqlens;    // queries
  const int32_t* cu_seqlens_k;  // keys (k, v, k_idx rows; cu_seqlens itself: the queries' layout)
  SparseWork work;
  int total_tokens;
  int num_seqs;
  int topk;
  int block_size;
  int hq, hkv, hi, hki;
  int di;
  int chunk_begin;
  int chunk_tokens;
  float scale_log2;        // softmax_scale * log2(e)
  float index_scale;
  bool main_stats;         // stats pass: the main branch's (max, sum) too (false: lse is given)
  bool write_out;          // output pass: P V partials too (false: KL terms only)
  float2* stats;           // (entries, G): (max, sum) of the main logits, log2 domain, sum 0 = none
  float2* idx_stats;       // (entries): the same for the index logits
  // Stats pass: the index logits of each row's own block only (the top-k kernel gave its other blocks' (max, sum):
  // SparseCombineParams::sel_stats); a slot of another block gets (-inf, 1), "counted, adds nothing".
  bool idx_own_only;
  const float* lse;        // (Hq, T) natural log (output pass input)
  void* out_part;          // (entries, G, D) input dtype
  int64_t out_entries;     // entries out_part holds (the extent of the warp-specialized pass's TMA store map)
  float* kl_part;          // (entries)
  // Output pass, optional: the KL's index gradient for d_kl = 1 (SPEC 4): dsi = Pidx - Pm per (entry,
  // key) without its constant factor, and dq_idx = dqi_scale * sum over the entries of dsi K_idx.
  const float* lse_idx;    // (Hi, T) natural log
  void* dsi_part;          // (entries, 128) input dtype, row i = entry work.entries[i]; nullptr: none
  float* dqi_accum;        // (T, Hi, Di) fp32
  float dqi_scale;         // index_scale / rows
  // Deterministic mode (nullptr: off): dq_idx goes to dqi_accum (hi) and dqi_lo on the grid dqi_grid
  // (DetGrid below), exact sums in any order.
  float* dqi_lo;           // (T, Hi, Di) fp32
  const float4* dqi_grid;
  // The warp-specialized output pass with the index gradient also computes dk_idx (index dk folded in:
  // sm90::out_ws_fuses_index_dk): dki_accum (Tk, Hki, Di) fp32, or deterministic, dki_part[item] (128 x Di
  // fp32 per work item, IndexDkParams' form) for item_reduce.
  float* dki_accum;
  float* dki_part;
  int out_rows;            // rows per tile of the portable output pass: 128, or 64 (less shared memory)
  int fixed_gu;            // sm_90a output pass: 4 = the kernel compiled for Gu = 4 (J = 1), 0 = any
  // sm_90a output pass: the warp-specialized kernel (csrc/sm90/sparse_fwd/out_pass_ws.cuh) where it
  // applies (fixed_gu = 4, the index branch, write_out); false keeps the general one.
  bool out_ws;
  bool stats_ws;           // the same for the stats pass (csrc/sm90/sparse_fwd/stats_pass_ws.cuh), with out_ws
                           // (the host sets it only when MSA_FWD_WS_STATS=1)
  // Portable passes only (sm80::launch_sparse_fwd; the sm_90a launcher ignores it): the small-smem
  // configuration for GPUs with 99 KB of shared memory per block (sparse_smem_bytes(d, pass, 64, true);
  // out_rows is then ignored). Same work items, partials and combines.
  bool small_smem;
};

// dk_idx of the KL for d_kl = 1, over the entries of one chunk: per key, scale times the sum over its
// entries of dsi[entry, key j] * q_idx[token], added to dki_accum[block token j, index key head].
struct IndexDkParams {
  const void* q_idx;
  int64_t qi_stride_t, qi_stride_h;
  const void* dsi_part;
  const int32_t* cu_seqlens;
  const int32_t* cu_seqlens_k;
  SparseWork work;          // whole keys: offsets / entries / block_offsets
  float* dki_accum;         // (Tk, Hki, Di) fp32
  // Deterministic mode (nullptr: off): CTA i takes work item i of the chunk and stores its scaled sum
  // in dki_part[i] (128 x Di fp32) instead of adding it; item_reduce then adds the items in order.
  float* dki_part;
  float scale;              // index_scale / rows
  int num_seqs;
  int topk;
  int block_size;
  int hi, hki, di;
  int chunk_begin;          // work.entries are local to the chunk [chunk_begin, chunk_begin + chunk_tokens)
  int chunk_tokens;         // and bound the grid
};

// Combines the per-entry results of one chunk: lse (Hq, T) and lse_idx (Hi, T) from the stats;
// out (T, Hq, D) and the per-row KL (Hi, T) from the output pass.
struct SparseCombineParams {
  const float2* stats;
  const float2* idx_stats;  // nullable
  const float2* sel_stats;  // nullable, (Hi, T): each row's other slots' index (max, sum) (IndexTopkParams)
  const void* out_part;
  const float* kl_part;     // nullable
  float* lse;
  float* lse_idx;
  void* out;
  int64_t out_stride_t, out_stride_h;
  float* kl_rows;           // (Hi, T)
  bool main;                // combine the main lse (false: it was given)
  int total_tokens;
  int topk;
  int hq, hi;
  int chunk_begin;
  int chunk_tokens;
};

}  // namespace msa

namespace msa {

// Sparse backward of the main branch (SPEC 3): dq, dk, dv accumulate in fp32 buffers (contiguous
// (T, Hq, D) and (T, Hkv, D)); the reverse index gives, per key, the tokens that selected the block, and
// its work list splits a key's tokens into items of at most units_per_item (one CTA each).
enum WsTmaMode : int { kWsTmaOff = 0, kWsTmaOn = 1, kWsTmaAuto = 2 };

struct SparseBwdParams {
  const void* q;
  const void* k;
  const void* v;
  const void* dout;
  int64_t q_stride_t, q_stride_h, k_stride_t, k_stride_h, v_stride_t, v_stride_h, do_stride_t, do_stride_h;
  const float* lse;    // (Hq, T) natural log
  const float* delta;  // (Hq, T) rowsum(dO * O)
  const int32_t* cu_seqlens;
  const int32_t* cu_seqlens_k;   // keys: dk_accum, dv_accum are (Tk, Hkv, D)
  const int32_t* offsets;        // (Hi * max_blocks + 1)
  const int32_t* tokens;         // tokens per key, ascending
  const int32_t* block_offsets;  // (num_seqs + 1)
  const int32_t* item_offsets;   // (num_keys + 1): item_offsets[num_keys] = number of items
  const int2* items;             // (key, first row) per item: hot keys split into several CTAs
  const int32_t* item_order;     // CTA -> item (nullable: CTA i runs item i), large items first
  int num_keys;
  int units_per_item;
  int max_items;                 // grid size: an upper bound on item_offsets[num_keys]
  float* dq_accum;
  float* dk_accum;
  float* dv_accum;
  // Deterministic mode (nullptr: off): dQ goes to dq_accum (hi) and dq_lo on the grid dq_grid (exact
  // sums in any order, DetGrid below); each item's dK (scaled) and dV go to dkv_part[item * J + j]
  // ((2, 128, D) fp32) instead of the accumulators, and item_reduce adds them in item order.
  float* dq_lo;
  const float4* dq_grid;
  float* dkv_part;
  int total_tokens;
  int num_seqs;
  int block_size;
  int max_blocks;
  int hq, hkv, hi;
  float scale;       // softmax_scale
  float scale_log2;  // softmax_scale * log2(e)
  // Portable kernel only (sm80::launch_sparse_bwd; the sm_90a launcher ignores it): the small-smem
  // configuration for GPUs with 99 KB of shared memory per block (sparse_smem_bytes(d, 2, 128, true)).
  // Same work items, accumulators and deterministic partials.
  bool small_smem;
  // sm_90a: the warp-specialized kernel (csrc/sm90/sparse_bwd/sparse_bwd_ws.cuh; the host sets it in both modes
  // unless MSA_BWD_WS=0); false: the general one.
  bool ws;
  // How the warp-specialized kernel gathers Q and dO: as TMA boxes of a unit's Gu heads, or by 16-byte cp.async
  // copies. kWsTmaAuto (the host's default): TMA where Gu is 4 or 8 (at Gu = 1 its 64 boxes of 128 B per panel
  // cost 40% of the kernel at 32K, at Gu = 2 it is even; s47, sparse_bwd_bench); kWsTmaOn (MSA_BWD_WS_TMA=1):
  // TMA where Gu is 1, 2, 4 or 8; kWsTmaOff (MSA_BWD_WS_TMA=0): cp.async. TMA also needs tensors it can describe.
  int ws_tma;
};

// delta[h, t] = sum_d dout[t, h, d] * out[t, h, d] (the backward's preprocess).
struct BwdDeltaParams {
  const void* out;
  const void* dout;
  int64_t o_stride_t, o_stride_h, do_stride_t, do_stride_h;
  float* delta;
  int total_tokens;
  int hq;
  int d;
};

}  // namespace msa

namespace msa {

// Deterministic mode (bitwise reproducible gradients). A sum that many CTAs add to in an arbitrary order
// is made exact: each fp32 contribution x is split on a fixed grid into hi = rint(x / u) u and
// lo = rint((x - hi) / w) w, added to two fp32 accumulators. u and w are powers of two chosen from a
// bound B on the sum of |x| over an element's contributions and their count n: every partial sum of the
// hi parts is a multiple of u below 2^24 u, and of the lo parts a multiple of w below 2^24 w, so both
// are exact and independent of the order. x is kept to w / 2 (about 2^-40 B for n = 32).
// grid = (1 / u, u, 1 / w, w); u = 0: no grid (B could not be bounded: plain, order-dependent sums).
struct DetGridParams {
  const unsigned* amax;  // finite max |x| of the inputs, as fp32 bits (absmax_kernel)
  float4* grid;          // out
  int mode;              // 0: B = factor a0 (a1 + a2) a3 (dQ);  1: B = factor a0 (dq_idx)
  double factor;
  int n_max;             // contributions per element
};

// Finite max |x| of a (rows, heads, dim) bf16/fp16 tensor with strides (stride_t, stride_h, 1), as the
// fp32 bit pattern (non-negative floats order as unsigned ints), atomically max-ed into *out.
struct AbsMaxParams {
  const void* x;
  int64_t rows, stride_t, stride_h;
  int heads, dim;
  unsigned* out;
};

// Adds per-item partial sums into an accumulator in a fixed order (deterministic mode): for output head
// o and global block gb, over the keys (index group r, gb) whose heads map to o, over each key's items
// in order, sum part[(item * J + j) * ntensors + n] (128 x width fp32, the block's rows) and add it to
// out[n] (T, hout, width) fp32 at the block's tokens. Hi >= hout: keys r in [o Hi / hout, +Hi / hout),
// j = 0 (J = 1); Hi < hout: r = o / J, j = o % J with J = hout / Hi.
struct ItemReduceParams {
  const float* part;
  const int32_t* item_offsets;   // (num_keys + 1)
  const int32_t* block_offsets;  // (num_seqs + 1)
  const int32_t* cu_seqlens;
  const int32_t* cu_seqlens_k;   // the rows of out: key rows
  float* out[2];
  int ntensors;
  int width;
  int hi, hout;
  int num_seqs, max_blocks, block_size;
};

}  // namespace msa

namespace msa {

// Warmup's dense KL pass on Hopper (csrc/sm90/dense_kl): SPEC 4 over the full causal set, given the main
// branch's lse and lse_idx (from the dense attention forward). One CTA per (128-key tile, chunk of
// query tiles, index-key head); every index group of that key head in turn.
struct DenseKlParams {
  const void* q;      // (T, Hq, D)
  const void* k;      // (Tk, Hkv, D)
  const void* q_idx;  // (T, Hi, Di)
  const void* k_idx;  // (Tk, Hki, Di)
  int64_t q_stride_t, q_stride_h, k_stride_t, k_stride_h;  // in elements
  int64_t qi_stride_t, qi_stride_h, ki_stride_t, ki_stride_h;
  const int32_t* cu_seqlens;    // (S + 1) queries
  const int32_t* cu_seqlens_k;  // (S + 1) keys (cu_seqlens itself: the queries' layout)
  const int32_t* tile_offsets;  // (S + 1): first key tile of each sequence (launch_block_offsets of cu_seqlens_k)
  const float* lse;             // (Hq, T) natural log
  const float* lse_idx;         // (Hi, T) natural log
  float* dq_idx;                // (T, Hi, Di) fp32, accumulated (zeroed by the caller); nullable: no grad
  float* dk_idx;                // (Tk, Hki, Di) fp32, accumulated (zeroed by the caller); with dq_idx
  unsigned long long* kl_fixed;  // (Hi, T) KL row sums (log2 units) in fixed point 2^-32, zeroed
  unsigned int* kl_bad;          // (Hi, T) nonzero: a non-finite partial sum reached the row, zeroed
  int total_tokens;    // T (query rows)
  int num_seqs;
  int num_tiles;       // >= tile_offsets[S] (Tk / key tile + S); grid.x = num_tiles * max_chunks, grid.y = Hki
  int chunk_tiles;     // 64-row query tiles per CTA
  int max_chunks;      // ceil(ceil(max_seqlen / 64) / chunk_tiles)
  int chunk_major;     // grid order: 0 = tile * max_chunks + chunk, a tile's chunks counted from its first visible
                       // query tile; 1 = chunk * num_tiles + tile, chunks aligned to query tiles [c, c + 1) * chunk_tiles
  int ws;              // 1: an index warpgroup takes dK_idx, dQ_idx and the KL rows (three warpgroups); 0: two
  int hq, hkv, hi, hki;
  float scale_log2;    // softmax_scale * log2(e)
  float iscale_log2;   // index_scale * log2(e)
  float grad_scale;    // index_scale / (T * Hi): d kl / d S_idx = (Pidx - P) / rows, times d S_idx / d q_idx
};

}  // namespace msa
