// msa::sparse_bwd and msa::msa_bwd on CUDA:
//   delta = rowsum(dO O) -> reverse index (tokens per key) -> sparse_bwd kernel into fp32 dq/dk/dv
//   accumulators -> cast. The KL's index gradients are the forward's kl_dq_idx / kl_dk_idx times d_kl.
#include <optional>
#include <tuple>

#include "api/checks.h"
#include "api/dispatch.h"
#include "api/host_phases.h"
#include "api/ops.h"
#include "common/workspace.h"
#include "sm80/sparse_bwd/sparse_bwd.h"
#include "sm80/sparse_fwd/sparse_fwd.h"
#include "sm90/sparse_bwd/sparse_bwd.h"
#include "smxx/bwd_delta/bwd_delta.h"

namespace msa::api {

bool small_smem_bwd_config(const Tensor& x, int64_t D) {
  if (use_sm90_kernels()) return false;
  return env_is("MSA_SMALL_SMEM", "1") || msa::bwd_small_smem(smem_per_block(x), int(D));
}

namespace {
// Tokens per backward work item (msa::bwd_units_per_item: 1024 up to 2^20 selection entries, then 2048;
// csrc/common/workspace.h): a key selected by more tokens (a hot block, an attention sink) is split over
// several CTAs. MSA_BWD_UNITS_PER_ITEM overrides it (tests force splits with small values).
int64_t bwd_units_per_item(const Tensor& indices) {
  // Capped at 2^20 tokens per item: the kernels add units_per_item to 32-bit unit offsets.
  return std::min<int64_t>(env_positive("MSA_BWD_UNITS_PER_ITEM", msa::bwd_units_per_item(indices.numel())),
                           int64_t(1) << 20);
}
}  // namespace

std::vector<Tensor> cast_grads(const std::vector<GradCast>& grads, cudaStream_t stream) {
  smxx::CastSegments bf16, fp16;
  std::vector<Tensor> res;
  if (grads.empty()) return res;
  MSA_CHECK(grads.size() <= size_t(smxx::kMaxCastSegments), "cast_grads: at most ", smxx::kMaxCastSegments,
            " gradients per call, got ", grads.size());
  const DeviceGuard guard(grads.front().like.get_device_index());  // the launches go to that device's stream
  for (const GradCast& g : grads) {
    MSA_CHECK(g.f32.scalar_type() == kFloat && g.f32.is_contiguous() && g.f32.numel() == g.like.numel(),
              "cast_grads: expected a contiguous fp32 gradient of ", g.like.numel(), " elements");
    res.push_back(empty_as(g.like));
    const bool is_bf16 = g.like.scalar_type() == kBFloat16;
    MSA_CHECK(is_bf16 || g.like.scalar_type() == kHalf, "cast_grads: expected bf16 or fp16, got ", dtype(g.like));
    (is_bf16 ? bf16 : fp16).add(ptr<float>(g.f32), res.back().data_ptr(), g.f32.numel(), g.scale, g.lo);  // fits
  }
  MSA_LAUNCH_CHECK(smxx::launch_cast_segments(bf16, true, stream), "the gradients' cast");
  MSA_LAUNCH_CHECK(smxx::launch_cast_segments(fp16, false, stream), "the gradients' cast");
  return res;
}

namespace {
// The main branch's gradients in fp32 before their cast; deterministic mode: dq's exact sum is dq + dq_lo (added
// by the cast).
struct SparseGradsF32 {
  Tensor dq, dk, dv, dq_lo;
};

SparseGradsF32 sparse_backward_f32(const Tensor& dout_in, const Tensor& q_in, const Tensor& k_in, const Tensor& v_in,
                                   const Tensor& out_in, const Tensor& lse, const Tensor& indices, const SeqMap& seqs,
                                   int64_t block_size, double softmax_scale, bool deterministic) {
  HostPhases hp("sparse_backward");
  check_qkv_cuda(q_in, k_in, v_in, seqs.total_k);
  MSA_CHECK(same_device(dout_in, q_in) && same_device(out_in, q_in) && same_device(lse, q_in),
            "dout, out, lse: expected the device of q, ", dev(q_in));
  MSA_CHECK(same_shape(dout_in, q_in) && same_shape(out_in, q_in), "dout, out: expected the shape of q ", shape(q_in),
            ", got ", shape(dout_in), " and ", shape(out_in));
  MSA_CHECK(dout_in.scalar_type() == q_in.scalar_type() && out_in.scalar_type() == q_in.scalar_type(),
            "dout, out: expected dtype ", dtype(q_in));
  const int64_t T = q_in.size(0), Hq = q_in.size(1), D = q_in.size(2), Hkv = k_in.size(1), Tk = seqs.total_k;
  MSA_CHECK(lse.scalar_type() == kFloat && lse.dim() == 2 && lse.size(0) == Hq && lse.size(1) == T,
            "lse: expected float32 (", Hq, ", ", T, "), got ", dtype(lse), " ", shape(lse));
  check_cuda_int32(indices, "indices", 3);
  MSA_CHECK(same_device(indices, q_in), "indices: expected device ", dev(q_in));
  const int64_t Hi = indices.size(0);
  MSA_CHECK(indices.size(1) == T, "indices: expected (Hi, ", T, ", topk), got ", shape(indices));
  check_group_heads("indices", Hq, Hkv, Hi);

  const DeviceGuard guard(q_in.get_device_index());
  const bool small = small_smem_bwd_config(q_in, D);
  check_smem(q_in, sm80::sparse_smem_bytes(int(D), 2, 128, small), "the sparse backward");
  const cudaStream_t stream = current_stream(q_in);
  hp.mark("checks");
  const ReverseIndex ri = build_reverse_index(indices, seqs, block_size, bwd_units_per_item(indices));
  hp.mark("ri");
  const int64_t S = seqs.num_seqs;
  const Tensor q = aligned_rows(q_in), k = aligned_rows(k_in), v = aligned_rows(v_in);
  const Tensor dout = aligned_rows(dout_in), out = aligned_rows(out_in);
  const Tensor lse_c = contig(lse);
  // The fp32 accumulators (and deterministic mode's dq_lo), zeroed by one memset, and delta (written by its
  // kernel), in one buffer.
  std::vector<Tensor> acc = deterministic
      ? zeros_f32_parts({{T, Hq, D}, {Tk, Hkv, D}, {Tk, Hkv, D}, {T, Hq, D}, {Hq, T}}, q, stream, 4)
      : zeros_f32_parts({{T, Hq, D}, {Tk, Hkv, D}, {Tk, Hkv, D}, {Hq, T}}, q, stream, 3);
  Tensor dq = acc[0];
  const Tensor dk = acc[1], dv = acc[2], delta = acc.back();
  hp.mark("buffers");
  Tensor dq_lo, dq_grid, dkv_part;  // deterministic mode
  if (T > 0) {
    BwdDeltaParams dp{};
    dp.out = out.data_ptr();
    dp.dout = dout.data_ptr();
    dp.o_stride_t = out.stride(0);
    dp.o_stride_h = out.stride(1);
    dp.do_stride_t = dout.stride(0);
    dp.do_stride_h = dout.stride(1);
    dp.delta = ptr<float>(delta);
    dp.total_tokens = int(T);
    dp.hq = int(Hq);
    dp.d = int(D);
    MSA_LAUNCH_CHECK(smxx::launch_bwd_delta(dp, q.scalar_type() == kBFloat16, stream), "sparse_bwd (delta)");

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
    p.lse = ptr<float>(lse_c);
    p.delta = ptr<float>(delta);
    p.cu_seqlens = ptr<int32_t>(seqs.cu);
    p.cu_seqlens_k = ptr<int32_t>(seqs.cu_k);  // seqs.cu itself without a key layout
    p.offsets = ri.params.offsets;
    p.tokens = ri.params.rows;
    p.block_offsets = ri.params.block_offsets;
    p.item_offsets = ri.params.item_offsets;
    p.items = ri.params.items;
    p.item_order = ri.params.item_order;
    p.num_keys = int(Hi * ri.max_blocks);
    p.units_per_item = int(ri.units_per_item);
    p.max_items = int(ri.max_items);
    p.dq_accum = ptr<float>(dq);
    p.dk_accum = ptr<float>(dk);
    p.dv_accum = ptr<float>(dv);
    if (deterministic) {
      // dQ: exact hi / lo sums. Per element at most topk contributions (one per slot) whose |x| sum to at
      // most scale * D * max|dO| * (max|V| + max|O|) * max|K| (|dP|, |delta| <= D max|dO| max|V or O|,
      // sum of P <= 1), doubled for the rounding of P and dS to the input dtype. dK, dV: per-item partials.
      dq_grid = det_grid({dout, v, out, k}, 0, 2.0 * softmax_scale * double(D), indices.size(2));
      dq_lo = acc[3];
      const int64_t J = Hkv > Hi ? Hkv / Hi : 1;
      dkv_part = empty({ri.max_items * J * 2 * sm80::kBwdKeys * D}, kFloat, q);
      p.dq_lo = ptr<float>(dq_lo);
      p.dq_grid = reinterpret_cast<const float4*>(ptr<float>(dq_grid));
      p.dkv_part = ptr<float>(dkv_part);
    }
    p.total_tokens = int(T);
    p.ws_tma = env_is("MSA_BWD_WS_TMA", "0")   ? kWsTmaOff  // (read by the warp-specialized backward only)
               : env_is("MSA_BWD_WS_TMA", "1") ? kWsTmaOn
                                               : kWsTmaAuto;
    p.num_seqs = int(S);
    p.block_size = int(block_size);
    p.max_blocks = int(ri.max_blocks);
    p.small_smem = small;  // the 99 KB configuration (the Hopper launcher ignores it)
    // Hopper: the warp-specialized kernel (csrc/sm90/sparse_bwd/sparse_bwd_ws.cuh) unless MSA_BWD_WS=0, in both
    // modes (s41: 9% faster than the general one at 32K, 12% at 8K; deterministic, s46: 5.85 against 7.14 ms at 32K;
    // benchmarks/NOTES.md).
    p.ws = !env_is("MSA_BWD_WS", "0");
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
    hp.mark("delta+kernel");
    if (deterministic) {
      item_reduce(dkv_part, p.item_offsets, p.block_offsets, seqs, block_size, ri.max_blocks, Hi, {dk, dv});
    }
  }
  return {dq, dk, dv, dq_lo};
}

// The cast of g's dq (with dq_lo where present), dk and dv to the dtypes of q, k, v.
GradCast cast_dq(const SparseGradsF32& g, const Tensor& q) {
  return {g.dq, q, nullptr, g.dq_lo.defined() ? ptr<float>(g.dq_lo) : nullptr};
}
}  // namespace

std::tuple<Tensor, Tensor, Tensor> sparse_backward_cuda(const Tensor& dout, const Tensor& q, const Tensor& k,
                                                        const Tensor& v, const Tensor& out, const Tensor& lse,
                                                        const Tensor& indices, const SeqMap& seqs, int64_t block_size,
                                                        double softmax_scale, bool deterministic) {
  const SparseGradsF32 f =
      sparse_backward_f32(dout, q, k, v, out, lse, indices, seqs, block_size, softmax_scale, deterministic);
  const std::vector<Tensor> g = cast_grads({cast_dq(f, q), {f.dk, k}, {f.dv, v}}, current_stream(q));
  return {g[0], g[1], g[2]};
}

namespace {

using torch::stable::detail::from;

std::tuple<Tensor, Tensor, Tensor> sparse_bwd_cuda(const Tensor& dout, const Tensor& q, const Tensor& k,
                                                   const Tensor& v, const Tensor& out, const Tensor& lse,
                                                   const Tensor& indices, const std::optional<Tensor>& cu_seqlens,
                                                   int64_t max_seqlen, int64_t block_size, double softmax_scale,
                                                   bool deterministic, const std::optional<Tensor>& cu_seqlens_k,
                                                   std::optional<int64_t> max_seqlen_k) {
  check_qkv_cuda(q, k, v, rows(k));  // the key rows against the layout: seq_map
  const SeqMap seqs = seq_map(cu_seqlens, q.size(0), max_seqlen, cu_seqlens_k, max_seqlen_k, k.size(0), q);
  return sparse_backward_cuda(dout, q, k, v, out, lse, indices, seqs, block_size, softmax_scale, deterministic);
}

// PyTorch's cuDNN or flash backward (the dense main branch of warmup, SPEC 5), through msa::_dense_bwd
// (msa/_ops.py): aten::_flash_attention_backward is deterministic when PyTorch's global flag says so,
// and the stable ABI cannot set that flag, so the Python side sets it for this call when
// deterministic=True (and takes flash then: cuDNN's backward is not repeatable). With a key layout
// (seqs.suffix, never uniform: flash) the keys' offsets go along, as in the forward.
std::tuple<Tensor, Tensor, Tensor> dense_attention_backward(const Tensor& dout, const Tensor& q, const Tensor& k,
                                                            const Tensor& v, const Tensor& out, const Tensor& lse,
                                                            const SeqMap& seqs, int64_t max_seqlen,
                                                            double softmax_scale, bool deterministic) {
  const std::optional<Tensor> cu_k = seqs.suffix ? std::optional<Tensor>(seqs.cu_k) : std::nullopt;
  const std::optional<int64_t> max_k = seqs.suffix ? std::optional<int64_t>(seqs.max_k) : std::nullopt;
  std::array<StableIValue, 13> st{from(dout),          from(q),             from(k),           from(v),
                                  from(out),           from(lse),           from(seqs.cu),     from(max_seqlen),
                                  from(softmax_scale), from(deterministic), from(seqs.uniform), from(cu_k),
                                  from(max_k)};
  detail::call_op("msa::_dense_bwd", "", st);
  using torch::stable::detail::to;
  return {to<Tensor>(st[0]), to<Tensor>(st[1]), to<Tensor>(st[2])};
}

std::tuple<Tensor, Tensor, Tensor, Tensor, Tensor> msa_bwd_cuda(
    const std::optional<Tensor>& dout, const std::optional<Tensor>& dkl, const Tensor& q, const Tensor& k,
    const Tensor& v, const Tensor& out, const Tensor& lse, const Tensor& q_idx, const Tensor& k_idx,
    const Tensor& lse_idx, const Tensor& indices, const Tensor& kl_dq_idx, const Tensor& kl_dk_idx,
    const std::optional<Tensor>& cu_seqlens, int64_t max_seqlen, int64_t block_size, double softmax_scale,
    double index_scale, bool warmup, bool deterministic, const std::optional<Tensor>& cu_seqlens_k,
    std::optional<int64_t> max_seqlen_k) {
  (void)lse_idx;
  (void)index_scale;
  HostPhases hp("msa_bwd");
  check_qkv_cuda(q, k, v, rows(k));  // the key rows against the layout: seq_map
  MSA_CHECK(same_device(q_idx, q) && same_device(k_idx, q), "q_idx, k_idx: expected device ", dev(q));
  Tensor dq, dk, dv, dq_idx, dk_idx;
  // The sparse backward's fp32 gradients, cast together with the index gradients below (one launch).
  SparseGradsF32 f;
  if (dout.has_value()) {
    const SeqMap seqs = seq_map(cu_seqlens, q.size(0), max_seqlen, cu_seqlens_k, max_seqlen_k, k.size(0), q);
    const DeviceGuard guard(q.get_device_index());
    hp.mark("checks");
    if (warmup) {
      // SPEC 5: the dense main branch's gradients from PyTorch's cuDNN or flash backward.
      std::tie(dq, dk, dv) =
          dense_attention_backward(*dout, q, k, v, out, lse, seqs, max_seqlen, softmax_scale, deterministic);
    } else {
      f = sparse_backward_f32(*dout, q, k, v, out, lse, indices, seqs, block_size, softmax_scale, deterministic);
    }
    hp.mark(warmup ? "dense_bwd" : "sparse_bwd");
  } else {
    dq = zeros_as(q);
    dk = zeros_as(k);
    dv = zeros_as(v);
  }
  const bool sparse = f.dq.defined();
  // One cast launch for the sparse backward's fp32 gradients and the index gradients.
  std::vector<GradCast> casts;
  if (sparse) {
    casts.push_back(cast_dq(f, q));
    casts.push_back({f.dk, k});
    casts.push_back({f.dv, v});
  }
  Tensor s;  // d_kl in fp32 on the device (alive until the cast is enqueued)
  if (dkl.has_value()) {
    // SPEC 4: the KL's gradient is linear in d_kl; the forward computed it for d_kl = 1.
    MSA_CHECK(same_shape(kl_dq_idx, q_idx) && same_shape(kl_dk_idx, k_idx),
              "kl_dq_idx, kl_dk_idx: expected the forward's index gradients (msa_fwd with index_grad=True), "
              "got shapes ", shape(kl_dq_idx), " and ", shape(kl_dk_idx));
    MSA_CHECK(dkl->numel() == 1 && same_device(*dkl, q_idx), "d_kl: expected one value on ", dev(q_idx),
              ", got shape ", shape(*dkl), " on ", dev(*dkl));
    MSA_CHECK(kl_dq_idx.is_contiguous() && kl_dk_idx.is_contiguous() && kl_dq_idx.scalar_type() == kFloat &&
                  kl_dk_idx.scalar_type() == kFloat,
              "kl_dq_idx, kl_dk_idx: expected the forward's contiguous fp32 index gradients");
    const DeviceGuard guard(q_idx.get_device_index());
    s = contig(cast(*dkl, kFloat));
    // The fp32 index gradients for d_kl = 1, times d_kl (a device scalar).
    const float* sc = ptr<float>(s);
    casts.push_back({kl_dq_idx, q_idx, sc});
    casts.push_back({kl_dk_idx, k_idx, sc});
  }
  if (!casts.empty()) {  // cast_grads holds the device guard
    const std::vector<Tensor> g = cast_grads(casts, current_stream(q_idx));
    size_t i = 0;
    if (sparse) dq = g[i++], dk = g[i++], dv = g[i++];
    if (dkl.has_value()) dq_idx = g[i++], dk_idx = g[i++];
  }
  if (!dkl.has_value()) {
    dq_idx = zeros_as(q_idx);
    dk_idx = zeros_as(k_idx);
  }
  hp.mark("casts");
  return {dq, dk, dv, dq_idx, dk_idx};
}

}  // namespace

STABLE_TORCH_LIBRARY_IMPL(msa, CUDA, m) {
  m.impl("sparse_bwd", TORCH_BOX(&sparse_bwd_cuda));
  m.impl("msa_bwd", TORCH_BOX(&msa_bwd_cuda));
}

}  // namespace msa::api
