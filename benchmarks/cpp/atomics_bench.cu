// Microbenchmark: the cost of the backward's dQ flush (one 2 KB fp32 row per (entry = token, group,
// slot), 4 heads x 128 dims, added into a (T, Hq, D) accumulator at a random token) with the reductions
// a deterministic mode could use:
//   f32x4   one 16-byte fp32 red per 4 values (what the kernels do today; order-dependent rounding)
//   hilo    values split on a fixed grid into hi + lo, two 16-byte fp32 reds into two buffers
//           (exact sums: order-independent)
//   u64     fixed point: one 8-byte integer red per value (exact: order-independent)
//   f64     one 8-byte fp64 red per value (order-dependent unless quantised; for comparison)
//   store   plain 16-byte stores to a per-entry partial buffer (a combine would then read it back)
// and the routes a faster (or order-fixed) dQ could take instead of one red per 16 bytes:
//   bulk    each warp stages its row in shared memory and one lane adds all 2 KB with one bulk reduction
//           (cp.reduce.async.bulk .add.f32: the TMA unit's reduce into L2; FA3's backward adds dQ this way),
//           or in four of 512 bytes (one head row: what a unit of fewer or non-adjacent heads would need)
//   bf16 store  the partials in bf16 (half the bytes; the forward's output partials are stored so)
//   combine f32 / bf16  reading the partials back, 16 per destination row (a token's 16 slots) in slot order,
//           summed in fp32 and written once: with "store" the cost of an order-fixed (deterministic) dQ
// After the timings, "check": f32x4 red and bulk red (512-byte ops) of the same entries into zeroed accumulators agree
// (max |difference| over the max |value|; fp32 sums in another order, so not bitwise).
// Build and run on the GPU: nvcc -O3 -arch=sm_90a -o /tmp/atomics_bench benchmarks/cpp/atomics_bench.cu
//   && /tmp/atomics_bench [tokens] [window] (default 32768 = the bench configuration at 32K: 2.1M entries).
// window < tokens (s44; a larger one is the whole tensor): each entry's token is drawn from the window of `window` tokens its query chunk covers (entries
// in order, 64 per token of the window: 4 groups x 16 slots), as a backward run over query chunks would add dQ; the
// chunk's rows (window x 16 heads x 512 B: 33.5 MB at 4096) can then stay in L2 while its entries are added. Its
// question: whether the fp32 reductions' rate (1.55 TB/s over the whole accumulator, s22) is L2-miss traffic.
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstdint>
#include <vector>

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

// Destination row of entry e: a pseudo-random token of the entry's window (window <= tokens; the whole tensor when
// equal: every entry's window then starts at token 0), group e % 4.
__device__ __forceinline__ int64_t dest(int e, int tokens, int window) {
  const int64_t w0 = int64_t(e) / (64 * int64_t(window)) * window;  // the window's first token
  const int t = int(min(int64_t(tokens - 1), w0 + hash(uint32_t(e)) % uint32_t(window)));
  return (int64_t(t) * kHeads + (e % 4) * kGroupHeads) * kDim;
}

__device__ __forceinline__ float value(int e, int i) { return float(int(hash(e * 977u + i) & 1023) - 512) * 1e-3f; }

