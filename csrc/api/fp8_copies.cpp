// msa::fp8_index_copies on CUDA: the e4m3 copies of (q_idx, k_idx) the FP8 selection scores (index_dtype, SPEC 2),
// in two launches (smxx/fp8_copies) instead of PyTorch's ~40 small ops per call; the CPU runs the same formula in
// PyTorch (msa/_ops.py), and both give the same bytes.
#include "api/checks.h"
#include "api/dispatch.h"
#include "api/ops.h"
#include "smxx/fp8_copies/fp8_copies.h"

namespace msa::api {
namespace {

smxx::Fp8CopyArgs copy_args(const Tensor& x, const Tensor& out) {
  return {x.data_ptr(), ptr<uint8_t>(out), x.size(0), x.stride(0), x.stride(1), int(x.size(1)), int(x.size(2))};
}

std::tuple<Tensor, Tensor> fp8_index_copies_cuda(const Tensor& q_idx, const Tensor& k_idx) {
  MSA_CHECK(q_idx.is_cuda() && same_device(k_idx, q_idx), "q_idx, k_idx: expected one CUDA device, got ", dev(q_idx),
            ", ", dev(k_idx));
  MSA_CHECK(q_idx.scalar_type() == kBFloat16 || q_idx.scalar_type() == kHalf, "q_idx: expected bfloat16 or float16, got ",
            dtype(q_idx));
  MSA_CHECK(k_idx.scalar_type() == q_idx.scalar_type(), "k_idx: expected dtype ", dtype(q_idx), ", got ", dtype(k_idx));
  MSA_CHECK(q_idx.dim() == 3 && k_idx.dim() == 3 && q_idx.size(2) == k_idx.size(2) &&
                (q_idx.size(2) == 64 || q_idx.size(2) == 128),
            "q_idx, k_idx: expected (T, H, Di) and (T_k, H_k, Di) with Di 64 or 128, got ", shape(q_idx), ", ",
            shape(k_idx));
  MSA_CHECK(q_idx.stride(2) == 1 && k_idx.stride(2) == 1, "q_idx, k_idx: expected a contiguous last dim");
  const DeviceGuard guard(q_idx.get_device_index());
  Tensor q8 = empty(sizes_of(q_idx), ScalarType::Float8_e4m3fn, q_idx);
  Tensor k8 = empty(sizes_of(k_idx), ScalarType::Float8_e4m3fn, k_idx);
  Tensor amax = empty({std::max<int64_t>(k_idx.size(1), 1)}, kFloat, q_idx);
  const cudaStream_t stream = current_stream(q_idx);
  zero_bytes(amax.data_ptr(), size_t(amax.size(0)) * 4, stream);
  const smxx::Fp8CopyArgs q = copy_args(q_idx, q8), k = copy_args(k_idx, k8);
  const cudaError_t err = q_idx.scalar_type() == kBFloat16
                              ? smxx::launch_fp8_index_copies<__nv_bfloat16>(q, k, ptr<float>(amax), stream)
                              : smxx::launch_fp8_index_copies<__half>(q, k, ptr<float>(amax), stream);
  MSA_LAUNCH_CHECK(err, "fp8_index_copies");
  return {q8, k8};
}

}  // namespace

STABLE_TORCH_LIBRARY_IMPL(msa, CUDA, m) { m.impl("fp8_index_copies", TORCH_BOX(&fp8_index_copies_cuda)); }

}  // namespace msa::api
