// Combine microbenchmark: the sparse forward's three combines (csrc/smxx/combine/combine.cu,
// combine_out.cuh) over every query chunk of N, on the partials of a real forward (set up as the op does).
// Bytes (gbps), per chunk, summed (n = Hi * chunk tokens * topk entries, every slot counted):
//   combine_stats  read stats n G x 8 B (+ idx_stats n x 8 B), write lse Hq x 4 B (+ lse_idx Hi x 4 B) per token
//   combine_out    read stats n G x 8 B (the valid flags: every float2's sector is fetched) and the output
//                  partials n G D x 2 B, write out Hq D x 2 B per token
//   combine_kl     read idx_stats n x 8 B, kl_part n x 4 B, lse_idx; write kl_rows (Hi x 4 B per token each)
// Their inputs are small next to the L2 cache at small N: each kernel rotates over copies of the buffers
// it reads (>= 256 MiB together).
#include <map>

#include "bench_fwd.h"
#include "sm80/sparse_fwd/sparse_fwd.h"
#include "smxx/combine/combine.h"

using namespace msa;
using namespace msa::bench;

namespace {

// Copies of some device buffers; a pointer into an original maps to the same offset in copy i.
class Replicas {
 public:
  Replicas(const std::vector<const Buf*>& bufs, int copies, cudaStream_t s) : copies_(copies) {
    for (const Buf* b : bufs) {
      std::vector<Buf> cs;
      for (int i = 1; i < copies; ++i) {
        cs.emplace_back(b->bytes());
        BENCH_CHECK(cudaMemcpyAsync(cs.back().get(), b->get(), b->bytes(), cudaMemcpyDeviceToDevice, s));
      }
      map_[static_cast<const char*>(b->get())] = {b->bytes(), std::move(cs)};
    }
    BENCH_CHECK(cudaStreamSynchronize(s));
  }
  template <typename T>
  T* at(T* p, int copy) const {
    if (p == nullptr || copy == 0) return p;
    const char* c = reinterpret_cast<const char*>(p);
    for (const auto& [base, e] : map_) {
      if (c >= base && c < base + e.first) {
        return reinterpret_cast<T*>(const_cast<char*>(static_cast<const char*>(e.second[copy - 1].get())) + (c - base));
      }
    }
    return p;  // not replicated (an output)
  }
  int copies() const { return copies_; }

 private:
  int copies_;
  std::map<const char*, std::pair<size_t, std::vector<Buf>>> map_;
};

}  // namespace

int main(int argc, char** argv) {
  Options opt;
  FwdConfig cfg;
  std::vector<Knob> knobs = fwd_knobs(cfg, false);
  parse_options(argc, argv,
                "Sparse forward combines (stats -> lse / lse_idx, output partials -> out, KL partials -> KL rows)\n"
                "over all query chunks of N, on the partials of one real forward (--mode as the forward's).\n"
                "Rows: combine_stats, combine_out, combine_kl (not in --mode sparse); gbps from the bytes\n"
                "read + written once (see the file's header).",
                opt, knobs);
  const cudaStream_t s = init_device();
  print_header(opt);
  for (const int64_t n : opt.ns) {
    const Problem pb = make_problem(opt, n, s);
    const FwdBench fb(pb, cfg, 1, opt.seed, s);
    const FwdSet& st = fb.sets[0];
    const double T = double(pb.tokens), entries = double(pb.hi) * T * pb.topk, G = pb.g;
    const std::string shape = fb.shape();
    const int chunks = fb.num_chunks();
    auto run_all = [&](const Replicas& r, int copy, auto launch) {
      for (int c = 0; c < chunks; ++c) {
        SparseCombineParams cp = fb.combine_params(0, c);
        cp.stats = r.at(cp.stats, copy);
        cp.idx_stats = r.at(cp.idx_stats, copy);
        cp.out_part = r.at(cp.out_part, copy);
        cp.kl_part = r.at(cp.kl_part, copy);
        cp.lse_idx = r.at(cp.lse_idx, copy);
        launch(cp);
      }
    };
    {
      const double read = entries * G * 8 + (fb.index ? entries * 8 : 0);
      const double bytes = read + T * 4 * (pb.hq + (fb.index ? pb.hi : 0));
      std::vector<const Buf*> in{&st.stats};
      if (fb.index) in.push_back(&st.idx_stats);
      const Replicas r(in, rotating_sets(opt, read, 64), s);
      const double ms = time_ms(opt, s, r.copies(), [&](int i) {
        run_all(r, i, [&](const SparseCombineParams& cp) { BENCH_CHECK(smxx::launch_sparse_combine_stats(cp, s)); });
      });
      print_row("combine_stats", shape, ms, 0, bytes);
    }
    {
      const double read = entries * G * 8 + entries * G * pb.d * pb.elem;
      const double bytes = read + T * pb.hq * pb.d * pb.elem;
      const Replicas r({&st.stats, &st.out_part}, rotating_sets(opt, read, 64), s);
      const double ms = time_ms(opt, s, r.copies(), [&](int i) {
        run_all(r, i, [&](const SparseCombineParams& cp) {
          dispatch(pb.fp16, pb.d, [&]<typename E, int D>() { BENCH_CHECK((smxx::launch_sparse_combine_out<E, D>(cp, s))); });
        });
      });
      print_row("combine_out", shape, ms, 0, bytes);
    }
    if (fb.index) {
      const double read = entries * 12 + T * pb.hi * 4;
      const double bytes = read + T * pb.hi * 4;
      const Replicas r({&st.idx_stats, &st.kl_part, &st.lse_idx}, rotating_sets(opt, read, 64), s);
      const double ms = time_ms(opt, s, r.copies(), [&](int i) {
        run_all(r, i, [&](const SparseCombineParams& cp) { BENCH_CHECK(smxx::launch_sparse_combine_kl(cp, s)); });
      });
      print_row("combine_kl", shape, ms, 0, bytes);
    }
  }
  BENCH_CHECK(cudaStreamDestroy(s));
  return 0;
}
