// msa::reverse_index on CUDA: argument checks, allocation, params, launch.
#include <algorithm>
#include <tuple>

#include "api/checks.h"
#include "api/dispatch.h"
#include "api/ops.h"
#include "sm80/reverse_index/reverse_index.h"

namespace msa::api {

bool item_order_enabled() { return !env_is("MSA_ITEM_ORDER", "0"); }

ReverseIndex alloc_reverse_index(const Tensor& indices, const Tensor& cu_seqlens, int64_t topk,
                                 int64_t block_size, int64_t capacity, int64_t units_per_item) {
  const int64_t heads = indices.size(0), tokens = indices.size(1);
  const int64_t num_seqs = cu_seqlens.size(0) - 1;
  const int64_t max_blocks = tokens / block_size + num_seqs;
  const int64_t num_keys = heads * max_blocks;
  const Tensor& like = indices;
  ReverseIndex ri;
  ri.max_blocks = max_blocks;
  ri.offsets = empty({num_keys + 1}, kInt, like);
  ri.rows = empty({capacity}, kInt, like);
  ri.block_offsets = empty({num_seqs + 1}, kInt, like);
  ri.keys = empty({2, capacity}, kInt, like);
  ri.rows_in = empty({capacity}, kInt, like);
  const size_t sort_bytes = reverse_index_sort_bytes(int(capacity), int(num_keys));
  const size_t scan_bytes = units_per_item > 0 ? reverse_index_scan_bytes(int(num_keys)) : 0;
  const bool order = units_per_item > 0 && item_order_enabled();
  const int64_t max_items = units_per_item > 0 ? capacity / units_per_item + num_keys : 0;
  const size_t order_bytes = order ? reverse_index_order_bytes(int(max_items), int(units_per_item)) : 0;
  ri.temp = empty({int64_t(std::max({sort_bytes, scan_bytes, order_bytes}))}, kByte, like);

  ReverseIndexParams& p = ri.params;
  p.indices = ptr<int32_t>(indices);
  p.cu_seqlens = ptr<int32_t>(cu_seqlens);
  p.block_offsets = ptr<int32_t>(ri.block_offsets);
  p.offsets = ptr<int32_t>(ri.offsets);
  p.rows = ptr<int32_t>(ri.rows);
  p.keys_in = ptr<int32_t>(ri.keys);
  p.keys_out = ptr<int32_t>(ri.keys) + capacity;
  p.rows_in = ptr<int32_t>(ri.rows_in);
  p.sort_temp = ri.temp.data_ptr();
  p.sort_temp_bytes = sort_bytes;
  p.num_heads = int(heads);
  p.total_tokens = int(tokens);
  p.topk = int(topk);
  p.num_seqs = int(num_seqs);
  p.block_size = int(block_size);
  p.max_blocks = int(max_blocks);
  p.token_begin = 0;
  p.token_end = int(tokens);
  if (units_per_item > 0) {
    // The work list: sum over keys of ceil(count / per_item) <= capacity / per_item + num_keys items.
    ri.units_per_item = units_per_item;
    ri.max_items = max_items;
    ri.item_offsets = empty({num_keys + 1}, kInt, like);
    ri.items = empty({ri.max_items, 2}, kInt, like);
    p.item_offsets = ptr<int32_t>(ri.item_offsets);
    p.items = reinterpret_cast<int2*>(ptr<int32_t>(ri.items));
    p.units_per_item = int(units_per_item);
    p.scan_temp = ri.temp.data_ptr();
    p.scan_temp_bytes = scan_bytes;
    p.max_items = int(max_items);
    if (order) {
      ri.order = empty({4 * max_items}, kInt, like);
      p.item_order = ptr<int32_t>(ri.order);
      p.order_keys = p.item_order + max_items;
      p.order_vals = p.item_order + 3 * max_items;
      p.order_temp = ri.temp.data_ptr();
      p.order_temp_bytes = order_bytes;
    }
  }
  return ri;
}

ReverseIndex build_reverse_index(const Tensor& indices, const SeqMap& seqs, int64_t block_size,
                                 int64_t units_per_item) {
  check_cuda_int32(indices, "indices", 3);
  MSA_CHECK(block_size == 64 || block_size == 128, "block_size: expected 64 or 128, got ", block_size);
  const int64_t heads = indices.size(0), tokens = indices.size(1), topk = indices.size(2);
  const int64_t num_seqs = seqs.num_seqs;
  const int64_t max_blocks = tokens / block_size + num_seqs;
  const int64_t entries = heads * tokens * topk;
  const int64_t num_keys = heads * max_blocks;
  MSA_CHECK(entries < (int64_t(1) << 31) && num_keys < (int64_t(1) << 30),
                    "indices: too many entries for the int32 reverse index, shape ", shape(indices));

  const DeviceGuard guard(indices.get_device_index());
  ReverseIndex ri = alloc_reverse_index(indices, seqs.cu, topk, block_size, entries, units_per_item);
  MSA_LAUNCH_CHECK(run_reverse_index(ri.params, current_stream(indices)), "reverse_index");
  // Only the outputs outlive the build: the workspace goes back to the caching allocator now (stream
  // ordered), not when the caller (the backward) drops the result.
  ri.keys = Tensor();
  ri.rows_in = Tensor();
  ri.temp = Tensor();
  ri.params = ReverseIndexParams{};
  return ri;
}

std::tuple<Tensor, Tensor, Tensor> reverse_index_cuda(const Tensor& indices, const std::optional<Tensor>& cu_seqlens,
                                                      int64_t max_seqlen, int64_t block_size) {
  check_cuda_int32(indices, "indices", 3);
  ReverseIndex ri = build_reverse_index(indices, seq_map(cu_seqlens, indices.size(1), max_seqlen, indices),
                                        block_size, 0);
  return {ri.offsets, ri.rows, ri.block_offsets};
}

STABLE_TORCH_LIBRARY_IMPL(msa, CUDA, m) { m.impl("reverse_index", TORCH_BOX(&reverse_index_cuda)); }

}  // namespace msa::api
