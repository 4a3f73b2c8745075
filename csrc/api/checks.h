// Argument checks shared by the CUDA entry points. They raise ValueError (TORCH_CHECK_VALUE) with the
// argument's name before anything is launched; the Python layer checks shapes and dtypes first.
#pragma once
#include <ATen/ATen.h>
#include <cuda_runtime_api.h>
#include <torch/library.h>

#include <optional>
#include <string>
#include <vector>

namespace msa::api {

inline void check_cuda_int32(const at::Tensor& t, const char* name, int64_t dim) {
  TORCH_CHECK_VALUE(t.is_cuda(), name, ": expected a CUDA tensor, got device ", t.device());
  TORCH_CHECK_VALUE(t.scalar_type() == at::kInt, name, ": expected dtype int32, got ", t.scalar_type());
  TORCH_CHECK_VALUE(t.dim() == dim, name, ": expected ", dim, " dims, got shape ", t.sizes());
  TORCH_CHECK_VALUE(t.is_contiguous(), name, ": expected a contiguous tensor");
}

// cu_seqlens must be [0, ..., total_tokens], non-decreasing, with no sequence longer than max_seqlen.
// Reading it costs a device-to-host copy, which drains the stream; that copy is what keeps a bad map
// from becoming an out-of-bounds access inside a kernel. The values read are remembered per tensor
// version (csrc/api/cu_seqlens.cpp), so a cu_seqlens tensor that is passed again unchanged (the next
// op of the same call, the backward, the next layer) is checked on the host without another copy.
// During CUDA graph capture the copy cannot run: a cu_seqlens that was not read before the capture
// (an earlier call, or msa.validate_cu_seqlens) raises instead, and says so.
std::vector<int32_t> check_cu_seqlens(const at::Tensor& cu, int64_t total_tokens, int64_t max_seqlen);

// The sequences of one op call. With a cu_seqlens: checked as above. Without (None, the batched
// layout): T / max_seqlen sequences of max_seqlen tokens, the offsets built on the device and nothing
// read back, so a batched call never waits for the GPU and can be captured in a CUDA graph. The ops'
// internal helpers take a SeqMap, so one call checks its cu_seqlens once.
struct SeqMap {
  at::Tensor cu;         // int32 (S + 1,) on the device of the inputs
  int64_t num_seqs = 0;  // S
};
SeqMap seq_map(const std::optional<at::Tensor>& cu_seqlens, int64_t total_tokens, int64_t max_seqlen,
               const at::Tensor& like);

// The shared memory per block x's device offers (opt-in maximum, bytes).
inline int64_t smem_per_block(const at::Tensor& x) {
  const int dev = x.get_device();
  int optin = 0;
  const cudaError_t err = cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, dev);
  TORCH_CHECK(err == cudaSuccess, "msa: cannot query the shared memory of device ", dev);
  return optin;
}

// The sparse kernels keep a kv block and their tiles in shared memory; a GPU with less per-block
// shared memory than they need (sm_86 / sm_89: 99 KB) is refused with a clear error before any launch.
inline void check_smem(const at::Tensor& x, int64_t needed, const char* what) {
  const int64_t optin = smem_per_block(x);
  TORCH_CHECK_NOT_IMPLEMENTED(needed <= optin, "msa: ", what, " needs ", needed, " bytes of shared memory per block; ",
                              "this GPU offers ", optin, " (the portable kernels are tuned for Hopper's 227 KB; "
                              "smaller GPUs are not supported yet, see README.md)");
}

// q, k, v of the sparse kernels: one CUDA device, bf16/fp16, (T, Hq, D) / (T, Hkv, D), D 64 or 128.
inline void check_qkv_cuda(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v) {
  TORCH_CHECK_VALUE(q.is_cuda() && k.device() == q.device() && v.device() == q.device(),
                    "q, k, v: expected one CUDA device, got ", q.device(), ", ", k.device(), ", ", v.device());
  TORCH_CHECK_TYPE(q.scalar_type() == at::kBFloat16 || q.scalar_type() == at::kHalf,
                   "q: expected bfloat16 or float16, got ", q.scalar_type());
  TORCH_CHECK_TYPE(k.scalar_type() == q.scalar_type() && v.scalar_type() == q.scalar_type(),
                   "k, v: expected dtype ", q.scalar_type());
  TORCH_CHECK_VALUE(q.dim() == 3 && k.dim() == 3 && k.sizes() == v.sizes() && k.size(0) == q.size(0) &&
                        k.size(2) == q.size(2),
                    "q, k, v: expected (T, Hq, D), (T, Hkv, D), (T, Hkv, D), got ", q.sizes(), ", ", k.sizes(), ", ",
                    v.sizes());
  TORCH_CHECK_VALUE(q.size(2) == 64 || q.size(2) == 128, "q: expected head dim 64 or 128, got ", q.size(2));
  TORCH_CHECK_VALUE(q.size(1) % k.size(1) == 0, "k: expected Hkv dividing Hq = ", q.size(1), ", got ", k.size(1));
  TORCH_CHECK_VALUE(q.stride(-1) == 1 && k.stride(-1) == 1 && v.stride(-1) == 1,
                    "q, k, v: expected a contiguous last dim");
}

}  // namespace msa::api
