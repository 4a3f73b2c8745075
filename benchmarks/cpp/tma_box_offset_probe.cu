// Probe: can a TMA tile load with the 128-byte swizzle write a box of R < 8 rows at row R b of a KMajorSw128 tile
// (a shared address 128 R b bytes past a 1024-aligned panel, i.e. not at the start of an 8-row swizzle atom), and
// does the data land where KMajorSw128::offset (swizzle by the row's address bits) says? The question decides
// whether the sparse backward / forward passes could gather a unit's Gu = R consecutive heads of one token by one
// TMA box per 64-column panel (R = 4 in the bench layout) instead of 16-byte cp.async copies by many threads
// (benchmarks/NOTES.md, s42). A box of R rows (R heads of one token, heads b R % 8 ..) per 64-column panel, 64 / R
// boxes per panel, into a 64 x 128 tile; each thread then reads the tile through KMajorSw128 and the bits are
// compared with the source (random 16-bit patterns, copied as bf16 bits). With "oob" every odd box reads a token
// past the tensor's end (entirely out of bounds): its rows must read zeros and its bytes still complete the
// mbarrier's phase (a hang otherwise: run under timeout), as a gather of a tile's missing units would use it.
// Build and run on the GPU (repository root), one case per process (a misaligned TMA faults the context):
//   nvcc -O3 -std=c++20 --expt-relaxed-constexpr -gencode=arch=compute_90a,code=sm_90a -Icsrc -o /tmp/tma_probe \
//     benchmarks/cpp/tma_box_offset_probe.cu && for r in 8 4 2 1; do timeout 20 /tmp/tma_probe $r; \
//     timeout 20 /tmp/tma_probe $r oob; done
// Prints: rows_per_box,oob,mismatches,elements (or the CUDA error of the launch); exit status 1 on any mismatch.
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <string>
#include <vector>

#include "bench_common.h"  // BENCH_CHECK (only the macro)
#include "common/mma_sm80.h"
#include "common/tma_map.h"
#include "common/wgmma_sm90.h"

namespace {

constexpr int kRows = 64, kD = 128, kHeads = 8, kTokens = 256;
using Tile = msa::sm90::KMajorSw128<kRows, kD>;

__global__ void __launch_bounds__(128) probe_kernel(const __grid_constant__ CUtensorMap map, const int* tokens,
                                                    int box_rows, uint16_t* out) {
  extern __shared__ __align__(1024) unsigned char smem_raw[];
  unsigned char* smem = smem_raw + ((1024u - (msa::sm80::smem_addr(smem_raw) & 1023u)) & 1023u);
  uint64_t* bar = reinterpret_cast<uint64_t*>(smem + kRows * kD * 2);
  if (threadIdx.x == 0) {
    msa::sm90::mbar_init(bar, 1);
    msa::sm90::mbar_fence_init();
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    msa::sm90::mbar_arrive_expect_tx(bar, kRows * kD * 2);
    for (int b = 0; b < kRows / box_rows; ++b) {
      const int head0 = (b * box_rows) % kHeads;
      for (int panel = 0; panel < kD / 64; ++panel) {
        msa::sm90::tma_load_3d(smem + panel * Tile::kPanelElems * 2 + b * box_rows * 128, &map, panel * 64, head0,
                               tokens[b], bar);
      }
    }
  }
  msa::sm90::mbar_wait(bar, 0);
  const uint16_t* tile = reinterpret_cast<const uint16_t*>(smem);
  for (int i = threadIdx.x; i < kRows * (kD / 8); i += blockDim.x) {
    const int row = i / (kD / 8), chunk = i % (kD / 8);
    for (int e = 0; e < 8; ++e) out[row * kD + chunk * 8 + e] = tile[Tile::offset(row, chunk) + e];
  }
}

}  // namespace

int main(int argc, char** argv) {
  const int box_rows = argc > 1 ? std::atoi(argv[1]) : 4;
  const bool oob = argc > 2 && std::string(argv[2]) == "oob";
  if (box_rows < 1 || box_rows > 8 || kRows % box_rows != 0 || kHeads % box_rows != 0) {
    std::fprintf(stderr, "rows per box: 1, 2, 4 or 8\n");
    return 2;
  }
  std::mt19937 rng(1234);
  std::vector<uint16_t> src(size_t(kTokens) * kHeads * kD);
  for (auto& x : src) x = uint16_t(rng());
  const int n_boxes = kRows / box_rows;
  std::vector<int> tokens(n_boxes);
  for (int b = 0; b < n_boxes; ++b) tokens[b] = oob && b % 2 == 1 ? kTokens : int(rng() % kTokens);

  uint16_t *d_src = nullptr, *d_out = nullptr;
  int* d_tok = nullptr;
  BENCH_CHECK(cudaMalloc(&d_src, src.size() * 2));
  BENCH_CHECK(cudaMalloc(&d_out, size_t(kRows) * kD * 2));
  BENCH_CHECK(cudaMalloc(&d_tok, n_boxes * sizeof(int)));
  BENCH_CHECK(cudaMemcpy(d_src, src.data(), src.size() * 2, cudaMemcpyHostToDevice));
  BENCH_CHECK(cudaMemcpy(d_tok, tokens.data(), n_boxes * sizeof(int), cudaMemcpyHostToDevice));
  BENCH_CHECK(cudaMemset(d_out, 0xff, size_t(kRows) * kD * 2));

  // (D, heads, tokens), boxes of 64 columns x box_rows heads x 1 token, 128-byte swizzle (the kernels' encoder).
  CUtensorMap map;
  const cudaError_t enc = msa::make_rows_map<__nv_bfloat16>(d_src, kD, kHeads, kTokens, kD, int64_t(kHeads) * kD, 1,
                                                            &map, box_rows);
  if (enc != cudaSuccess) {
    std::printf("%d,%d,encode_error,\n", box_rows, int(oob));
    return 1;
  }
  const int smem = kRows * kD * 2 + 64 + 1024;
  BENCH_CHECK(cudaFuncSetAttribute(probe_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
  probe_kernel<<<1, 128, smem>>>(map, d_tok, box_rows, d_out);
  const cudaError_t err = cudaDeviceSynchronize();
  if (err != cudaSuccess) {
    std::printf("%d,%d,%s,\n", box_rows, int(oob), cudaGetErrorString(err));
    return 1;
  }
  std::vector<uint16_t> out(size_t(kRows) * kD);
  BENCH_CHECK(cudaMemcpy(out.data(), d_out, out.size() * 2, cudaMemcpyDeviceToHost));
  int64_t bad = 0;
  for (int row = 0; row < kRows; ++row) {
    const int b = row / box_rows, head = (b * box_rows) % kHeads + row % box_rows;
    for (int d = 0; d < kD; ++d) {
      const uint16_t want = tokens[b] >= kTokens ? uint16_t(0) : src[(size_t(tokens[b]) * kHeads + head) * kD + d];
      bad += out[size_t(row) * kD + d] != want;
    }
  }
  std::printf("%d,%d,%lld,%d\n", box_rows, int(oob), static_cast<long long>(bad), kRows * kD);
  return bad == 0 ? 0 : 1;
}
