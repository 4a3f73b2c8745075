// The deterministic mode's small kernels: finite |x| maxima, the summation grid, and the in-order sum of
// per-item partials (params.h).
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>
#include <cmath>

#include "common/block_span.h"
#include "common/mma_sm80.h"
#include "smxx/deterministic/det.h"

namespace msa::smxx {
namespace {

constexpr int kThreads = 256;

template <typename T>
__global__ void absmax_kernel(AbsMaxParams p) {
  const int chunks = p.dim / 8;
  const int64_t n = p.rows * p.heads * chunks;
  float m = 0.f;
  for (int64_t i = blockIdx.x * int64_t(kThreads) + threadIdx.x; i < n; i += int64_t(gridDim.x) * kThreads) {
    const int64_t row = i / (int64_t(p.heads) * chunks);
    const int h = int(i / chunks % p.heads), c = int(i % chunks);
    const uint4 v = *reinterpret_cast<const uint4*>(static_cast<const T*>(p.x) + row * p.stride_t + h * p.stride_h +
                                                    c * 8);
    const uint32_t w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const float2 f = sm80::unpack2<T>(w[j]);
      const float a = fabsf(f.x), b = fabsf(f.y);
      if (a <= 3.4e38f) m = fmaxf(m, a);  // NaN and Inf fail the test: they bound nothing
      if (b <= 3.4e38f) m = fmaxf(m, b);
    }
  }
#pragma unroll
  for (int off = 16; off >= 1; off >>= 1) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, off));
  if (threadIdx.x % 32 == 0) atomicMax(p.out, __float_as_uint(m));
}

__global__ void det_grid_kernel(DetGridParams p) {
  const double a0 = double(__uint_as_float(p.amax[0]));
  // |factor|: a negative softmax or index scale bounds the sums as its magnitude does (log2 of a negative B was
  // NaN: every element of the deterministic dq_idx was NaN under a negative index scale).
  const double f = fabs(p.factor);
  double B = p.mode == 0 ? f * a0 * (double(__uint_as_float(p.amax[1])) + double(__uint_as_float(p.amax[2]))) *
                               double(__uint_as_float(p.amax[3]))
                         : f * a0;
  if (B == 0.0) B = 1.0;  // every contribution is 0: any grid
  if (!(B < 1e30)) {      // overflow: no exact grid, plain sums
    *p.grid = make_float4(0.f, 0.f, 0.f, 0.f);
    return;
  }
  // u = 2^(ceil log2 B - 22): |sum of hi| <= B + n u / 2 < 2^24 u; w = u 2^(ceil log2 n - 23): |sum of
  // lo| <= n (u + w) / 2 < 2^24 w. u >= 2^-80 keeps w a normal float (fp32 atomics flush subnormals).
  const int eu = std::max(int(ceil(log2(B))) - 22, -80);
  const int ew = eu + int(ceil(log2(double(std::max(p.n_max, 1))))) - 23;
  *p.grid = make_float4(ldexpf(1.f, -eu), ldexpf(1.f, eu), ldexpf(1.f, -ew), ldexpf(1.f, ew));
}

__global__ void item_reduce_kernel(ItemReduceParams p) {
  const int gb = blockIdx.x, o = blockIdx.y;
  const BlockSpan span = block_span(p.block_offsets, p.cu_seqlens, p.cu_seqlens_k, p.num_seqs, gb, p.block_size);
  if (span.blen <= 0) return;
  const bool many = p.hi >= p.hout;  // several index groups per output head, J = 1
  const int J = many ? 1 : p.hout / p.hi;
  const int r0 = many ? o * (p.hi / p.hout) : o / J, nr = many ? p.hi / p.hout : 1, j = many ? 0 : o % J;
  const int64_t plane = int64_t(128) * p.width;  // one tensor's partial of one item
  const int n = p.ntensors * span.blen * p.width;
  for (int i = threadIdx.x; i < n; i += kThreads) {
    const int t = i / (span.blen * p.width), e = i % (span.blen * p.width);
    const int row = e / p.width, col = e % p.width;
    float acc = 0.f;
    for (int r = r0; r < r0 + nr; ++r) {
      const int key = r * p.max_blocks + gb;
      for (int it = p.item_offsets[key]; it < p.item_offsets[key + 1]; ++it)
        acc += p.part[((int64_t(it) * J + j) * p.ntensors + t) * plane + int64_t(row) * p.width + col];
    }
    float* dst = p.out[t] + (int64_t(span.k_start + span.key0 + row) * p.hout + o) * p.width + col;
    *dst += acc;  // one owner per element: the reductions of successive chunks run in stream order
  }
}

}  // namespace

cudaError_t launch_absmax(const AbsMaxParams& p, bool bf16, cudaStream_t stream) {
  const int64_t n = p.rows * p.heads * (p.dim / 8);
  if (n == 0) return cudaSuccess;
  const unsigned blocks = unsigned(std::min<int64_t>((n + kThreads - 1) / kThreads, 1024));
  if (bf16) absmax_kernel<__nv_bfloat16><<<blocks, kThreads, 0, stream>>>(p);
  else absmax_kernel<__half><<<blocks, kThreads, 0, stream>>>(p);
  return cudaGetLastError();
}

cudaError_t launch_det_grid(const DetGridParams& p, cudaStream_t stream) {
  det_grid_kernel<<<1, 1, 0, stream>>>(p);
  return cudaGetLastError();
}

cudaError_t launch_item_reduce(const ItemReduceParams& p, cudaStream_t stream) {
  if (p.max_blocks == 0 || p.hout == 0) return cudaSuccess;
  item_reduce_kernel<<<dim3(unsigned(p.max_blocks), unsigned(p.hout)), kThreads, 0, stream>>>(p);
  return cudaGetLastError();
}

}  // namespace msa::smxx
