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

ReverseIndexPlan plan_reverse_index(const Tensor& indices, const SeqMap& seqs, int64_t topk, int64_t block_size,
                                    int64_t capacity, int64_t units_per_item, BytePlan& out, BytePlan& work) {
  // Sizes: csrc/common/workspace.h (shared with the C++ microbenchmarks).
  ReverseIndexPlan plan;
  plan.sizes = reverse_index_sizes(indices.size(0), indices.size(1), seqs.total_k, topk, seqs.num_seqs, block_size,
                                   capacity, units_per_item, item_order_enabled());
  plan.layout = reverse_index_layout(plan.sizes, out, work);
  return plan;
}

namespace {
ReverseIndex index_over(const ReverseIndexPlan& plan, const ReverseIndexBuffers& b, const Tensor& indices,
                        const SeqMap& seqs) {
  ReverseIndex ri;
  ri.max_blocks = plan.sizes.max_blocks;
  ri.units_per_item = plan.sizes.units_per_item;
  ri.max_items = plan.sizes.max_items;
  ri.params = reverse_index_params(plan.sizes, b, ptr<int32_t>(indices), ptr<int32_t>(seqs.cu), ptr<int32_t>(seqs.cu_k));
  return ri;
}

// Checks and the plan of a build over all of `indices` (rows = tokens).
ReverseIndexPlan whole_plan(const Tensor& indices, const SeqMap& seqs, int64_t block_size, int64_t units_per_item,
                            BytePlan& out, BytePlan& work) {
  check_cuda_int32(indices, "indices", 3);
  MSA_CHECK(block_size == 64 || block_size == 128, "block_size: expected 64 or 128, got ", block_size);
  const int64_t heads = indices.size(0), tokens = indices.size(1), topk = indices.size(2);
  const int64_t max_blocks = seqs.total_k / block_size + seqs.num_seqs;  // key blocks
  const int64_t entries = heads * tokens * topk;
  const int64_t num_keys = heads * max_blocks;
  MSA_CHECK(entries < (int64_t(1) << 31) && num_keys < (int64_t(1) << 30),
            "indices: too many entries for the int32 reverse index, shape ", shape(indices));
  return plan_reverse_index(indices, seqs, topk, block_size, entries, units_per_item, out, work);
}

char* bytes(const Tensor& t) { return static_cast<char*>(t.data_ptr()); }
}  // namespace

ReverseIndex place_reverse_index(const ReverseIndexPlan& plan, const Tensor& indices, const SeqMap& seqs, char* out,
                                 char* work) {
  return index_over(plan, reverse_index_buffers(plan.sizes, plan.layout, out, work), indices, seqs);
}

ReverseIndex build_reverse_index(const Tensor& indices, const SeqMap& seqs, int64_t block_size,
                                 int64_t units_per_item) {
  BytePlan out, work;
  const ReverseIndexPlan plan = whole_plan(indices, seqs, block_size, units_per_item, out, work);
  const DeviceGuard guard(indices.get_device_index());
  const Tensor storage = empty({int64_t(out.total)}, kByte, indices);
  Tensor ws = empty({int64_t(work.total)}, kByte, indices);
  ReverseIndex ri = place_reverse_index(plan, indices, seqs, bytes(storage), bytes(ws));
  ri.storage = storage;
  MSA_LAUNCH_CHECK(run_reverse_index(ri.params, current_stream(indices)), "reverse_index");
  // Only the outputs outlive the build: the workspace goes back to the caching allocator now (stream ordered),
  // not when the caller (the backward) drops the result; params no longer point into it.
  ReverseIndexParams& p = ri.params;
  p.keys_in = p.keys_out = p.rows_in = nullptr;
  p.sort_temp = nullptr;
  return ri;
}

std::tuple<Tensor, Tensor, Tensor> reverse_index_cuda(const Tensor& indices, const std::optional<Tensor>& cu_seqlens,
                                                      int64_t max_seqlen, int64_t block_size) {
  check_cuda_int32(indices, "indices", 3);
  const SeqMap seqs = seq_map(cu_seqlens, indices.size(1), max_seqlen, indices);
  BytePlan out, work;
  const ReverseIndexPlan plan = whole_plan(indices, seqs, block_size, 0, out, work);
  const ReverseIndexSizes& s = plan.sizes;
  const DeviceGuard guard(indices.get_device_index());
  // The op's outputs in their own allocations (outputs must not share storage), the workspace in one.
  const Tensor offsets = empty({s.num_keys + 1}, kInt, indices), rows = empty({s.capacity}, kInt, indices);
  const Tensor block_offsets = empty({s.num_seqs + 1}, kInt, indices);
  const Tensor ws = empty({int64_t(work.total)}, kByte, indices);
  ReverseIndexBuffers b = reverse_index_buffers(s, plan.layout, nullptr, bytes(ws));
  b.offsets = ptr<int32_t>(offsets);
  b.rows = ptr<int32_t>(rows);
  b.block_offsets = ptr<int32_t>(block_offsets);
  const ReverseIndex ri = index_over(plan, b, indices, seqs);
  MSA_LAUNCH_CHECK(run_reverse_index(ri.params, current_stream(indices)), "reverse_index");
  return {offsets, rows, block_offsets};
}

// msa::_work_list (tests): a build as the backward makes it, its outputs copied into tensors of their own.
std::tuple<Tensor, Tensor, Tensor, Tensor, Tensor> work_list_cuda(const Tensor& indices,
                                                                  const std::optional<Tensor>& cu_seqlens,
                                                                  int64_t max_seqlen, int64_t block_size,
                                                                  int64_t units_per_item) {
  check_cuda_int32(indices, "indices", 3);
  MSA_CHECK(units_per_item >= 1 && units_per_item < (int64_t(1) << 30), "units_per_item: expected >= 1, got ",
            units_per_item);
  const SeqMap seqs = seq_map(cu_seqlens, indices.size(1), max_seqlen, indices);
  const DeviceGuard guard(indices.get_device_index());
  const ReverseIndex ri = build_reverse_index(indices, seqs, block_size, units_per_item);
  const ReverseIndexParams& p = ri.params;
  const int64_t num_keys = int64_t(p.num_heads) * p.max_blocks, rows_n = indices.numel();
  const cudaStream_t stream = current_stream(indices);
  auto copy = [&](const void* src, std::initializer_list<int64_t> shape) {
    Tensor t = empty(shape, kInt, indices);
    if (t.numel() > 0) {
      MSA_LAUNCH_CHECK(cudaMemcpyAsync(t.data_ptr(), src, size_t(t.numel()) * sizeof(int32_t),
                                       cudaMemcpyDeviceToDevice, stream), "_work_list");
    }
    return t;
  };
  return {copy(p.offsets, {num_keys + 1}), copy(p.rows, {rows_n}), copy(p.item_offsets, {num_keys + 1}),
          copy(p.items, {ri.max_items, 2}), copy(p.item_order, {p.item_order != nullptr ? ri.max_items : 0})};
}

STABLE_TORCH_LIBRARY_IMPL(msa, CUDA, m) {
  m.impl("reverse_index", TORCH_BOX(&reverse_index_cuda));
  m.impl("_work_list", TORCH_BOX(&work_list_cuda));
}

}  // namespace msa::api
