// Device helpers of the microbenchmarks: random normal inputs, the attended-token count (SPEC 8), the sink.
#include <cuda_runtime.h>

#include "bench_common.h"

namespace msa::bench {
namespace {

__device__ __forceinline__ uint64_t mix64(uint64_t x) {  // splitmix64's finaliser
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

template <typename T>
__device__ __forceinline__ T to_elem(float x);
template <>
__device__ __forceinline__ __nv_bfloat16 to_elem<__nv_bfloat16>(float x) { return __float2bfloat16(x); }
template <>
__device__ __forceinline__ __half to_elem<__half>(float x) { return __float2half(x); }

// Box-Muller on two 24-bit uniforms of one 64-bit hash of (seed, i).
template <typename T>
__global__ void fill_normal_kernel(T* x, int64_t n, uint64_t seed) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x) {
    const uint64_t h = mix64(seed * 0x2545f4914f6cdd1dull ^ uint64_t(i));
    const float u1 = (float((h >> 40) & 0xffffff) + 1.f) * (1.f / 16777216.f);  // (0, 1]
    const float u2 = float(h & 0xffffff) * (1.f / 16777216.f);                 // [0, 1)
    x[i] = to_elem<T>(sqrtf(-2.f * logf(u1)) * cospif(2.f * u2));
  }
}

// One thread per (r, t) row: the tokens of its distinct, causally visible blocks (first occurrence only,
// the reverse index's rule), summed per warp and added atomically.
__global__ void attended_kernel(const int32_t* idx, int64_t rows, int64_t tokens, int topk, int64_t seqlen, int block,
                                unsigned long long* out) {
  unsigned long long sum = 0;
  for (int64_t row = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; row < rows;
       row += int64_t(gridDim.x) * blockDim.x) {
    const int64_t pos = (row % tokens) % seqlen;  // position in its sequence (equal lengths)
    const int own = int(pos / block);
    const int32_t* s = idx + row * topk;
    for (int j = 0; j < topk; ++j) {
      const int b = s[j];
      bool valid = b >= 0 && b <= own;
      for (int i = 0; i < j && valid; ++i) valid = s[i] != b;
      if (valid) sum += unsigned(min(int64_t(block), pos - int64_t(b) * block + 1));
    }
  }
  for (int o = 16; o > 0; o /= 2) sum += __shfl_down_sync(0xffffffffu, sum, o);
  if (threadIdx.x % 32 == 0 && sum != 0) atomicAdd(out, sum);
}

__global__ void sink_kernel(int32_t* idx, int64_t rows, int topk) {
  const int64_t row = blockIdx.x * int64_t(blockDim.x) + threadIdx.x;
  if (row < rows) idx[row * topk] = 0;
}

unsigned grid_for(int64_t n) { return unsigned(n <= 0 ? 1 : ((n + 255) / 256 < 65536 ? (n + 255) / 256 : 65536)); }

}  // namespace

void fill_normal(void* x, int64_t n, bool fp16, uint64_t seed, cudaStream_t s) {
  if (fp16) {
    fill_normal_kernel<<<grid_for(n), 256, 0, s>>>(static_cast<__half*>(x), n, seed);
  } else {
    fill_normal_kernel<<<grid_for(n), 256, 0, s>>>(static_cast<__nv_bfloat16*>(x), n, seed);
  }
  BENCH_CHECK(cudaGetLastError());
}

int64_t attended_tokens(const int32_t* indices, const Problem& pb, cudaStream_t s) {
  Buf acc(sizeof(unsigned long long));
  acc.zero(s);
  const int64_t rows = int64_t(pb.hi) * pb.tokens;
  attended_kernel<<<grid_for(rows), 256, 0, s>>>(indices, rows, pb.tokens, pb.topk, pb.n, pb.block,
                                                 acc.as<unsigned long long>());
  BENCH_CHECK(cudaGetLastError());
  unsigned long long host = 0;
  BENCH_CHECK(cudaMemcpyAsync(&host, acc.get(), sizeof(host), cudaMemcpyDeviceToHost, s));
  BENCH_CHECK(cudaStreamSynchronize(s));
  return int64_t(host);
}

void make_sink(int32_t* indices, int64_t rows, int topk, cudaStream_t s) {
  sink_kernel<<<unsigned((rows + 255) / 256), 256, 0, s>>>(indices, rows, topk);
  BENCH_CHECK(cudaGetLastError());
}

}  // namespace msa::bench
