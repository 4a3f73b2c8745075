// msa::select_blocks on CUDA (SPEC 2): argument checks, allocation, params, dispatch on (dtype, Di).
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include "api/checks.h"
#include "api/dispatch.h"
#include "api/ops.h"
#include "sm80/index_topk/index_topk.h"
#ifdef MSA_WITH_SM90
#include "sm90/index_topk/index_topk.h"
#endif

namespace msa::api {

at::Tensor select_blocks_cuda(const at::Tensor& q_idx, const at::Tensor& k_idx, const SeqMap& seqs,
                              int64_t max_seqlen, int64_t topk, int64_t block_size, double index_scale) {
  TORCH_CHECK_VALUE(q_idx.is_cuda() && k_idx.device() == q_idx.device(), "q_idx, k_idx: expected one CUDA device, got ",
                    q_idx.device(), ", ", k_idx.device());
  TORCH_CHECK_TYPE(q_idx.scalar_type() == at::kBFloat16 || q_idx.scalar_type() == at::kHalf,
                   "q_idx: expected bfloat16 or float16, got ", q_idx.scalar_type());
  TORCH_CHECK_TYPE(k_idx.scalar_type() == q_idx.scalar_type(), "k_idx: expected dtype ", q_idx.scalar_type(),
                   ", got ", k_idx.scalar_type());
  TORCH_CHECK_VALUE(q_idx.dim() == 3 && k_idx.dim() == 3, "q_idx, k_idx: expected (T, H, Di), got ", q_idx.sizes(),
                    " and ", k_idx.sizes());
  const int64_t T = q_idx.size(0), Hi = q_idx.size(1), Di = q_idx.size(2), Hki = k_idx.size(1);
  TORCH_CHECK_VALUE(k_idx.size(0) == T && k_idx.size(2) == Di, "k_idx: expected (", T, ", Hki, ", Di, "), got ",
                    k_idx.sizes());
  TORCH_CHECK_VALUE(Di == 64 || Di == 128, "q_idx: expected head dim 64 or 128, got ", Di);
  TORCH_CHECK_VALUE(Hki >= 1 && Hi % Hki == 0 && Hi / Hki <= 64, "k_idx: expected Hki dividing Hi = ", Hi,
                    " with Hi / Hki <= 64, got Hki = ", Hki);
  TORCH_CHECK_VALUE(topk >= 1 && topk <= 32, "topk: expected 1..32, got ", topk);
  TORCH_CHECK_VALUE(block_size == 64 || block_size == 128, "block_size: expected 64 or 128, got ", block_size);
  TORCH_CHECK_VALUE(q_idx.stride(-1) == 1 && k_idx.stride(-1) == 1, "q_idx, k_idx: expected a contiguous last dim");

  c10::cuda::CUDAGuard guard(q_idx.device());
  auto indices = at::empty({Hi, T, topk}, q_idx.options().dtype(at::kInt));
  if (T == 0) return indices;
  const at::Tensor q = aligned_rows(q_idx), k = aligned_rows(k_idx);
  IndexTopkParams p{};
  p.q_idx = q.data_ptr();
  p.k_idx = k.data_ptr();
  p.cu_seqlens = seqs.cu.data_ptr<int32_t>();
  p.indices = indices.data_ptr<int32_t>();
  p.q_stride_t = q.stride(0);
  p.q_stride_h = q.stride(1);
  p.k_stride_t = k.stride(0);
  p.k_stride_h = k.stride(1);
  p.total_tokens = int(T);
  p.num_heads = int(Hi);
  p.num_key_heads = int(Hki);
  p.num_seqs = int(seqs.num_seqs);
  p.max_seqlen = int(std::max<int64_t>(max_seqlen, 1));
  p.topk = int(topk);
  p.block_size = int(block_size);
  p.scale = float(index_scale);
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  [[maybe_unused]] const bool sm90 = use_sm90_kernels();
  dispatch_dtype_dim(q.scalar_type(), Di, [&]<typename T_, int D_>() {
#ifdef MSA_WITH_SM90
    if (sm90) {  // cudaErrorNotSupported: no TMA descriptor for this k_idx (nothing launched)
      const cudaError_t err = sm90::launch_index_topk<T_, D_>(p, stream);
      if (err != cudaErrorNotSupported) {
        MSA_LAUNCH_CHECK(err, "select_blocks");
        return;
      }
    }
#endif
    MSA_LAUNCH_CHECK((sm80::launch_index_topk<T_, D_>(p, stream)), "select_blocks");
  });
  return indices;
}

namespace {

at::Tensor select_blocks_op(const at::Tensor& q_idx, const at::Tensor& k_idx,
                            const std::optional<at::Tensor>& cu_seqlens, int64_t max_seqlen, int64_t topk,
                            int64_t block_size, double index_scale) {
  TORCH_CHECK_VALUE(q_idx.is_cuda() && q_idx.dim() == 3, "q_idx: expected a (T, Hi, Di) CUDA tensor, got ",
                    q_idx.sizes(), " on ", q_idx.device());
  const SeqMap seqs = seq_map(cu_seqlens, q_idx.size(0), max_seqlen, q_idx);
  return select_blocks_cuda(q_idx, k_idx, seqs, max_seqlen, topk, block_size, index_scale);
}

}  // namespace

TORCH_LIBRARY_IMPL(msa, CUDA, m) { m.impl("select_blocks", &select_blocks_op); }

}  // namespace msa::api
