// Shared pieces of the C++ microbenchmarks (benchmarks/cpp/*_bench.cpp): options, device buffers, the
// random inputs, the selection (the index top-k kernel itself), CUDA-event timing over rotating input
// sets, and the CSV rows `kernel,shape,ms,tflops,gbps`. No torch: the kernels are called through the same
// params structs (csrc/params.h) and launchers as the torch ops (csrc/api).
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime_api.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <initializer_list>
#include <string>
#include <utility>
#include <vector>

#include "params.h"

#define BENCH_CHECK(expr)                                                                          \
  do {                                                                                             \
    const cudaError_t bench_err_ = (expr);                                                         \
    if (bench_err_ != cudaSuccess) {                                                               \
      std::fprintf(stderr, "%s:%d: %s: %s\n", __FILE__, __LINE__, #expr, cudaGetErrorString(bench_err_)); \
      std::exit(1);                                                                                \
    }                                                                                              \
  } while (0)

namespace msa::bench {

// ---- options ------------------------------------------------------------------------------------------

struct Options {
  std::vector<int64_t> ns;  // sequence lengths (--n; default 32768)
  int b = 1, hq = 16, hkv = 2, hi = 4, hki = 1, d = 128, di = 0, block = 128, topk = 16;  // di 0: = d
  bool fp16 = false;
  bool portable = false;    // the sm80 kernels on Hopper too
  bool small_smem = false;  // the portable kernels' 99 KB configuration
  int reps = 20, warmup = 2;
  int sets = 0;             // rotating input sets (0: enough to exceed the L2 cache, see rotating_sets)
  bool header = true;
  uint64_t seed = 1;
};

// An executable-specific option: `flag` with an argument when `arg` is set (its name in the help).
struct Knob {
  const char* flag;
  const char* arg;  // nullptr: a switch
  const char* help;
  std::function<void(const char*)> set;
};

// A knob's value among its choices: the index of v in `names`, else a usage error naming `flag` and the choices
// (stderr, exit 2).
int knob_choice(const char* flag, const char* v, std::initializer_list<const char*> names);

// Parses argv into `opt` (common options) and the knobs; --help prints `about`, the options and exits 0.
void parse_options(int argc, char** argv, const char* about, Options& opt, const std::vector<Knob>& knobs = {});

// ---- device ---------------------------------------------------------------------------------------------

// A device allocation (cudaMalloc), move-only.
class Buf {
 public:
  Buf() = default;
  explicit Buf(size_t bytes);
  ~Buf();
  Buf(Buf&& o) noexcept : p_(std::exchange(o.p_, nullptr)), bytes_(std::exchange(o.bytes_, 0)) {}
  Buf& operator=(Buf&& o) noexcept;
  Buf(const Buf&) = delete;
  Buf& operator=(const Buf&) = delete;
  void* get() const { return p_; }
  template <typename T>
  T* as() const { return static_cast<T*>(p_); }
  size_t bytes() const { return bytes_; }
  void zero(cudaStream_t s) const;

 private:
  void* p_ = nullptr;
  size_t bytes_ = 0;
};

// One problem size: the shape and what the device / options choose.
struct Problem {
  int64_t n = 0, b = 1, tokens = 0;  // tokens T = b * n (b sequences of n tokens)
  int hq, hkv, hi, hki, d, di, block, topk;
  int g, j;                          // G = Hq / Hi, J = Hkv / Hi (>= 1)
  bool fp16;
  int elem = 2;                      // bytes per element
  float softmax_scale, index_scale;  // D^-1/2, Di^-1/2 (the API defaults)
  bool sm90 = false;                 // the Hopper kernels (MSA_WITH_SM90, an sm_90 GPU, no --portable)
  bool force_small_smem = false;     // --small-smem (the index top-k's 64-row tile too)
  bool small_smem = false;           // portable forward: the 99 KB configuration
  bool small_smem_bwd = false;       // portable backward: the same
  int out_rows = 128;                // portable output pass rows per tile
  int64_t smem_optin = 0;
  Buf cu;                            // int32 (b + 1): b sequences of n tokens
  std::string shape;                 // for the CSV rows
};

// The CUDA context: device 0, a stream; prints the device to stderr once.
cudaStream_t init_device();
Problem make_problem(const Options& opt, int64_t n, cudaStream_t s);

// Random normal values (mean 0, std 1) in bf16 / fp16, from a counter-based hash of (seed, i).
void fill_normal(void* x, int64_t n, bool fp16, uint64_t seed, cudaStream_t s);
// sum over (r, t) of |T(t, r)| (SPEC 8): the tokens of the distinct selected blocks that t sees causally.
int64_t attended_tokens(const int32_t* indices, const Problem& pb, cudaStream_t s);
// An attention sink: slot 0 of every row becomes block 0 (rows are ascending, so slot 0 is their
// smallest block; a repeat of block 0 later in the row is counted once by the kernels).
void make_sink(int32_t* indices, int64_t rows, int topk, cudaStream_t s);

// ---- kernels shared by several benchmarks ---------------------------------------------------------------

// Index top-k params as csrc/api/index_topk.cpp fills them (contiguous (T, H, Di) inputs).
IndexTopkParams index_topk_params(const Problem& pb, const void* q_idx, const void* k_idx, int32_t* indices);
// The op's dispatch: sm_90a kernel when pb.sm90 (falling back to the portable one where it has no TMA
// descriptor, as the op does); `used_sm90` says which ran.
cudaError_t launch_index_topk(const Problem& pb, const IndexTopkParams& p, cudaStream_t s, bool* used_sm90 = nullptr);
// Warmup's lse_idx on the Hopper index kernel (p.lse set): cudaErrorNotSupported where it does not run (the portable
// path keeps a dense forward of torch's, which this executable does not link).
cudaError_t launch_index_lse(const Problem& pb, const IndexTopkParams& p, cudaStream_t s);
// The FP8 selection's inputs (index_dtype, SPEC 2): e4m3 copies q8 (T x Hi x Di bytes), k8 (T x Hki x Di) of pb's
// q_idx / k_idx on the op's kernel (smxx/fp8_copies; k scaled per (sequence, head): k_amax, B x Hki floats, zeroed
// here first, as the op does).
cudaError_t launch_fp8_copies(const Problem& pb, const void* q_idx, const void* k_idx, uint8_t* q8, uint8_t* k8,
                              float* k_amax, cudaStream_t s);
// The Hopper FP8 top-k on such copies (p from index_topk_params: strides in elements are bytes): the op's kernel for
// Di = 128 on Hopper; cudaErrorNotSupported where it does not run (the op widens the copies to bf16 there).
cudaError_t launch_index_topk_fp8(const Problem& pb, const IndexTopkParams& p, cudaStream_t s);

// Calls f.template operator()<T, D>() for fp16 / bf16 and D = 64 / 128 (csrc/api/dispatch.h, torch-free).
template <typename F>
void dispatch(bool fp16, int d, F&& f) {
  if (!fp16) {
    if (d == 64) f.template operator()<__nv_bfloat16, 64>(); else f.template operator()<__nv_bfloat16, 128>();
  } else {
    if (d == 64) f.template operator()<__half, 64>(); else f.template operator()<__half, 128>();
  }
}

// ---- timing and output ------------------------------------------------------------------------------------

// Rotating sets: enough that together they exceed the L2 cache (>= 256 MiB of the timed kernel's
// inputs), at most `cap`; opt.sets overrides.
int rotating_sets(const Options& opt, double set_bytes, int cap);

// Median ms over opt.reps of run(set) between two CUDA events on `s`, set = rep % n_sets, after
// opt.warmup untimed calls; prepare(set) (nullable) runs before the start event, untimed.
double time_ms(const Options& opt, cudaStream_t s, int n_sets, const std::function<void(int)>& run,
               const std::function<void(int)>& prepare = nullptr);

// CSV: `kernel,shape,ms,tflops,gbps`; flops / bytes <= 0 leave their column empty.
void print_header(const Options& opt);
void print_row(const std::string& kernel, const std::string& shape, double ms, double flops, double bytes);

// The suffix that names the path taken: "/sm90", "/sm80", "/sm80-small".
std::string path_suffix(bool sm90, bool small);

}  // namespace msa::bench
