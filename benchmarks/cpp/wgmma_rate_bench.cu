// Probe: the rate of the wgmma shapes the Hopper kernels use, alone and with exponentials between GEMMs,
// on csrc/common/wgmma_sm90.h's own wrappers. Each warpgroup repeats one GEMM acc (64 x N) = A (64 x 128)
// B^T (B: N x 128), eight k-steps of m64nNk16, A and B K-major 128-byte-swizzled tiles in shared memory
// (A: the warpgroup's own 64 rows, B shared by the CTA's warpgroups, as the dense KL pass's S^T = K Q^T):
//   ss        A and B by descriptor (SS)
//   rs        A from registers (loaded once), B by descriptor (RS); N = 64 and 128 (the wrappers' RS shapes)
//   (N = 128's SS reads both tiles MN-major: the only SS N = 128 wrapper; the bytes read are the same)
//   acc       1: issue, wait, (exp); 2: GEMM i + 1 issued before GEMM i's wait and exponentials, in runs of 4
//   exp       0: nothing between GEMMs; 1: each accumulator's N / 2 values per thread through exp2 into a
//             running sum (one MUFU.EX2 and one FFMA + FADD per value: the dense KL's head_terms)
//   rs_e4m3   the FP8 top-k's shape: A (64 x 128 e4m3 bytes) from registers, B (N x 128 bytes) by descriptor,
//             four k-steps of m64nNk32 into f16 accumulators (N = 128: WgmmaRSE4m3N128F16, the kernel's; N = 256:
//             a wrapper of this file's); its "exp" 0 only, the consumer a running f16 max of the accumulators
//             (HMNMX2, the top-k's row max), also at 4 warpgroups (the top-k's long-sequence CTA)
// One CTA per SM (132), wg warpgroups each; TFLOP/s counts the wgmma FLOPs only (2 x 64 x N x 128 per GEMM).
// Build and run on the GPU (repository root):
//   nvcc -O3 -std=c++20 --expt-relaxed-constexpr -gencode=arch=compute_90a,code=sm_90a -Icsrc -o /tmp/wgmma_rate \
//     benchmarks/cpp/wgmma_rate_bench.cu && /tmp/wgmma_rate
// CSV: kernel,n,mode,wg,acc,exp,ms,tflops
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdio>
#include <cstdlib>

#include "bench_common.h"  // BENCH_CHECK (only the macro: this probe links nothing of the benchmarks)
#include "common/mma_sm80.h"
#include "common/wgmma_sm90.h"

