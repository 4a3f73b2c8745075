// Host side of the deterministic mode (params.h, DetGridParams): the summation grid from the inputs'
// finite |x| maxima, computed on the device (nothing is read back: the call stays capturable).
#include "api/dispatch.h"
#include "api/ops.h"
#include "smxx/deterministic/det.h"

namespace msa::api {

Tensor det_grid(const std::vector<Tensor>& tensors, int mode, double factor, int64_t n_max) {
  const Tensor& like = tensors.front();
  const cudaStream_t stream = current_stream(like);
  const Tensor amax = zeros({int64_t(tensors.size())}, kInt, like);
  for (size_t i = 0; i < tensors.size(); ++i) {
    const Tensor& x = tensors[i];
    AbsMaxParams a{};
    a.x = x.data_ptr();
    a.rows = x.size(0);
    a.heads = int(x.size(1));
    a.dim = int(x.size(2));
    a.stride_t = x.stride(0);
    a.stride_h = x.stride(1);
    a.out = reinterpret_cast<unsigned*>(ptr<int32_t>(amax)) + i;
    MSA_LAUNCH_CHECK(smxx::launch_absmax(a, x.scalar_type() == kBFloat16, stream), "deterministic (absmax)");
  }
  const Tensor grid = empty({4}, kFloat, like);
  DetGridParams g{};
  g.amax = reinterpret_cast<const unsigned*>(ptr<int32_t>(amax));
  g.grid = reinterpret_cast<float4*>(ptr<float>(grid));
  g.mode = mode;
  g.factor = factor;
  g.n_max = int(std::min<int64_t>(n_max, int64_t(1) << 30));
  MSA_LAUNCH_CHECK(smxx::launch_det_grid(g, stream), "deterministic (grid)");
  return grid;
}

void item_reduce(const Tensor& part, const int32_t* item_offsets, const int32_t* block_offsets,
                 const SeqMap& seqs, int64_t block_size, int64_t max_blocks, int64_t hi,
                 const std::vector<Tensor>& out) {
  ItemReduceParams r{};
  r.part = ptr<float>(part);
  r.item_offsets = item_offsets;
  r.block_offsets = block_offsets;
  r.cu_seqlens = ptr<int32_t>(seqs.cu);
  r.cu_seqlens_k = ptr<int32_t>(seqs.cu_k);
  r.num_seqs = int(seqs.num_seqs);
  r.block_size = int(block_size);
  r.max_blocks = int(max_blocks);
  r.hi = int(hi);
  r.hout = int(out.front().size(1));
  r.width = int(out.front().size(2));
  r.ntensors = int(out.size());
  for (size_t i = 0; i < out.size(); ++i) r.out[i] = ptr<float>(out[i]);
  MSA_LAUNCH_CHECK(smxx::launch_item_reduce(r, current_stream(part)), "deterministic (item reduce)");
}

}  // namespace msa::api