template <int kMode>
__global__ void flush(float* acc, float* acc2, unsigned long long* acc64, double* accd, float* part, int entries,
                      int tokens, int window, float inv_u, float u, float inv_w, float w, float inv_fix) {
  const int lane = threadIdx.x % 32;
  for (int e = blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32; e < entries; e += gridDim.x * (blockDim.x / 32)) {
    const int64_t base = dest(e, tokens, window);
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

// Bulk reduction: the warp writes entry e's 2 KB row to one of its two shared-memory buffers, fences it to
// the async proxy, and lane 0 adds it to the destination with one cp.reduce.async.bulk; before a buffer is
// written again, lane 0 waits until the reduction issued from it two rows ago has read it.
// kOps: the row in that many reductions (1: the group's 4 heads at once, 4: one 512-byte head row each).
template <int kOps>
__global__ void flush_bulk(float* acc, int entries, int tokens, int window) {
  extern __shared__ __align__(128) float sbuf[];  // 2 x kRow floats per warp
  const int lane = threadIdx.x % 32, wid = threadIdx.x / 32;
  float* mine = sbuf + wid * 2 * kRow;
  int k = 0;
  for (int e = blockIdx.x * (blockDim.x / 32) + wid; e < entries; e += gridDim.x * (blockDim.x / 32), ++k) {
    float* buf = mine + (k & 1) * kRow;
    if (lane == 0) asm volatile("cp.async.bulk.wait_group.read 1;\n" ::: "memory");
    __syncwarp();
#pragma unroll
    for (int c = 0; c < kRow / 128; ++c) {
      const int i = c * 128 + lane * 4;
      *reinterpret_cast<float4*>(buf + i) = make_float4(value(e, i), value(e, i + 1), value(e, i + 2), value(e, i + 3));
    }
    asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
    __syncwarp();
    if (lane == 0) {
      constexpr int kOpFloats = kRow / kOps;
#pragma unroll
      for (int o = 0; o < kOps; ++o) {
        const uint32_t src = uint32_t(__cvta_generic_to_shared(buf + o * kOpFloats));
        asm volatile("cp.reduce.async.bulk.global.shared::cta.bulk_group.add.f32 [%0], [%1], %2;\n" ::"l"(
                         acc + dest(e, tokens, window) + o * kOpFloats),
                     "r"(src), "n"(kOpFloats * 4)
                     : "memory");
      }
      asm volatile("cp.async.bulk.commit_group;\n" ::: "memory");
    }
  }
  if (lane == 0) asm volatile("cp.async.bulk.wait_group 0;\n" ::: "memory");
}

// The partials in bf16: 8 bytes per lane and chunk.
__global__ void store_bf16(__nv_bfloat16* part, int entries) {
  const int lane = threadIdx.x % 32;
  for (int e = blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32; e < entries; e += gridDim.x * (blockDim.x / 32)) {
#pragma unroll
    for (int c = 0; c < kRow / 128; ++c) {
      const int i = c * 128 + lane * 4;
      const __nv_bfloat162 a = __floats2bfloat162_rn(value(e, i), value(e, i + 1));
      const __nv_bfloat162 b = __floats2bfloat162_rn(value(e, i + 2), value(e, i + 3));
      uint2 v;
      v.x = *reinterpret_cast<const uint32_t*>(&a);
      v.y = *reinterpret_cast<const uint32_t*>(&b);
      *reinterpret_cast<uint2*>(part + int64_t(e) * kRow + i) = v;
    }
  }
}

// Combine: destination row r (entries / 16 of them) sums partial rows 16 r .. 16 r + 15 in order.
template <typename P>
__global__ void combine(const P* part, float* out, int rows) {
  const int lane = threadIdx.x % 32;
  for (int r = blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32; r < rows; r += gridDim.x * (blockDim.x / 32)) {
#pragma unroll
    for (int c = 0; c < kRow / 128; ++c) {
      const int i = c * 128 + lane * 4;
      float4 s = make_float4(0.f, 0.f, 0.f, 0.f);
#pragma unroll 8
      for (int j = 0; j < 16; ++j) {
        const P* src = part + (int64_t(r) * 16 + j) * kRow + i;
        float4 v;
        if constexpr (sizeof(P) == 4) {
          v = __ldg(reinterpret_cast<const float4*>(src));
        } else {
          const uint2 w = __ldg(reinterpret_cast<const uint2*>(src));
          const float2 a = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&w.x));
          const float2 b = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&w.y));
          v = make_float4(a.x, a.y, b.x, b.y);
        }
        s.x += v.x; s.y += v.y; s.z += v.z; s.w += v.w;
      }
      *reinterpret_cast<float4*>(out + int64_t(r) * kRow + i) = s;
    }
  }
}

