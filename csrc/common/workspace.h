// Torch-free sizes, chunking and configuration choices of the sparse ops: what csrc/api computes around
// its launches, as plain functions, so the C++ microbenchmarks (benchmarks/cpp) size and fill their
// workspaces exactly as the torch ops do. Host code only; the functions below call the kernels'
// own size queries (reverse_index_*_bytes, sparse_smem_bytes), so they link against the kernel objects.
#pragma once
#include <cuda_runtime_api.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>

#include "params.h"
#include "sm80/sparse_fwd/sparse_fwd.h"
#include "smxx/reverse_index/reverse_index.h"

namespace msa {

// The ops' defaults (csrc/api applies its environment overrides on top: MSA_PARTIAL_BUDGET,
// MSA_FWD_UNITS_PER_ITEM, MSA_BWD_UNITS_PER_ITEM; benchmarks/NOTES_history.md s25 / s30 for the values).
constexpr int64_t kFwdPartialBudget = int64_t(1) << 30;  // bytes of per-entry partials per forward chunk
constexpr int kFwdUnitsPerItem = 512;                    // units per forward work item (<= kFwdMaxItemUnits)
constexpr int64_t kBwdUnitsPerItem = 2048;               // tokens per backward work item (long sequences)
constexpr int64_t kBwdUnitsPerItemShort = 1024;          // ... up to kBwdShortEntries selection entries
constexpr int64_t kBwdShortEntries = int64_t(1) << 20;   // Hi * T * topk: N = 16K in the bench configuration
static_assert(kFwdUnitsPerItem <= sm80::kFwdMaxItemUnits, "the kernel's unit tables hold kFwdMaxItemUnits");

// Tokens per backward work item for a selection of `entries` = Hi * T * topk slots: half-size items up to
// kBwdShortEntries, so a short step still has several items per SM to balance (bench configuration, one call,
// fwd+bwd: 8K 2.974 -> 2.787 ms with 1024, 2.855 with 512; 16K 5.743 -> 5.642; benchmarks/NOTES.md s25).
inline int64_t bwd_units_per_item(int64_t entries) {
  return entries <= kBwdShortEntries ? kBwdUnitsPerItemShort : kBwdUnitsPerItem;
}

// The forward's partial budget: kFwdPartialBudget, or where the forward computes the index gradients
// (index_grad: training the indexer, so a backward follows) at least 8 T Hq D bytes, twice the
// backward's fp32 dq accumulator. In the bench configuration (Hq = 16, Hkv = 2) the backward's measured
// workspace is that large (1.99 GiB at 128K, where 8 T Hq D = 2 GiB), so fewer forward chunks cost no
// peak memory there (fwd+bwd 61.5 -> 59.9 ms at 128K, workspace 1.99 GiB either way; benchmarks/NOTES.md
// s15); this is measured, not a bound: a layout whose backward needs less can see a higher fwd+bwd peak.
// Shorter N keeps 1 GiB.
inline int64_t fwd_partial_budget(int64_t tokens, int64_t hq, int64_t d, bool training) {
  return training ? std::max(kFwdPartialBudget, tokens * hq * d * 8) : kFwdPartialBudget;
}

// ---- reverse index -------------------------------------------------------------------------------------

// Work items of `entries` entries over `num_keys` keys, at most `units_per_item` entries each: the sum over keys
// of ceil(count / per_item) <= entries / per_item + the keys with an entry, and those are at most
// min(num_keys, entries) (with few queries over many key blocks, the second term keeps the grid and the
// deterministic partials from growing with the keys; only idle CTAs change otherwise).
inline int64_t max_work_items(int64_t entries, int64_t units_per_item, int64_t num_keys) {
  return entries / units_per_item + std::min(num_keys, entries);
}

// Element counts and workspace bytes of one reverse index over `heads` x `tokens` x `topk` slots (query
// tokens) of keys from `tokens_k` key rows, with room for `capacity` entries (all of them, or one query
// chunk's); units_per_item > 0 adds the work list and `order` its launch order.
struct ReverseIndexSizes {
  int64_t heads = 0, tokens = 0, topk = 0, num_seqs = 0, block_size = 0;
  int64_t capacity = 0;
  int64_t max_blocks = 0;      // tokens_k / block_size + num_seqs: bound on the global (key) blocks
  int64_t num_keys = 0;        // heads * max_blocks
  int64_t units_per_item = 0;  // 0: no work list
  int64_t max_items = 0;       // max_work_items(capacity, units_per_item, num_keys) (work list), else 0
  bool order = false;          // item_order (needs the work list)
  size_t sort_bytes = 0;  // the radix sort's temporaries
  size_t temp_bytes() const { return sort_bytes; }
};

inline ReverseIndexSizes reverse_index_sizes(int64_t heads, int64_t tokens, int64_t tokens_k, int64_t topk,
                                             int64_t num_seqs, int64_t block_size, int64_t capacity,
                                             int64_t units_per_item, bool order) {
  ReverseIndexSizes s;
  s.heads = heads;
  s.tokens = tokens;
  s.topk = topk;
  s.num_seqs = num_seqs;
  s.block_size = block_size;
  s.capacity = capacity;
  s.max_blocks = tokens_k / block_size + num_seqs;
  s.num_keys = heads * s.max_blocks;
  s.units_per_item = units_per_item > 0 ? units_per_item : 0;
  s.order = s.units_per_item > 0 && order;
  s.max_items = s.units_per_item > 0 ? max_work_items(capacity, s.units_per_item, s.num_keys) : 0;
  s.sort_bytes = reverse_index_sort_bytes(int(capacity), int(s.num_keys));
  return s;
}

// Keys of the queries' layout.
inline ReverseIndexSizes reverse_index_sizes(int64_t heads, int64_t tokens, int64_t topk, int64_t num_seqs,
                                             int64_t block_size, int64_t capacity, int64_t units_per_item,
                                             bool order) {
  return reverse_index_sizes(heads, tokens, tokens, topk, num_seqs, block_size, capacity, units_per_item, order);
}

// Device buffers of one reverse index, in elements of ReverseIndexSizes s (nullptr where not needed).
struct ReverseIndexBuffers {
  int32_t* offsets = nullptr;        // s.num_keys + 1
  int32_t* rows = nullptr;           // s.capacity
  int32_t* block_offsets = nullptr;  // s.num_seqs + 1
  int32_t* keys = nullptr;           // 2 * s.capacity (workspace)
  int32_t* rows_in = nullptr;        // s.capacity (workspace)
  void* temp = nullptr;              // s.temp_bytes() (workspace)
  int32_t* item_offsets = nullptr;   // s.num_keys + 1 (work list)
  int2* items = nullptr;             // s.max_items (work list)
  int32_t* order = nullptr;          // s.max_items: the launch order
};

// The params every build over these buffers shares: the whole token range, rows = tokens (callers set
// token_begin / token_end, emit_entries and dense for a chunk of the forward). cu_seqlens_k: the keys'
// layout, nullptr for the queries' (then cu_seqlens itself, ReverseIndexParams).
inline ReverseIndexParams reverse_index_params(const ReverseIndexSizes& s, const ReverseIndexBuffers& b,
                                               const int32_t* indices, const int32_t* cu_seqlens,
                                               const int32_t* cu_seqlens_k = nullptr) {
  ReverseIndexParams p{};
  p.indices = indices;
  p.cu_seqlens = cu_seqlens;
  p.cu_seqlens_k = cu_seqlens_k ? cu_seqlens_k : cu_seqlens;
  p.block_offsets = b.block_offsets;
  p.offsets = b.offsets;
  p.rows = b.rows;
  p.keys_in = b.keys;
  p.keys_out = b.keys + s.capacity;
  p.rows_in = b.rows_in;
  p.sort_temp = b.temp;
  p.sort_temp_bytes = s.sort_bytes;
  p.num_heads = int(s.heads);
  p.total_tokens = int(s.tokens);
  p.topk = int(s.topk);
  p.num_seqs = int(s.num_seqs);
  p.block_size = int(s.block_size);
  p.max_blocks = int(s.max_blocks);
  p.token_begin = 0;
  p.token_end = int(s.tokens);
  if (s.units_per_item > 0) {
    p.item_offsets = b.item_offsets;
    p.items = b.items;
    p.units_per_item = int(s.units_per_item);
    p.max_items = int(s.max_items);
    if (s.order) p.item_order = b.order;
  }
  return p;
}

// Byte offsets of the parts of one device allocation: each part starts 256-byte aligned (cub's temporaries and
// every vector access of the kernels are satisfied by that).
struct BytePlan {
  size_t total = 0;
  size_t add(size_t bytes) {
    const size_t at = total;
    total += (bytes + 255) / 256 * 256;
    return at;
  }
};

// Where the buffers of one reverse index (ReverseIndexBuffers) lie: the outputs (what kernels read after the
// build) in one allocation, the build's workspace (keys, rows_in, temp) in another or in the same one.
struct ReverseIndexLayout {
  size_t offsets = 0, rows = 0, block_offsets = 0, item_offsets = 0, items = 0, order = 0;  // in `out`
  size_t keys = 0, rows_in = 0, temp = 0;                                                  // in `work`
};
inline ReverseIndexLayout reverse_index_layout(const ReverseIndexSizes& s, BytePlan& out, BytePlan& work) {
  constexpr size_t i4 = sizeof(int32_t);
  ReverseIndexLayout l;
  l.offsets = out.add(size_t(s.num_keys + 1) * i4);
  l.rows = out.add(size_t(s.capacity) * i4);
  l.block_offsets = out.add(size_t(s.num_seqs + 1) * i4);
  if (s.units_per_item > 0) {
    l.item_offsets = out.add(size_t(s.num_keys + 1) * i4);
    l.items = out.add(size_t(s.max_items) * 2 * i4);
    if (s.order) l.order = out.add(size_t(s.max_items) * i4);
  }
  l.keys = work.add(size_t(2 * s.capacity) * i4);
  l.rows_in = work.add(size_t(s.capacity) * i4);
  l.temp = work.add(s.temp_bytes());
  return l;
}
inline ReverseIndexBuffers reverse_index_buffers(const ReverseIndexSizes& s, const ReverseIndexLayout& l, char* out,
                                                 char* work) {
  auto at = [](char* base, size_t off) { return reinterpret_cast<int32_t*>(base + off); };
  ReverseIndexBuffers b;
  b.offsets = at(out, l.offsets);
  b.rows = at(out, l.rows);
  b.block_offsets = at(out, l.block_offsets);
  if (s.units_per_item > 0) {
    b.item_offsets = at(out, l.item_offsets);
    b.items = reinterpret_cast<int2*>(at(out, l.items));
    if (s.order) b.order = at(out, l.order);
  }
  b.keys = at(work, l.keys);
  b.rows_in = at(work, l.rows_in);
  b.temp = work + l.temp;
  return b;
}

// The reverse index as the sparse forward's kernels read it (max_items: set per chunk).
inline SparseWork sparse_work(const ReverseIndexParams& rp) {
  SparseWork w{};
  w.offsets = rp.offsets;
  w.entries = rp.rows;
  w.item_offsets = rp.item_offsets;
  w.items = rp.items;
  w.item_order = rp.item_order;
  w.block_offsets = rp.block_offsets;
  w.num_keys = rp.num_heads * rp.max_blocks;
  w.max_blocks = rp.max_blocks;
  w.units_per_item = rp.units_per_item;
  w.max_items = rp.max_items;
  return w;
}

// ---- sparse forward: query chunks ----------------------------------------------------------------------

// Bytes of per-entry workspace per query token of the forward: output partials and main stats (unless
// kl_only), index stats and KL partials (32), dsi partials (index grad), deterministic dk_idx partials.
inline int64_t fwd_bytes_per_token(int64_t hi, int64_t topk, int64_t g, int64_t d, int64_t elem_bytes, bool kl_only,
                                   bool grad, bool det, int64_t di, int64_t units_per_item) {
  return hi * topk *
         ((kl_only ? 0 : g * (d * elem_bytes + 8)) + 32 + (grad ? 256 : 0) +
          (det ? (128 * di * 4 + units_per_item - 1) / units_per_item : 0));
}

// Tokens per query chunk: the chunk's partials fit the budget (at least one token).
inline int64_t fwd_chunk_tokens(int64_t tokens, int64_t bytes_per_token, int64_t budget) {
  return std::max<int64_t>(1, std::min<int64_t>(tokens, budget / bytes_per_token));
}

// The sm_90a output pass compiled for Gu = 4 heads per unit applies at J = 1, G = 4 (SparseFwdParams::fixed_gu).
inline int fwd_fixed_gu(int64_t g, int64_t j) { return j == 1 && g == 4 ? 4 : 0; }

// ---- portable kernels' configuration from the GPU's opt-in shared memory per block ---------------------

// The small-smem (99 KB) configuration of the portable forward passes.
inline bool fwd_small_smem(int64_t smem_optin, int d) {
  return smem_optin < std::max(sm80::sparse_smem_bytes(d, 0), sm80::sparse_smem_bytes(d, 1, 64));
}
// Rows per tile of the portable output pass: 128 where the shared memory allows, else 64.
inline int fwd_out_rows(int64_t smem_optin, int d) {
  return smem_optin >= sm80::sparse_smem_bytes(d, 1, 128) ? 128 : 64;
}
// The small-smem configuration of the portable backward.
inline bool bwd_small_smem(int64_t smem_optin, int d) { return smem_optin < sm80::sparse_smem_bytes(d, 2); }

// Whether `device` is an sm_90 GPU (the Hopper kernels run there when the build has them: MSA_WITH_SM90).
inline bool device_is_sm90(int device) {
  int major = 0, minor = 0;
  if (cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device) != cudaSuccess) return false;
  if (cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, device) != cudaSuccess) return false;
  return major == 9 && minor == 0;
}

}  // namespace msa
