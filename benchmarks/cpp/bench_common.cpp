#include "bench_common.h"

#include <algorithm>
#include <cmath>
#include <cstring>

#include "common/workspace.h"
#include "sm80/index_topk/index_topk.h"
#include "smxx/fill/fill.h"
#include "smxx/fp8_copies/fp8_copies.h"
#ifdef MSA_WITH_SM90
#include "sm90/index_topk/index_topk.h"
#endif

namespace msa::bench {

// ---- options ------------------------------------------------------------------------------------------

namespace {

[[noreturn]] void usage_error(const char* prog, const std::string& msg) {
  std::fprintf(stderr, "%s: %s (see --help)\n", prog, msg.c_str());
  std::exit(2);
}

int64_t to_int(const char* prog, const char* flag, const char* s) {
  char* end = nullptr;
  const long long v = std::strtoll(s, &end, 10);
  if (end == s || *end != '\0') usage_error(prog, std::string(flag) + ": expected an integer, got '" + s + "'");
  return v;
}

void print_help(const char* prog, const char* about, const std::vector<Knob>& knobs) {
  std::printf("usage: %s [options]\n%s\n\n", prog, about);
  std::printf(
      "Shape (default: the bench configuration, SPEC 8):\n"
      "  --n N [N ...]       sequence lengths, also comma-separated (default 32768)\n"
      "  --b B               sequences of N tokens each (default 1)\n"
      "  --hq/--hkv/--hi/--hki H  heads (default 16 / 2 / 4 / 1)\n"
      "  --d 64|128          head dim of q, k, v (default 128; also Di unless --di)\n"
      "  --di 64|128         index head dim\n"
      "  --block 64|128      kv block size (default 128)\n"
      "  --topk K            blocks per row, 1..32 (default 16)\n"
      "  --dtype bf16|fp16   (default bf16)\n"
      "Kernels:\n"
      "  --portable          the portable sm80 kernels on Hopper too (MSA_PORTABLE_KERNELS=1)\n"
      "  --small-smem        the portable kernels' 99 KB configuration (MSA_SMALL_SMEM=1)\n"
      "Timing:\n"
      "  --reps R            timed calls, median reported (default 20)\n"
      "  --warmup W          untimed calls first (default 2)\n"
      "  --sets S            rotating input sets (default: >= 256 MiB of inputs together, capped)\n"
      "  --seed S            random inputs' seed (default 1)\n"
      "  --no-header         no CSV header line\n");
  if (!knobs.empty()) {
    std::printf("This benchmark:\n");
    for (const Knob& k : knobs) {
      std::string f = std::string(k.flag) + (k.arg ? std::string(" ") + k.arg : "");
      if (f.size() <= 19) std::printf("  %-19s %s\n", f.c_str(), k.help);
      else std::printf("  %s\n  %-19s %s\n", f.c_str(), "", k.help);
    }
  }
  std::printf(
      "Output: CSV on stdout, `kernel,shape,ms,tflops,gbps` (median ms over the reps; tflops from the SPEC 8\n"
      "FLOPs, gbps from the bytes read + written, empty where not counted); setup notes on stderr.\n");
}

}  // namespace

int knob_choice(const char* flag, const char* v, std::initializer_list<const char*> names) {
  int i = 0;
  std::string list;
  for (const char* n : names) {
    if (std::strcmp(v, n) == 0) return i;
    list += (i++ ? "|" : "") + std::string(n);
  }
  std::fprintf(stderr, "%s: expected %s, got %s (see --help)\n", flag, list.c_str(), v);
  std::exit(2);
}

void parse_options(int argc, char** argv, const char* about, Options& opt, const std::vector<Knob>& knobs) {
  const char* prog = argc > 0 ? argv[0] : "bench";
  if (const char* slash = std::strrchr(prog, '/')) prog = slash + 1;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    auto value = [&]() -> const char* {
      if (i + 1 >= argc) usage_error(prog, a + ": missing value");
      return argv[++i];
    };
    auto int_value = [&]() { return to_int(prog, a.c_str(), value()); };
    if (a == "--help" || a == "-h") {
      print_help(prog, about, knobs);
      std::exit(0);
    } else if (a == "--n") {
      bool any = false;
      while (i + 1 < argc && argv[i + 1][0] >= '0' && argv[i + 1][0] <= '9') {
        std::string list = argv[++i];
        size_t pos = 0;
        while (pos <= list.size()) {
          const size_t comma = std::min(list.find(',', pos), list.size());
          const std::string item = list.substr(pos, comma - pos);
          if (!item.empty()) opt.ns.push_back(to_int(prog, "--n", item.c_str()));
          pos = comma + 1;
        }
        any = true;
      }
      if (!any) usage_error(prog, "--n: missing value");
    } else if (a == "--b") {
      opt.b = int(int_value());
    } else if (a == "--hq") {
      opt.hq = int(int_value());
    } else if (a == "--hkv") {
      opt.hkv = int(int_value());
    } else if (a == "--hi") {
      opt.hi = int(int_value());
    } else if (a == "--hki") {
      opt.hki = int(int_value());
    } else if (a == "--d") {
      opt.d = int(int_value());
    } else if (a == "--di") {
      opt.di = int(int_value());
    } else if (a == "--block") {
      opt.block = int(int_value());
    } else if (a == "--topk") {
      opt.topk = int(int_value());
    } else if (a == "--dtype") {
      const std::string v = value();
      if (v != "bf16" && v != "fp16") usage_error(prog, "--dtype: expected bf16 or fp16, got " + v);
      opt.fp16 = v == "fp16";
    } else if (a == "--reps") {
      opt.reps = int(int_value());
    } else if (a == "--warmup") {
      opt.warmup = int(int_value());
    } else if (a == "--sets") {
      opt.sets = int(int_value());
    } else if (a == "--seed") {
      opt.seed = uint64_t(int_value());
    } else if (a == "--portable") {
      opt.portable = true;
    } else if (a == "--small-smem") {
      opt.small_smem = true;
    } else if (a == "--no-header") {
      opt.header = false;
    } else {
      const Knob* k = nullptr;
      for (const Knob& c : knobs) {
        if (a == c.flag) k = &c;
      }
      if (k == nullptr) usage_error(prog, "unknown option " + a);
      k->set(k->arg ? value() : nullptr);
    }
  }
  if (opt.ns.empty()) opt.ns.push_back(32768);
  if (opt.di == 0) opt.di = opt.d;
  if (opt.reps < 1) usage_error(prog, "--reps: expected >= 1");
  auto check = [&](bool ok, const char* what) {
    if (!ok) usage_error(prog, what);
  };
  check(opt.d == 64 || opt.d == 128, "--d: expected 64 or 128");
  check(opt.di == 64 || opt.di == 128, "--di: expected 64 or 128");
  check(opt.block == 64 || opt.block == 128, "--block: expected 64 or 128");
  check(opt.topk >= 1 && opt.topk <= 32, "--topk: expected 1..32");
  check(opt.b >= 1, "--b: expected >= 1");
  check(opt.hi >= 1 && opt.hq % opt.hi == 0, "--hi: expected Hi dividing Hq");
  check(opt.hkv >= 1 && opt.hq % opt.hkv == 0 && (opt.hi % opt.hkv == 0 || opt.hkv % opt.hi == 0),
        "--hkv: expected Hkv dividing Hq, Hi and Hkv dividing one another");
  check(opt.hki >= 1 && opt.hi % opt.hki == 0 && opt.hi / opt.hki <= 64, "--hki: expected Hki dividing Hi, Hi / Hki <= 64");
  const int g = opt.hq / opt.hi, j = opt.hkv > opt.hi ? opt.hkv / opt.hi : 1;
  check(g / j <= 64, "at most 64 query heads per (index group, kv head)");
  for (int64_t n : opt.ns) check(n >= 1 && n * opt.b < (int64_t(1) << 31) / (opt.hi * opt.topk), "--n: out of range");
}

