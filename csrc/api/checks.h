// Argument checks shared by the CUDA entry points. They raise (RuntimeError) with the argument's name
// before anything is launched; the Python layer checks shapes and dtypes first (SPEC 7's ValueError /
// TypeError), so these are the last line before a launch.
#pragma once
#include <cuda_runtime_api.h>

#include "api/stable.h"

#include <optional>
#include <string>
#include <vector>

namespace msa::api {

inline void check_cuda_int32(const Tensor& t, const char* name, int64_t dim) {
  MSA_CHECK(t.is_cuda(), name, ": expected a CUDA tensor, got device ", dev(t));
  MSA_CHECK(t.scalar_type() == kInt, name, ": expected dtype int32, got ", dtype(t));
  MSA_CHECK(t.dim() == dim, name, ": expected ", dim, " dims, got shape ", shape(t));
  MSA_CHECK(t.is_contiguous(), name, ": expected a contiguous tensor");
}

// cu_seqlens must be [0, ..., total_tokens], non-decreasing, with no sequence longer than max_seqlen.
// Reading it costs a device-to-host copy, which drains the stream; that copy is what keeps a bad map
// from becoming an out-of-bounds access inside a kernel. The values read are remembered per tensor
// version (csrc/api/cu_seqlens.cpp), so a cu_seqlens tensor that is passed again unchanged (the next
// op of the same call, the backward, the next layer) is checked on the host without another copy.
// During CUDA graph capture the copy cannot run: a cu_seqlens that was not read before the capture
// (an earlier call, or msa.validate_cu_seqlens) raises instead, and says so. side: "" for the queries'
// cu_seqlens, "_k" for the keys' (the names in the messages).
std::vector<int32_t> check_cu_seqlens(const Tensor& cu, int64_t total_tokens, int64_t max_seqlen,
                                      const char* side = "");

// The sequences of one op call. With a cu_seqlens: checked as above. Without (None, the batched
// layout): T / max_seqlen sequences of max_seqlen tokens, the offsets built on the device and nothing
// read back, so a batched call never waits for the GPU and can be captured in a CUDA graph. The ops'
// internal helpers take a SeqMap, so one call checks its cu_seqlens once.
struct SeqMap {
  Tensor cu;             // int32 (S + 1,) on the device of the inputs
  int64_t num_seqs = 0;  // S
  // Every sequence holds T / S tokens: the batched layout, or one packed sequence (warmup's cuDNN path).
  bool uniform = false;
  // The keys (k, v, k_idx rows, docs/semantics.md): cu_k is cu itself (the same tensor, so the kernels
  // take the square path's expressions unchanged) unless the queries are a suffix of the keys (suffix:
  // some len_k > len_q; each sequence's queries are then the last len_q of its len_k positions).
  Tensor cu_k;
  int64_t total_k = 0, max_k = 0;  // Tk, max_seqlen_k (those of the queries without a key layout)
  bool suffix = false;
};
SeqMap seq_map(const std::optional<Tensor>& cu_seqlens, int64_t total_tokens, int64_t max_seqlen,
               const Tensor& like);
// With the ops' key layout (cu_seqlens_k, max_seqlen_k): both None for the queries' layout (then
// total_k must be T); cu_seqlens_k None with max_seqlen_k: batched keys (total_k / max_seqlen_k
// sequences). The same number of sequences as the queries', len_k >= len_q in each; a key layout equal
// to the queries' (a clone of cu_seqlens) is the square path.
SeqMap seq_map(const std::optional<Tensor>& cu_seqlens, int64_t total_tokens, int64_t max_seqlen,
               const std::optional<Tensor>& cu_seqlens_k, std::optional<int64_t> max_seqlen_k, int64_t total_k,
               const Tensor& like);

// The shared memory per block x's device offers (opt-in maximum, bytes).
inline int64_t smem_per_block(const Tensor& x) {
  const int device = x.get_device_index();
  int optin = 0;
  const cudaError_t err = cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, device);
  MSA_CHECK(err == cudaSuccess, "msa: cannot query the shared memory of device ", device);
  return optin;
}

// The sparse kernels keep a kv block and their tiles in shared memory; every configuration is checked
// against what the GPU offers before any launch (the 99 KB one of sm_86 / sm_89 / sm_120 included).
inline void check_smem(const Tensor& x, int64_t needed, const char* what) {
  const int64_t optin = smem_per_block(x);
  MSA_CHECK(needed <= optin, "msa: ", what, " needs ", needed, " bytes of shared memory per block; ",
            "this GPU offers ", optin, " (msa needs at least 99 KB per block, see README.md)");
}

// Rows of a tensor's first dim (-1 for a 0-dim tensor, which the shape checks then reject).
inline int64_t rows(const Tensor& t) { return t.dim() > 0 ? t.size(0) : -1; }

// q, k, v of the sparse kernels: one CUDA device, bf16/fp16, (T, Hq, D) / (Tk, Hkv, D), D 64 or 128.
inline void check_qkv_cuda(const Tensor& q, const Tensor& k, const Tensor& v, int64_t total_k) {
  MSA_CHECK(q.is_cuda() && same_device(k, q) && same_device(v, q), "q, k, v: expected one CUDA device, got ", dev(q),
            ", ", dev(k), ", ", dev(v));
  MSA_CHECK(q.scalar_type() == kBFloat16 || q.scalar_type() == kHalf, "q: expected bfloat16 or float16, got ",
            dtype(q));
  MSA_CHECK(k.scalar_type() == q.scalar_type() && v.scalar_type() == q.scalar_type(), "k, v: expected dtype ",
            dtype(q));
  MSA_CHECK(q.dim() == 3 && k.dim() == 3 && same_shape(k, v) && k.size(0) == total_k && k.size(2) == q.size(2),
            "q, k, v: expected (T, Hq, D), (", total_k, ", Hkv, D), (", total_k, ", Hkv, D), got ", shape(q), ", ",
            shape(k), ", ", shape(v));
  MSA_CHECK(q.size(2) == 64 || q.size(2) == 128, "q: expected head dim 64 or 128, got ", q.size(2));
  MSA_CHECK(q.size(1) % k.size(1) == 0, "k: expected Hkv dividing Hq = ", q.size(1), ", got ", k.size(1));
  MSA_CHECK(q.stride(2) == 1 && k.stride(2) == 1 && v.stride(2) == 1, "q, k, v: expected a contiguous last dim");
}

// Hi index groups (`what` names their source: indices, q_idx) over Hq query heads and Hkv kv heads, as the
// CUDA kernels take them: Hi divides Hq, one of Hi and Hkv divides the other, and at most 64 query heads
// per (index group, kv head).
inline void check_group_heads(const char* what, int64_t Hq, int64_t Hkv, int64_t Hi) {
  MSA_CHECK(Hi >= 1 && Hq % Hi == 0 && (Hi % Hkv == 0 || Hkv % Hi == 0), what, ": expected Hi dividing Hq = ", Hq,
            " with Hi and Hkv = ", Hkv, " dividing one another, got Hi = ", Hi);
  const int64_t G = Hq / Hi, J = Hkv > Hi ? Hkv / Hi : 1;
  MSA_CHECK(G / J <= 64, "q: at most 64 query heads per (index group, kv head) on CUDA, got ", G / J);
}

}  // namespace msa::api
