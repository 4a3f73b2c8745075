// Reverse index: for every (index head r, kv block b) the tokens whose selection holds b.
// A stable radix sort of (key, token) pairs in (r, token, slot) order keeps each key's tokens
// ascending, so the map (and everything that reduces over it) is deterministic.
#include <algorithm>

#include <cub/device/device_radix_sort.cuh>

#include "common/block_span.h"
#include "common/cuda_check.h"
#include "smxx/reverse_index/reverse_index.h"

namespace msa {
namespace {

// block_offsets[s] = sum over s' < s of ceil(len(s') / block_size). Sequences are few: one thread.
__global__ void reverse_index_block_offsets_kernel(const int32_t* cu, int32_t* block_offsets, int num_seqs,
                                                   int block_size) {
  if (blockIdx.x != 0 || threadIdx.x != 0) return;
  int32_t acc = 0;
  for (int s = 0; s < num_seqs; ++s) {
    block_offsets[s] = acc;
    acc += (cu[s + 1] - cu[s] + block_size - 1) / block_size;
  }
  block_offsets[num_seqs] = acc;
}

// One thread per (r, t, slot) of the tokens [token_begin, token_end). Entries that select nothing
// (-1, out of range, causally invisible, or a repeat of an earlier slot of the same row) get the
// sentinel key and sort to the end.
__global__ void reverse_index_keys_kernel(ReverseIndexParams p) {
  const int chunk = p.token_end - p.token_begin;
  const int64_t total = int64_t(p.num_heads) * chunk * p.topk;
  const int32_t sentinel = p.num_heads * p.max_blocks;
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < total;
       i += int64_t(gridDim.x) * blockDim.x) {
    const int slot = int(i % p.topk);
    const int64_t local_row = i / p.topk;  // r * chunk + t - token_begin
    const int t = p.token_begin + int(local_row % chunk);
    const int r = int(local_row / chunk);
    const int64_t e = (int64_t(r) * p.total_tokens + t) * p.topk + slot;
    const int lo = last_leq(p.cu_seqlens, p.num_seqs, t);  // sequence of token t
    // Its position: the sequence's queries are the last of its len_k keys (t - cu_seqlens[lo] when
    // cu_seqlens_k is cu_seqlens).
    const int pos = t - p.cu_seqlens[lo + 1] + (p.cu_seqlens_k[lo + 1] - p.cu_seqlens_k[lo]);
    const int local_block = pos / p.block_size;
    const int32_t b = p.dense ? slot : p.indices[e];
    bool valid = b >= 0 && b <= local_block;
    for (int j = 0; j < slot && valid && !p.dense; ++j) valid = p.indices[e - slot + j] != b;
    p.keys_in[i] = valid ? r * p.max_blocks + p.block_offsets[lo] + b : sentinel;
    p.rows_in[i] = p.emit_entries ? int32_t(i) : t;  // i: the chunk-local entry id
  }
}

// offsets[key] = first position of key in the sorted keys (whose sentinels, key num_keys, sort last);
// offsets[num_keys] = the entries with a key. Position i starts every key in (keys[i - 1], keys[i]] (keys[-1] =
// -1, keys[n] = num_keys): one pass over the sorted keys, O(n + num_keys) writes in all.
__global__ void reverse_index_offsets_kernel(const int32_t* sorted_keys, int64_t n, int32_t* offsets, int num_keys) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i <= n; i += int64_t(gridDim.x) * blockDim.x) {
    const int prev = i > 0 ? sorted_keys[i - 1] : -1;
    const int cur = i < n ? sorted_keys[i] : num_keys;
    for (int k = prev + 1; k <= cur; ++k) offsets[k] = int32_t(i);
  }
}

// The work list in one CTA (two passes over the keys in chunks of kListThreads): item_offsets (scan of the
// per-key item counts ceil(count / per_item)), items (key, first unit) and, with item_order != nullptr, the
// launch order: the full items first in key order, then the partial ones (at most one per key, its last) by
// size descending in kOrderBuckets classes (key order within a class), then the max_items - items idle slots
// (values >= the item count, which the kernels skip). Deterministic; the order only schedules (every item's
// work is the same wherever it runs).
constexpr int kListThreads = 1024;
constexpr int kOrderBuckets = 64;

