// Reverse index microbenchmark: run_reverse_index in the three configurations the ops build it in.
//   reverse_index      msa::reverse_index: tokens per key, no work list (whole T)
//   reverse_index_bwd  the backward's (csrc/api/sparse_bwd.cpp): tokens, work list of kBwdUnitsPerItem, order
//   reverse_index_fwd  the forward's (csrc/api/sparse_fwd.cpp): entry ids per query chunk, work list of
//                      kFwdUnitsPerItem, order; all chunks of the forward's chunking per call
// The selection comes from the index top-k kernel on random q_idx / k_idx.
// Bytes (gbps): the minimum traffic, counted once: the indices read (4 B per slot), the rows written
// (4 B per slot), offsets (4 B per key + 1), and with a work list item_offsets (4 B per key + 1), items
// (8 B per item slot) and the launch order (4 B per item slot). The radix sort's passes over the keys
// and values (several reads and writes of 8 B per slot) are not counted: gbps is an effective rate.
#include <cstring>

#include "bench_fwd.h"
#include "smxx/reverse_index/reverse_index.h"

using namespace msa;
using namespace msa::bench;

namespace {

double list_bytes(int64_t num_keys, int64_t max_items, bool list, bool order) {
  if (!list) return 0;
  return 4.0 * (num_keys + 1) + 8.0 * max_items + (order ? 4.0 * max_items : 0.0);
}

}  // namespace

