// Sparse backward microbenchmark: the kernels of csrc/api/sparse_bwd.cpp (delta = rowsum(dO O), the
// sparse_bwd kernel into fp32 dq / dk / dv) and the op's sequence, on a real forward's out and lse.
// FLOPs: 2.5 x the attended fwd FLOPs of SPEC 8, 4 D sum over (t, h) |T(t, r(h))|.
// Bytes of bwd_delta: out and dout read (2 x T Hq D x 2 B), delta written (Hq T x 4 B).
#include <memory>

#include "bench_fwd.h"
#include "sm80/sparse_bwd/sparse_bwd.h"
#include "sm80/sparse_fwd/sparse_fwd.h"
#include "sm90/sparse_bwd/sparse_bwd.h"
#include "smxx/bwd_delta/bwd_delta.h"
#include "smxx/reverse_index/reverse_index.h"

using namespace msa;
using namespace msa::bench;

namespace {

struct BwdSet {
  Buf q, k, v, out, dout, lse, delta, indices;
  std::unique_ptr<RevIndex> ri;  // the backward's reverse index: tokens, work list, launch order
  int64_t attended = 0;
};

}  // namespace

int main(int argc, char** argv) {
  Options opt;
  int64_t units = 0;  // 0: the op's choice, bwd_units_per_item(entries)
  bool item_order = true, sink = false, ws = true;  // ws, ws_tma: as the op's defaults
  int ws_tma = msa::kWsTmaAuto;
  std::string only;
  const std::vector<Knob> knobs = {
      {"--units-per-item", "U", "tokens per backward work item (default: the op's, 1024 up to 2^20 entries, else 2048; MSA_BWD_UNITS_PER_ITEM)",
       [&](const char* v) { units = std::max<int64_t>(1, std::atoll(v)); }},
      {"--no-item-order", nullptr, "work items in key order, not largest first (MSA_ITEM_ORDER=0)",
       [&](const char*) { item_order = false; }},
      {"--sink", nullptr, "an attention sink: slot 0 of every row is block 0 (msa.bench's sparse bwd, sink row)",
       [&](const char*) { sink = true; }},
      {"--general", nullptr, "sm_90a: the general kernel, not the warp-specialized one (MSA_BWD_WS=0)",
       [&](const char*) { ws = false; }},
      {"--ws-cp-async", nullptr, "sm_90a: the warp-specialized kernel gathers Q and dO by cp.async, not TMA (MSA_BWD_WS_TMA=0)",
       [&](const char*) { ws_tma = msa::kWsTmaOff; }},
      {"--ws-tma", nullptr, "sm_90a: the TMA gather at every Gu it supports (1, 2, 4, 8), not only 4 and 8 (MSA_BWD_WS_TMA=1)",
       [&](const char*) { ws_tma = msa::kWsTmaOn; }},
      {"--only", "delta|bwd|total", "time one row only", [&](const char* v) { only = v; }},
  };
  parse_options(argc, argv,
                "Sparse backward of the main branch: bwd_delta, the sparse_bwd kernel (dq / dk / dv fp32\n"
                "accumulators zeroed outside the timing), and the op's sequence (zero fills, delta, reverse\n"
                "index, kernel; not the final casts). out and lse come from a real sparse forward.\n"
                "Rows: bwd_delta, sparse_bwd/<path>, bwd_total/<path>.",
                opt, knobs);
  const cudaStream_t s = init_device();
  print_header(opt);
  for (const int64_t n : opt.ns) {
    const Problem pb = make_problem(opt, n, s);
    const int64_t T = pb.tokens, Hi = pb.hi, K = pb.topk, entries = Hi * T * K;
    const int64_t need = sm80::sparse_smem_bytes(pb.d, 2, 128, pb.small_smem_bwd);
    if (!pb.sm90 && need > pb.smem_optin) {
      std::fprintf(stderr, "the sparse backward needs %lld bytes of shared memory per block; the GPU offers %lld\n",
                   (long long)need, (long long)pb.smem_optin);
      return 1;
    }
    const double set_bytes = double(T) * pb.elem * pb.d * (3.0 * pb.hq + 2.0 * pb.hkv);
    const int n_sets = rotating_sets(opt, set_bytes, 3);
    const int64_t item_units = units > 0 ? units : bwd_units_per_item(entries);  // per shape
    const ReverseIndexSizes rs = reverse_index_sizes(Hi, T, K, pb.b, pb.block, entries, item_units, item_order);
    std::vector<BwdSet> sets(n_sets);
    {
      // out and lse from the sparse forward (msa::sparse_fwd), then its workspace is released.
      FwdConfig fcfg;
      fcfg.mode = FwdMode::kSparse;
      FwdBench fb(pb, fcfg, n_sets, opt.seed, s, sink);
      for (int i = 0; i < n_sets; ++i) {
        FwdSet& f = fb.sets[i];
        BwdSet& b = sets[i];
        b.q = std::move(f.q);
        b.k = std::move(f.k);
        b.v = std::move(f.v);
        b.out = std::move(f.out);
        b.lse = std::move(f.lse);
        b.indices = std::move(f.indices);
        b.attended = f.attended;
        b.dout = Buf(b.out.bytes());
        fill_normal(b.dout.get(), T * pb.hq * pb.d, pb.fp16, opt.seed * 1000003u + uint64_t(i) * 16u + 9, s);
        b.delta = Buf(sizeof(float) * pb.hq * T);
        b.ri = std::make_unique<RevIndex>(rs, pb);
        b.ri->p.indices = b.indices.as<int32_t>();
        BENCH_CHECK(run_reverse_index(b.ri->p, s));
      }
      BENCH_CHECK(cudaStreamSynchronize(s));
    }
    Buf dq(sizeof(float) * T * pb.hq * pb.d), dk(sizeof(float) * T * pb.hkv * pb.d), dv(dk.bytes());
    auto zero = [&](int) {
      dq.zero(s);
      dk.zero(s);
      dv.zero(s);
    };
    // Params as csrc/api/sparse_bwd.cpp fills them (contiguous inputs; not deterministic).
    std::vector<BwdDeltaParams> dps(n_sets);
    std::vector<SparseBwdParams> ps(n_sets);
    double att = 0;
    for (int i = 0; i < n_sets; ++i) {
      const BwdSet& b = sets[i];
      att += double(b.attended) / n_sets;
      BwdDeltaParams& dp = dps[i];
      dp.out = b.out.get();
      dp.dout = b.dout.get();
      dp.o_stride_t = dp.do_stride_t = int64_t(pb.hq) * pb.d;
      dp.o_stride_h = dp.do_stride_h = pb.d;
      dp.delta = b.delta.as<float>();
      dp.total_tokens = int(T);
      dp.hq = pb.hq;
      dp.d = pb.d;
      BENCH_CHECK(smxx::launch_bwd_delta(dp, !pb.fp16, s));
      SparseBwdParams& p = ps[i];
      p.q = b.q.get();
      p.k = b.k.get();
      p.v = b.v.get();
      p.dout = b.dout.get();
      p.q_stride_t = p.do_stride_t = int64_t(pb.hq) * pb.d;
      p.k_stride_t = p.v_stride_t = int64_t(pb.hkv) * pb.d;
      p.q_stride_h = p.k_stride_h = p.v_stride_h = p.do_stride_h = pb.d;
      p.lse = b.lse.as<float>();
      p.delta = b.delta.as<float>();
      p.cu_seqlens = pb.cu.as<int32_t>();
      p.cu_seqlens_k = p.cu_seqlens;  // keys of the queries' layout
      p.offsets = b.ri->p.offsets;
      p.tokens = b.ri->p.rows;
      p.block_offsets = b.ri->p.block_offsets;
      p.item_offsets = b.ri->p.item_offsets;
      p.items = b.ri->p.items;
      p.item_order = b.ri->p.item_order;
      p.num_keys = int(rs.num_keys);
      p.units_per_item = int(rs.units_per_item);
      p.max_items = int(rs.max_items);
      p.dq_accum = dq.as<float>();
      p.dk_accum = dk.as<float>();
      p.dv_accum = dv.as<float>();
      p.total_tokens = int(T);
      p.num_seqs = int(pb.b);
      p.block_size = pb.block;
      p.max_blocks = int(rs.max_blocks);
      p.hq = pb.hq;
      p.hkv = pb.hkv;
      p.hi = pb.hi;
      p.scale = pb.softmax_scale;
      p.scale_log2 = float(double(pb.softmax_scale) * 1.4426950408889634);
      p.small_smem = pb.small_smem_bwd;
      p.ws = ws;
      p.ws_tma = ws_tma;
    }
    BENCH_CHECK(cudaStreamSynchronize(s));
    std::fprintf(stderr, "# sparse bwd N=%lld: %d set(s), up to %lld work items%s\n", (long long)n, n_sets,
                 (long long)rs.max_items, sink ? ", sink" : "");
    auto kernel = [&](int i) {
      dispatch(pb.fp16, pb.d, [&]<typename E, int D>() {
#ifdef MSA_WITH_SM90
        if (pb.sm90) {
          BENCH_CHECK((sm90::launch_sparse_bwd<E, D>(ps[i], s)));
          return;
        }
#endif
        BENCH_CHECK((sm80::launch_sparse_bwd<E, D>(ps[i], s)));
      });
    };
    const std::string path = path_suffix(pb.sm90, pb.small_smem_bwd) + (pb.sm90 && ws ? "-ws" : "");
    const std::string shape = pb.shape + " units=" + std::to_string(rs.units_per_item) + (sink ? " sink" : "");
    const double F = 4.0 * pb.d * pb.g * att;
    auto want = [&](const char* row) { return only.empty() || only == row; };
    if (want("delta")) {
      const double ms = time_ms(opt, s, n_sets, [&](int i) { BENCH_CHECK(smxx::launch_bwd_delta(dps[i], !pb.fp16, s)); });
      print_row("bwd_delta", shape, ms, 0, 2.0 * T * pb.hq * pb.d * pb.elem + 4.0 * pb.hq * T);
    }
    if (want("bwd")) {
      const double ms = time_ms(opt, s, n_sets, kernel, zero);
      print_row("sparse_bwd" + path, shape, ms, 2.5 * F, 0);
    }
    if (want("total")) {
      const double ms = time_ms(opt, s, n_sets, [&](int i) {
        zero(i);
        BENCH_CHECK(smxx::launch_bwd_delta(dps[i], !pb.fp16, s));
        BENCH_CHECK(run_reverse_index(sets[i].ri->p, s));
        kernel(i);
      });
      print_row("bwd_total" + path, shape, ms, 2.5 * F, 0);
    }
  }
  BENCH_CHECK(cudaStreamDestroy(s));
  return 0;
}