__device__ __forceinline__ int order_bucket(int size, int per_item) {  // size in [1, per_item)
  return int(int64_t(size) * kOrderBuckets / per_item);
}

// Exclusive prefix sums of (x, y) over the CTA's kListThreads threads; *total: the CTA's sums (every thread).
__device__ __forceinline__ int2 cta_exclusive_sum(int2 v, int2* warp_sums, int2* total) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  int2 x = v;
  for (int o = 1; o < 32; o <<= 1) {
    const int a = __shfl_up_sync(~0u, x.x, o), b = __shfl_up_sync(~0u, x.y, o);
    if (lane >= o) x.x += a, x.y += b;
  }
  if (lane == 31) warp_sums[warp] = x;
  __syncthreads();
  if (warp == 0) {
    int2 w = warp_sums[lane];
    for (int o = 1; o < 32; o <<= 1) {
      const int a = __shfl_up_sync(~0u, w.x, o), b = __shfl_up_sync(~0u, w.y, o);
      if (lane >= o) w.x += a, w.y += b;
    }
    warp_sums[lane] = w;
  }
  __syncthreads();
  const int2 before = warp > 0 ? warp_sums[warp - 1] : make_int2(0, 0);
  *total = warp_sums[31];
  __syncthreads();  // warp_sums is reused by the next call
  return make_int2(before.x + x.x - v.x, before.y + x.y - v.y);
}

__global__ void __launch_bounds__(kListThreads)
    reverse_index_work_list_kernel(const int32_t* offsets, int32_t* item_offsets, int2* items, int32_t* item_order,
                                   int num_keys, int per_item, int max_items) {
  __shared__ int2 warp_sums[32];
  __shared__ int bucket_next[kOrderBuckets];              // next order slot of each class
  __shared__ int warp_class[32][kOrderBuckets];           // a chunk's partial items per (warp, class), then slots
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const bool order = item_order != nullptr;
  if (tid < kOrderBuckets) bucket_next[tid] = 0;
  __syncthreads();
  // Pass 1: item offsets, the item and full-item totals, the partial items per class.
  int2 sum = make_int2(0, 0);  // (items, full items) of the chunks so far; the same in every thread
  for (int base = 0; base < num_keys; base += kListThreads) {
    const int k = base + tid;
    const int units = k < num_keys ? offsets[k + 1] - offsets[k] : 0;
    const int n = (units + per_item - 1) / per_item, full = units / per_item;
    int2 total;
    const int2 ex = cta_exclusive_sum(make_int2(n, full), warp_sums, &total);
    if (k < num_keys) item_offsets[k] = sum.x + ex.x;
    if (order && n > full) atomicAdd(&bucket_next[order_bucket(units - full * per_item, per_item)], 1);
    sum.x += total.x, sum.y += total.y;
  }
  __syncthreads();  // the last chunk's class counts
  if (tid == 0) {
    item_offsets[num_keys] = sum.x;
    int at = sum.y;  // the partial items follow the full ones, largest class first
    for (int b = kOrderBuckets - 1; b >= 0; --b) {
      const int c = bucket_next[b];
      bucket_next[b] = at;
      at += c;
    }
  }
  __syncthreads();
  if (items == nullptr) return;
  // Pass 2: items and their launch slots.
  int2 done = make_int2(0, 0);
  for (int base = 0; base < num_keys; base += kListThreads) {
    const int k = base + tid;
    const int first_unit = k < num_keys ? offsets[k] : 0;
    const int units = k < num_keys ? offsets[k + 1] - first_unit : 0;
    const int n = (units + per_item - 1) / per_item, full = units / per_item;
    int2 total;
    const int2 ex = cta_exclusive_sum(make_int2(n, full), warp_sums, &total);
    const int first = done.x + ex.x;
    for (int c = 0; c < n; ++c) items[first + c] = make_int2(k, first_unit + c * per_item);
    if (order) {
      for (int c = 0; c < full; ++c) item_order[done.y + ex.y + c] = first + c;
      // The partial item's slot: its class's next slot plus its rank among the chunk's earlier partial items of
      // the class (earlier warps, then earlier lanes).
      const int cls = n > full ? order_bucket(units - full * per_item, per_item) : -1;
      for (int i = tid; i < 32 * kOrderBuckets; i += kListThreads) (&warp_class[0][0])[i] = 0;
      __syncthreads();
      const unsigned peers = __match_any_sync(~0u, cls);
      if (cls >= 0 && lane == __ffs(peers) - 1) warp_class[warp][cls] = __popc(peers);
      __syncthreads();
      if (tid < kOrderBuckets) {
        int at = bucket_next[tid];
        for (int w = 0; w < 32; ++w) {
          const int c = warp_class[w][tid];
          warp_class[w][tid] = at;
          at += c;
        }
        bucket_next[tid] = at;
      }
      __syncthreads();
      if (cls >= 0) item_order[warp_class[warp][cls] + __popc(peers & ((1u << lane) - 1u))] = first + full;
      __syncthreads();  // warp_class is cleared by the next chunk
    }
    done.x += total.x, done.y += total.y;
  }
  if (order) {
    for (int i = sum.x + tid; i < max_items; i += kListThreads) item_order[i] = i;
  }
}

