// msa::select_blocks on CUDA (SPEC 2): argument checks, allocation, params, dispatch on (dtype, Di); and warmup's
// lse_idx on the same Hopper kernel (index_lse_cuda).
#include "api/checks.h"
#include "api/dispatch.h"
#include "api/host_phases.h"
#include "api/ops.h"
#include "sm80/index_topk/index_topk.h"
#ifdef MSA_WITH_SM90
#include "sm90/index_topk/index_topk.h"
#endif

namespace msa::api {

namespace {

// The fields select_blocks and index_lse share (q, k: the 16-byte aligned q_idx, k_idx).
IndexTopkParams index_params(const Tensor& q, const Tensor& k, const SeqMap& seqs, int64_t max_seqlen,
                             double index_scale) {
  IndexTopkParams p{};
  p.q_idx = q.data_ptr();
  p.k_idx = k.data_ptr();
  p.cu_seqlens = ptr<int32_t>(seqs.cu);
  p.cu_seqlens_k = ptr<int32_t>(seqs.cu_k);  // seqs.cu itself without a key layout
  p.q_stride_t = q.stride(0);
  p.q_stride_h = q.stride(1);
  p.k_stride_t = k.stride(0);
  p.k_stride_h = k.stride(1);
  p.total_tokens = int(q.size(0));
  p.total_tokens_k = int(seqs.total_k);
  p.num_heads = int(q.size(1));
  p.num_key_heads = int(k.size(1));
  p.num_seqs = int(seqs.num_seqs);
  // No sequence is longer than T: a looser bound would only add CTAs that find no token.
  p.max_seqlen = int(std::clamp<int64_t>(max_seqlen, 1, std::max<int64_t>(q.size(0), 1)));
  // The top-k kernels' grid is (query tiles of max_seqlen) x (sequences) in one 32-bit dimension; the smallest
  // tile any of them takes holds 64 / (Hi / Hki) tokens (at least 1).
  const int64_t tile_min = std::max<int64_t>(64 / (q.size(1) / std::max<int64_t>(k.size(1), 1)), 1);
  MSA_CHECK((p.max_seqlen + tile_min - 1) / tile_min * seqs.num_seqs < (int64_t(1) << 31),
            "max_seqlen: expected a bound whose index top-k grid (", seqs.num_seqs, " sequences x tiles of up to ",
            tile_min, " tokens) stays under 2^31 CTAs, e.g. the longest sequence, got ", p.max_seqlen);
  p.scale = float(index_scale);
  return p;
}

}  // namespace

namespace {

// The top-k's params: index_params, its output and the selection's sizes (both select_blocks kernels' launches).
IndexTopkParams topk_params(const Tensor& q, const Tensor& k, const SeqMap& seqs, int64_t max_seqlen,
                            double index_scale, const Tensor& indices, int64_t topk, int64_t block_size) {
  IndexTopkParams p = index_params(q, k, seqs, max_seqlen, index_scale);
  p.indices = ptr<int32_t>(indices);
  p.topk = int(topk);
  p.block_size = int(block_size);
  return p;
}

// FP8 selection inputs (index_dtype, SPEC 2) on the Hopper FP8 top-k: Di = 128, rows 16-byte aligned (else a
// contiguous copy), the plain top-k (no kept-block sums) into `indices`. False (nothing launched) where the kernel
// does not apply; the caller then runs the 16-bit kernels on the inputs widened to bf16, which holds every e4m3 value
// exactly, so the selection is the same up to the fp32 sums' order.
bool select_blocks_fp8(const Tensor& q_idx, const Tensor& k_idx, const SeqMap& seqs, int64_t max_seqlen, int64_t topk,
                       int64_t block_size, double index_scale, const Tensor& indices) {
#ifdef MSA_WITH_SM90
  if (!use_sm90_kernels() || q_idx.size(2) != 128) return false;
  const Tensor q = aligned_rows(q_idx, 1), k = aligned_rows(k_idx, 1);
  const IndexTopkParams p = topk_params(q, k, seqs, max_seqlen, index_scale, indices, topk, block_size);
  const cudaError_t err = sm90::launch_index_topk_fp8<128>(p, current_stream(q));
  // No TMA descriptor for this k_idx, or an odd stride left (a size-1 dim's, which contig() keeps): nothing
  // launched, the widened inputs take it.
  if (err == cudaErrorNotSupported || err == cudaErrorInvalidValue) return false;
  MSA_LAUNCH_CHECK(err, "select_blocks (fp8)");
  return true;
#else
  (void)q_idx, (void)k_idx, (void)seqs, (void)max_seqlen, (void)topk, (void)block_size, (void)index_scale,
      (void)indices;
  return false;
#endif
}

}  // namespace

Tensor select_blocks_cuda(const Tensor& q_idx_in, const Tensor& k_idx_in, const SeqMap& seqs, int64_t max_seqlen,
                          int64_t topk, int64_t block_size, double index_scale, std::optional<Tensor>* sel_stats) {
  HostPhases hp("select_blocks");
  MSA_CHECK(q_idx_in.is_cuda() && same_device(k_idx_in, q_idx_in), "q_idx, k_idx: expected one CUDA device, got ",
            dev(q_idx_in), ", ", dev(k_idx_in));
  const bool fp8 = q_idx_in.scalar_type() == ScalarType::Float8_e4m3fn;
  MSA_CHECK(q_idx_in.scalar_type() == kBFloat16 || q_idx_in.scalar_type() == kHalf || fp8,
            "q_idx: expected bfloat16, float16 or float8_e4m3fn, got ", dtype(q_idx_in));
  MSA_CHECK(k_idx_in.scalar_type() == q_idx_in.scalar_type(), "k_idx: expected dtype ", dtype(q_idx_in), ", got ",
            dtype(k_idx_in));
  MSA_CHECK(!fp8 || sel_stats == nullptr, "select_blocks: FP8 inputs give no kept-block sums");
  MSA_CHECK(q_idx_in.dim() == 3 && k_idx_in.dim() == 3, "q_idx, k_idx: expected (T, H, Di), got ", shape(q_idx_in),
            " and ", shape(k_idx_in));
  const int64_t T = q_idx_in.size(0), Hi = q_idx_in.size(1), Di = q_idx_in.size(2), Hki = k_idx_in.size(1);
  const int64_t Tk = seqs.total_k;
  MSA_CHECK(k_idx_in.size(0) == Tk && k_idx_in.size(2) == Di, "k_idx: expected (", Tk, ", Hki, ", Di, "), got ",
            shape(k_idx_in));
  MSA_CHECK(Di == 64 || Di == 128, "q_idx: expected head dim 64 or 128, got ", Di);
  MSA_CHECK(Hki >= 1 && Hi % Hki == 0 && Hi / Hki <= 64, "k_idx: expected Hki dividing Hi = ", Hi,
            " with Hi / Hki <= 64, got Hki = ", Hki);
  MSA_CHECK(topk >= 1 && topk <= 32, "topk: expected 1..32, got ", topk);
  MSA_CHECK(block_size == 64 || block_size == 128, "block_size: expected 64 or 128, got ", block_size);
  MSA_CHECK(q_idx_in.stride(2) == 1 && k_idx_in.stride(2) == 1, "q_idx, k_idx: expected a contiguous last dim");
  const DeviceGuard guard(q_idx_in.get_device_index());
  hp.mark("checks");
  Tensor indices = empty({Hi, T, topk}, kInt, q_idx_in);
  if (T == 0) return indices;
  hp.mark("alloc");
  Tensor q_idx = q_idx_in, k_idx = k_idx_in;
  if (fp8) {
    if (select_blocks_fp8(q_idx, k_idx, seqs, max_seqlen, topk, block_size, index_scale, indices)) return indices;
    // FP8 inputs the Hopper FP8 kernel does not take (Di = 64, other GPUs, no TMA descriptor): widened to bf16
    // (exact), then as 16-bit inputs.
    q_idx = torch::stable::to(q_idx_in, kBFloat16);
    k_idx = torch::stable::to(k_idx_in, kBFloat16);
  }
  const Tensor q = aligned_rows(q_idx), k = aligned_rows(k_idx);
  IndexTopkParams p = topk_params(q, k, seqs, max_seqlen, index_scale, indices, topk, block_size);
  p.small_smem = env_is("MSA_SMALL_SMEM", "1");  // forces the portable kernel's 64-row tile (99 KB GPUs take it)
  const cudaStream_t stream = current_stream(q_idx);
  [[maybe_unused]] const bool sm90 = use_sm90_kernels();
  Tensor sel;  // the kept blocks' (max, sum) per row, for the caller (sm90 kernel only)
  if (sm90 && sel_stats != nullptr) sel = empty({Hi, T, 2}, kFloat, q_idx);
  hp.mark("params");
  dispatch_dtype_dim(q.scalar_type(), Di, [&]<typename T_, int D_>() {
#ifdef MSA_WITH_SM90
    if (sm90) {  // cudaErrorNotSupported: no TMA descriptor for this k_idx (nothing launched)
      if (sel_stats != nullptr) p.sel_stats = reinterpret_cast<float2*>(ptr<float>(sel));
      const cudaError_t err = sm90::launch_index_topk<T_, D_>(p, stream);
      if (err != cudaErrorNotSupported) {
        MSA_LAUNCH_CHECK(err, "select_blocks");
        if (sel_stats != nullptr) *sel_stats = sel;
        return;
      }
      p.sel_stats = nullptr;
    }
#endif
    MSA_LAUNCH_CHECK((sm80::launch_index_topk<T_, D_>(p, stream)), "select_blocks");
  });
  hp.mark("launch");
  return indices;
}

std::optional<Tensor> index_lse_cuda(const Tensor& q_idx, const Tensor& k_idx, const SeqMap& seqs, int64_t max_seqlen,
                                     double index_scale) {
#ifdef MSA_WITH_SM90
  // Inputs as msa_fwd checked them (check_index_cuda: dtype, Di in {64, 128}, Hki dividing Hi; the layout). The
  // kernel's CTAs hold at least two tokens of Hi / Hki <= 64 index heads (select_blocks' own limit): more heads
  // per index key head take the dense forward.
  const DeviceGuard guard(q_idx.get_device_index());
  const int64_t T = q_idx.size(0), Hi = q_idx.size(1), Di = q_idx.size(2);
  if (!use_sm90_kernels() || env_is("MSA_INDEX_LSE", "dense") || Hi / k_idx.size(1) > 64) return std::nullopt;
  Tensor lse = empty({Hi, T}, kFloat, q_idx);
  if (T == 0) return lse;
  const Tensor q = aligned_rows(q_idx), k = aligned_rows(k_idx);
  IndexTopkParams p = index_params(q, k, seqs, max_seqlen, index_scale);
  p.lse = ptr<float>(lse);
  p.topk = 1;
  p.block_size = 128;
  const cudaStream_t stream = current_stream(q_idx);
  bool launched = false;
  dispatch_dtype_dim(q.scalar_type(), Di, [&]<typename T_, int D_>() {
    const cudaError_t err = sm90::launch_index_lse<T_, D_>(p, stream);
    if (err == cudaErrorNotSupported) return;  // no TMA descriptor for this k_idx: nothing launched
    MSA_LAUNCH_CHECK(err, "msa_fwd (index lse)");
    launched = true;
  });
  if (launched) return lse;
#else
  (void)q_idx, (void)k_idx, (void)seqs, (void)max_seqlen, (void)index_scale;
#endif
  return std::nullopt;
}

namespace {

Tensor select_blocks_op(const Tensor& q_idx, const Tensor& k_idx, const std::optional<Tensor>& cu_seqlens,
                        int64_t max_seqlen, int64_t topk, int64_t block_size, double index_scale,
                        const std::optional<Tensor>& cu_seqlens_k, std::optional<int64_t> max_seqlen_k) {
  MSA_CHECK(q_idx.is_cuda() && q_idx.dim() == 3, "q_idx: expected a (T, Hi, Di) CUDA tensor, got ", shape(q_idx),
            " on ", dev(q_idx));
  const SeqMap seqs =
      seq_map(cu_seqlens, q_idx.size(0), max_seqlen, cu_seqlens_k, max_seqlen_k, rows(k_idx), q_idx);
  return select_blocks_cuda(q_idx, k_idx, seqs, max_seqlen, topk, block_size, index_scale);
}

}  // namespace

STABLE_TORCH_LIBRARY_IMPL(msa, CUDA, m) { m.impl("select_blocks", TORCH_BOX(&select_blocks_op)); }

}  // namespace msa::api
