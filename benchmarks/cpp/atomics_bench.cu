// Microbenchmark: the cost of the backward's dQ flush (one 2 KB fp32 row per (entry = token, group,
// slot), 4 heads x 128 dims, added into a (T, Hq, D) accumulator at a random token) with the reductions
// a deterministic mode could use:
//   f32x4   one 16-byte fp32 red per 4 values (what the kernels do today; order-dependent rounding)
//   hilo    values split on a fixed grid into hi + lo, two 16-byte fp32 reds into two buffers
//           (exact sums: order-independent)
//   u64     fixed point: one 8-byte integer red per value (exact: order-independent)
//   f64     one 8-byte fp64 red per value (order-dependent unless quantised; for comparison)
//   store   plain 16-byte stores to a per-entry partial buffer (a combine would then read it back)
// Build and run on the GPU: nvcc -O3 -arch=sm_90a -o /tmp/atomics_bench benchmarks/cpp/atomics_bench.cu
//   && /tmp/atomics_bench [tokens] (default 32768 = the bench configuration at 32K: 2.1M entries).
#include <cuda_runtime.h>

#include <cstdio>
#include <cstdlib>
#include <cstdint>

#define CHECK(x)                                                                  \
  do {                                                                            \
    cudaError_t e = (x);                                                          \
    if (e != cudaSuccess) {                                                       \
      std::printf("%s:%d %s\n", __FILE__, __LINE__, cudaGetErrorString(e));      \
      std::exit(1);                                                               \
    }                                                                             \
  } while (0)

constexpr int kHeads = 16, kGroupHeads = 4, kDim = 128, kRow = kGroupHeads * kDim;  // 512 floats per entry

__device__ __forceinline__ uint32_t hash(uint32_t x) {
  x ^= x >> 16; x *= 0x7feb352dU; x ^= x >> 15; x *= 0x846ca68bU; x ^= x >> 16;
  return x;
}

// Destination row of entry e: a pseudo-random token, group e % 4.
__device__ __forceinline__ int64_t dest(int e, int tokens) {
  const int t = hash(uint32_t(e)) % uint32_t(tokens);
  return (int64_t(t) * kHeads + (e % 4) * kGroupHeads) * kDim;
}

__device__ __forceinline__ float value(int e, int i) { return float(int(hash(e * 977u + i) & 1023) - 512) * 1e-3f; }

template <int kMode>
__global__ void flush(float* acc, float* acc2, unsigned long long* acc64, double* accd, float* part, int entries,
                      int tokens, float inv_u, float u, float inv_w, float w, float inv_fix) {
  const int lane = threadIdx.x % 32;
  for (int e = blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32; e < entries; e += gridDim.x * (blockDim.x / 32)) {
    const int64_t base = dest(e, tokens);
#pragma unroll
    for (int c = 0; c < kRow / 128; ++c) {  // 4 chunks of 128 floats: lane owns 4 consecutive floats
      const int i = c * 128 + lane * 4;
      float4 v = make_float4(value(e, i), value(e, i + 1), value(e, i + 2), value(e, i + 3));
      if constexpr (kMode == 0) {
        atomicAdd(reinterpret_cast<float4*>(acc + base + i), v);
      } else if constexpr (kMode == 1) {
        float4 hi, lo;
        hi.x = rintf(v.x * inv_u) * u; hi.y = rintf(v.y * inv_u) * u;
        hi.z = rintf(v.z * inv_u) * u; hi.w = rintf(v.w * inv_u) * u;
        lo.x = rintf((v.x - hi.x) * inv_w) * w; lo.y = rintf((v.y - hi.y) * inv_w) * w;
        lo.z = rintf((v.z - hi.z) * inv_w) * w; lo.w = rintf((v.w - hi.w) * inv_w) * w;
        atomicAdd(reinterpret_cast<float4*>(acc + base + i), hi);
        atomicAdd(reinterpret_cast<float4*>(acc2 + base + i), lo);
      } else if constexpr (kMode == 2) {
        const float a[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
        for (int j = 0; j < 4; ++j)
          atomicAdd(acc64 + base + i + j, static_cast<unsigned long long>(__float2ll_rn(a[j] * inv_fix)));
      } else if constexpr (kMode == 3) {
        const float a[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
        for (int j = 0; j < 4; ++j) atomicAdd(accd + base + i + j, double(a[j]));
      } else {
        *reinterpret_cast<float4*>(part + int64_t(e) * kRow + i) = v;
      }
    }
  }
}

int main(int argc, char** argv) {
  const int tokens = argc > 1 ? std::atoi(argv[1]) : 32768;
  const int entries = 4 * tokens * 16;  // Hi x T x topk
  const size_t n = size_t(tokens) * kHeads * kDim;
  float *acc, *acc2, *part;
  unsigned long long* acc64;
  double* accd;
  CHECK(cudaMalloc(&acc, n * 4));
  CHECK(cudaMalloc(&acc2, n * 4));
  CHECK(cudaMalloc(&acc64, n * 8));
  CHECK(cudaMalloc(&accd, n * 8));
  CHECK(cudaMalloc(&part, size_t(entries) * kRow * 4));
  int sms = 0;
  CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
  const char* names[] = {"f32x4 red", "hilo 2 x f32x4 red", "u64 red", "f64 red", "f32x4 store (partials)"};
  cudaEvent_t a, b;
  CHECK(cudaEventCreate(&a));
  CHECK(cudaEventCreate(&b));
  std::printf("tokens %d, entries %d (2 KB each: %.2f GB of values)\n", tokens, entries, entries * 2048.0 / 1e9);
  for (int mode = 0; mode < 5; ++mode) {
    float best = 1e30f;
    for (int rep = 0; rep < 5; ++rep) {
      CHECK(cudaEventRecord(a));
      const dim3 grid(sms * 8), block(256);
      const float u = 1.0f / 1024, w = u / 16777216.0f, fix = 1.0f / 1073741824.0f;
      if (mode == 0) flush<0><<<grid, block>>>(acc, acc2, acc64, accd, part, entries, tokens, 1 / u, u, 1 / w, w, 1 / fix);
      if (mode == 1) flush<1><<<grid, block>>>(acc, acc2, acc64, accd, part, entries, tokens, 1 / u, u, 1 / w, w, 1 / fix);
      if (mode == 2) flush<2><<<grid, block>>>(acc, acc2, acc64, accd, part, entries, tokens, 1 / u, u, 1 / w, w, 1 / fix);
      if (mode == 3) flush<3><<<grid, block>>>(acc, acc2, acc64, accd, part, entries, tokens, 1 / u, u, 1 / w, w, 1 / fix);
      if (mode == 4) flush<4><<<grid, block>>>(acc, acc2, acc64, accd, part, entries, tokens, 1 / u, u, 1 / w, w, 1 / fix);
      CHECK(cudaEventRecord(b));
      CHECK(cudaEventSynchronize(b));
      float ms = 0;
      CHECK(cudaEventElapsedTime(&ms, a, b));
      if (ms < best) best = ms;
    }
    std::printf("%-26s %8.3f ms\n", names[mode], best);
  }
  CHECK(cudaGetLastError());
  return 0;
}