int key_bits(int num_keys) {
  int bits = 1;
  while ((int64_t(1) << bits) <= num_keys) ++bits;
  return bits;
}

}  // namespace

size_t reverse_index_sort_bytes(int num_entries, int num_keys) {
  size_t bytes = 0;
  cub::DeviceRadixSort::SortPairs(nullptr, bytes, static_cast<int32_t*>(nullptr), static_cast<int32_t*>(nullptr),
                                  static_cast<int32_t*>(nullptr), static_cast<int32_t*>(nullptr), num_entries, 0,
                                  key_bits(num_keys));
  return bytes;
}

cudaError_t launch_block_offsets(const int32_t* cu_seqlens, int32_t* block_offsets, int num_seqs, int block_size,
                                 cudaStream_t stream) {
  reverse_index_block_offsets_kernel<<<1, 1, 0, stream>>>(cu_seqlens, block_offsets, num_seqs, block_size);
  return cudaGetLastError();
}

cudaError_t run_reverse_index(const ReverseIndexParams& p, cudaStream_t stream) {
  const int64_t n = int64_t(p.num_heads) * (p.token_end - p.token_begin) * p.topk;
  const int num_keys = p.num_heads * p.max_blocks;
  reverse_index_block_offsets_kernel<<<1, 1, 0, stream>>>(p.cu_seqlens_k, p.block_offsets, p.num_seqs, p.block_size);
  MSA_CUDA_TRY(cudaGetLastError());
  if (n > 0) {
    const int threads = 256;
    const int blocks = int((n + threads - 1) / threads < 65536 ? (n + threads - 1) / threads : 65536);
    reverse_index_keys_kernel<<<blocks, threads, 0, stream>>>(p);
    MSA_CUDA_TRY(cudaGetLastError());
    size_t bytes = p.sort_temp_bytes;
    MSA_CUDA_TRY(cub::DeviceRadixSort::SortPairs(p.sort_temp, bytes, p.keys_in, p.keys_out, p.rows_in, p.rows,
                                                 int(n), 0, key_bits(num_keys), stream));
  }
  const int threads = 256;
  const int64_t offset_blocks = std::min<int64_t>((n + 1 + threads - 1) / threads, 4096);
  reverse_index_offsets_kernel<<<int(offset_blocks), threads, 0, stream>>>(p.keys_out, n, p.offsets, num_keys);
  MSA_CUDA_TRY(cudaGetLastError());
  if (p.item_offsets != nullptr) {
    // The work list and, with item_order, its launch order (largest items first: a launch's tail is then made
    // of small items, and the CTAs end closer together across SMs).
    const bool order = p.items != nullptr && p.item_order != nullptr && p.max_items > 0;
    reverse_index_work_list_kernel<<<1, kListThreads, 0, stream>>>(p.offsets, p.item_offsets, p.items,
                                                                   order ? p.item_order : nullptr, num_keys,
                                                                   p.units_per_item, p.max_items);
  }
  return cudaGetLastError();
}

}  // namespace msa
