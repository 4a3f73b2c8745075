// msa::sparse_fwd and msa::msa_fwd on CUDA: checks, workspace, the per-chunk pipeline
//   reverse index -> stats pass -> stats combine (lse, lse_idx) -> output pass -> out / KL combine.
// Queries are processed in chunks of tokens so the per-entry partials stay within a budget
// (fwd_partial_budget: 1 GiB, or with index gradients 8 T Hq D bytes where larger): memory is O(N)
// overall and bounded per chunk.
#include <algorithm>
#include <cstdlib>
#include <tuple>

#include "api/checks.h"
#include "api/dispatch.h"
#include "api/host_phases.h"
#include "api/ops.h"
#include "common/workspace.h"
#include "sm80/sparse_fwd/sparse_fwd.h"
#include "sm90/index_dk/index_dk.h"
#include "sm90/sparse_fwd/sparse_fwd.h"
#include "smxx/combine/combine.h"
#include "smxx/index_dk/index_dk.h"
#include "smxx/reverse_index/reverse_index.h"

namespace msa::api {
namespace {

// Bytes of per-entry partials per chunk: fwd_partial_budget (csrc/common/workspace.h: 1 GiB, more at
// long N with index gradients). Each chunk pays fixed costs (a reverse-index build, five launches, and a
// partly filled item for every kv block its tokens select, which loads that block again), so fewer
// chunks are faster: at N = 32K (bench configuration, fwd+bwd) 6 chunks of 512 MiB took 18.8 ms, 3 of
// 1 GiB 18.0 ms, 2 of 2 GiB 17.9 ms; at 128K 84.3 / 80.5 / 78.8 ms, where the backward sets the peak
// (benchmarks/NOTES_history.md s25).
// MSA_PARTIAL_BUDGET (bytes) overrides the budget: tests use a small one to exercise many chunks.
int64_t partial_budget(int64_t tokens, int64_t hq, int64_t d, bool training) {
  return env_positive("MSA_PARTIAL_BUDGET", fwd_partial_budget(tokens, hq, d, training));
}
// Units per forward work item (one CTA: one kv block, loaded once, and up to this many of the units that
// selected it): kFwdUnitsPerItem (512; 128 -> 512: fwd+bwd -0.3 ms at 32K, -1.0 at 128K, NOTES s30).
// MSA_FWD_UNITS_PER_ITEM overrides it (1 .. sm80::kFwdMaxItemUnits, the kernel's table size).
int fwd_units_per_item() {
  return int(std::min<int64_t>(env_positive("MSA_FWD_UNITS_PER_ITEM", kFwdUnitsPerItem), sm80::kFwdMaxItemUnits));
}

}  // namespace

// Rows per tile of the portable output pass: 128 where the GPU offers the shared memory (215 KB at
// D = 128: Hopper), else 64 (157 KB, within the A100's 163 KB per block). MSA_FWD_ROWS=64 forces the
// small tile, so the tests run it on Hopper too.
int fwd_out_rows(const Tensor& q, int64_t D) {
  if (env_positive("MSA_FWD_ROWS", 128) == 64) return 64;
  return msa::fwd_out_rows(smem_per_block(q), int(D));
}

bool small_smem_config(const Tensor& x, int64_t D) {
  if (use_sm90_kernels()) return false;  // the Hopper kernels have their own tiles
  if (env_is("MSA_SMALL_SMEM", "1")) return true;
  return msa::fwd_small_smem(smem_per_block(x), int(D));
}

// The kept blocks' index (max, sum) from the top-k (IndexTopkParams::sel_stats) where no sequence has more than
// MSA_SEL_MAX_BLOCKS key blocks (default 128; 0: never, the stats pass scores every selected block: tests and A/B
// runs compare the two). The top-k's sums cost grows with the blocks it scores and its kSel kernel is ~8% slower
// even where it skips them, the stats pass's saving does not grow (H200, s27): at 8K the step's GPU time went
// 2.534 -> 2.456 ms (stats pass -107 us, top-k +36), at 32K 11.08 -> 11.02 (-0.45 / +0.39 ms), at 128K the step
// lost 1.7 ms. The opt-in warp-specialized stats pass scores every block: with the selection's stats the general
// stats pass runs instead (csrc/sm90/sparse_fwd/sparse_fwd.cuh).
// A block_size select_blocks_cuda refuses (its check raises after this) takes no part; any MSA_SEL_MAX_BLOCKS <= 0
// (or not a number) turns it off.
bool sel_stats_applies(const SeqMap& seqs, int64_t block_size) {
  constexpr int64_t kDefault = 128;
  if (block_size != 64 && block_size != 128) return false;
  const char* env = std::getenv("MSA_SEL_MAX_BLOCKS");
  const int64_t bound = env != nullptr ? std::atoll(env) : kDefault;
  return bound > 0 && (seqs.max_k + block_size - 1) / block_size <= bound;
}

namespace {

// The index branch's inputs against the main branch's (SPEC 1, 7): dtype, device, shapes, Di, and the
// head layout the CUDA kernels take. Before any launch of msa_fwd (both of its branches).
void check_index_cuda(const Tensor& q, const Tensor& k, const Tensor& qi, const Tensor& ki) {
  const int64_t T = q.size(0), Tk = k.size(0), Hq = q.size(1), Hkv = k.size(1);
  MSA_CHECK(qi.scalar_type() == q.scalar_type() && ki.scalar_type() == q.scalar_type(), "q_idx, k_idx: expected dtype ",
            dtype(q));
  MSA_CHECK(same_device(qi, q) && same_device(ki, q), "q_idx, k_idx: expected device ", dev(q));
  MSA_CHECK(qi.dim() == 3 && ki.dim() == 3 && qi.size(0) == T && ki.size(0) == Tk && ki.size(2) == qi.size(2),
            "q_idx, k_idx: expected (", T, ", Hi, Di), (", Tk, ", Hki, Di), got ", shape(qi), ", ", shape(ki));
  const int64_t Hi = qi.size(1), Hki = ki.size(1), Di = qi.size(2);
  MSA_CHECK(Di == 64 || Di == 128, "q_idx: expected head dim 64 or 128, got ", Di);
  check_group_heads("q_idx", Hq, Hkv, Hi);
  MSA_CHECK(Hki >= 1 && Hi % Hki == 0, "k_idx: expected Hki dividing Hi = ", Hi, ", got ", Hki);
}

// The selection's own inputs (index_dtype: e4m3 copies of q_idx, k_idx): both or neither, each of its index
// tensor's shape and device, float8_e4m3fn or that tensor's dtype.
void check_sel_cuda(const Tensor& qi, const Tensor& ki, const std::optional<Tensor>& sq,
                    const std::optional<Tensor>& sk) {
  MSA_CHECK(sq.has_value() == sk.has_value(), "sel_q_idx, sel_k_idx: expected both or neither");
  if (!sq) return;
  for (const auto& [name, x, like] : {std::tuple{"sel_q_idx", *sq, qi}, std::tuple{"sel_k_idx", *sk, ki}}) {
    MSA_CHECK(same_device(x, like) && same_shape(x, like), name, ": expected the shape ", shape(like), " on ",
              dev(like), ", got ", shape(x), " on ", dev(x));
    MSA_CHECK(x.scalar_type() == ScalarType::Float8_e4m3fn || x.scalar_type() == like.scalar_type(), name,
              ": expected float8_e4m3fn or ", dtype(like), ", got ", dtype(x));
  }
  MSA_CHECK(sq->scalar_type() == sk->scalar_type(), "sel_k_idx: expected dtype ", dtype(*sq), ", got ", dtype(*sk));
}

}  // namespace

SparseForward sparse_forward_cuda(const Tensor& q_in, const Tensor& k_in, const Tensor& v_in,
                                  const std::optional<Tensor>& q_idx_in, const std::optional<Tensor>& k_idx_in,
                                  const Tensor& indices, const SeqMap& seqs, int64_t block_size,
                                  double softmax_scale, double index_scale, bool index_grad, bool deterministic,
                                  bool dense, const std::optional<Tensor>& lse_given,
                                  const std::optional<Tensor>& lse_idx_given,
                                  const std::optional<Tensor>& sel_stats) {
  HostPhases hp("sparse_forward");
  check_qkv_cuda(q_in, k_in, v_in, seqs.total_k);
  check_cuda_int32(indices, "indices", 3);
  const bool kl_only = lse_given.has_value();
  // Both lse given (warmup): the stats pass would compute nothing else, so it does not run.
  const bool no_stats = kl_only && lse_idx_given.has_value();
  MSA_CHECK(same_device(indices, q_in), "indices: expected device ", dev(q_in));
  MSA_CHECK(block_size == 64 || block_size == 128, "block_size: expected 64 or 128, got ", block_size);
  const int64_t T = q_in.size(0), Hq = q_in.size(1), D = q_in.size(2), Hkv = k_in.size(1), Tk = seqs.total_k;
  const int64_t Hi = indices.size(0);
  // Dense: one slot per block of the longest sequence's keys (a query sees up to all of them).
  const int64_t topk = dense ? std::max<int64_t>(1, (seqs.max_k + block_size - 1) / block_size) : indices.size(2);
  MSA_CHECK(indices.size(1) == T && (dense || (topk >= 1 && topk <= 32)), "indices: expected (Hi, ", T,
                    ", 1..32), got ", shape(indices));
  check_group_heads("indices", Hq, Hkv, Hi);
  const int64_t G = Hq / Hi, J = Hkv > Hi ? Hkv / Hi : 1;
  const bool index = q_idx_in.has_value();
  int64_t Di = 0, Hki = 0;
  if (index) {  // the rest of the index inputs: checked by msa_fwd_cuda (check_index_cuda) before any launch
    MSA_CHECK(q_idx_in->size(1) == Hi, "q_idx: expected Hi = ", Hi, " heads (indices), got ", shape(*q_idx_in));
    Di = q_idx_in->size(2);
    Hki = k_idx_in->size(1);
  }
  const int64_t S = seqs.num_seqs;

  const DeviceGuard guard(q_in.get_device_index());
  const bool small = small_smem_config(q_in, D);
  const int out_rows = small ? 64 : fwd_out_rows(q_in, D);
  check_smem(q_in, std::max(sm80::sparse_smem_bytes(int(D), 0, 128, small),
                            sm80::sparse_smem_bytes(int(D), 1, out_rows, small)), "the sparse forward");
  const cudaStream_t stream = current_stream(q_in);
  const Tensor q = aligned_rows(q_in), k = aligned_rows(k_in), v = aligned_rows(v_in);
  Tensor qi, ki;
  if (index) {
    qi = aligned_rows(*q_idx_in);
    ki = aligned_rows(*k_idx_in);
  }
  SparseForward res;
  res.out = kl_only ? Tensor() : empty_as(q_in);
  res.lse = kl_only ? contig(*lse_given) : empty({Hq, T}, kFloat, q);
  if (no_stats) {
    MSA_CHECK(index && lse_idx_given->dim() == 2 && lse_idx_given->size(0) == Hi && lse_idx_given->size(1) == T &&
                  lse_idx_given->scalar_type() == kFloat,
              "lse_idx: expected fp32 (", Hi, ", ", T, "), got ", shape(*lse_idx_given));
  }
  res.lse_idx = no_stats ? contig(*lse_idx_given) : empty({index ? Hi : 0, T}, kFloat, q);
  res.kl_rows = empty({index ? Hi : 0, T}, kFloat, q);
  const bool grad = index && index_grad;
  const bool det = grad && deterministic;
  Tensor dqi_lo;  // deterministic mode (params.h)
  if (det) {
    // Own buffers: kl_dq_idx is replaced by its sum with dqi_lo below, and a part of a shared buffer would
    // stay allocated with kl_dk_idx (saved for the backward).
    res.kl_dq_idx = zeros_f32({T, Hi, Di}, q, stream);
    res.kl_dk_idx = zeros_f32({Tk, Hki, Di}, q, stream);
    dqi_lo = zeros_f32({T, Hi, Di}, q, stream);
  } else if (grad) {  // the fp32 accumulators, zeroed by memsets (op outputs: separate storage)
    res.kl_dq_idx = zeros_f32({T, Hi, Di}, q, stream);
    res.kl_dk_idx = zeros_f32({Tk, Hki, Di}, q, stream);
  }
  if (T == 0) return res;

  // Chunk of query tokens: its per-entry partials (output rows + stats) fit the budget. Deterministic
  // mode adds index_dk's per-item dk_idx partials: 128 x Di fp32 per item of <= units_per_item entries
  // (and at most one more item per key with an entry: max_work_items).
  const int units_per_item = fwd_units_per_item();
  // The output pass's configuration, needed here: where the warp-specialized pass computes dk_idx itself (index dk
  // folded in) there is no dsi_part.
  SparseFwdParams fp{};
  fp.q_idx = index ? qi.data_ptr() : nullptr;
  fp.write_out = !kl_only;
  fp.small_smem = small;  // the 99 KB configuration (out_rows is then its own)
  // The sm_90a output pass compiled for Gu = 4 heads per unit (fewer registers, compile-time KL loops)
  // where it applies; MSA_FWD_FIXED_GU=0 keeps the general kernel (tests compare the two).
  fp.fixed_gu = env_is("MSA_FWD_FIXED_GU", "0") ? 0 : fwd_fixed_gu(G, J);
  // The warp-specialized output pass where it applies (Gu = 4 with the index branch); MSA_FWD_WS=0 keeps
  // the general sm_90a pass (tests and A/B runs compare the two).
  fp.out_ws = !env_is("MSA_FWD_WS", "0");
  fp.dki_accum = grad ? ptr<float>(res.kl_dk_idx) : nullptr;
  [[maybe_unused]] const bool sm90 = use_sm90_kernels();
  // The dsi partials and the index dk launch that reads them: none where the warp-specialized output pass computes
  // dk_idx itself (index dk folded in).
  const bool dsi = grad && !(sm90 && sm90::out_ws_fuses_index_dk(fp));
  // per_token does not depend on no_stats (idx_stats is then not allocated), nor on dsi: the same chunks for every
  // kernel path, so their results can be compared bitwise (a row's lse moves by an ulp with its tile's company,
  // tests/test_sparse_fwd_gpu.py::test_fwd_results_do_not_depend_on_query_chunks).
  const int64_t per_token =
      fwd_bytes_per_token(Hi, topk, G, D, q.element_size(), kl_only, grad, det, Di, units_per_item);
  const int64_t chunk = fwd_chunk_tokens(T, per_token, partial_budget(T, Hq, D, grad));
  const int64_t entries = Hi * chunk * topk;
  const int64_t max_blocks = Tk / block_size + S;  // key blocks
  const int64_t num_keys = Hi * max_blocks;
  // Entry ids are local to a chunk (ReverseIndexParams::emit_entries): int32 per chunk, any sequence length.
  MSA_CHECK(entries < (int64_t(1) << 31) && num_keys < (int64_t(1) << 30),
            "q: too many tokens for the int32 reverse index, T = ", T, ", T_k = ", Tk);

  // The slots' (max, sum) of the main heads and then of the index head: one buffer, zeroed per chunk by one
  // memset (slots that select nothing are never written: they stay (0, 0), "no keys").
  const int64_t stats_floats = kl_only ? 0 : entries * G * 2;
  const int64_t all_stats_floats = stats_floats + (index && !no_stats ? entries * 2 : 0);
  // The chunk's workspace in one allocation: stats, KL and output partials, dsi partials and the reverse index
  // (its outputs and its build's workspace).
  BytePlan ws;
  const size_t elem = size_t(q.element_size());
  const size_t at_stats = ws.add(size_t(all_stats_floats) * sizeof(float));
  const size_t at_kl = ws.add(size_t(index ? entries : 0) * sizeof(float));
  const size_t at_out = ws.add(size_t(kl_only ? 0 : entries * G * D) * elem);
  const size_t at_dsi = ws.add(size_t(dsi ? entries * 128 : 0) * elem);
  const ReverseIndexPlan ri_plan = plan_reverse_index(indices, seqs, topk, block_size, entries, units_per_item, ws, ws);
  const Tensor workspace = empty({int64_t(ws.total)}, kByte, q);
  char* const base = static_cast<char*>(workspace.data_ptr());
  float* const stats = reinterpret_cast<float*>(base + at_stats);
  float* const idx_stats = stats + stats_floats;
  float* const kl_part = reinterpret_cast<float*>(base + at_kl);
  void* const out_part = base + at_out;
  void* const dsi_part = base + at_dsi;
  Tensor dqi_grid, dki_part;  // deterministic mode (params.h)
  if (det) {
    // dq_idx: exact hi / lo sums; per element topk * J contributions (one per slot and kv head) whose |x|
    // sum to at most 2 * dqi_scale * max|k_idx| (the |Pidx - P| of a row sum to <= 2), doubled for the
    // rounding of dsi to the input dtype. dk_idx: per-item partials, reduced per chunk.
    dqi_grid = det_grid({ki}, 1, 4.0 * index_scale / double(T * Hi), topk * J);
    dki_part = empty({max_work_items(entries, units_per_item, num_keys) * 128 * Di}, kFloat, q);
  }

  hp.mark("checks+buffers");
  ReverseIndex ri = place_reverse_index(ri_plan, indices, seqs, base, base);
  hp.mark("ri_alloc");
  ReverseIndexParams& rp = ri.params;
  rp.emit_entries = true;
  rp.dense = dense;

  fp.q = q.data_ptr();
  fp.k = k.data_ptr();
  fp.v = v.data_ptr();
  fp.q_stride_t = q.stride(0);
  fp.q_stride_h = q.stride(1);
  fp.k_stride_t = k.stride(0);
  fp.k_stride_h = k.stride(1);
  fp.v_stride_t = v.stride(0);
  fp.v_stride_h = v.stride(1);
  if (index) {
    fp.k_idx = ki.data_ptr();
    fp.qi_stride_t = qi.stride(0);
    fp.qi_stride_h = qi.stride(1);
    fp.ki_stride_t = ki.stride(0);
    fp.ki_stride_h = ki.stride(1);
  }
  fp.cu_seqlens = ptr<int32_t>(seqs.cu);
  fp.cu_seqlens_k = ptr<int32_t>(seqs.cu_k);  // seqs.cu itself without a key layout
  fp.work = sparse_work(rp);  // max_items: per chunk
  fp.total_tokens = int(T);
  fp.num_seqs = int(S);
  fp.topk = int(topk);
  fp.block_size = int(block_size);
  fp.hq = int(Hq);
  fp.hkv = int(Hkv);
  fp.hi = int(Hi);
  fp.hki = int(std::max<int64_t>(Hki, 1));
  fp.di = int(Di);
  fp.scale_log2 = float(softmax_scale * 1.4426950408889634);
  fp.index_scale = float(index_scale);
  fp.main_stats = !kl_only;
  fp.out_rows = out_rows;
  // The warp-specialized stats pass only when asked for (MSA_FWD_WS_STATS=1, with the output pass's): it
  // measured no faster than the general one (1.545 vs 1.518 ms at 32K, s16).
  fp.stats_ws = env_is("MSA_FWD_WS_STATS", "1");
  fp.stats = reinterpret_cast<float2*>(stats);
  fp.idx_stats = index && !no_stats ? reinterpret_cast<float2*>(idx_stats) : nullptr;
  // The selection's kept blocks' index (max, sum) (msa_fwd, the Hopper top-k): the stats pass then scores the
  // index branch on each row's own block only.
  const bool sel = sel_stats.has_value() && fp.idx_stats != nullptr && !dense;
  fp.idx_own_only = sel;
  fp.lse = ptr<float>(res.lse);
  fp.out_part = out_part;
  fp.out_entries = kl_only ? 0 : entries;
  fp.kl_part = index ? kl_part : nullptr;
  fp.lse_idx = index ? ptr<float>(res.lse_idx) : nullptr;
  fp.dsi_part = dsi ? dsi_part : nullptr;
  fp.dqi_accum = grad ? ptr<float>(res.kl_dq_idx) : nullptr;
  fp.dqi_lo = det ? ptr<float>(dqi_lo) : nullptr;
  fp.dqi_grid = det ? reinterpret_cast<const float4*>(ptr<float>(dqi_grid)) : nullptr;
  fp.dki_part = det ? ptr<float>(dki_part) : nullptr;
  // SPEC 4: d kl / d S_idx = (Pidx - P) / rows with S_idx = index_scale * q_idx . k_idx: the constant
  // factor is applied where the gradients accumulate.
  const float index_grad_scale = float(index_scale / double(T * Hi));
  fp.dqi_scale = index_grad_scale;

  IndexDkParams dp{};
  if (grad) {
    dp.q_idx = qi.data_ptr();
    dp.qi_stride_t = qi.stride(0);
    dp.qi_stride_h = qi.stride(1);
    dp.dsi_part = dsi_part;
    dp.cu_seqlens = fp.cu_seqlens;
    dp.cu_seqlens_k = fp.cu_seqlens_k;
    dp.work = fp.work;
    dp.dki_accum = ptr<float>(res.kl_dk_idx);
    dp.dki_part = det ? ptr<float>(dki_part) : nullptr;
    dp.scale = index_grad_scale;
    dp.num_seqs = int(S);
    dp.topk = int(topk);
    dp.block_size = int(block_size);
    dp.hi = int(Hi);
    dp.hki = int(Hki);
    dp.di = int(Di);
  }

  SparseCombineParams cp{};
  cp.stats = fp.stats;
  cp.idx_stats = fp.idx_stats;
  if (sel) {
    MSA_CHECK(sel_stats->dim() == 3 && sel_stats->size(0) == Hi && sel_stats->size(1) == T && sel_stats->size(2) == 2 &&
                  sel_stats->scalar_type() == kFloat && sel_stats->is_contiguous(),
              "sel_stats: expected fp32 (", Hi, ", ", T, ", 2), got ", shape(*sel_stats));
    cp.sel_stats = reinterpret_cast<const float2*>(ptr<float>(*sel_stats));
  }
  cp.out_part = fp.out_part;
  cp.kl_part = fp.kl_part;
  cp.lse = ptr<float>(res.lse);
  cp.lse_idx = index ? ptr<float>(res.lse_idx) : nullptr;
  cp.main = !kl_only;
  if (!kl_only) {
    cp.out = res.out.data_ptr();
    cp.out_stride_t = res.out.stride(0);
    cp.out_stride_h = res.out.stride(1);
  }
  cp.kl_rows = index ? ptr<float>(res.kl_rows) : nullptr;
  cp.total_tokens = int(T);
  cp.topk = int(topk);
  cp.hq = int(Hq);
  cp.hi = int(Hi);

  for (int64_t t0 = 0; t0 < T; t0 += chunk) {
    const int64_t tc = std::min(chunk, T - t0);
    const int64_t n = Hi * tc * topk;
    rp.token_begin = int(t0);
    rp.token_end = int(t0 + tc);
    // The grid: the chunk's work-list bound, within the one the buffers were sized for (n <= entries).
    fp.work.max_items = int(max_work_items(n, units_per_item, num_keys));
    rp.max_items = fp.work.max_items;  // the launch order covers the grid
    hp.mark("chunk_setup");
    MSA_LAUNCH_CHECK(run_reverse_index(rp, stream), "sparse_fwd (reverse index)");
    hp.mark("ri_build");
    // The whole stats buffer (a chunk's n <= entries slots: only a last, shorter chunk zeroes more than it needs).
    if (all_stats_floats > 0) {
      MSA_LAUNCH_CHECK(cudaMemsetAsync(stats, 0, size_t(all_stats_floats) * sizeof(float), stream), "sparse_fwd");
    }
    if (no_stats) {  // the kl combine then sums every slot: a slot that selects nothing must hold 0
      MSA_LAUNCH_CHECK(cudaMemsetAsync(kl_part, 0, size_t(n) * sizeof(float), stream), "sparse_fwd");
    }
    fp.chunk_begin = cp.chunk_begin = int(t0);
    fp.chunk_tokens = cp.chunk_tokens = int(tc);
    dispatch_dtype_dim(q.scalar_type(), D, [&]<typename T_, int D_>() {
      auto pass = [&](bool out_pass) {
#ifdef MSA_WITH_SM90
        if (sm90) return sm90::launch_sparse_fwd<T_, D_>(fp, out_pass, stream);
#endif
        return sm80::launch_sparse_fwd<T_, D_>(fp, out_pass, stream);
      };
      if (!no_stats) {
        MSA_LAUNCH_CHECK(pass(false), "sparse_fwd (stats pass)");
        MSA_LAUNCH_CHECK(smxx::launch_sparse_combine_stats(cp, stream), "sparse_fwd (stats combine)");
      }
      MSA_LAUNCH_CHECK(pass(true), "sparse_fwd (output pass)");
      if (!kl_only) {
        MSA_LAUNCH_CHECK((smxx::launch_sparse_combine_out<T_, D_>(cp, stream)), "sparse_fwd (output combine)");
      }
      MSA_LAUNCH_CHECK(smxx::launch_sparse_combine_kl(cp, stream), "sparse_fwd (kl combine)");
    });
    hp.mark("passes+combines");
    if (grad) {
      dp.chunk_begin = int(t0);
      dp.chunk_tokens = int(tc);
      dp.work.max_items = fp.work.max_items;
      auto index_dk = [&](bool bf16) {
#ifdef MSA_WITH_SM90
        if (sm90) return sm90::launch_index_dk(dp, bf16, stream);
#endif
        return smxx::launch_index_dk(dp, bf16, stream);
      };
      if (dsi) MSA_LAUNCH_CHECK(index_dk(q.scalar_type() == kBFloat16), "msa_fwd (index dk)");
      if (det) {
        item_reduce(dki_part, rp.item_offsets, rp.block_offsets, seqs, block_size, max_blocks, Hi, {res.kl_dk_idx});
      }
    }
  }
  hp.mark("index_dk");
  if (det) res.kl_dq_idx = add(res.kl_dq_idx, dqi_lo);
  return res;
}

namespace {

using torch::stable::detail::from;

// Dense causal attention over packed sequences with PyTorch's flash kernel (GQA native): out and the
// lse (Hq, T) that the KL pass and the backward need. Through msa::_dense_fwd (msa/_ops.py), which
// calls aten::_flash_attention_forward by keyword: that schema grows between torch releases. lse_only:
// out is not read (it may come back narrower than v). seqs.uniform: equal sequence lengths, which the
// cuDNN kernels need; with a key layout (seqs.suffix, never uniform) the keys' offsets go along.
std::tuple<Tensor, Tensor> dense_attention_forward(const Tensor& q, const Tensor& k, const Tensor& v,
                                                   const SeqMap& seqs, int64_t max_seqlen, double scale,
                                                   bool deterministic, bool lse_only = false) {
  const std::optional<Tensor> cu_k = seqs.suffix ? std::optional<Tensor>(seqs.cu_k) : std::nullopt;
  const std::optional<int64_t> max_k = seqs.suffix ? std::optional<int64_t>(seqs.max_k) : std::nullopt;
  std::array<StableIValue, 11> st{from(q),           from(k),     from(v),           from(seqs.cu),
                                  from(max_seqlen),  from(scale), from(seqs.uniform), from(deterministic),
                                  from(lse_only),    from(cu_k),  from(max_k)};
  detail::call_op("msa::_dense_fwd", "", st);
  return {torch::stable::detail::to<Tensor>(st[0]), torch::stable::detail::to<Tensor>(st[1])};
}

std::tuple<Tensor, Tensor> sparse_fwd_cuda(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& indices,
                                           const std::optional<Tensor>& cu_seqlens, int64_t max_seqlen,
                                           int64_t block_size, double softmax_scale, bool deterministic,
                                           const std::optional<Tensor>& cu_seqlens_k,
                                           std::optional<int64_t> max_seqlen_k) {
  (void)deterministic;  // the forward is deterministic; the flag is for its backward (msa/_ops.py)
  check_qkv_cuda(q, k, v, rows(k));  // the key rows against the layout: seq_map
  const SeqMap seqs = seq_map(cu_seqlens, q.size(0), max_seqlen, cu_seqlens_k, max_seqlen_k, k.size(0), q);
  SparseForward r = sparse_forward_cuda(q, k, v, std::nullopt, std::nullopt, indices, seqs, block_size,
                                        softmax_scale, 0.0, false, false);
  return {r.out, r.lse};
}

std::tuple<Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor>
msa_fwd_cuda(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& q_idx,
             const Tensor& k_idx, const std::optional<Tensor>& cu_seqlens, int64_t max_seqlen, int64_t topk,
             int64_t block_size, double softmax_scale, double index_scale, bool warmup, bool return_indices,
             bool index_grad, bool deterministic, const std::optional<Tensor>& cu_seqlens_k,
             std::optional<int64_t> max_seqlen_k, const std::optional<Tensor>& sel_q_idx,
             const std::optional<Tensor>& sel_k_idx) {
  HostPhases hp("msa_fwd");
  check_qkv_cuda(q, k, v, rows(k));  // the key rows against the layout: seq_map
  hp.mark("check_qkv");
  check_index_cuda(q, k, q_idx, k_idx);  // before the dense kernels of warmup, too
  check_sel_cuda(q_idx, k_idx, sel_q_idx, sel_k_idx);
  hp.mark("check_index");
  // The selection's inputs: the given copies (index_dtype), else the index branch itself.
  const Tensor& sq = sel_q_idx ? *sel_q_idx : q_idx;
  const Tensor& sk = sel_k_idx ? *sel_k_idx : k_idx;
  const SeqMap seqs = seq_map(cu_seqlens, q.size(0), max_seqlen, cu_seqlens_k, max_seqlen_k, k.size(0), q);
  hp.mark("seq_map");
  Tensor indices;
  SparseForward r;
  if (warmup) {
    // SPEC 5: dense causal main attention through PyTorch's cuDNN or flash kernel (it keeps the lse),
    // then the KL over the full causal set and its index gradient with our kernels in dense mode.
    const DeviceGuard guard(q.get_device_index());
    indices = return_indices ? select_blocks_cuda(sq, sk, seqs, max_seqlen, topk, block_size, index_scale)
                             : empty({q_idx.size(1), q.size(0), 0}, kInt, q);
    // lse_idx: the Hopper index kernel's logsumexp mode (deterministic: no atomics), else the dense kernel on the
    // index branch (its output unused, lse_only): both faster than our stats pass over every block. Launched before
    // the dense forward: the GPU runs it while the host goes through the dispatcher and cuDNN's launch path (at 8K
    // the step's GPU otherwise waits ~0.3 ms for its first kernel).
    std::optional<Tensor> lse_idx_k = index_lse_cuda(q_idx, k_idx, seqs, max_seqlen, index_scale);
    hp.mark("lse_idx");
    auto [out, lse] = dense_attention_forward(q, k, v, seqs, max_seqlen, softmax_scale, deterministic);
    hp.mark("dense_fwd");
    const Tensor lse_idx = lse_idx_k ? *lse_idx_k
                                     : std::get<1>(dense_attention_forward(q_idx, k_idx, k_idx, seqs, max_seqlen,
                                                                           index_scale, deterministic,
                                                                           /*lse_only=*/true));
    if (dense_kl_applies(k, q_idx, deterministic)) {
      r = dense_kl_cuda(q, k, q_idx, k_idx, seqs, max_seqlen, softmax_scale, index_scale, index_grad, lse, lse_idx);
    } else {
      const Tensor shape_only = empty({q_idx.size(1), q.size(0), 1}, kInt, q);
      r = sparse_forward_cuda(q, k, v, q_idx, k_idx, shape_only, seqs, block_size, softmax_scale, index_scale,
                              index_grad, deterministic, /*dense=*/true, lse, lse_idx);
    }
    r.out = out;  // the KL-only pass returns the given lse and no output
  } else {
    // The kept blocks' sums (kSel) are sums of the index logits themselves: not from other selection inputs.
    std::optional<Tensor> sel;
    indices = select_blocks_cuda(sq, sk, seqs, max_seqlen, topk, block_size, index_scale,
                                 !sel_q_idx && sel_stats_applies(seqs, block_size) ? &sel : nullptr);
    hp.mark("select_blocks");
    r = sparse_forward_cuda(q, k, v, q_idx, k_idx, indices, seqs, block_size, softmax_scale, index_scale,
                            index_grad, deterministic, false, std::nullopt, std::nullopt, sel);
  }
  // SPEC 4: kl = sum over rows / rows, rows = T * Hi (a fixed-order reduction: deterministic).
  hp.mark("forward");
  const Tensor kl = mean(r.kl_rows);
  hp.mark("kl_mean");
  auto none = [&] { return empty({0}, kFloat, q); };  // distinct: outputs must not alias
  return {r.out, kl, indices, r.lse, r.lse_idx, index_grad ? r.kl_dq_idx : none(), index_grad ? r.kl_dk_idx : none(),
          r.kl_rows};
}

}  // namespace

STABLE_TORCH_LIBRARY_IMPL(msa, CUDA, m) {
  m.impl("sparse_fwd", TORCH_BOX(&sparse_fwd_cuda));
  m.impl("msa_fwd", TORCH_BOX(&msa_fwd_cuda));
}

}  // namespace msa::api