namespace {

using T = __nv_bfloat16;
using msa::sm90::KMajorSw128;
using msa::sm90::WgmmaRS;
using msa::sm90::WgmmaRSE4m3N128F16;
using msa::sm90::WgmmaSS;
using msa::sm90::wgmma_commit;
using msa::sm90::wgmma_fence;
using msa::sm90::wgmma_wait;
constexpr int kK = 128, kSteps = kK / 16, kMaxWg = 4;

// One GEMM into acc (not waited for).
template <int N, bool kRS>
__device__ __forceinline__ void issue(float (&acc)[N / 2], uint32_t a_addr, uint32_t b_addr, const uint32_t (&af)[kSteps][4]) {
  using AT = KMajorSw128<64, kK>;
  using BT = KMajorSw128<N, kK>;
  wgmma_fence();
#pragma unroll
  for (int ks = 0; ks < kSteps; ++ks) {
    if constexpr (kRS) {
      WgmmaRS<T, N>::run(acc, af[ks], BT::desc(b_addr, ks), ks > 0);
    } else if constexpr (N == 128) {  // the SS N = 128 wrapper reads both operands MN-major
      WgmmaSS<T, N, true, true>::run(acc, AT::desc_mn(a_addr, ks), BT::desc_mn(b_addr, ks), ks > 0);
    } else {
      WgmmaSS<T, N>::run(acc, AT::desc(a_addr, ks), BT::desc(b_addr, ks), ks > 0);
    }
  }
  wgmma_commit();
}

constexpr int kSums = 8;
template <int N, bool kExp>
__device__ __forceinline__ void consume(float (&acc)[N / 2], float (&sum)[kSums]) {
  msa::sm90::fence_regs(acc);
#pragma unroll
  for (int i = 0; i < N / 2; ++i) {
    if constexpr (kExp) {
      sum[i % kSums] += msa::sm80::fast_exp2(fmaf(acc[i], 0.0883883f, -3.f));
    } else {
      sum[i % kSums] += acc[i];
    }
  }
}

// The timed loop of both rate kernels. kAcc = 1: issue, wait, consume. kAcc = 2: GEMM i + 1 into the other
// accumulator before GEMM i's wait and use, four GEMMs per loop trip with the last one waited for in full (the dense
// KL pass's heads: no wgmma in flight across the back edge, which ptxas would serialise; iters a multiple of 4).
template <int kAcc, typename Acc, typename Issue, typename Consume>
__device__ __forceinline__ void gemm_loop(int iters, Acc (&acc)[kAcc], Issue issue, Consume consume) {
  if constexpr (kAcc == 2) {
    for (int it = 0; it < iters; it += 4) {
      issue(acc[0]);
#pragma unroll
      for (int h = 0; h < 4; ++h) {
        if (h < 3) {
          issue(acc[(h + 1) & 1]);
          wgmma_wait<1>();
        } else {
          wgmma_wait<0>();
        }
        consume(acc[h & 1]);
      }
    }
  } else {
    for (int it = 0; it < iters; ++it) {
      issue(acc[0]);
      wgmma_wait<0>();
      consume(acc[0]);
    }
  }
}

template <int N, bool kRS, int kAcc, bool kExp, int kWg>
__global__ void __launch_bounds__(128 * kWg, 1) rate_kernel(int iters, float* out) {
  extern __shared__ __align__(1024) char smem_raw[];
  char* smem = smem_raw + ((1024u - (msa::sm80::smem_addr(smem_raw) & 1023u)) & 1023u);
  const int tid = threadIdx.x, wg = tid / 128;
  // Tiles: A 3 x (64 x 128) (one per warpgroup), then B (N x 128); small finite values.
  constexpr int kABytes = 64 * kK * 2, kBBytes = N * kK * 2;
  for (int i = tid; i < (kMaxWg * kABytes + kBBytes) / 2; i += blockDim.x) {
    reinterpret_cast<T*>(smem)[i] = __float2bfloat16(float((i * 7) % 13 - 6) * 0.01f);
  }
  msa::sm90::fence_proxy_async_smem();
  __syncthreads();
  const uint32_t a_addr = msa::sm80::smem_addr(smem) + wg * kABytes;
  const uint32_t b_addr = msa::sm80::smem_addr(smem) + kMaxWg * kABytes;
  uint32_t af[kSteps][4] = {};
  if constexpr (kRS) {
    // This warp's A fragments (rows 16 (warp % 4) + lane / 4 and + 8): values only matter for the timing.
#pragma unroll
    for (int ks = 0; ks < kSteps; ++ks)
#pragma unroll
      for (int j = 0; j < 4; ++j) af[ks][j] = 0x3c003c00u ^ uint32_t(ks * 4 + j + tid);
  }
  float sum[kSums] = {};
  float acc[kAcc][N / 2];
  gemm_loop(iters, acc, [&](float (&d)[N / 2]) { issue<N, kRS>(d, a_addr, b_addr, af); },
            [&](float (&d)[N / 2]) { consume<N, kExp>(d, sum); });
  float s = 0.f;
#pragma unroll
  for (int i = 0; i < kSums; ++i) s += sum[i];
  if (s == 1234.5f) out[tid] = s;  // keeps the sums (never true for these inputs in practice)
}

// m64n256k32 e4m3 into f16 (64 registers), A from registers: not among csrc/common/wgmma_sm90.h's wrappers (no
// kernel takes it); here to ask whether the wider N runs faster than the top-k's n128 (NOTES s67).
__device__ __forceinline__ void wgmma_e4m3_n256_f16(uint32_t (&d)[64], const uint32_t (&a)[4], uint64_t desc_b,
                                                    bool accumulate) {
  asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %69, 0;\n"
               "wgmma.mma_async.sync.aligned.m64n256k32.f16.e4m3.e4m3 "
               "{%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,"
               "%27,%28,%29,%30,%31,%32,%33,%34,%35,%36,%37,%38,%39,%40,%41,%42,%43,%44,%45,%46,%47,%48,%49,%50,%51,"
               "%52,%53,%54,%55,%56,%57,%58,%59,%60,%61,%62,%63}, "
               "{%64,%65,%66,%67}, %68, p, 1, 1;\n}\n"
               : "+r"(d[0]), "+r"(d[1]), "+r"(d[2]), "+r"(d[3]), "+r"(d[4]), "+r"(d[5]), "+r"(d[6]), "+r"(d[7]),
                 "+r"(d[8]), "+r"(d[9]), "+r"(d[10]), "+r"(d[11]), "+r"(d[12]), "+r"(d[13]), "+r"(d[14]),
                 "+r"(d[15]), "+r"(d[16]), "+r"(d[17]), "+r"(d[18]), "+r"(d[19]), "+r"(d[20]), "+r"(d[21]),
                 "+r"(d[22]), "+r"(d[23]), "+r"(d[24]), "+r"(d[25]), "+r"(d[26]), "+r"(d[27]), "+r"(d[28]),
                 "+r"(d[29]), "+r"(d[30]), "+r"(d[31]), "+r"(d[32]), "+r"(d[33]), "+r"(d[34]), "+r"(d[35]),
                 "+r"(d[36]), "+r"(d[37]), "+r"(d[38]), "+r"(d[39]), "+r"(d[40]), "+r"(d[41]), "+r"(d[42]),
                 "+r"(d[43]), "+r"(d[44]), "+r"(d[45]), "+r"(d[46]), "+r"(d[47]), "+r"(d[48]), "+r"(d[49]),
                 "+r"(d[50]), "+r"(d[51]), "+r"(d[52]), "+r"(d[53]), "+r"(d[54]), "+r"(d[55]), "+r"(d[56]),
                 "+r"(d[57]), "+r"(d[58]), "+r"(d[59]), "+r"(d[60]), "+r"(d[61]), "+r"(d[62]), "+r"(d[63])
               : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b), "r"(int(accumulate)));
}