// ---- device ---------------------------------------------------------------------------------------------

Buf::Buf(size_t bytes) : bytes_(bytes) {
  if (bytes > 0) {
    const cudaError_t err = cudaMalloc(&p_, bytes);
    if (err != cudaSuccess) {
      std::fprintf(stderr, "cudaMalloc(%.3f GiB): %s\n", double(bytes) / (1 << 30), cudaGetErrorString(err));
      std::exit(1);
    }
  }
}

Buf::~Buf() {
  if (p_ != nullptr) cudaFree(p_);
}

Buf& Buf::operator=(Buf&& o) noexcept {
  if (this != &o) {
    if (p_ != nullptr) cudaFree(p_);
    p_ = std::exchange(o.p_, nullptr);
    bytes_ = std::exchange(o.bytes_, 0);
  }
  return *this;
}

void Buf::zero(cudaStream_t s) const {
  if (bytes_ > 0) BENCH_CHECK(cudaMemsetAsync(p_, 0, bytes_, s));
}

cudaStream_t init_device() {
  BENCH_CHECK(cudaSetDevice(0));
  cudaDeviceProp prop{};
  BENCH_CHECK(cudaGetDeviceProperties(&prop, 0));
  std::fprintf(stderr, "# device: %s (sm_%d%d), %d SMs, L2 %.0f MB, %.0f GB\n", prop.name, prop.major, prop.minor,
               prop.multiProcessorCount, prop.l2CacheSize / 1e6, prop.totalGlobalMem / 1e9);
  cudaStream_t s = nullptr;
  BENCH_CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  return s;
}

