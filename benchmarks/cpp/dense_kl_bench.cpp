// Dense KL microbenchmark: warmup's KL pass on Hopper (csrc/sm90/dense_kl, launch_dense_kl and
// launch_dense_kl_finish) with the params as csrc/api/dense_kl.cpp fills them. sm_90a builds only
// (MSA_WITH_SM90) on an sm_90 GPU; elsewhere it says so and exits 0 (the op takes the sparse kernels in
// dense mode there).
//   dense_kl/sm90        the kernel alone (kl_fixed, dq_idx, dk_idx zeroed before the start event)
//   dense_kl_total/sm90  the op's sequence: zero kl_fixed (+ dq_idx, dk_idx), tile offsets, kernel, finish
// FLOPs (tflops): the useful ones, over the causal (query, key) pairs only (not the masked parts of the
// diagonal tiles): per pair and index group, S_h = Q_h K^T for the G heads (2 D G), S_idx = Q_idx K_idx^T
// (2 Di) and with the gradient dK_idx += dS^T Q_idx, dQ_idx = dS K_idx (2 Di each): (2 D G + 6 Di), or
// (2 D G + 2 Di) with --no-grad; times Hi groups and B N (N + 1) / 2 pairs. This is the kernel header's
// "128 x 64 x (2 D G + 6 Di)" per (query tile, group) restricted to the causal pairs, without that
// comment's trailing "x 2" (2 D G already counts the multiply and the add).
// lse and lse_idx are inputs (the dense attention's, in the op): here the constants ln(p + 1) + 1 for the
// row at position p of its sequence, a plausible magnitude for random unit-variance scores. The timing does
// not depend on their values (no data-dependent branches; only the KL / gradient values do).
#include <algorithm>
#include <cmath>
#include <string>

#include "bench_common.h"
#include "smxx/reverse_index/reverse_index.h"
#ifdef MSA_WITH_SM90
#include "sm90/dense_kl/dense_kl.h"
#endif

using namespace msa;
using namespace msa::bench;

