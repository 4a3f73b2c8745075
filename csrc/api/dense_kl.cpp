// Warmup's KL pass on Hopper (SPEC 4 and 5): csrc/sm90/dense_kl, given the dense attention's lse and
// lse_idx. msa_fwd takes it for J = 1 layouts outside deterministic mode (dense_kl_applies); the
// sparse kernels in dense mode cover the rest.
#include <algorithm>

#include "api/checks.h"
#include "api/dispatch.h"
#include "api/ops.h"
#include "smxx/reverse_index/reverse_index.h"
#ifdef MSA_WITH_SM90
#include "sm90/dense_kl/dense_kl.h"
#endif

namespace msa::api {

bool dense_kl_applies(const Tensor& k, const Tensor& q_idx, bool deterministic) {
#ifdef MSA_WITH_SM90
  // J = 1: Hkv <= Hi, so every head of an index group reads one kv head.
  return use_sm90_kernels() && !deterministic && k.size(1) <= q_idx.size(1) && !env_is("MSA_DENSE_KL", "0");
#else
  (void)k, (void)q_idx, (void)deterministic;
  return false;
#endif
}

SparseForward dense_kl_cuda(const Tensor& q_in, const Tensor& k_in, const Tensor& q_idx_in, const Tensor& k_idx_in,
                            const SeqMap& seqs, int64_t max_seqlen, double softmax_scale, double index_scale,
                            bool index_grad, const Tensor& lse, const Tensor& lse_idx) {
  SparseForward res;
#ifdef MSA_WITH_SM90
  const int64_t T = q_in.size(0), Hq = q_in.size(1), D = q_in.size(2), Hkv = k_in.size(1);
  const int64_t Hi = q_idx_in.size(1), Hki = k_idx_in.size(1), Di = q_idx_in.size(2), S = seqs.num_seqs;
  const int64_t Tk = seqs.total_k;
  const DeviceGuard guard(q_in.get_device_index());
  const cudaStream_t stream = current_stream(q_in);
  const Tensor q = aligned_rows(q_in), k = aligned_rows(k_in), qi = aligned_rows(q_idx_in), ki = aligned_rows(k_idx_in);
  res.lse = contig(lse);
  res.lse_idx = contig(lse_idx);
  res.kl_rows = empty({Hi, T}, kFloat, q);
  if (index_grad) {
    res.kl_dq_idx = zeros({T, Hi, Di}, kFloat, q);
    res.kl_dk_idx = zeros({Tk, Hki, Di}, kFloat, q);
  }
  if (T == 0) return res;
  const int smem = sm90::dense_kl_smem_bytes(int(D), int(Di), int(Hq / Hi));
  check_smem(q_in, smem, "the dense KL pass");
  const Tensor kl_fixed = zeros({Hi, T}, kLong, q);
  const Tensor kl_bad = zeros({Hi, T}, kInt, q);
  const Tensor tile_offsets = empty({S + 1}, kInt, q);  // 128-key tiles: of the keys' layout
  MSA_LAUNCH_CHECK(launch_block_offsets(ptr<int32_t>(seqs.cu_k), ptr<int32_t>(tile_offsets), int(S), 128, stream),
                   "msa_fwd (dense KL tiles)");

  DenseKlParams p{};
  p.q = q.data_ptr();
  p.k = k.data_ptr();
  p.q_idx = qi.data_ptr();
  p.k_idx = ki.data_ptr();
  p.q_stride_t = q.stride(0);
  p.q_stride_h = q.stride(1);
  p.k_stride_t = k.stride(0);
  p.k_stride_h = k.stride(1);
  p.qi_stride_t = qi.stride(0);
  p.qi_stride_h = qi.stride(1);
  p.ki_stride_t = ki.stride(0);
  p.ki_stride_h = ki.stride(1);
  p.cu_seqlens = ptr<int32_t>(seqs.cu);
  p.cu_seqlens_k = ptr<int32_t>(seqs.cu_k);  // seqs.cu itself without a key layout
  p.tile_offsets = ptr<int32_t>(tile_offsets);
  p.lse = ptr<float>(res.lse);
  p.lse_idx = ptr<float>(res.lse_idx);
  p.dq_idx = index_grad ? ptr<float>(res.kl_dq_idx) : nullptr;
  p.dk_idx = index_grad ? ptr<float>(res.kl_dk_idx) : nullptr;
  p.kl_fixed = reinterpret_cast<unsigned long long*>(ptr<int64_t>(kl_fixed));
  p.kl_bad = reinterpret_cast<unsigned int*>(ptr<int32_t>(kl_bad));
  p.total_tokens = int(T);
  p.num_seqs = int(S);
  p.num_tiles = int(Tk / 128 + S);
  // Query tiles per CTA: ~32 chunks per key tile's column, at least 4 (the dK_idx flush is per CTA).
  const int64_t n_qt = (std::min<int64_t>(max_seqlen, T) + 63) / 64;
  // (MSA_DENSE_KL_CHUNK beyond n_qt is one chunk, as n_qt is.)
  p.chunk_tiles = int(std::min<int64_t>(env_positive("MSA_DENSE_KL_CHUNK", std::max<int64_t>(4, n_qt / 32)),
                                        std::max<int64_t>(n_qt, 1)));
  p.max_chunks = int((n_qt + p.chunk_tiles - 1) / p.chunk_tiles);
  // The grid's order (DenseKlParams::chunk_major): chunk-major (s73 on the H100: -20% at 128K, -4% at 32K, -3% at
  // 8K) unless MSA_DENSE_KL_ORDER=tile (an A/B knob).
  p.chunk_major = env_is("MSA_DENSE_KL_ORDER", "tile") ? 0 : 1;
  // The index warpgroup (s76) unless MSA_DENSE_KL_WS=0 (the two-warpgroup kernel; an A/B knob).
  p.ws = env_is("MSA_DENSE_KL_WS", "0") ? 0 : 1;
  MSA_CHECK(int64_t(p.num_tiles) * p.max_chunks < (int64_t(1) << 31) && Hki <= 65535,
            "q: too many query tiles for the dense KL grid, T = ", T, ", T_k = ", Tk);
  p.hq = int(Hq);
  p.hkv = int(Hkv);
  p.hi = int(Hi);
  p.hki = int(Hki);
  p.scale_log2 = float(softmax_scale * 1.4426950408889634);
  p.iscale_log2 = float(index_scale * 1.4426950408889634);
  p.grad_scale = float(index_scale / double(T * Hi));
  dispatch_dtype_dim(q.scalar_type(), D, [&]<typename T_, int D_>() {
    const cudaError_t err = Di == 64 ? sm90::launch_dense_kl<T_, D_, 64>(p, stream)
                                     : sm90::launch_dense_kl<T_, D_, 128>(p, stream);
    MSA_LAUNCH_CHECK(err, "msa_fwd (dense KL)");
  });
  MSA_LAUNCH_CHECK(sm90::launch_dense_kl_finish(p.kl_fixed, p.kl_bad, p.lse_idx, ptr<float>(res.kl_rows), Hi * T, stream),
                   "msa_fwd (dense KL finish)");
#else
  (void)q_in, (void)k_in, (void)q_idx_in, (void)k_idx_in, (void)seqs, (void)max_seqlen, (void)softmax_scale;
  (void)index_scale, (void)index_grad, (void)lse, (void)lse_idx;
  MSA_CHECK(false, "msa: the dense KL pass needs a build with sm_90a kernels");
#endif
  return res;
}

}  // namespace msa::api