Problem make_problem(const Options& opt, int64_t n, cudaStream_t s) {
  Problem pb;
  pb.n = n;
  pb.b = opt.b;
  pb.tokens = n * opt.b;
  pb.hq = opt.hq;
  pb.hkv = opt.hkv;
  pb.hi = opt.hi;
  pb.hki = opt.hki;
  pb.d = opt.d;
  pb.di = opt.di;
  pb.block = opt.block;
  pb.topk = opt.topk;
  pb.g = opt.hq / opt.hi;
  pb.j = opt.hkv > opt.hi ? opt.hkv / opt.hi : 1;
  pb.fp16 = opt.fp16;
  pb.softmax_scale = float(1.0 / std::sqrt(double(opt.d)));
  pb.index_scale = float(1.0 / std::sqrt(double(opt.di)));
  int device = 0, optin = 0;
  BENCH_CHECK(cudaGetDevice(&device));
  BENCH_CHECK(cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, device));
  pb.smem_optin = optin;
#ifdef MSA_WITH_SM90
  pb.sm90 = !opt.portable && device_is_sm90(device);
#endif
  // csrc/api/sparse_fwd.cpp (small_smem_config, fwd_out_rows) and sparse_bwd.cpp (small_smem_bwd_config).
  pb.force_small_smem = opt.small_smem;
  pb.small_smem = !pb.sm90 && (opt.small_smem || fwd_small_smem(optin, pb.d));
  pb.out_rows = pb.small_smem ? 64 : fwd_out_rows(optin, pb.d);
  pb.small_smem_bwd = !pb.sm90 && (opt.small_smem || bwd_small_smem(optin, pb.d));
  pb.cu = Buf(sizeof(int32_t) * (pb.b + 1));
  BENCH_CHECK(smxx::launch_iota_int32(pb.cu.as<int32_t>(), pb.b + 1, int32_t(n), s));
  char shape[256];
  std::snprintf(shape, sizeof(shape), "B=%d N=%lld Hq=%d Hkv=%d Hi=%d Hki=%d D=%d Di=%d bs=%d k=%d %s", opt.b,
                (long long)n, pb.hq, pb.hkv, pb.hi, pb.hki, pb.d, pb.di, pb.block, pb.topk,
                pb.fp16 ? "fp16" : "bf16");
  pb.shape = shape;
  return pb;
}

// ---- index top-k ------------------------------------------------------------------------------------------

IndexTopkParams index_topk_params(const Problem& pb, const void* q_idx, const void* k_idx, int32_t* indices) {
  IndexTopkParams p{};
  p.q_idx = q_idx;
  p.k_idx = k_idx;
  p.cu_seqlens = pb.cu.as<int32_t>();
  p.cu_seqlens_k = p.cu_seqlens;  // keys of the queries' layout
  p.indices = indices;
  p.q_stride_t = int64_t(pb.hi) * pb.di;
  p.q_stride_h = pb.di;
  p.k_stride_t = int64_t(pb.hki) * pb.di;
  p.k_stride_h = pb.di;
  p.total_tokens = int(pb.tokens);
  p.total_tokens_k = p.total_tokens;
  p.num_heads = pb.hi;
  p.num_key_heads = pb.hki;
  p.num_seqs = int(pb.b);
  p.max_seqlen = int(pb.n);
  p.topk = pb.topk;
  p.block_size = pb.block;
  p.scale = pb.index_scale;
  p.small_smem = pb.force_small_smem;  // the op: MSA_SMALL_SMEM=1 only
  return p;
}

cudaError_t launch_index_topk(const Problem& pb, const IndexTopkParams& p, cudaStream_t s, bool* used_sm90) {
  cudaError_t err = cudaErrorNotSupported;
  dispatch(pb.fp16, pb.di, [&]<typename T, int D>() {
#ifdef MSA_WITH_SM90
    if (pb.sm90) {
      err = sm90::launch_index_topk<T, D>(p, s);  // cudaErrorNotSupported: no TMA descriptor, nothing launched
      if (err != cudaErrorNotSupported) {
        if (used_sm90) *used_sm90 = true;
        return;
      }
    }
#endif
    if (used_sm90) *used_sm90 = false;
    err = sm80::launch_index_topk<T, D>(p, s);
  });
  return err;
}