// The FP8 top-k's GEMM (index_topk_sm90_kernel, kFp8): acc (64 x N f16) = A (64 x 128 e4m3, registers) B^T (B: N
// keys x 128 e4m3 bytes, the K-major 128-byte-swizzled tile of 64 16-bit columns), four k-steps of k32 (N = 128: the
// kernel's WgmmaRSE4m3N128F16; N = 256: the wrapper above), timed by gemm_loop as the 16-bit GEMMs.
constexpr int kFp8Steps = kK / 32;
template <int N>
__device__ __forceinline__ void issue_fp8(uint32_t (&acc)[N / 4], uint32_t b_addr, const uint32_t (&af)[kFp8Steps][4]) {
  using BT = KMajorSw128<N, kK / 2>;  // 128 bytes a row, seen as 64 16-bit columns (the kernel's D = Di / 2)
  wgmma_fence();
#pragma unroll
  for (int ks = 0; ks < kFp8Steps; ++ks) {
    if constexpr (N == 128) {
      WgmmaRSE4m3N128F16::run(acc, af[ks], BT::desc(b_addr, ks), ks > 0);
    } else {
      wgmma_e4m3_n256_f16(acc, af[ks], BT::desc(b_addr, ks), ks > 0);
    }
  }
  wgmma_commit();
}

template <int N>
__device__ __forceinline__ void consume_fp8(uint32_t (&acc)[N / 4], __half2 (&mx)[kSums]) {
  msa::sm90::fence_regs(acc);
#pragma unroll
  for (int i = 0; i < N / 4; ++i) mx[i % kSums] = __hmax2(mx[i % kSums], *reinterpret_cast<const __half2*>(&acc[i]));
}

template <int N, int kAcc, int kWg>
__global__ void __launch_bounds__(128 * kWg, 1) rate_kernel_fp8(int iters, float* out) {
  extern __shared__ __align__(1024) char smem_raw[];
  char* smem = smem_raw + ((1024u - (msa::sm80::smem_addr(smem_raw) & 1023u)) & 1023u);
  const int tid = threadIdx.x;
  // B: N x 128 e4m3 bytes, values 0.5 .. 0.9375 (0x30 .. 0x37: finite, no f16 overflow over 128 products).
  for (int i = tid; i < N * kK; i += blockDim.x) reinterpret_cast<unsigned char*>(smem)[i] = 0x30 + (i * 7) % 8;
  msa::sm90::fence_proxy_async_smem();
  __syncthreads();
  const uint32_t b_addr = msa::sm80::smem_addr(smem);
  uint32_t af[kFp8Steps][4];
#pragma unroll
  for (int ks = 0; ks < kFp8Steps; ++ks)
#pragma unroll
    for (int j = 0; j < 4; ++j) af[ks][j] = 0x30303030u | uint32_t((ks * 4 + j + tid) & 7);
  __half2 mx[kSums];
#pragma unroll
  for (int i = 0; i < kSums; ++i) mx[i] = __float2half2_rn(-1.f);
  uint32_t acc[kAcc][N / 4];
  gemm_loop(iters, acc, [&](uint32_t (&d)[N / 4]) { issue_fp8<N>(d, b_addr, af); },
            [&](uint32_t (&d)[N / 4]) { consume_fp8<N>(d, mx); });
  float m = -1.f;
#pragma unroll
  for (int i = 0; i < kSums; ++i) m = fmaxf(m, fmaxf(__low2float(mx[i]), __high2float(mx[i])));
  if (m == 1234.5f) out[tid] = m;  // keeps the maxima
}

