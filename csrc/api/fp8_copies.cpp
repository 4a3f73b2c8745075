// msa::_fp8_copies_cuda: the e4m3 copies of (q_idx, k_idx) the FP8 selection scores (index_dtype, SPEC 2) in two
// launches (smxx/fp8_copies) instead of ~30 PyTorch kernels. msa::fp8_index_copies (msa/_ops.py) calls it for CUDA
// bf16 / fp16 inputs of Di 64 / 128 and runs the PyTorch formula elsewhere: the same bytes for finite inputs.
#include "api/checks.h"
#include "api/dispatch.h"
#include "api/ops.h"
#include "smxx/fp8_copies/fp8_copies.h"

namespace msa::api {
namespace {

smxx::Fp8CopyArgs copy_args(const Tensor& x, const Tensor& out) {
  return {x.data_ptr(), ptr<uint8_t>(out), x.size(0), x.stride(0), x.stride(1), int(x.size(1)), int(x.size(2))};
}

// k's sequences: cu_seqlens_k (S + 1 offsets into k's rows) where given, else runs of seq_len_k rows.
std::tuple<Tensor, Tensor> fp8_copies_cuda(const Tensor& q_idx, const Tensor& k_idx,
                                           const std::optional<Tensor>& cu_seqlens_k, int64_t seq_len_k) {
  MSA_CHECK(q_idx.is_cuda() && same_device(k_idx, q_idx), "q_idx, k_idx: expected one CUDA device, got ", dev(q_idx),
            ", ", dev(k_idx));
  MSA_CHECK(q_idx.scalar_type() == kBFloat16 || q_idx.scalar_type() == kHalf,
            "q_idx: expected bfloat16 or float16, got ", dtype(q_idx));
  MSA_CHECK(k_idx.scalar_type() == q_idx.scalar_type(), "k_idx: expected dtype ", dtype(q_idx), ", got ", dtype(k_idx));
  MSA_CHECK(q_idx.dim() == 3 && k_idx.dim() == 3 && q_idx.size(2) == k_idx.size(2) &&
                (q_idx.size(2) == 64 || q_idx.size(2) == 128),
            "q_idx, k_idx: expected (T, H, Di) and (T_k, H_k, Di) with Di 64 or 128, got ", shape(q_idx), ", ",
            shape(k_idx));
  MSA_CHECK(q_idx.stride(2) == 1 && k_idx.stride(2) == 1, "q_idx, k_idx: expected a contiguous last dim");
  smxx::Fp8KeySeqs seqs{nullptr, std::max<int64_t>(seq_len_k, 1), 1};
  if (cu_seqlens_k) {
    MSA_CHECK(cu_seqlens_k->is_cuda() && same_device(*cu_seqlens_k, k_idx) && cu_seqlens_k->scalar_type() == kInt &&
                  cu_seqlens_k->dim() == 1 && cu_seqlens_k->size(0) >= 2 && cu_seqlens_k->stride(0) == 1,
              "cu_seqlens_k: expected a contiguous int32 (S+1,) tensor on ", dev(k_idx));
    seqs.cu = ptr<int32_t>(*cu_seqlens_k);
    seqs.num_seqs = int(cu_seqlens_k->size(0) - 1);
  } else {
    MSA_CHECK(seq_len_k >= 1 && k_idx.size(0) % seq_len_k == 0, "seq_len_k: expected a divisor of T_k = ",
              k_idx.size(0), ", got ", seq_len_k);
    seqs.num_seqs = int(std::max<int64_t>(k_idx.size(0) / seq_len_k, 1));
  }
  const DeviceGuard guard(q_idx.get_device_index());
  Tensor q8 = empty(sizes_of(q_idx), ScalarType::Float8_e4m3fn, q_idx);
  Tensor k8 = empty(sizes_of(k_idx), ScalarType::Float8_e4m3fn, k_idx);
  Tensor amax = empty({int64_t(seqs.num_seqs) * std::max<int64_t>(k_idx.size(1), 1)}, kFloat, q_idx);
  const cudaStream_t stream = current_stream(q_idx);
  zero_bytes(amax.data_ptr(), size_t(amax.size(0)) * 4, stream);
  const smxx::Fp8CopyArgs q = copy_args(q_idx, q8), k = copy_args(k_idx, k8);
  const cudaError_t err = q_idx.scalar_type() == kBFloat16
                              ? smxx::launch_fp8_index_copies<__nv_bfloat16>(q, k, seqs, ptr<float>(amax), stream)
                              : smxx::launch_fp8_index_copies<__half>(q, k, seqs, ptr<float>(amax), stream);
  MSA_LAUNCH_CHECK(err, "fp8_index_copies");
  return {q8, k8};
}

}  // namespace

STABLE_TORCH_LIBRARY_IMPL(msa, CUDA, m) { m.impl("_fp8_copies_cuda", TORCH_BOX(&fp8_copies_cuda)); }

}  // namespace msa::api