cudaError_t launch_index_lse(const Problem& pb, const IndexTopkParams& p, cudaStream_t s) {
  cudaError_t err = cudaErrorNotSupported;
#ifdef MSA_WITH_SM90
  if (pb.sm90) dispatch(pb.fp16, pb.di, [&]<typename T, int D>() { err = sm90::launch_index_lse<T, D>(p, s); });
#else
  (void)pb, (void)p, (void)s;
#endif
  return err;
}

cudaError_t launch_fp8_copies(const Problem& pb, const void* q_idx, const void* k_idx, uint8_t* q8, uint8_t* k8,
                              float* k_amax, cudaStream_t s) {
  const cudaError_t err = cudaMemsetAsync(k_amax, 0, sizeof(float) * size_t(pb.b) * pb.hki, s);
  if (err != cudaSuccess) return err;
  const smxx::Fp8CopyArgs q{q_idx, q8, pb.tokens, int64_t(pb.hi) * pb.di, pb.di, pb.hi, pb.di};
  const smxx::Fp8CopyArgs k{k_idx, k8, pb.tokens, int64_t(pb.hki) * pb.di, pb.di, pb.hki, pb.di};
  const smxx::Fp8KeySeqs seqs{nullptr, pb.n, int(pb.b)};  // b sequences of n keys (the op's batched layout)
  return pb.fp16 ? smxx::launch_fp8_index_copies<__half>(q, k, seqs, k_amax, s)
                 : smxx::launch_fp8_index_copies<__nv_bfloat16>(q, k, seqs, k_amax, s);
}

cudaError_t launch_index_topk_fp8(const Problem& pb, const IndexTopkParams& p, cudaStream_t s) {
#ifdef MSA_WITH_SM90
  if (pb.sm90 && pb.di == 128) return sm90::launch_index_topk_fp8<128>(p, s);
#else
  (void)p, (void)s;
#endif
  (void)pb;
  return cudaErrorNotSupported;
}

// ---- timing and output ------------------------------------------------------------------------------------

int rotating_sets(const Options& opt, double set_bytes, int cap) {
  if (opt.sets > 0) return opt.sets;
  const double target = double(256 << 20);
  const int n = set_bytes > 0 ? int(std::ceil(target / set_bytes)) : 1;
  return std::max(1, std::min(cap, n));
}

double time_ms(const Options& opt, cudaStream_t s, int n_sets, const std::function<void(int)>& run,
               const std::function<void(int)>& prepare) {
  cudaEvent_t start, end;
  BENCH_CHECK(cudaEventCreate(&start));
  BENCH_CHECK(cudaEventCreate(&end));
  for (int i = 0; i < opt.warmup; ++i) {
    if (prepare) prepare(i % n_sets);
    run(i % n_sets);
  }
  BENCH_CHECK(cudaStreamSynchronize(s));
  BENCH_CHECK(cudaGetLastError());
  std::vector<float> times;
  for (int i = 0; i < opt.reps; ++i) {
    const int set = i % n_sets;
    if (prepare) prepare(set);
    BENCH_CHECK(cudaEventRecord(start, s));
    run(set);
    BENCH_CHECK(cudaEventRecord(end, s));
    BENCH_CHECK(cudaEventSynchronize(end));
    float ms = 0.f;
    BENCH_CHECK(cudaEventElapsedTime(&ms, start, end));
    times.push_back(ms);
  }
  BENCH_CHECK(cudaGetLastError());
  BENCH_CHECK(cudaEventDestroy(start));
  BENCH_CHECK(cudaEventDestroy(end));
  std::sort(times.begin(), times.end());
  const size_t m = times.size();
  return m % 2 ? times[m / 2] : 0.5 * (double(times[m / 2 - 1]) + times[m / 2]);
}

void print_header(const Options& opt) {
  if (opt.header) std::printf("kernel,shape,ms,tflops,gbps\n");
  std::fflush(stdout);
}

void print_row(const std::string& kernel, const std::string& shape, double ms, double flops, double bytes) {
  char tf[32] = "", gb[32] = "";
  if (flops > 0 && ms > 0) std::snprintf(tf, sizeof(tf), "%.2f", flops / (ms * 1e-3) / 1e12);
  if (bytes > 0 && ms > 0) std::snprintf(gb, sizeof(gb), "%.1f", bytes / (ms * 1e-3) / 1e9);
  std::printf("%s,%s,%.4f,%s,%s\n", kernel.c_str(), shape.c_str(), ms, tf, gb);
  std::fflush(stdout);
}

std::string path_suffix(bool sm90, bool small) { return sm90 ? "/sm90" : small ? "/sm80-small" : "/sm80"; }

}  // namespace msa::bench
