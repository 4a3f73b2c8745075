// PyTorch's dense causal attention for the warmup path (SPEC 5): the dense main branch's forward and backward, and
// the index branch's lse_idx where the Hopper index kernel does not give it. Through msa::_dense_fwd /
// msa::_dense_bwd (msa/_ops.py), which choose cuDNN or flash and call aten by keyword (those schemas grow between
// torch releases; the flash backward's determinism is PyTorch's global flag, which the stable ABI cannot set), or,
// for the main branch's forward where msa/_ops.py has chosen cuDNN (msa_fwd's dense_cudnn), cuDNN's forward called
// from here: the Python kernel costs ~100-300 us of host time per call at 8K, aten's op ~50 (NOTES s82).
#include <atomic>

#include "api/ops.h"

namespace msa::api {
namespace {

using torch::stable::detail::from;
using torch::stable::detail::to;

// Set after a direct cuDNN call failed or returned an unexpected layout while msa::_dense_fwd then gave the
// result: from then on every call takes msa::_dense_fwd (its own cuDNN attempt warns and switches a failing shape
// to flash; a failure of this call's own conversions would repeat on every shape).
std::atomic<bool> direct_off{false};

// (T, H, D) rows of `batch` equal sequences as the (B, H, N, D) view cuDNN takes (msa/_ops.py _bhnd).
Tensor bhnd(const Tensor& x, int64_t batch) {
  const int64_t n = x.size(0) / batch;
  const int64_t strides[4] = {n * x.stride(0), x.stride(1), x.stride(0), x.stride(2)};
  return strided_view(x, {batch, x.size(1), n, x.size(2)}, strides);
}

// A contiguous copy of x's elements in the order of `shape` / `strides` (a view of x), or x's view itself where
// that order is already contiguous (aten::contiguous returns its input then).
Tensor gathered(const Tensor& x, const std::vector<int64_t>& shape, const int64_t* strides) {
  return contig(strided_view(x, shape, strides));
}

// aten::_scaled_dot_product_cudnn_attention(query, key, value, attn_bias, compute_log_sumexp, dropout_p, is_causal,
// return_debug_mask, *, scale) -> (output, logsumexp, cum_seq_q, cum_seq_k, max_q, max_k, philox_seed,
// philox_offset, debug_attn_mask): out (T, H, D) and lse (H, T), or nullopt where the call failed or its outputs
// are not of the shapes expected. msa/_ops.py passes dense_cudnn only where this schema is the running torch's.
std::optional<std::tuple<Tensor, Tensor>> cudnn_forward(const Tensor& q, const Tensor& k, const Tensor& v,
                                                        int64_t batch, double scale) {
  const int64_t T = q.size(0), H = q.size(1), D = v.size(2), n = T / batch;
  std::array<StableIValue, 9> st{from(bhnd(q, batch)),        from(bhnd(k, batch)), from(bhnd(v, batch)),
                                 from(std::optional<Tensor>()), from(true),           from(0.0),
                                 from(true),                    from(false),          from(std::optional<double>(scale))};
  if (torch_call_dispatcher("aten::_scaled_dot_product_cudnn_attention", "", st.data(), TORCH_ABI_VERSION) !=
      AOTI_TORCH_SUCCESS) {
    return std::nullopt;
  }
  const Tensor out = to<Tensor>(st[0]), lse = to<Tensor>(st[1]);
  for (int i : {2, 3, 6, 7, 8}) (void)to<Tensor>(st[i]);  // released (max_q, max_k: ints)
  // out (B, H, N, D), in memory (B, N, H, D) as cuDNN writes it; lse (B, H, N[, 1]) fp32.
  const bool out_ok = out.dim() == 4 && out.size(0) == batch && out.size(1) == H && out.size(2) == n &&
                      out.size(3) == D && out.scalar_type() == q.scalar_type();
  const bool lse_ok = (lse.dim() == 3 || (lse.dim() == 4 && lse.size(3) == 1)) && lse.size(0) == batch &&
                      lse.size(1) == H && lse.size(2) == n && lse.scalar_type() == kFloat;
  if (!out_ok || !lse_ok) return std::nullopt;
  const int64_t out_bnhd[4] = {out.stride(0), out.stride(2), out.stride(1), out.stride(3)};
  const int64_t lse_hbn[3] = {lse.stride(1), lse.stride(0), lse.stride(2)};
  return std::tuple{part_view(gathered(out, {batch, n, H, D}, out_bnhd), 0, {T, H, D}),
                    part_view(gathered(lse, {H, batch, n}, lse_hbn), 0, {H, T})};
}

}  // namespace

std::tuple<Tensor, Tensor> dense_attention_forward(const Tensor& q, const Tensor& k, const Tensor& v,
                                                   const SeqMap& seqs, int64_t max_seqlen, double scale,
                                                   bool deterministic, bool lse_only, bool cudnn_direct) {
  const int64_t batch = seqs.num_seqs;
  const bool direct = cudnn_direct && !lse_only && !deterministic && seqs.uniform && !seqs.suffix && scale > 0 &&
                      batch > 0 && q.size(0) / batch >= 2 && !direct_off.load(std::memory_order_relaxed);
  if (direct) {
    if (auto r = cudnn_forward(q, k, v, batch, scale)) return *r;
  }
  const std::optional<Tensor> cu_k = seqs.suffix ? std::optional<Tensor>(seqs.cu_k) : std::nullopt;
  const std::optional<int64_t> max_k = seqs.suffix ? std::optional<int64_t>(seqs.max_k) : std::nullopt;
  std::array<StableIValue, 11> st{from(q),           from(k),     from(v),           from(seqs.cu),
                                  from(max_seqlen),  from(scale), from(seqs.uniform), from(deterministic),
                                  from(lse_only),    from(cu_k),  from(max_k)};
  detail::call_op("msa::_dense_fwd", "", st);
  if (direct) direct_off.store(true, std::memory_order_relaxed);  // the direct call failed; this one did not
  return {to<Tensor>(st[0]), to<Tensor>(st[1])};
}

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
  return {to<Tensor>(st[0]), to<Tensor>(st[1]), to<Tensor>(st[2])};
}

}  // namespace msa::api