int main(int argc, char** argv) {
  const int tokens = argc > 1 ? std::atoi(argv[1]) : 32768;
  const int window_arg = argc > 2 ? std::atoi(argv[2]) : tokens;
  if (tokens <= 0 || window_arg <= 0) {
    std::printf("usage: atomics_bench [tokens > 0] [window > 0]\n");
    return 2;
  }
  const int window = window_arg < tokens ? window_arg : tokens;
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
  __nv_bfloat16* part16;
  CHECK(cudaMalloc(&part16, size_t(entries) * kRow * 2));
  int sms = 0;
  CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
  const char* names[] = {"f32x4 red", "hilo 2 x f32x4 red", "u64 red", "f64 red", "f32x4 store (partials)",
                         "bulk red (2 KB per op)", "bf16 store (partials)", "combine f32 partials",
                         "combine bf16 partials", "bulk red (512 B per op)"};
  constexpr int kBulkSmem = 8 * 2 * kRow * 4;  // 256 threads: 8 warps x 2 buffers x 2 KB
  CHECK(cudaFuncSetAttribute(flush_bulk<1>, cudaFuncAttributeMaxDynamicSharedMemorySize, kBulkSmem));
  CHECK(cudaFuncSetAttribute(flush_bulk<4>, cudaFuncAttributeMaxDynamicSharedMemorySize, kBulkSmem));
  cudaEvent_t a, b;
  CHECK(cudaEventCreate(&a));
  CHECK(cudaEventCreate(&b));
  std::printf("tokens %d, window %d, entries %d (2 KB each: %.2f GB of values)\n", tokens, window, entries,
              entries * 2048.0 / 1e9);
  for (int mode = 0; mode < 10; ++mode) {
    float best = 1e30f;
    for (int rep = 0; rep < 5; ++rep) {
      CHECK(cudaEventRecord(a));
      const dim3 grid(sms * 8), block(256);
      const float u = 1.0f / 1024, w = u / 16777216.0f, fix = 1.0f / 1073741824.0f;
      if (mode == 0) flush<0><<<grid, block>>>(acc, acc2, acc64, accd, part, entries, tokens, window, 1 / u, u, 1 / w, w, 1 / fix);
      if (mode == 1) flush<1><<<grid, block>>>(acc, acc2, acc64, accd, part, entries, tokens, window, 1 / u, u, 1 / w, w, 1 / fix);
      if (mode == 2) flush<2><<<grid, block>>>(acc, acc2, acc64, accd, part, entries, tokens, window, 1 / u, u, 1 / w, w, 1 / fix);
      if (mode == 3) flush<3><<<grid, block>>>(acc, acc2, acc64, accd, part, entries, tokens, window, 1 / u, u, 1 / w, w, 1 / fix);
      if (mode == 4) flush<4><<<grid, block>>>(acc, acc2, acc64, accd, part, entries, tokens, window, 1 / u, u, 1 / w, w, 1 / fix);
      if (mode == 5) flush_bulk<1><<<grid, block, kBulkSmem>>>(acc, entries, tokens, window);
      if (mode == 9) flush_bulk<4><<<grid, block, kBulkSmem>>>(acc, entries, tokens, window);
      if (mode == 6) store_bf16<<<grid, block>>>(part16, entries);
      if (mode == 7) combine<float><<<grid, block>>>(part, acc, entries / 16);
      if (mode == 8) combine<__nv_bfloat16><<<grid, block>>>(part16, acc, entries / 16);
      CHECK(cudaEventRecord(b));
      CHECK(cudaEventSynchronize(b));
      float ms = 0;
      CHECK(cudaEventElapsedTime(&ms, a, b));
      if (ms < best) best = ms;
    }
    std::printf("%-26s %8.3f ms\n", names[mode], best);
  }
  // check: the same entries once through f32x4 red and once through bulk red, into zeroed accumulators.
  {
    const dim3 grid(sms * 8), block(256);
    CHECK(cudaMemset(acc, 0, n * 4));
    CHECK(cudaMemset(acc2, 0, n * 4));
    flush<0><<<grid, block>>>(acc, acc2, acc64, accd, part, entries, tokens, window, 1, 1, 1, 1, 1);
    flush_bulk<4><<<grid, block, kBulkSmem>>>(acc2, entries, tokens, window);
    CHECK(cudaDeviceSynchronize());
    std::vector<float> x(n), y(n);
    CHECK(cudaMemcpy(x.data(), acc, n * 4, cudaMemcpyDeviceToHost));
    CHECK(cudaMemcpy(y.data(), acc2, n * 4, cudaMemcpyDeviceToHost));
    double diff = 0, mag = 0;
    for (size_t i = 0; i < n; ++i) {
      diff = std::fmax(diff, std::fabs(double(x[i]) - double(y[i])));
      mag = std::fmax(mag, std::fabs(double(x[i])));
    }
    const bool ok = mag > 0 && diff <= 1e-5 * mag;
    std::printf("check bulk red vs f32x4 red: max |diff| %.3g of max |value| %.3g (%s)\n", diff, mag,
                ok ? "ok" : "MISMATCH");
    if (!ok) return 1;
  }
  CHECK(cudaGetLastError());
  return 0;
}