int main(int argc, char** argv) {
  Options opt;
  FwdConfig fcfg;
  std::string config = "all";
  int64_t bwd_units = 0;  // 0: the op's choice, bwd_units_per_item(entries)
  std::vector<Knob> knobs = fwd_knobs(fcfg, false);
  knobs.push_back({"--config", "all|op|bwd|fwd", "which configurations to time (default all)",
                   [&](const char* v) { config = v; }});
  knobs.push_back({"--bwd-units", "U", "tokens per backward work item (default: the op's, 1024 up to 2^20 entries, else 2048; MSA_BWD_UNITS_PER_ITEM)",
                   [&](const char* v) { bwd_units = std::max<int64_t>(1, std::atoll(v)); }});
  parse_options(argc, argv,
                "Reverse index (kv block -> the tokens / entries that selected it) in the ops' three configurations.\n"
                "Rows: reverse_index, reverse_index_bwd, reverse_index_fwd; gbps from the minimum traffic\n"
                "(indices read, rows / offsets / work list written once; the radix sort's passes not counted).\n"
                "--mode / --units-per-item / --budget-mib set the forward's chunking (reverse_index_fwd).",
                opt, knobs);
  const bool all = config == "all";
  const cudaStream_t s = init_device();
  print_header(opt);
  for (const int64_t n : opt.ns) {
    const Problem pb = make_problem(opt, n, s);
    const int64_t T = pb.tokens, Hi = pb.hi, K = pb.topk, entries = Hi * T * K;
    // The selection once, then copies: rotating inputs of >= 256 MiB together.
    const int n_sets = rotating_sets(opt, 4.0 * entries, 64);
    std::vector<Buf> idx;
    {
      Buf qi(size_t(T) * pb.hi * pb.di * 2), ki(size_t(T) * pb.hki * pb.di * 2);
      fill_normal(qi.get(), T * pb.hi * pb.di, pb.fp16, opt.seed * 31 + 1, s);
      fill_normal(ki.get(), T * pb.hki * pb.di, pb.fp16, opt.seed * 31 + 2, s);
      idx.emplace_back(sizeof(int32_t) * entries);
      BENCH_CHECK(launch_index_topk(pb, index_topk_params(pb, qi.get(), ki.get(), idx[0].as<int32_t>()), s));
      for (int i = 1; i < n_sets; ++i) {
        idx.emplace_back(sizeof(int32_t) * entries);
        BENCH_CHECK(cudaMemcpyAsync(idx[i].get(), idx[0].get(), idx[0].bytes(), cudaMemcpyDeviceToDevice, s));
      }
      BENCH_CHECK(cudaStreamSynchronize(s));
    }
    std::fprintf(stderr, "# reverse index N=%lld: %d set(s) of the indices\n", (long long)n, n_sets);

    if (all || config == "op") {
      const ReverseIndexSizes rs = reverse_index_sizes(Hi, T, K, pb.b, pb.block, entries, 0, false);
      RevIndex ri(rs, pb);
      const double ms = time_ms(opt, s, n_sets, [&](int i) {
        ReverseIndexParams p = ri.p;
        p.indices = idx[i].as<int32_t>();
        BENCH_CHECK(run_reverse_index(p, s));
      });
      print_row("reverse_index", pb.shape, ms, 0, 8.0 * entries + 4.0 * (rs.num_keys + 1));
    }
    if (all || config == "bwd") {
      const int64_t item_units = bwd_units > 0 ? bwd_units : bwd_units_per_item(entries);  // per shape
      const ReverseIndexSizes rs = reverse_index_sizes(Hi, T, K, pb.b, pb.block, entries, item_units, fcfg.item_order);
      RevIndex ri(rs, pb);
      const double ms = time_ms(opt, s, n_sets, [&](int i) {
        ReverseIndexParams p = ri.p;
        p.indices = idx[i].as<int32_t>();
        BENCH_CHECK(run_reverse_index(p, s));
      });
      print_row("reverse_index_bwd", pb.shape + " units=" + std::to_string(item_units), ms, 0,
                8.0 * entries + 4.0 * (rs.num_keys + 1) + list_bytes(rs.num_keys, rs.max_items, true, rs.order));
    }
    if (all || config == "fwd") {
      // The forward's chunking (csrc/api/sparse_fwd.cpp): one chunk-sized index rebuilt per chunk.
      const bool grad = fcfg.mode == FwdMode::kMsaGrad;
      const int64_t per_token =
          fwd_bytes_per_token(Hi, K, pb.g, pb.d, pb.elem, false, grad, false, pb.di, fcfg.units_per_item);
      const int64_t chunk = fwd_chunk_tokens(T, per_token, fcfg.budget_for(T, pb.hq, pb.d));
      const ReverseIndexSizes rs =
          reverse_index_sizes(Hi, T, K, pb.b, pb.block, Hi * chunk * K, fcfg.units_per_item, fcfg.item_order);
      RevIndex ri(rs, pb);
      ri.p.emit_entries = true;
      double bytes = 0;
      for (int64_t t0 = 0; t0 < T; t0 += chunk) {
        const int64_t nc = Hi * std::min(chunk, T - t0) * K;
        bytes += 8.0 * nc + 4.0 * (rs.num_keys + 1) +
                 list_bytes(rs.num_keys, max_work_items(nc, fcfg.units_per_item, rs.num_keys), true, rs.order);
      }
      const double ms = time_ms(opt, s, n_sets, [&](int i) {
        ReverseIndexParams p = ri.p;
        p.indices = idx[i].as<int32_t>();
        for (int64_t t0 = 0; t0 < T; t0 += chunk) {
          const int64_t tc = std::min(chunk, T - t0);
          p.token_begin = int(t0);
          p.token_end = int(t0 + tc);
          p.max_items = int(max_work_items(Hi * tc * K, fcfg.units_per_item, rs.num_keys));
          BENCH_CHECK(run_reverse_index(p, s));
        }
      });
      char extra[96];
      std::snprintf(extra, sizeof(extra), " mode=%s chunk=%lld units=%d", mode_name(fcfg.mode), (long long)chunk,
                    fcfg.units_per_item);
      print_row("reverse_index_fwd", pb.shape + extra, ms, 0, bytes);
    }
  }
  BENCH_CHECK(cudaStreamDestroy(s));
  return 0;
}
