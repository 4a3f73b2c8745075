#include "bench_fwd.h"

#include <algorithm>

#include "sm80/sparse_fwd/sparse_fwd.h"
#include "sm90/index_dk/index_dk.h"
#include "sm90/sparse_fwd/sparse_fwd.h"
#include "smxx/combine/combine.h"
#include "smxx/index_dk/index_dk.h"
#include "smxx/reverse_index/reverse_index.h"

namespace msa::bench {

RevIndex::RevIndex(const ReverseIndexSizes& s, const Problem& pb) {
  offsets = Buf(sizeof(int32_t) * (s.num_keys + 1));
  rows = Buf(sizeof(int32_t) * s.capacity);
  block_offsets = Buf(sizeof(int32_t) * (s.num_seqs + 1));
  keys = Buf(sizeof(int32_t) * 2 * s.capacity);
  rows_in = Buf(sizeof(int32_t) * s.capacity);
  temp = Buf(s.temp_bytes());
  if (s.units_per_item > 0) {
    item_offsets = Buf(sizeof(int32_t) * (s.num_keys + 1));
    items = Buf(sizeof(int2) * s.max_items);
    if (s.order) order = Buf(sizeof(int32_t) * s.max_items);
  }
  ReverseIndexBuffers b;
  b.offsets = offsets.as<int32_t>();
  b.rows = rows.as<int32_t>();
  b.block_offsets = block_offsets.as<int32_t>();
  b.keys = keys.as<int32_t>();
  b.rows_in = rows_in.as<int32_t>();
  b.temp = temp.get();
  b.item_offsets = item_offsets.as<int32_t>();
  b.items = items.as<int2>();
  b.order = order.as<int32_t>();
  p = reverse_index_params(s, b, nullptr, pb.cu.as<int32_t>());
}

const char* mode_name(FwdMode m) {
  switch (m) {
    case FwdMode::kSparse: return "sparse";
    case FwdMode::kMsa: return "msa";
    default: return "msa-grad";
  }
}

std::vector<Knob> fwd_knobs(FwdConfig& cfg, bool passes) {
  std::vector<Knob> knobs = {
      {"--mode", "sparse|msa|msa-grad",
       "forward variant: msa::sparse_fwd (main branch), msa_fwd, msa_fwd with index grads (default msa-grad)",
       [&cfg](const char* v) {
         constexpr FwdMode kModes[] = {FwdMode::kSparse, FwdMode::kMsa, FwdMode::kMsaGrad};
         cfg.mode = kModes[knob_choice("--mode", v, {"sparse", "msa", "msa-grad"})];
       }},
      {"--units-per-item", "U", "units per forward work item, 1..512 (default 512; MSA_FWD_UNITS_PER_ITEM)",
       [&cfg](const char* v) { cfg.units_per_item = std::max(1, std::min(sm80::kFwdMaxItemUnits, std::atoi(v))); }},
      {"--budget-mib", "M", "per-entry partials per query chunk, MiB (default the op's: 1024, more at long N in msa-grad mode; MSA_PARTIAL_BUDGET)",
       [&cfg](const char* v) { cfg.budget = std::max<int64_t>(1, std::atoll(v)) << 20; }},
      {"--no-item-order", nullptr, "work items in key order, not largest first (MSA_ITEM_ORDER=0)",
       [&cfg](const char*) { cfg.item_order = false; }},
      {"--sel-max-blocks", "B",
       "msa modes, Hopper top-k: the kept blocks' index stats from the selection up to B key blocks per sequence "
       "(default 128; 0: never; MSA_SEL_MAX_BLOCKS)",
       [&cfg](const char* v) { cfg.sel_max_blocks = std::max(0, std::atoi(v)); }},
  };
  if (!passes) return knobs;
  knobs.insert(knobs.end(), {
      {"--no-fixed-gu", nullptr, "sm_90a output pass: the general kernel, not the Gu = 4 one (MSA_FWD_FIXED_GU=0)",
       [&cfg](const char*) { cfg.fixed_gu = false; }},
      {"--no-ws", nullptr, "sm_90a output pass: not the warp-specialized kernel (MSA_FWD_WS=0)",
       [&cfg](const char*) { cfg.out_ws = false; }},
      {"--fwd-rows", "64|128", "portable output pass: rows per tile (default: the device's; MSA_FWD_ROWS)",
       [&cfg](const char* v) { cfg.rows64 = std::atoi(v) == 64; }},
  });
  return knobs;
}

FwdBench::FwdBench(const Problem& pb_, const FwdConfig& cfg_, int n_sets, uint64_t seed, cudaStream_t s, bool sink)
    : pb(pb_), cfg(cfg_), stream(s) {
  const int64_t T = pb.tokens, Hi = pb.hi, K = pb.topk, G = pb.g;
  index = cfg.mode != FwdMode::kSparse;
  grad = cfg.mode == FwdMode::kMsaGrad;
  // The op's sel_stats_applies (csrc/api/sparse_fwd.cpp); sel stays only where the Hopper top-k ran (below).
  sel = index && pb.sm90 && cfg.sel_max_blocks > 0 && (pb.n + pb.block - 1) / pb.block <= cfg.sel_max_blocks;
  // Chunk and reverse index sizes: csrc/api/sparse_fwd.cpp (through csrc/common/workspace.h).
  const int64_t per_token = fwd_bytes_per_token(Hi, K, G, pb.d, pb.elem, false, grad, false, pb.di, cfg.units_per_item);
  chunk = fwd_chunk_tokens(T, per_token, cfg.budget_for(T, pb.hq, pb.d));
  ri = reverse_index_sizes(Hi, T, K, pb.b, pb.block, Hi * chunk * K, cfg.units_per_item, cfg.item_order);
  keys = Buf(sizeof(int32_t) * 2 * ri.capacity);
  rows_in = Buf(sizeof(int32_t) * ri.capacity);
  temp = Buf(ri.temp_bytes());
  const int64_t smem = std::max(sm80::sparse_smem_bytes(pb.d, 0, 128, pb.small_smem),
                                sm80::sparse_smem_bytes(pb.d, 1, cfg.rows64 ? 64 : pb.out_rows, pb.small_smem));
  if (!pb.sm90 && smem > pb.smem_optin) {
    std::fprintf(stderr, "the sparse forward needs %lld bytes of shared memory per block; the GPU offers %lld\n",
                 (long long)smem, (long long)pb.smem_optin);
    std::exit(1);
  }
  const int64_t entries = Hi * T * K;
  for (int si = 0; si < n_sets; ++si) {
    FwdSet st;
    const uint64_t sd = seed * 1000003u + uint64_t(si) * 16u;
    st.q = Buf(size_t(T) * pb.hq * pb.d * pb.elem);
    st.k = Buf(size_t(T) * pb.hkv * pb.d * pb.elem);
    st.v = Buf(size_t(T) * pb.hkv * pb.d * pb.elem);
    st.qi = Buf(size_t(T) * pb.hi * pb.di * pb.elem);
    st.ki = Buf(size_t(T) * pb.hki * pb.di * pb.elem);
    fill_normal(st.q.get(), T * pb.hq * pb.d, pb.fp16, sd + 1, s);
    fill_normal(st.k.get(), T * pb.hkv * pb.d, pb.fp16, sd + 2, s);
    fill_normal(st.v.get(), T * pb.hkv * pb.d, pb.fp16, sd + 3, s);
    fill_normal(st.qi.get(), T * pb.hi * pb.di, pb.fp16, sd + 4, s);
    fill_normal(st.ki.get(), T * pb.hki * pb.di, pb.fp16, sd + 5, s);
    // The selection: the index top-k kernel on the random q_idx / k_idx, as msa_fwd does.
    st.indices = Buf(sizeof(int32_t) * entries);
    IndexTopkParams tp = index_topk_params(pb, st.qi.get(), st.ki.get(), st.indices.as<int32_t>());
    if (sel) {
      st.sel_stats = Buf(sizeof(float2) * Hi * T);
      tp.sel_stats = st.sel_stats.as<float2>();
    }
    bool topk_sm90 = false;
    BENCH_CHECK(launch_index_topk(pb, tp, s, &topk_sm90));
    sel = sel && topk_sm90;  // the portable top-k (no TMA descriptor) does not write them: the op drops them too
    if (sink) make_sink(st.indices.as<int32_t>(), Hi * T, int(K), s);
    st.attended = attended_tokens(st.indices.as<int32_t>(), pb, s);

    st.stats = Buf(sizeof(float2) * entries * G);
    st.out_part = Buf(size_t(entries) * G * pb.d * pb.elem);
    if (index) {
      st.idx_stats = Buf(sizeof(float2) * entries);
      st.kl_part = Buf(sizeof(float) * entries);
      st.lse_idx = Buf(sizeof(float) * Hi * T);
      st.kl_rows = Buf(sizeof(float) * Hi * T);
    }
    if (grad) {
      st.dqi = Buf(sizeof(float) * T * Hi * pb.di);
      st.dki = Buf(sizeof(float) * T * pb.hki * pb.di);
    }
    st.out = Buf(size_t(T) * pb.hq * pb.d * pb.elem);
    st.lse = Buf(sizeof(float) * pb.hq * T);

    for (int64_t t0 = 0; t0 < T; t0 += chunk) {
      FwdChunk c;
      c.begin = t0;
      c.tokens = std::min(chunk, T - t0);
      c.offsets = Buf(sizeof(int32_t) * (ri.num_keys + 1));
      c.rows = Buf(sizeof(int32_t) * ri.capacity);
      c.block_offsets = Buf(sizeof(int32_t) * (ri.num_seqs + 1));
      c.item_offsets = Buf(sizeof(int32_t) * (ri.num_keys + 1));
      c.items = Buf(sizeof(int2) * ri.max_items);
      if (ri.order) c.order = Buf(sizeof(int32_t) * ri.max_items);
      ReverseIndexBuffers b;
      b.offsets = c.offsets.as<int32_t>();
      b.rows = c.rows.as<int32_t>();
      b.block_offsets = c.block_offsets.as<int32_t>();
      b.keys = keys.as<int32_t>();
      b.rows_in = rows_in.as<int32_t>();
      b.temp = temp.get();
      b.item_offsets = c.item_offsets.as<int32_t>();
      b.items = c.items.as<int2>();
      b.order = c.order.as<int32_t>();
      c.rp = reverse_index_params(ri, b, st.indices.as<int32_t>(), pb.cu.as<int32_t>());
      c.rp.emit_entries = true;
      c.rp.token_begin = int(t0);
      c.rp.token_end = int(t0 + c.tokens);
      c.rp.max_items = int(max_work_items(Hi * c.tokens * K, cfg.units_per_item, ri.num_keys));  // the grid
      st.chunks.push_back(std::move(c));
    }
    sets.push_back(std::move(st));
    if (grad) {  // the op's choice (csrc/api/sparse_fwd.cpp), from the params its passes get
      if (si == 0) dsi = !(pb.sm90 && sm90::out_ws_fuses_index_dk(fwd_params(0, 0)));
      if (dsi) sets.back().dsi_part = Buf(size_t(entries) * 128 * pb.elem);
    }
    zero_grads(si);
    forward(si);  // every chunk's reverse index, partials, lse (and lse_idx, dsi) valid from here on
    BENCH_CHECK(cudaStreamSynchronize(s));
  }
  std::fprintf(stderr, "# sparse fwd %s N=%lld: %d set(s), %d chunk(s) of %lld tokens, %lld attended tokens x G\n",
               mode_name(cfg.mode), (long long)pb.n, n_sets, num_chunks(), (long long)chunk,
               (long long)sets[0].attended);
}

SparseFwdParams FwdBench::fwd_params(int set, int c) const {
  const FwdSet& st = sets[set];
  const FwdChunk& ch = st.chunks[c];
  const int64_t base = int64_t(pb.hi) * ch.begin * pb.topk;  // first entry of the chunk in the partials
  SparseFwdParams fp{};
  fp.q = st.q.get();
  fp.k = st.k.get();
  fp.v = st.v.get();
  fp.q_stride_t = int64_t(pb.hq) * pb.d;
  fp.q_stride_h = pb.d;
  fp.k_stride_t = fp.v_stride_t = int64_t(pb.hkv) * pb.d;
  fp.k_stride_h = fp.v_stride_h = pb.d;
  if (index) {
    fp.q_idx = st.qi.get();
    fp.k_idx = st.ki.get();
    fp.qi_stride_t = int64_t(pb.hi) * pb.di;
    fp.qi_stride_h = pb.di;
    fp.ki_stride_t = int64_t(pb.hki) * pb.di;
    fp.ki_stride_h = pb.di;
  }
  fp.cu_seqlens = pb.cu.as<int32_t>();
  fp.cu_seqlens_k = fp.cu_seqlens;  // keys of the queries' layout
  fp.work = sparse_work(ch.rp);
  fp.total_tokens = int(pb.tokens);
  fp.num_seqs = int(pb.b);
  fp.topk = pb.topk;
  fp.block_size = pb.block;
  fp.hq = pb.hq;
  fp.hkv = pb.hkv;
  fp.hi = pb.hi;
  fp.hki = index ? pb.hki : 1;  // the op: max(Hki, 1), Hki = 0 without an index branch
  fp.di = index ? pb.di : 0;
  fp.chunk_begin = int(ch.begin);
  fp.chunk_tokens = int(ch.tokens);
  fp.scale_log2 = float(double(pb.softmax_scale) * 1.4426950408889634);
  fp.index_scale = pb.index_scale;
  fp.main_stats = true;
  fp.write_out = true;
  fp.out_rows = cfg.rows64 ? 64 : pb.out_rows;
  fp.small_smem = pb.small_smem;
  fp.fixed_gu = cfg.fixed_gu ? fwd_fixed_gu(pb.g, pb.j) : 0;
  fp.out_ws = cfg.out_ws;
  fp.stats_ws = false;  // as the op's default (MSA_FWD_WS_STATS=1 turns it on there)
  fp.stats = st.stats.as<float2>() + base * pb.g;
  fp.idx_stats = index ? st.idx_stats.as<float2>() + base : nullptr;
  fp.lse = st.lse.as<float>();
  fp.out_part = static_cast<char*>(st.out_part.get()) + size_t(base) * pb.g * pb.d * pb.elem;
  fp.out_entries = int64_t(pb.hi) * ch.tokens * pb.topk;  // the chunk's slice (the TMA store map's extent)
  fp.kl_part = index ? st.kl_part.as<float>() + base : nullptr;
  fp.lse_idx = index ? st.lse_idx.as<float>() : nullptr;
  fp.dsi_part = dsi ? static_cast<char*>(st.dsi_part.get()) + size_t(base) * 128 * pb.elem : nullptr;
  fp.dqi_accum = grad ? st.dqi.as<float>() : nullptr;
  fp.dki_accum = grad ? st.dki.as<float>() : nullptr;  // the warp-specialized output pass's dk_idx (out_ws_fuses_index_dk)
  fp.idx_own_only = sel;
  fp.dqi_scale = float(double(pb.index_scale) / double(pb.tokens * pb.hi));
  return fp;
}

SparseCombineParams FwdBench::combine_params(int set, int c) const {
  const FwdSet& st = sets[set];
  const SparseFwdParams fp = fwd_params(set, c);
  SparseCombineParams cp{};
  cp.stats = fp.stats;
  cp.idx_stats = fp.idx_stats;
  cp.sel_stats = sel ? st.sel_stats.as<float2>() : nullptr;
  cp.out_part = fp.out_part;
  cp.kl_part = fp.kl_part;
  cp.lse = st.lse.as<float>();
  cp.lse_idx = index ? st.lse_idx.as<float>() : nullptr;
  cp.main = true;
  cp.out = st.out.get();
  cp.out_stride_t = int64_t(pb.hq) * pb.d;
  cp.out_stride_h = pb.d;
  cp.kl_rows = index ? st.kl_rows.as<float>() : nullptr;
  cp.total_tokens = int(pb.tokens);
  cp.topk = pb.topk;
  cp.hq = pb.hq;
  cp.hi = pb.hi;
  cp.chunk_begin = fp.chunk_begin;
  cp.chunk_tokens = fp.chunk_tokens;
  return cp;
}

IndexDkParams FwdBench::dk_params(int set, int c) const {
  const FwdSet& st = sets[set];
  const SparseFwdParams fp = fwd_params(set, c);
  IndexDkParams dp{};
  dp.q_idx = st.qi.get();
  dp.qi_stride_t = fp.qi_stride_t;
  dp.qi_stride_h = fp.qi_stride_h;
  dp.dsi_part = fp.dsi_part;
  dp.cu_seqlens = fp.cu_seqlens;
  dp.cu_seqlens_k = fp.cu_seqlens_k;
  dp.work = fp.work;
  dp.dki_accum = grad ? st.dki.as<float>() : nullptr;
  dp.scale = fp.dqi_scale;
  dp.num_seqs = int(pb.b);
  dp.topk = pb.topk;
  dp.block_size = pb.block;
  dp.hi = pb.hi;
  dp.hki = pb.hki;
  dp.di = pb.di;
  dp.chunk_begin = fp.chunk_begin;
  dp.chunk_tokens = fp.chunk_tokens;
  return dp;
}

void FwdBench::reverse_index(int set, int c) const {
  BENCH_CHECK(run_reverse_index(sets[set].chunks[c].rp, stream));
}

void FwdBench::zero_stats(int set, int c) const {
  const SparseFwdParams fp = fwd_params(set, c);
  const size_t n = size_t(pb.hi) * fp.chunk_tokens * pb.topk;
  BENCH_CHECK(cudaMemsetAsync(fp.stats, 0, n * pb.g * sizeof(float2), stream));
  if (index) BENCH_CHECK(cudaMemsetAsync(fp.idx_stats, 0, n * sizeof(float2), stream));
}

namespace {
cudaError_t fwd_pass(const Problem& pb, const SparseFwdParams& fp, bool out_pass, cudaStream_t s) {
  cudaError_t err = cudaSuccess;
  dispatch(pb.fp16, pb.d, [&]<typename T, int D>() {
#ifdef MSA_WITH_SM90
    if (pb.sm90) {
      err = sm90::launch_sparse_fwd<T, D>(fp, out_pass, s);
      return;
    }
#endif
    err = sm80::launch_sparse_fwd<T, D>(fp, out_pass, s);
  });
  return err;
}
}  // namespace

void FwdBench::stats_pass(int set, int c) const { BENCH_CHECK(fwd_pass(pb, fwd_params(set, c), false, stream)); }
void FwdBench::out_pass(int set, int c) const { BENCH_CHECK(fwd_pass(pb, fwd_params(set, c), true, stream)); }
void FwdBench::combine_stats(int set, int c) const {
  BENCH_CHECK(smxx::launch_sparse_combine_stats(combine_params(set, c), stream));
}
void FwdBench::combine_out(int set, int c) const {
  const SparseCombineParams cp = combine_params(set, c);
  dispatch(pb.fp16, pb.d, [&]<typename T, int D>() { BENCH_CHECK((smxx::launch_sparse_combine_out<T, D>(cp, stream))); });
}
void FwdBench::combine_kl(int set, int c) const {
  BENCH_CHECK(smxx::launch_sparse_combine_kl(combine_params(set, c), stream));
}
void FwdBench::index_dk(int set, int c) const {
  if (!dsi) return;
#ifdef MSA_WITH_SM90
  if (pb.sm90) {
    BENCH_CHECK(sm90::launch_index_dk(dk_params(set, c), !pb.fp16, stream));
    return;
  }
#endif
  BENCH_CHECK(smxx::launch_index_dk(dk_params(set, c), !pb.fp16, stream));
}

void FwdBench::forward(int set) const {
  for (int c = 0; c < num_chunks(); ++c) {
    reverse_index(set, c);
    zero_stats(set, c);
    stats_pass(set, c);
    combine_stats(set, c);
    out_pass(set, c);
    combine_out(set, c);
    combine_kl(set, c);
    index_dk(set, c);
  }
}

void FwdBench::zero_grads(int set) const {
  sets[set].dqi.zero(stream);
  sets[set].dki.zero(stream);
}

std::string FwdBench::shape() const { return pb.shape + " mode=" + mode_name(cfg.mode); }

double FwdBench::attended() const {
  double sum = 0;
  for (const FwdSet& st : sets) sum += double(st.attended);
  return sum / double(sets.size());
}

double FwdBench::attended_flops() const { return 4.0 * pb.d * pb.g * attended(); }

double fwd_input_bytes(const Problem& pb, bool index) {
  return double(pb.tokens) * pb.elem * (double(pb.hq + 2 * pb.hkv) * pb.d + (index ? double(pb.hi + pb.hki) * pb.di : 0.0));
}

}  // namespace msa::bench