// Best of 3 timed launches of `kernel` (one warm-up first), as TFLOP/s of 2 x 64 x N x 128 per GEMM, one CSV row.
template <typename Kernel>
void time_rows(Kernel kernel, int n, const char* mode, int wg, int acc, int exp, int smem, int sms, float* out) {
  BENCH_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
  const int iters = 4000;
  kernel<<<sms, 128 * wg, smem>>>(16, out);  // warm-up
  BENCH_CHECK(cudaGetLastError());
  cudaEvent_t e0, e1;
  BENCH_CHECK(cudaEventCreate(&e0));
  BENCH_CHECK(cudaEventCreate(&e1));
  float best = 1e30f;
  for (int rep = 0; rep < 3; ++rep) {
    BENCH_CHECK(cudaEventRecord(e0));
    kernel<<<sms, 128 * wg, smem>>>(iters, out);
    BENCH_CHECK(cudaEventRecord(e1));
    BENCH_CHECK(cudaEventSynchronize(e1));
    float ms = 0.f;
    BENCH_CHECK(cudaEventElapsedTime(&ms, e0, e1));
    best = ms < best ? ms : best;
  }
  const double flops = 2.0 * 64 * n * kK * double(iters) * wg * sms;
  std::printf("wgmma_rate,%d,%s,%d,%d,%d,%.4f,%.1f\n", n, mode, wg, acc, exp, best, flops / (best * 1e-3) / 1e12);
  BENCH_CHECK(cudaEventDestroy(e0));
  BENCH_CHECK(cudaEventDestroy(e1));
}

template <int N, bool kRS, int kAcc, bool kExp, int kWg>
void run(int sms, float* out) {
  constexpr int wg = kWg;
  auto kernel = rate_kernel<N, kRS, kAcc, kExp, kWg>;
  const int smem = kMaxWg * 64 * kK * 2 + N * kK * 2 + 1024;
  time_rows(kernel, N, kRS ? "rs" : "ss", wg, kAcc, kExp ? 1 : 0, smem, sms, out);
}

template <int N, int kAcc, int kWg>
void run_fp8(int sms, float* out) {
  time_rows(rate_kernel_fp8<N, kAcc, kWg>, N, "rs_e4m3", kWg, kAcc, 0, N * kK + 1024, sms, out);
}

// Every mode of N (RS where the wrappers have it: N = 64 and 128) with kWg warpgroups.
template <int N, int kWg>
void modes(int sms, float* out) {
  run<N, false, 1, false, kWg>(sms, out);
  run<N, false, 2, false, kWg>(sms, out);
  run<N, false, 1, true, kWg>(sms, out);
  run<N, false, 2, true, kWg>(sms, out);
  if constexpr (N != 32) {
    run<N, true, 1, false, kWg>(sms, out);
    run<N, true, 2, false, kWg>(sms, out);
    run<N, true, 1, true, kWg>(sms, out);
    run<N, true, 2, true, kWg>(sms, out);
  }
}
template <int N>
void all_modes(int sms, float* out) {
  modes<N, 1>(sms, out);
  modes<N, 2>(sms, out);
  modes<N, 3>(sms, out);
}
// N = 256 with two accumulator sets (128 registers) only where a thread may hold 255 (<= 2 warpgroups).
template <int kWg>
void fp8_modes(int sms, float* out) {
  run_fp8<128, 1, kWg>(sms, out);
  run_fp8<128, 2, kWg>(sms, out);
  run_fp8<256, 1, kWg>(sms, out);
  if constexpr (kWg <= 2) run_fp8<256, 2, kWg>(sms, out);
}

}  // namespace

int main() {
  int dev = 0, sms = 0, major = 0, count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess || count == 0) {
    std::printf("wgmma_rate: no CUDA device here\n");
    return 0;
  }
  BENCH_CHECK(cudaGetDevice(&dev));
  BENCH_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev));
  BENCH_CHECK(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev));
  if (major != 9) {
    std::printf("wgmma_rate: needs an sm_90 GPU (compute capability %d.x here)\n", major);
    return 0;
  }
  float* out = nullptr;
  BENCH_CHECK(cudaMalloc(&out, 128 * kMaxWg * sizeof(float)));
  std::printf("kernel,n,mode,wg,acc,exp,ms,tflops\n");
  all_modes<32>(sms, out);
  all_modes<64>(sms, out);
  all_modes<128>(sms, out);
  fp8_modes<1>(sms, out);
  fp8_modes<2>(sms, out);
  fp8_modes<3>(sms, out);
  fp8_modes<4>(sms, out);
  BENCH_CHECK(cudaFree(out));
  return 0;
}
