// msa::sparse_bwd and msa::msa_bwd on CUDA:
//   delta = rowsum(dO O) -> reverse index (tokens per key) -> sparse_bwd kernel into fp32 dq/dk/dv
//   accumulators -> cast. The KL's index gradients are the forward's kl_dq_idx / kl_dk_idx times d_kl.
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <ATen/ops/_flash_attention_backward.h>
#include <torch/library.h>

#include <optional>
#include <tuple>

#include "api/checks.h"
#include "api/dispatch.h"
#include "api/ops.h"
#include "sm80/sparse_bwd/sparse_bwd.h"
#include "sm80/sparse_fwd/sparse_fwd.h"

namespace msa::api {

namespace {
// Tokens per backward work item: a key selected by more tokens (a hot block, an attention sink) is
// split over several CTAs. MSA_BWD_UNITS_PER_ITEM overrides it (tests force splits with small values).
constexpr int64_t kBwdUnitsPerItem = 2048;
int64_t bwd_units_per_item() { return env_positive("MSA_BWD_UNITS_PER_ITEM", kBwdUnitsPerItem); }
}  // namespace

std::tuple<at::Tensor, at::Tensor, at::Tensor> sparse_backward_cuda(
    const at::Tensor& dout_in, const at::Tensor& q_in, const at::Tensor& k_in, const at::Tensor& v_in,
    const at::Tensor& out_in, const at::Tensor& lse, const at::Tensor& indices, const SeqMap& seqs, int64_t block_size,
    double softmax_scale, bool deterministic) {
  check_qkv_cuda(q_in, k_in, v_in);
  TORCH_CHECK_VALUE(dout_in.device() == q_in.device() && out_in.device() == q_in.device() &&
                        lse.device() == q_in.device(),
                    "dout, out, lse: expected the device of q, ", q_in.device());
  TORCH_CHECK_VALUE(dout_in.sizes() == q_in.sizes() && out_in.sizes() == q_in.sizes(),
                    "dout, out: expected the shape of q ", q_in.sizes(), ", got ", dout_in.sizes(), " and ",
                    out_in.sizes());
  TORCH_CHECK_TYPE(dout_in.scalar_type() == q_in.scalar_type() && out_in.scalar_type() == q_in.scalar_type(),
                   "dout, out: expected dtype ", q_in.scalar_type());
  const int64_t T = q_in.size(0), Hq = q_in.size(1), D = q_in.size(2), Hkv = k_in.size(1);
  TORCH_CHECK_VALUE(lse.scalar_type() == at::kFloat && lse.dim() == 2 && lse.size(0) == Hq && lse.size(1) == T,
                    "lse: expected float32 (", Hq, ", ", T, "), got ", lse.scalar_type(), " ", lse.sizes());
  check_cuda_int32(indices, "indices", 3);
  TORCH_CHECK_VALUE(indices.device() == q_in.device(), "indices: expected device ", q_in.device());
  const int64_t Hi = indices.size(0);
  TORCH_CHECK_VALUE(indices.size(1) == T && Hq % Hi == 0 && (Hi % Hkv == 0 || Hkv % Hi == 0),
                    "indices: expected (Hi, ", T, ", topk) with Hi dividing Hq = ", Hq, ", got ", indices.sizes());
  TORCH_CHECK_VALUE((Hq / Hi) / (Hkv > Hi ? Hkv / Hi : 1) <= 64,
                    "q: at most 64 query heads per (index group, kv head) on CUDA");

  c10::cuda::CUDAGuard guard(q_in.device());
  check_smem(q_in, sm80::sparse_smem_bytes(int(D), 2), "the sparse backward");
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  const ReverseIndex ri = build_reverse_index(indices, seqs, block_size, bwd_units_per_item());
  const int64_t S = seqs.num_seqs;
  const at::Tensor q = aligned_rows(q_in), k = aligned_rows(k_in), v = aligned_rows(v_in);
  const at::Tensor dout = aligned_rows(dout_in), out = aligned_rows(out_in);
  const at::Tensor lse_c = lse.contiguous();
  auto f32 = q.options().dtype(at::kFloat);
  auto delta = at::empty({Hq, T}, f32);
  auto dq = at::zeros({T, Hq, D}, f32);
  auto dk = at::zeros({T, Hkv, D}, f32);
  auto dv = at::zeros({T, Hkv, D}, f32);
  at::Tensor dq_lo, dq_grid, dkv_part;  // deterministic mode
  if (T > 0) {
    BwdDeltaParams dp{};
    dp.out = out.data_ptr();
    dp.dout = dout.data_ptr();
    dp.o_stride_t = out.stride(0);
    dp.o_stride_h = out.stride(1);
    dp.do_stride_t = dout.stride(0);
    dp.do_stride_h = dout.stride(1);
    dp.delta = delta.data_ptr<float>();
    dp.total_tokens = int(T);
    dp.hq = int(Hq);
    dp.d = int(D);
    MSA_LAUNCH_CHECK(sm80::launch_bwd_delta(dp, q.scalar_type() == at::kBFloat16, stream), "sparse_bwd (delta)");

    SparseBwdParams p{};
    p.q = q.data_ptr();
    p.k = k.data_ptr();
    p.v = v.data_ptr();
    p.dout = dout.data_ptr();
    p.q_stride_t = q.stride(0);
    p.q_stride_h = q.stride(1);
    p.k_stride_t = k.stride(0);
    p.k_stride_h = k.stride(1);
    p.v_stride_t = v.stride(0);
    p.v_stride_h = v.stride(1);
    p.do_stride_t = dout.stride(0);
    p.do_stride_h = dout.stride(1);
    p.lse = lse_c.data_ptr<float>();
    p.delta = delta.data_ptr<float>();
    p.cu_seqlens = seqs.cu.data_ptr<int32_t>();
    p.offsets = ri.offsets.data_ptr<int32_t>();
    p.tokens = ri.rows.data_ptr<int32_t>();
    p.block_offsets = ri.block_offsets.data_ptr<int32_t>();
    p.item_offsets = ri.item_offsets.data_ptr<int32_t>();
    p.items = reinterpret_cast<const int2*>(ri.items.data_ptr<int32_t>());
    p.item_order = ri.order.defined() ? ri.order.data_ptr<int32_t>() : nullptr;
    p.num_keys = int(Hi * ri.max_blocks);
    p.units_per_item = int(ri.units_per_item);
    p.max_items = int(ri.max_items);
    p.dq_accum = dq.data_ptr<float>();
    p.dk_accum = dk.data_ptr<float>();
    p.dv_accum = dv.data_ptr<float>();
    if (deterministic) {
      // dQ: exact hi / lo sums. Per element at most topk contributions (one per slot) whose |x| sum to at
      // most scale * D * max|dO| * (max|V| + max|O|) * max|K| (|dP|, |delta| <= D max|dO| max|V or O|,
      // sum of P <= 1), doubled for the rounding of P and dS to the input dtype. dK, dV: per-item partials.
      dq_grid = det_grid({dout, v, out, k}, 0, 2.0 * softmax_scale * double(D), indices.size(2));
      dq_lo = at::zeros_like(dq);
      const int64_t J = Hkv > Hi ? Hkv / Hi : 1;
      dkv_part = at::empty({ri.max_items * J * 2 * sm80::kBwdKeys * D}, f32);
      p.dq_lo = dq_lo.data_ptr<float>();
      p.dq_grid = reinterpret_cast<const float4*>(dq_grid.data_ptr<float>());
      p.dkv_part = dkv_part.data_ptr<float>();
    }
    p.total_tokens = int(T);
    p.num_seqs = int(S);
    p.block_size = int(block_size);
    p.max_blocks = int(ri.max_blocks);
    p.hq = int(Hq);
    p.hkv = int(Hkv);
    p.hi = int(Hi);
    p.scale = float(softmax_scale);
    p.scale_log2 = float(softmax_scale * 1.4426950408889634);
    [[maybe_unused]] const bool sm90 = use_sm90_kernels();
    dispatch_dtype_dim(q.scalar_type(), D, [&]<typename T_, int D_>() {
#ifdef MSA_WITH_SM90
      if (sm90) {
        MSA_LAUNCH_CHECK((sm90::launch_sparse_bwd<T_, D_>(p, stream)), "sparse_bwd");
        return;
      }
#endif
      MSA_LAUNCH_CHECK((sm80::launch_sparse_bwd<T_, D_>(p, stream)), "sparse_bwd");
    });
    if (deterministic) {
      item_reduce(dkv_part, p.item_offsets, p.block_offsets, seqs, block_size, ri.max_blocks, Hi, {dk, dv});
      dq.add_(dq_lo);
    }
  }
  return {dq.to(q.scalar_type()), dk.to(q.scalar_type()), dv.to(q.scalar_type())};
}

namespace {

std::tuple<at::Tensor, at::Tensor, at::Tensor> sparse_bwd_cuda(const at::Tensor& dout, const at::Tensor& q,
                                                               const at::Tensor& k, const at::Tensor& v,
                                                               const at::Tensor& out, const at::Tensor& lse,
                                                               const at::Tensor& indices,
                                                               const std::optional<at::Tensor>& cu_seqlens,
                                                               int64_t max_seqlen, int64_t block_size,
                                                               double softmax_scale, bool deterministic) {
  check_qkv_cuda(q, k, v);
  const SeqMap seqs = seq_map(cu_seqlens, q.size(0), max_seqlen, q);
  return sparse_backward_cuda(dout, q, k, v, out, lse, indices, seqs, block_size, softmax_scale, deterministic);
}

// Sets PyTorch's global deterministic flag for one scope and restores it after.
struct DeterministicScope {
  at::Context& ctx = at::globalContext();
  const bool was = ctx.deterministicAlgorithms(), warn_only = ctx.deterministicAlgorithmsWarnOnly();
  explicit DeterministicScope(bool on) {
    if (on) ctx.setDeterministicAlgorithms(true, false);
  }
  ~DeterministicScope() { ctx.setDeterministicAlgorithms(was, warn_only); }
};

// PyTorch's flash backward (the dense main branch of warmup, SPEC 5). It is deterministic when the
// global flag says so, so deterministic=True sets the flag for this call.
std::tuple<at::Tensor, at::Tensor, at::Tensor> dense_attention_backward(
    const at::Tensor& dout, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& out,
    const at::Tensor& lse, const at::Tensor& cu, int64_t max_seqlen, double softmax_scale, bool deterministic) {
  const DeterministicScope scope(deterministic);
  auto rng = at::zeros({2}, q.options().dtype(at::kLong));  // no dropout: its rng state is not read
  auto unused = at::empty({0}, q.options().dtype(at::kLong));
  return at::_flash_attention_backward(dout.contiguous(), q, k, v, out, lse, cu, cu, max_seqlen, max_seqlen, 0.0,
                                       /*is_causal=*/true, rng, unused, softmax_scale);
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> msa_bwd_cuda(
    const std::optional<at::Tensor>& dout, const std::optional<at::Tensor>& dkl, const at::Tensor& q,
    const at::Tensor& k, const at::Tensor& v, const at::Tensor& out, const at::Tensor& lse, const at::Tensor& q_idx,
    const at::Tensor& k_idx, const at::Tensor& lse_idx, const at::Tensor& indices, const at::Tensor& kl_dq_idx,
    const at::Tensor& kl_dk_idx, const std::optional<at::Tensor>& cu_seqlens, int64_t max_seqlen, int64_t block_size,
    double softmax_scale, double index_scale, bool warmup, bool deterministic) {
  (void)lse_idx;
  (void)index_scale;
  check_qkv_cuda(q, k, v);
  at::Tensor dq, dk, dv, dq_idx, dk_idx;
  if (dout.has_value()) {
    const SeqMap seqs = seq_map(cu_seqlens, q.size(0), max_seqlen, q);
    c10::cuda::CUDAGuard guard(q.device());
    if (warmup) {
      // SPEC 5: the dense main branch's gradients from PyTorch's flash backward.
      std::tie(dq, dk, dv) =
          dense_attention_backward(*dout, q, k, v, out, lse, seqs.cu, max_seqlen, softmax_scale, deterministic);
    } else {
      std::tie(dq, dk, dv) =
          sparse_backward_cuda(*dout, q, k, v, out, lse, indices, seqs, block_size, softmax_scale, deterministic);
    }
  } else {
    dq = at::zeros_like(q);
    dk = at::zeros_like(k);
    dv = at::zeros_like(v);
  }
  if (dkl.has_value()) {
    // SPEC 4: the KL's gradient is linear in d_kl; the forward computed it for d_kl = 1.
    TORCH_CHECK_VALUE(kl_dq_idx.sizes() == q_idx.sizes() && kl_dk_idx.sizes() == k_idx.sizes(),
                      "kl_dq_idx, kl_dk_idx: expected the forward's index gradients (msa_fwd with index_grad=True), "
                      "got shapes ", kl_dq_idx.sizes(), " and ", kl_dk_idx.sizes());
    TORCH_CHECK_VALUE(dkl->numel() == 1 && dkl->device() == q_idx.device(), "d_kl: expected one value on ",
                      q_idx.device(), ", got shape ", dkl->sizes(), " on ", dkl->device());
    TORCH_CHECK_VALUE(kl_dq_idx.is_contiguous() && kl_dk_idx.is_contiguous() &&
                          kl_dq_idx.scalar_type() == at::kFloat && kl_dk_idx.scalar_type() == at::kFloat,
                      "kl_dq_idx, kl_dk_idx: expected the forward's contiguous fp32 index gradients");
    c10::cuda::CUDAGuard guard(q_idx.device());
    const at::Tensor s = dkl->to(at::kFloat).contiguous();
    const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
    // One pass each: the fp32 gradient for d_kl = 1, times d_kl (a device scalar), cast to the input dtype.
    auto scale_cast = [&](const at::Tensor& g, const at::Tensor& like) {
      at::Tensor res = at::empty(like.sizes(), like.options());
      MSA_LAUNCH_CHECK(sm80::launch_scale_cast(g.data_ptr<float>(), s.data_ptr<float>(), res.data_ptr(), g.numel(),
                                               like.scalar_type() == at::kBFloat16, stream),
                       "msa_bwd (index gradients)");
      return res;
    };
    dq_idx = scale_cast(kl_dq_idx, q_idx);
    dk_idx = scale_cast(kl_dk_idx, k_idx);
  } else {
    dq_idx = at::zeros_like(q_idx);
    dk_idx = at::zeros_like(k_idx);
  }
  return {dq, dk, dv, dq_idx, dk_idx};
}

}  // namespace

TORCH_LIBRARY_IMPL(msa, CUDA, m) {
  m.impl("sparse_bwd", &sparse_bwd_cuda);
  m.impl("msa_bwd", &msa_bwd_cuda);
}

}  // namespace msa::api
