// The backward's small kernels: the preprocess delta[h, t] = sum_d dout[t, h, d] * out[t, h, d] in
// fp32 (FA2's D_i), and the index gradients' final scale and cast.
#include "common/mma_sm80.h"
#include "smxx/bwd_delta/bwd_delta.h"

namespace msa::smxx {
using namespace sm80;  // common/mma_sm80.h: pack / ldmatrix / mma.sync helpers (sm80 and later)
namespace {

// D / 8 lanes per (token, head), each with one 16-byte chunk of out and dout (rows are 16-byte
// aligned: api/ops.h aligned_rows), then a shuffle sum within the lane group.
template <typename T, int D>
__global__ void bwd_delta_kernel(BwdDeltaParams p) {
  constexpr int kLanes = D / 8;
  const int64_t row = (blockIdx.x * int64_t(blockDim.x) + threadIdx.x) / kLanes;
  const int c = threadIdx.x % kLanes;
  const bool ok = row < int64_t(p.total_tokens) * p.hq;
  const int t = ok ? int(row / p.hq) : 0, h = ok ? int(row % p.hq) : 0;
  float acc = 0.f;
  if (ok) {
    const uint4 o = *reinterpret_cast<const uint4*>(static_cast<const T*>(p.out) + t * p.o_stride_t +
                                                    h * p.o_stride_h + c * 8);
    const uint4 d = *reinterpret_cast<const uint4*>(static_cast<const T*>(p.dout) + t * p.do_stride_t +
                                                    h * p.do_stride_h + c * 8);
    const uint32_t ov[4] = {o.x, o.y, o.z, o.w}, dv[4] = {d.x, d.y, d.z, d.w};
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const float2 a = unpack2<T>(ov[i]), b = unpack2<T>(dv[i]);
      acc += a.x * b.x + a.y * b.y;
    }
  }
#pragma unroll
  for (int off = kLanes / 2; off >= 1; off >>= 1) acc += __shfl_xor_sync(0xffffffffu, acc, off);
  if (ok && c == 0) p.delta[int64_t(h) * p.total_tokens + t] = acc;
}

// out[i] = T(in[i] * scale[0]), four elements per thread (n a multiple of 4, 16-byte aligned in).
template <typename T>
__global__ void scale_cast_kernel(const float* in, const float* scale, T* out, int64_t n4) {
  const int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x;
  if (i >= n4) return;
  const float s = *scale;
  const float4 v = reinterpret_cast<const float4*>(in)[i];
  reinterpret_cast<uint2*>(out)[i] = make_uint2(pack2<T>(v.x * s, v.y * s), pack2<T>(v.z * s, v.w * s));
}

}  // namespace

cudaError_t launch_bwd_delta(const BwdDeltaParams& p, bool bf16, cudaStream_t stream) {
  const int64_t threads = int64_t(p.total_tokens) * p.hq * (p.d / 8);
  if (threads == 0) return cudaSuccess;
  const unsigned blocks = unsigned((threads + 255) / 256);
  if (p.d == 64) {
    if (bf16) bwd_delta_kernel<__nv_bfloat16, 64><<<blocks, 256, 0, stream>>>(p);
    else bwd_delta_kernel<__half, 64><<<blocks, 256, 0, stream>>>(p);
  } else {
    if (bf16) bwd_delta_kernel<__nv_bfloat16, 128><<<blocks, 256, 0, stream>>>(p);
    else bwd_delta_kernel<__half, 128><<<blocks, 256, 0, stream>>>(p);
  }
  return cudaGetLastError();
}

cudaError_t launch_scale_cast(const float* in, const float* scale, void* out, int64_t n, bool bf16,
                              cudaStream_t stream) {
  const int64_t n4 = n / 4;
  if (n4 == 0) return cudaSuccess;
  const unsigned blocks = unsigned((n4 + 255) / 256);
  if (bf16) scale_cast_kernel<<<blocks, 256, 0, stream>>>(in, scale, static_cast<__nv_bfloat16*>(out), n4);
  else scale_cast_kernel<<<blocks, 256, 0, stream>>>(in, scale, static_cast<__half*>(out), n4);
  return cudaGetLastError();
}

}  // namespace msa::smxx