int main(int argc, char** argv) {
  Options opt;
  bool grad = true;
  int chunk_override = 0;
  int chunk_major = 1;
  int ws = 1;
  std::string only;
  const std::vector<Knob> knobs = {
      {"--no-grad", nullptr, "no index gradients (msa_fwd with index_grad=False: dq_idx / dk_idx null)",
       [&](const char*) { grad = false; }},
      {"--chunk", "C", "64-row query tiles per CTA (default max(4, ceil(N / 64) / 32); MSA_DENSE_KL_CHUNK)",
       [&](const char* v) { chunk_override = std::max(1, std::atoi(v)); }},
      {"--order", "tile|chunk", "the grid's order (default chunk; MSA_DENSE_KL_ORDER=tile)",
       [&](const char* v) { chunk_major = knob_choice("--order", v, {"tile", "chunk"}); }},
      {"--ws", "0|1", "1: the index warpgroup (default), 0: the two-warpgroup kernel (MSA_DENSE_KL_WS=0)",
       [&](const char* v) { ws = knob_choice("--ws", v, {"0", "1"}); }},
      {"--only", "kl|total", "time one row only", [&](const char* v) { only = v; }},
  };
  parse_options(argc, argv,
                "Warmup's dense KL pass (sm_90a): KL over the full causal set with its index gradients, given\n"
                "lse and lse_idx (constants here; the timing does not depend on them). Needs Hkv <= Hi (J = 1).\n"
                "--block, --topk, --small-smem do not apply.\n"
                "Rows: dense_kl/sm90 (the kernel; zeroing outside the timing), dense_kl_total/sm90 (zeroing,\n"
                "tile offsets, kernel, finish). tflops: the causal pairs' (2 D G + 6 Di) per index group.",
                opt, knobs);
#ifndef MSA_WITH_SM90
  (void)grad, (void)chunk_override, (void)chunk_major, (void)ws;
  std::fprintf(stderr, "msa_bench_dense_kl: this build has no sm_90a kernels (MSA_CUDA_ARCHS without 90a): "
                       "nothing to time\n");
  return 0;
#else
  const cudaStream_t s = init_device();
  print_header(opt);
  for (const int64_t n : opt.ns) {
    const Problem pb = make_problem(opt, n, s);
    if (!pb.sm90) {
      std::fprintf(stderr, "msa_bench_dense_kl: the dense KL pass runs on sm_90 GPUs only (not with --portable): "
                           "nothing to time\n");
      break;
    }
    if (pb.hkv > pb.hi) {
      std::fprintf(stderr, "msa_bench_dense_kl: needs Hkv <= Hi (J = 1), got Hkv = %d, Hi = %d\n", pb.hkv, pb.hi);
      return 1;
    }
    const int64_t T = pb.tokens, S = pb.b;
    const int smem = sm90::dense_kl_smem_bytes(pb.d, pb.di, pb.g);
    if (smem > pb.smem_optin) {
      std::fprintf(stderr, "the dense KL pass needs %d bytes of shared memory per block; the GPU offers %lld\n", smem,
                   (long long)pb.smem_optin);
      return 1;
    }
    const double set_bytes = double(T) * pb.elem * (double(pb.hq + pb.hkv) * pb.d + double(pb.hi + pb.hki) * pb.di);
    const int n_sets = rotating_sets(opt, set_bytes, 4);
    struct Set {
      Buf q, k, qi, ki;
    };
    auto normal = [&](int64_t heads, int dim, uint64_t seed) {  // (T, heads, dim), random normal
      Buf b(size_t(T) * heads * dim * pb.elem);
      fill_normal(b.get(), T * heads * dim, pb.fp16, seed, s);
      return b;
    };
    std::vector<Set> sets(n_sets);
    for (int i = 0; i < n_sets; ++i) {
      const uint64_t seed = opt.seed * 1000003u + uint64_t(i) * 16u;
      sets[i] = {normal(pb.hq, pb.d, seed + 1), normal(pb.hkv, pb.d, seed + 2), normal(pb.hi, pb.di, seed + 3),
                 normal(pb.hki, pb.di, seed + 4)};
    }
    // lse (Hq, T), lse_idx (Hi, T): ln(p + 1) + 1 at position p of the row's sequence (one copy for every set).
    std::vector<float> row(static_cast<size_t>(T));
    for (int64_t t = 0; t < T; ++t) row[size_t(t)] = float(std::log(double(t % n + 1)) + 1.0);
    Buf lse(sizeof(float) * pb.hq * T), lse_idx(sizeof(float) * pb.hi * T);
    auto upload = [&](const Buf& dst, int heads) {
      for (int h = 0; h < heads; ++h) {
        BENCH_CHECK(cudaMemcpyAsync(dst.as<float>() + int64_t(h) * T, row.data(), sizeof(float) * T,
                                    cudaMemcpyHostToDevice, s));
      }
    };
    upload(lse, pb.hq);
    upload(lse_idx, pb.hi);
    // The outputs (one set: written, not read): the op allocates dq_idx, dk_idx and kl_fixed zeroed.
    Buf dq_idx(grad ? sizeof(float) * T * pb.hi * pb.di : 0), dk_idx(grad ? sizeof(float) * T * pb.hki * pb.di : 0);
    Buf kl_fixed(sizeof(unsigned long long) * pb.hi * T), kl_rows(sizeof(float) * pb.hi * T);
    Buf kl_bad(sizeof(unsigned int) * pb.hi * T);
    Buf tile_offsets(sizeof(int32_t) * (S + 1));
    BENCH_CHECK(launch_block_offsets(pb.cu.as<int32_t>(), tile_offsets.as<int32_t>(), int(S), 128, s));

    // Params as csrc/api/dense_kl.cpp fills them (contiguous inputs; max_seqlen = N).
    std::vector<DenseKlParams> ps(n_sets);
    const int64_t n_qt = (std::min<int64_t>(n, T) + 63) / 64;  // 64-row query tiles of the longest sequence
    const int chunk_tiles = chunk_override > 0 ? chunk_override : int(std::max<int64_t>(4, n_qt / 32));
    for (int i = 0; i < n_sets; ++i) {
      DenseKlParams& p = ps[i];
      p = DenseKlParams{};
      p.q = sets[i].q.get();
      p.k = sets[i].k.get();
      p.q_idx = sets[i].qi.get();
      p.k_idx = sets[i].ki.get();
      p.q_stride_t = int64_t(pb.hq) * pb.d;
      p.q_stride_h = pb.d;
      p.k_stride_t = int64_t(pb.hkv) * pb.d;
      p.k_stride_h = pb.d;
      p.qi_stride_t = int64_t(pb.hi) * pb.di;
      p.qi_stride_h = pb.di;
      p.ki_stride_t = int64_t(pb.hki) * pb.di;
      p.ki_stride_h = pb.di;
      p.cu_seqlens = pb.cu.as<int32_t>();
      p.cu_seqlens_k = p.cu_seqlens;  // keys of the queries' layout
      p.tile_offsets = tile_offsets.as<int32_t>();
      p.lse = lse.as<float>();
      p.lse_idx = lse_idx.as<float>();
      p.dq_idx = grad ? dq_idx.as<float>() : nullptr;
      p.dk_idx = grad ? dk_idx.as<float>() : nullptr;
      p.kl_fixed = kl_fixed.as<unsigned long long>();
      p.kl_bad = kl_bad.as<unsigned int>();
      p.total_tokens = int(T);
      p.num_seqs = int(S);
      p.num_tiles = int(T / 128 + S);
      p.chunk_tiles = chunk_tiles;
      p.max_chunks = int((n_qt + chunk_tiles - 1) / chunk_tiles);
      p.chunk_major = chunk_major;
      p.ws = ws;
      p.hq = pb.hq;
      p.hkv = pb.hkv;
      p.hi = pb.hi;
      p.hki = pb.hki;
      p.scale_log2 = float(double(pb.softmax_scale) * 1.4426950408889634);
      p.iscale_log2 = float(double(pb.index_scale) * 1.4426950408889634);
      p.grad_scale = float(double(pb.index_scale) / double(T * pb.hi));
    }
    if (int64_t(ps[0].num_tiles) * ps[0].max_chunks >= (int64_t(1) << 31) || pb.hki > 65535) {
      std::fprintf(stderr, "msa_bench_dense_kl: too many query tiles for the dense KL grid, T = %lld\n", (long long)T);
      return 1;
    }
    BENCH_CHECK(cudaStreamSynchronize(s));
    std::fprintf(stderr, "# dense kl N=%lld: %d set(s), grid %d x %d x %d, %d query tiles per CTA, %d B smem%s\n",
                 (long long)n, n_sets, ps[0].num_tiles, ps[0].max_chunks, pb.hki, chunk_tiles, smem,
                 grad ? "" : ", no grad");

    auto zero = [&](int) {
      kl_fixed.zero(s);
      kl_bad.zero(s);
      dq_idx.zero(s);  // empty without grad: no-ops
      dk_idx.zero(s);
    };
    auto kernel = [&](int i) {
      dispatch(pb.fp16, pb.d, [&]<typename E, int D>() {
        BENCH_CHECK(pb.di == 64 ? (sm90::launch_dense_kl<E, D, 64>(ps[i], s))
                                : (sm90::launch_dense_kl<E, D, 128>(ps[i], s)));
      });
    };
    const double pairs = double(pb.b) * double(n) * double(n + 1) / 2.0;
    const double F = pairs * pb.hi * (2.0 * pb.d * pb.g + (grad ? 6.0 : 2.0) * pb.di);
    const std::string shape = pb.shape + " chunk=" + std::to_string(chunk_tiles) + (chunk_major ? "" : " tile-major") +
                              (ws ? "" : " ws=0") + (grad ? " grad" : " nograd");
    auto want = [&](const char* r) { return only.empty() || only == r; };
    if (want("kl")) {
      const double ms = time_ms(opt, s, n_sets, kernel, zero);
      print_row("dense_kl/sm90", shape, ms, F, 0);
    }
    if (want("total")) {
      const double ms = time_ms(opt, s, n_sets, [&](int i) {
        zero(i);
        BENCH_CHECK(launch_block_offsets(pb.cu.as<int32_t>(), tile_offsets.as<int32_t>(), int(S), 128, s));
        kernel(i);
        BENCH_CHECK(sm90::launch_dense_kl_finish(ps[i].kl_fixed, ps[i].kl_bad, ps[i].lse_idx, kl_rows.as<float>(),
                                                 int64_t(pb.hi) * T, s));
      });
      print_row("dense_kl_total/sm90", shape, ms, F, 0);
    }
  }
  BENCH_CHECK(cudaStreamDestroy(s));
  return 0;
#endif
}
