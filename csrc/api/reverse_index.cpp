// msa::reverse_index on CUDA: argument checks, allocation, params, launch.
#include <algorithm>
#include <tuple>

#include "api/checks.h"
#include "api/dispatch.h"
#include "api/ops.h"
#include "common/workspace.h"
#include "smxx/reverse_index/reverse_index.h"

namespace msa::api {

bool item_order_enabled() { return !env_is("MSA_ITEM_ORDER", "0"); }

ReverseIndex alloc_reverse_index(const Tensor& indices, const SeqMap& seqs, int64_t topk, int64_t block_size,
                                 int64_t capacity, int64_t units_per_item) {
  // Sizes and params: csrc/common/workspace.h (shared with the C++ microbenchmarks).
  const ReverseIndexSizes s = reverse_index_sizes(indices.size(0), indices.size(1), seqs.total_k, topk,
                                                  seqs.num_seqs, block_size, capacity, units_per_item,
                                                  item_order_enabled());
  const Tensor& like = indices;
  ReverseIndex ri;
  ri.max_blocks = s.max_blocks;
  ri.offsets = empty({s.num_keys + 1}, kInt, like);
  ri.rows = empty({s.capacity}, kInt, like);
  ri.block_offsets = empty({s.num_seqs + 1}, kInt, like);
  ri.keys = empty({2, s.capacity}, kInt, like);
  ri.rows_in = empty({s.capacity}, kInt, like);
  ri.temp = empty({int64_t(s.temp_bytes())}, kByte, like);
  if (s.units_per_item > 0) {
    ri.units_per_item = s.units_per_item;
    ri.max_items = s.max_items;
    ri.item_offsets = empty({s.num_keys + 1}, kInt, like);
    ri.items = empty({s.max_items, 2}, kInt, like);
    if (s.order) ri.order = empty({4 * s.max_items}, kInt, like);
  }
  ReverseIndexBuffers b;
  b.offsets = ptr<int32_t>(ri.offsets);
  b.rows = ptr<int32_t>(ri.rows);
  b.block_offsets = ptr<int32_t>(ri.block_offsets);
  b.keys = ptr<int32_t>(ri.keys);
  b.rows_in = ptr<int32_t>(ri.rows_in);
  b.temp = ri.temp.data_ptr();
  if (s.units_per_item > 0) {
    b.item_offsets = ptr<int32_t>(ri.item_offsets);
    b.items = reinterpret_cast<int2*>(ptr<int32_t>(ri.items));
    if (s.order) b.order = ptr<int32_t>(ri.order);
  }
  ri.params = reverse_index_params(s, b, ptr<int32_t>(indices), ptr<int32_t>(seqs.cu), ptr<int32_t>(seqs.cu_k));
  return ri;
}

ReverseIndex build_reverse_index(const Tensor& indices, const SeqMap& seqs, int64_t block_size,
                                 int64_t units_per_item) {
  check_cuda_int32(indices, "indices", 3);
  MSA_CHECK(block_size == 64 || block_size == 128, "block_size: expected 64 or 128, got ", block_size);
  const int64_t heads = indices.size(0), tokens = indices.size(1), topk = indices.size(2);
  const int64_t num_seqs = seqs.num_seqs;
  const int64_t max_blocks = seqs.total_k / block_size + num_seqs;  // key blocks
  const int64_t entries = heads * tokens * topk;
  const int64_t num_keys = heads * max_blocks;
  MSA_CHECK(entries < (int64_t(1) << 31) && num_keys < (int64_t(1) << 30),
                    "indices: too many entries for the int32 reverse index, shape ", shape(indices));

  const DeviceGuard guard(indices.get_device_index());
  ReverseIndex ri = alloc_reverse_index(indices, seqs, topk, block_size, entries, units_per_item);
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
