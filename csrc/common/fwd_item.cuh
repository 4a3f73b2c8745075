// A sparse forward work item (SparseWork, params.h) as the forward passes' CTAs read it: one kv block of
// one index group and up to units_per_item of the units (reverse-index entries) that selected it.
#pragma once
#include "common/block_span.h"
#include "params.h"

namespace msa {

struct FwdItem {
  int item;       // the work item's id (deterministic partials are per item)
  int r;          // index group
  int u_begin;    // first unit: position in work.entries
  int n_units;    // units of the item
  BlockSpan span;  // the kv block in the packed sequences
};

// The item of this CTA (work.item_order: largest first); false past the last item (the grid is an upper
// bound on the items).
__device__ __forceinline__ bool fwd_item(const SparseFwdParams& p, FwdItem& f) {
  const SparseWork& w = p.work;
  const int item = w.item_order != nullptr ? w.item_order[blockIdx.x] : int(blockIdx.x);
  if (item >= w.item_offsets[w.num_keys]) return false;
  const int2 it = w.items[item];
  f.item = item;
  const int key = it.x;
  f.u_begin = it.y;
  f.n_units = min(f.u_begin + w.units_per_item, w.offsets[key + 1]) - f.u_begin;
  f.r = key / w.max_blocks;
  f.span = block_span(w.block_offsets, p.cu_seqlens, p.cu_seqlens_k, p.num_seqs, key % w.max_blocks, p.block_size);
  return true;
}

// The item's unit table in shared memory, by threads i0, i0 + step, ...: per unit its chunk-local entry id
// ((r * chunk_tokens + t - chunk_begin) * topk + slot) and its token t.
__device__ __forceinline__ void load_unit_table(const SparseFwdParams& p, const FwdItem& f, int* sEntry, int* sTok,
                                                int i0, int step) {
  for (int i = i0; i < f.n_units; i += step) {
    const int e = p.work.entries[f.u_begin + i];  // chunk-local (ReverseIndexParams::emit_entries)
    sEntry[i] = e;
    sTok[i] = p.chunk_begin + (e / p.topk) % p.chunk_tokens;
  }
}

}  // namespace msa
