// CUDA implementations that other entry points call directly (msa_fwd runs the selection itself).
#pragma once

#include <optional>
#include <tuple>
#include <vector>

#include "api/checks.h"
#include "api/stable.h"
#include "common/workspace.h"
#include "params.h"

namespace msa::api {

// sel_stats (nullable): where the Hopper kernel ran, set to its (Hi, T, 2) fp32 per-row (max, sum) of the kept
// blocks' index logits (IndexTopkParams::sel_stats), for sparse_forward_cuda; left empty otherwise.
Tensor select_blocks_cuda(const Tensor& q_idx, const Tensor& k_idx, const SeqMap& seqs,
                              int64_t max_seqlen, int64_t topk, int64_t block_size, double index_scale,
                              std::optional<Tensor>* sel_stats = nullptr);

// Warmup's lse_idx (Hi, T) on the Hopper index kernel (csrc/sm90/index_topk, kLse), or nullopt where it does not
// apply (not the sm90 path, MSA_INDEX_LSE=dense, no TMA descriptor for k_idx): the caller takes the dense forward.
std::optional<Tensor> index_lse_cuda(const Tensor& q_idx, const Tensor& k_idx, const SeqMap& seqs, int64_t max_seqlen,
                                     double index_scale);

// The sparse forward of SPEC 3 (and, with q_idx/k_idx, the KL terms of SPEC 4) over `indices`.
struct SparseForward {
  Tensor out;      // (T, Hq, D)
  Tensor lse;      // (Hq, T) fp32
  Tensor lse_idx;  // (Hi, T) fp32, empty without the index branch
  Tensor kl_rows;  // (Hi, T) fp32 per-row KL, empty without the index branch
  Tensor kl_dq_idx;  // (T, Hi, Di) fp32 d kl / d q_idx, with index_grad only
  Tensor kl_dk_idx;  // (Tk, Hki, Di) fp32 d kl / d k_idx, with index_grad only
};
SparseForward sparse_forward_cuda(const Tensor& q, const Tensor& k, const Tensor& v,
                                  const std::optional<Tensor>& q_idx, const std::optional<Tensor>& k_idx,
                                  const Tensor& indices, const SeqMap& seqs, int64_t block_size,
                                  double softmax_scale, double index_scale, bool index_grad, bool deterministic,
                                  bool dense = false, const std::optional<Tensor>& lse_given = std::nullopt,
                                  const std::optional<Tensor>& lse_idx_given = std::nullopt,
                                  const std::optional<Tensor>& sel_stats = std::nullopt);
// dense: warmup (SPEC 5), every block up to the token's own (indices is then only read for Hi); with
// lse_given (Hq, T) the main branch's lse comes from elsewhere and only the KL part runs; with
// lse_idx_given (Hi, T) too, the stats pass is skipped (it would only compute lse_idx). q_idx / k_idx:
// the caller has checked them against q and k (msa_fwd_cuda, before any launch). sel_stats: select_blocks_cuda's
// for these indices; the stats pass then scores the index branch on each row's own block only.
// sel_stats_applies: whether msa_fwd asks the selection for it (sequences of at most MSA_SEL_MAX_BLOCKS key
// blocks, default 128; 0 turns it off).
bool sel_stats_applies(const SeqMap& seqs, int64_t block_size);

// Warmup's KL pass on Hopper (csrc/api/dense_kl.cpp): lse, lse_idx, kl_rows and (index_grad) the KL's
// index gradients, given the dense attention's lse and lse_idx; out is left empty. dense_kl_applies:
// this build and device take it for these heads (J = 1) outside deterministic mode.
bool dense_kl_applies(const Tensor& k, const Tensor& q_idx, bool deterministic);
SparseForward dense_kl_cuda(const Tensor& q, const Tensor& k, const Tensor& q_idx, const Tensor& k_idx,
                            const SeqMap& seqs, int64_t max_seqlen, double softmax_scale, double index_scale,
                            bool index_grad, const Tensor& lse, const Tensor& lse_idx);

// An fp32 gradient and the input whose dtype and shape it takes; scale: a device scalar it is multiplied
// by, or nullptr; lo: an fp32 array added to it first (deterministic mode's low parts), or nullptr.
struct GradCast {
  const Tensor& f32;
  const Tensor& like;
  const float* scale = nullptr;
  const float* lo = nullptr;
};
// The gradients cast (and scaled), bf16 ones in one launch and fp16 ones in another; at most
// smxx::kMaxCastSegments (5: a step's five gradients) per call.
std::vector<Tensor> cast_grads(const std::vector<GradCast>& grads, cudaStream_t stream);

// The main branch's gradients (SPEC 3) from the forward's lse.
std::tuple<Tensor, Tensor, Tensor> sparse_backward_cuda(
    const Tensor& dout, const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& out,
    const Tensor& lse, const Tensor& indices, const SeqMap& seqs, int64_t block_size, double softmax_scale,
    bool deterministic);

// A reverse index as the kernels read it: params points into `storage` (its outputs; the build's workspace
// only while the build is enqueued); the forward places everything in its own workspace (storage undefined).
struct ReverseIndex {
  Tensor storage;
  int64_t max_blocks = 0, units_per_item = 0, max_items = 0;
  ReverseIndexParams params{};  // the whole token range
};
// The sizes of a reverse index with room for `capacity` entries (all of `indices`, or one query chunk's) and
// where its outputs and workspace lie in allocations planned by `out` and `work` (which may be one plan).
// topk: slots per token (indices.size(2), or the dense mode's block count). units_per_item > 0 adds the work
// list. Keys are (index group, global block of seqs' key layout).
struct ReverseIndexPlan {
  ReverseIndexSizes sizes;
  ReverseIndexLayout layout;
};
ReverseIndexPlan plan_reverse_index(const Tensor& indices, const SeqMap& seqs, int64_t topk, int64_t block_size,
                                    int64_t capacity, int64_t units_per_item, BytePlan& out, BytePlan& work);
// The reverse index over the plan's places in `out` and `work` (device memory the caller keeps alive); callers
// set the chunk's token range, emit_entries and dense in params.
ReverseIndex place_reverse_index(const ReverseIndexPlan& plan, const Tensor& indices, const SeqMap& seqs, char* out,
                                 char* work);
// Whether the work list gets a launch order, largest items first (default; MSA_ITEM_ORDER=0: key order).
bool item_order_enabled();
// The reverse index of a whole selection: per key (index group r, global block) the tokens that selected
// it, ascending; with units_per_item > 0 also the work list that splits hot keys into items of at most
// that many tokens (item_offsets (keys + 1), items (max_items, 2) = (key, first row)). Built in two
// allocations (the outputs; the workspace, released once the build is enqueued).
ReverseIndex build_reverse_index(const Tensor& indices, const SeqMap& seqs, int64_t block_size,
                                 int64_t units_per_item);

std::tuple<Tensor, Tensor, Tensor> reverse_index_cuda(const Tensor& indices,
                                                                  const std::optional<Tensor>& cu_seqlens,
                                                                  int64_t max_seqlen, int64_t block_size);

// Deterministic mode (params.h, DetGridParams). det_grid: the summation grid, a (4,) fp32 device tensor,
// for the bound of `mode` (0: factor a0 (a1 + a2) a3, 1: factor a0) over the finite max |x| of each of
// `tensors` (3-dim bf16/fp16 CUDA tensors with 16-byte rows), and n_max contributions per element.
Tensor det_grid(const std::vector<Tensor>& tensors, int mode, double factor, int64_t n_max);
// Adds per-item partials into the fp32 accumulators `out` ((T, hout, width) each) in item order
// (ItemReduceParams): the backward's dK and dV, the forward's dk_idx per query chunk.
void item_reduce(const Tensor& part, const int32_t* item_offsets, const int32_t* block_offsets,
                 const SeqMap& seqs, int64_t block_size, int64_t max_blocks, int64_t hi,
                 const std::vector<Tensor>& out);

// Rows per tile of the portable forward's output pass on x's device (128 or 64) for head dim D.
int fwd_out_rows(const Tensor& x, int64_t D);
// The 99 KB configuration of the portable sparse kernels for head dim D: taken where x's device offers
// less shared memory per block than the default portable kernels need (sm_86, sm_89, sm_120: 99 KB), or
// when MSA_SMALL_SMEM=1 forces it (tests run it on Hopper that way).
bool small_smem_config(const Tensor& x, int64_t D);
// The same for the portable backward (at D = 64 its default fits 99 KB; the forward's output pass does not).
bool small_smem_bwd_config(const Tensor& x, int64_t D);

// Rows must be 16-byte aligned for cp.async and TMA; otherwise work on a contiguous copy. elem_bytes: the dtype's
// size (2 for bf16 / fp16, 1 for the FP8 selection inputs).
inline Tensor aligned_rows(const Tensor& x, int64_t elem_bytes = 2) {
  const int64_t per16 = 16 / elem_bytes;  // elements per 16 bytes
  const bool ok = x.stride(2) == 1 && x.stride(0) % per16 == 0 && x.stride(1) % per16 == 0 &&
                  reinterpret_cast<uintptr_t>(x.data_ptr()) % 16 == 0;
  return ok ? x : contig(x);
}

}  // namespace msa::api
