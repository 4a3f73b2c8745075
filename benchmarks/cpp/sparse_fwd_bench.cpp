// Sparse forward microbenchmark: the two passes of csrc/api/sparse_fwd.cpp (stats pass, output pass),
// index_dk (msa-grad) and the whole per-chunk sequence of the op, over every query chunk of N.
// FLOPs (SPEC 8, the main branch; the index branch's logits, KL and dsi work in the msa modes is extra
// and not counted): attended fwd FLOPs F = 4 D sum over (t, h) |T(t, r(h))|;
//   fwd_stats_pass  0.5 F (Q K^T)          fwd_out_pass  F (Q K^T again and P V)
//   fwd_total       1.5 F (as msa.bench's sparse fwd row; reverse index, memsets and combines included)
//   index_dk        2 Di sum over (t, r) |T(t, r)| (dsi^T q_idx over the attended keys); only where the op
//                   launches it: the warp-specialized output pass computes dk_idx itself (no row then)
#include "bench_fwd.h"

using namespace msa;
using namespace msa::bench;

int main(int argc, char** argv) {
  Options opt;
  FwdConfig cfg;
  std::string only;
  std::vector<Knob> knobs = fwd_knobs(cfg);
  knobs.push_back({"--only", "stats|out|dk|total", "time one row only", [&](const char* v) { only = v; }});
  parse_options(argc, argv,
                "Sparse forward (KV-outer work items): stats pass, output pass, index_dk, and the op's whole\n"
                "per-chunk sequence, over all query chunks of N (chunked as the op: fwd_partial_budget's partials each).\n"
                "Rows: fwd_stats_pass/<path>, fwd_out_pass/<path>, index_dk, fwd_total/<path>.",
                opt, knobs);
  const cudaStream_t s = init_device();
  print_header(opt);
  for (const int64_t n : opt.ns) {
    const Problem pb = make_problem(opt, n, s);
    const double set_bytes = fwd_input_bytes(pb, cfg.mode != FwdMode::kSparse);
    const FwdBench fb(pb, cfg, rotating_sets(opt, set_bytes, 3), opt.seed, s);
    const int n_sets = int(fb.sets.size());
    const std::string path = path_suffix(pb.sm90, pb.small_smem);
    const std::string shape = fb.shape();
    const double F = fb.attended_flops();
    auto want = [&](const char* row) { return only.empty() || only == row; };
    if (want("stats")) {
      const double ms = time_ms(
          opt, s, n_sets,
          [&](int i) {
            for (int c = 0; c < fb.num_chunks(); ++c) fb.stats_pass(i, c);
          },
          [&](int i) {
            for (int c = 0; c < fb.num_chunks(); ++c) fb.zero_stats(i, c);
          });
      print_row("fwd_stats_pass" + path, shape, ms, 0.5 * F, 0);
    }
    if (want("out")) {
      const double ms = time_ms(
          opt, s, n_sets,
          [&](int i) {
            for (int c = 0; c < fb.num_chunks(); ++c) fb.out_pass(i, c);
          },
          [&](int i) { fb.zero_grads(i); });
      const bool gu4 = pb.sm90 && cfg.fixed_gu && fwd_fixed_gu(pb.g, pb.j);
      // -ws: the warp-specialized pass (Gu = 4 with the index branch; sparse mode has none).
      const bool ws = gu4 && cfg.out_ws && cfg.mode != FwdMode::kSparse;
      print_row("fwd_out_pass" + path + (ws ? "-ws" : gu4 ? "-gu4" : ""), shape, ms, F, 0);
    }
    if (fb.dsi && want("dk")) {
      const double ms = time_ms(
          opt, s, n_sets,
          [&](int i) {
            for (int c = 0; c < fb.num_chunks(); ++c) fb.index_dk(i, c);
          },
          [&](int i) { fb.zero_grads(i); });
      print_row("index_dk", shape, ms, 2.0 * pb.di * fb.attended(), 0);
    }
    if (want("total")) {
      const double ms = time_ms(opt, s, n_sets, [&](int i) { fb.forward(i); }, [&](int i) { fb.zero_grads(i); });
      print_row("fwd_total" + path, shape, ms, 1.5 * F, 0);
    }
  }
  BENCH_CHECK(cudaStreamDestroy(s));
  return 0;
}
