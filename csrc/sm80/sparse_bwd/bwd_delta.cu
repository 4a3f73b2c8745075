// The backward's preprocess: delta[h, t] = sum_d dout[t, h, d] * out[t, h, d] in fp32 (FA2's D_i).
#include "common/mma_sm80.h"
#include "sm80/sparse_bwd/sparse_bwd.h"

namespace msa::sm80 {
namespace {

// One warp per (token, head); lanes stride over D in 16-bit pairs.
template <typename T>
__global__ void bwd_delta_kernel(BwdDeltaParams p) {
  const int64_t wid = (blockIdx.x * int64_t(blockDim.x) + threadIdx.x) / 32;
  const int lane = threadIdx.x % 32;
  if (wid >= int64_t(p.total_tokens) * p.hq) return;
  const int t = int(wid / p.hq), h = int(wid % p.hq);
  const uint32_t* o = reinterpret_cast<const uint32_t*>(static_cast<const T*>(p.out) + t * p.o_stride_t + h * p.o_stride_h);
  const uint32_t* d =
      reinterpret_cast<const uint32_t*>(static_cast<const T*>(p.dout) + t * p.do_stride_t + h * p.do_stride_h);
  float acc = 0.f;
  for (int i = lane; i < p.d / 2; i += 32) {
    const float2 a = unpack2<T>(o[i]), b = unpack2<T>(d[i]);
    acc += a.x * b.x + a.y * b.y;
  }
#pragma unroll
  for (int off = 16; off >= 1; off >>= 1) acc += __shfl_xor_sync(0xffffffffu, acc, off);
  if (lane == 0) p.delta[int64_t(h) * p.total_tokens + t] = acc;
}

}  // namespace

cudaError_t launch_bwd_delta(const BwdDeltaParams& p, bool bf16, cudaStream_t stream) {
  const int64_t threads = int64_t(p.total_tokens) * p.hq * 32;
  if (threads == 0) return cudaSuccess;
  const unsigned blocks = unsigned((threads + 255) / 256);
  if (bf16) bwd_delta_kernel<__nv_bfloat16><<<blocks, 256, 0, stream>>>(p);
  else bwd_delta_kernel<__half><<<blocks, 256, 0, stream>>>(p);
  return cudaGetLastError();
}

}  // namespace msa::sm80
