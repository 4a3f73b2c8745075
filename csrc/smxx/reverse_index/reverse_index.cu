// Reverse index: for every (index head r, kv block b) the tokens whose selection holds b.
// A stable radix sort of (key, token) pairs in (r, token, slot) order keeps each key's tokens
// ascending, so the map (and everything that reduces over it) is deterministic.
#include <algorithm>

#include <cub/device/device_radix_sort.cuh>
#include <cub/device/device_scan.cuh>

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
    p.rows_in[i] = p.emit_entries ? int32_t(e) : t;
  }
}

// First position of `key` in the sorted keys (lower bound).
__device__ __forceinline__ int32_t lower_bound_key(const int32_t* sorted_keys, int64_t n, int key) {
  int64_t lo = 0, hi = n;
  while (lo < hi) {
    const int64_t mid = (lo + hi) >> 1;
    if (sorted_keys[mid] < key) lo = mid + 1; else hi = mid;
  }
  return int32_t(lo);
}

// offsets[key] = first position of key in the sorted keys; offsets[num_keys] = count. With items != nullptr
// also items[key] = ceil(count(key) / per_item) and items[num_keys] = 0 (the scan turns it into the total).
__global__ void reverse_index_offsets_kernel(const int32_t* sorted_keys, int64_t n, int32_t* offsets,
                                             int32_t* items, int num_keys, int per_item) {
  const int key = blockIdx.x * blockDim.x + threadIdx.x;
  if (key > num_keys) return;
  const int32_t first = lower_bound_key(sorted_keys, n, key);
  offsets[key] = first;
  if (items != nullptr) {
    items[key] = key < num_keys ? (lower_bound_key(sorted_keys, n, key + 1) - first + per_item - 1) / per_item : 0;
  }
}

// Thread i: the items of key i (key, first unit), so kernels find their item in one load; with sizes !=
// nullptr also the sort keys and values of the launch order over max_items slots: an item's slot gets its
// unit count, the slots past the item count 0 (they sort last and hold values >= the count, which the
// kernels skip). The grid covers max(num_keys, max_items) threads.
__global__ void reverse_index_item_list_kernel(const int32_t* offsets, const int32_t* item_offsets, int2* items,
                                               int num_keys, int per_item, int max_items, int32_t* sizes,
                                               int32_t* vals) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < num_keys) {
    const int first = item_offsets[i], count = item_offsets[i + 1] - first;
    const int units = offsets[i + 1] - offsets[i];
    for (int c = 0; c < count; ++c) {
      items[first + c] = make_int2(i, offsets[i] + c * per_item);
      if (sizes != nullptr) {
        sizes[first + c] = min(per_item, units - c * per_item);
        vals[first + c] = first + c;
      }
    }
  }
  if (sizes != nullptr && i < max_items && i >= item_offsets[num_keys]) {
    sizes[i] = 0;
    vals[i] = i;
  }
}

int key_bits(int num_keys) {
  int bits = 1;
  while ((int64_t(1) << bits) <= num_keys) ++bits;
  return bits;
}

}  // namespace

size_t reverse_index_order_bytes(int max_items, int units_per_item) {
  size_t bytes = 0;
  cub::DeviceRadixSort::SortPairsDescending(nullptr, bytes, static_cast<int32_t*>(nullptr),
                                            static_cast<int32_t*>(nullptr), static_cast<int32_t*>(nullptr),
                                            static_cast<int32_t*>(nullptr), max_items, 0, key_bits(units_per_item));
  return bytes;
}

size_t reverse_index_scan_bytes(int num_keys) {
  size_t bytes = 0;
  cub::DeviceScan::ExclusiveSum(nullptr, bytes, static_cast<int32_t*>(nullptr), static_cast<int32_t*>(nullptr),
                                num_keys + 1);
  return bytes;
}

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
  const int key_blocks = (num_keys + 1 + threads - 1) / threads;
  const bool work_list = p.item_offsets != nullptr;
  // Offsets, and for a work list the per-key item counts (scanned in place below).
  reverse_index_offsets_kernel<<<key_blocks, threads, 0, stream>>>(p.keys_out, n, p.offsets,
                                                                   work_list ? p.item_offsets : nullptr, num_keys,
                                                                   p.units_per_item);
  MSA_CUDA_TRY(cudaGetLastError());
  if (work_list) {
    // In-place exclusive scan: item_offsets[num_keys] = number of items.
    size_t bytes = p.scan_temp_bytes;
    MSA_CUDA_TRY(cub::DeviceScan::ExclusiveSum(p.scan_temp, bytes, p.item_offsets, p.item_offsets, num_keys + 1,
                                               stream));
    if (p.items != nullptr) {
      // Largest items first (item_order): a launch's tail is then made of small items (a full item is up
      // to a tenth of an SM's work in a pass), and the launches end closer together across SMs.
      const bool order = p.item_order != nullptr && p.max_items > 0;
      const int list_threads = order ? std::max(num_keys, p.max_items) : num_keys;
      if (list_threads > 0) {
        reverse_index_item_list_kernel<<<(list_threads + threads - 1) / threads, threads, 0, stream>>>(
            p.offsets, p.item_offsets, p.items, num_keys, p.units_per_item, order ? p.max_items : 0,
            order ? p.order_keys : nullptr, p.order_vals);
        MSA_CUDA_TRY(cudaGetLastError());
      }
      if (order) {
        const int n_items = p.max_items;
        size_t obytes = p.order_temp_bytes;
        MSA_CUDA_TRY(cub::DeviceRadixSort::SortPairsDescending(p.order_temp, obytes, p.order_keys,
                                                               p.order_keys + n_items, p.order_vals, p.item_order,
                                                               n_items, 0, key_bits(p.units_per_item), stream));
      }
    }
  }
  return cudaGetLastError();
}

}  // namespace msa
