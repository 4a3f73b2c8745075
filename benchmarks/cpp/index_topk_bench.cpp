// Index top-k (SPEC 2) microbenchmark: the kernel msa::select_blocks launches, on random normal q_idx / k_idx; on the
// Hopper path also its lse mode (warmup's lse_idx, row index_lse/sm90) and, at Di = 128, the FP8 selection
// (index_dtype): the e4m3 copies (fp8_copies/smxx) and the FP8 top-k on them (index_topk_fp8/sm90). FLOPs: the index
// FLOPs of SPEC 8, 2 Di Hi sum_i (i + 1) per sequence (the causal scores), for every top-k row; the copies' bytes:
// k_idx read twice (its maxima, then the copy), q_idx once, both written at one byte a value.
#include "bench_common.h"

using namespace msa::bench;

int main(int argc, char** argv) {
  Options opt;
  parse_options(argc, argv,
                "Index top-k (msa::select_blocks' kernel: sm_90a where built and on Hopper, else portable).\n"
                "Rows: index_topk/<path>, index_topk_sel/sm90 and index_lse/sm90 (Hopper only), fp8_copies/smxx and\n"
                "index_topk_fp8/sm90 (Hopper, Di = 128); tflops = 2 Di Hi B N (N + 1) / 2 / time.",
                opt);
  const cudaStream_t s = init_device();
  print_header(opt);
  for (const int64_t n : opt.ns) {
    const Problem pb = make_problem(opt, n, s);
    const int64_t T = pb.tokens;
    const size_t qi_bytes = size_t(T) * pb.hi * pb.di * 2, ki_bytes = size_t(T) * pb.hki * pb.di * 2;
    // Rotating sets of q_idx / k_idx (the kernel's inputs): >= 256 MiB together.
    const int n_sets = rotating_sets(opt, double(qi_bytes + ki_bytes), 64);
    std::vector<Buf> qi, ki;
    for (int i = 0; i < n_sets; ++i) {
      qi.emplace_back(qi_bytes);
      ki.emplace_back(ki_bytes);
      fill_normal(qi.back().get(), T * pb.hi * pb.di, pb.fp16, opt.seed * 7919 + 2 * i, s);
      fill_normal(ki.back().get(), T * pb.hki * pb.di, pb.fp16, opt.seed * 7919 + 2 * i + 1, s);
    }
    Buf indices(sizeof(int32_t) * pb.hi * T * pb.topk);
    std::vector<msa::IndexTopkParams> params;
    for (int i = 0; i < n_sets; ++i) {
      params.push_back(index_topk_params(pb, qi[i].get(), ki[i].get(), indices.as<int32_t>()));
    }
    bool sm90 = false;
    BENCH_CHECK(launch_index_topk(pb, params[0], s, &sm90));
    BENCH_CHECK(cudaStreamSynchronize(s));
    std::fprintf(stderr, "# index top-k N=%lld: %d set(s)\n", (long long)n, n_sets);
    const double ms = time_ms(opt, s, n_sets, [&](int i) { BENCH_CHECK(launch_index_topk(pb, params[i], s)); });
    const double flops = 2.0 * pb.di * pb.hi * double(pb.b) * double(n) * double(n + 1) / 2;
    print_row("index_topk" + path_suffix(sm90, !sm90 && pb.force_small_smem), pb.shape, ms, flops, 0);
    if (sm90) {
      // The selection msa_fwd runs: the top list also carries each kept block's sum (IndexTopkParams::sel_stats).
      Buf sel(sizeof(float) * 2 * pb.hi * T);
      std::vector<msa::IndexTopkParams> sel_params = params;
      for (msa::IndexTopkParams& p : sel_params) p.sel_stats = reinterpret_cast<float2*>(sel.get());
      const double sel_ms =
          time_ms(opt, s, n_sets, [&](int i) { BENCH_CHECK(launch_index_topk(pb, sel_params[i], s)); });
      print_row("index_topk_sel/sm90", pb.shape, sel_ms, flops, 0);
      Buf lse(sizeof(float) * pb.hi * T);
      for (msa::IndexTopkParams& p : params) p.lse = lse.as<float>();
      const cudaError_t err = launch_index_lse(pb, params[0], s);
      if (err != cudaErrorNotSupported) {
        BENCH_CHECK(err);
        const double lse_ms = time_ms(opt, s, n_sets, [&](int i) { BENCH_CHECK(launch_index_lse(pb, params[i], s)); });
        print_row("index_lse/sm90", pb.shape, lse_ms, flops, 0);
      }
      if (pb.di == 128) {
        // The FP8 selection: the copies of each set, then the FP8 top-k on them.
        std::vector<Buf> q8, k8;
        std::vector<msa::IndexTopkParams> fp8_params;
        Buf amax(sizeof(float) * size_t(pb.b) * pb.hki);
        auto copies = [&](int i) {
          BENCH_CHECK(launch_fp8_copies(pb, qi[i].get(), ki[i].get(), q8[i].as<uint8_t>(), k8[i].as<uint8_t>(),
                                        amax.as<float>(), s));
        };
        for (int i = 0; i < n_sets; ++i) {
          q8.emplace_back(qi_bytes / 2);
          k8.emplace_back(ki_bytes / 2);
          copies(i);
          fp8_params.push_back(index_topk_params(pb, q8[i].get(), k8[i].get(), indices.as<int32_t>()));
        }
        const double copies_ms = time_ms(opt, s, n_sets, copies);
        print_row("fp8_copies/smxx", pb.shape, copies_ms, 0, 1.5 * double(qi_bytes) + 2.5 * double(ki_bytes));
        const cudaError_t err8 = launch_index_topk_fp8(pb, fp8_params[0], s);
        if (err8 != cudaErrorNotSupported) {
          BENCH_CHECK(err8);
          const double fp8_ms =
              time_ms(opt, s, n_sets, [&](int i) { BENCH_CHECK(launch_index_topk_fp8(pb, fp8_params[i], s)); });
          print_row("index_topk_fp8/sm90", pb.shape, fp8_ms, flops, 0);
        }
      }
    }
  }
  BENCH_CHECK(cudaStreamDestroy(s));
  return 0;
}
