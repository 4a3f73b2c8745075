// The backward's small kernels: the preprocess delta[h, t] = sum_d dout[t, h, d] * out[t, h, d] in
// fp32 (FA2's D_i), and the final scale and cast of the fp32 gradients (one launch for all of them).
#include <algorithm>

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

// Every segment of s, one per blockIdx.y: out[i] = T((in[i] + lo[i]) * scale[0]) (lo 0 and scale 1 where the
// segment has none; in + lo in fp32 is the exact sum's rounding, as an fp32 add before the cast), four elements
// per thread and grid-stride step (n a multiple of 4, in and lo 16-byte aligned).
template <typename T>
__global__ void cast_segments_kernel(CastSegments s) {
  const CastSegment& g = s.seg[blockIdx.y];
  const float sc = g.scale != nullptr ? *g.scale : 1.f;
  T* out = static_cast<T*>(g.out);
  const int64_t n4 = g.n / 4;
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n4; i += int64_t(gridDim.x) * blockDim.x) {
    float4 v = reinterpret_cast<const float4*>(g.in)[i];
    if (g.lo != nullptr) {
      const float4 l = reinterpret_cast<const float4*>(g.lo)[i];
      v = make_float4(v.x + l.x, v.y + l.y, v.z + l.z, v.w + l.w);
    }
    reinterpret_cast<uint2*>(out)[i] = make_uint2(pack2<T>(v.x * sc, v.y * sc), pack2<T>(v.z * sc, v.w * sc));
  }
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

cudaError_t launch_cast_segments(const CastSegments& s, bool bf16, cudaStream_t stream) {
  if (s.count < 0 || s.count > kMaxCastSegments) return cudaErrorInvalidValue;
  int64_t n4 = 0;
  for (int i = 0; i < s.count; ++i) {
    const CastSegment& g = s.seg[i];
    if (g.n < 0 || g.n % 4 != 0 || reinterpret_cast<uintptr_t>(g.in) % 16 != 0 ||
        reinterpret_cast<uintptr_t>(g.lo) % 16 != 0 || reinterpret_cast<uintptr_t>(g.out) % 8 != 0) {
      return cudaErrorInvalidValue;
    }
    n4 = std::max(n4, g.n / 4);
  }
  if (s.count == 0 || n4 == 0) return cudaSuccess;
  // Grid-stride over the longest segment (at most 4096 CTAs of 256 threads); a shorter segment's extra CTAs exit.
  const dim3 grid(unsigned(std::min<int64_t>((n4 + 255) / 256, 4096)), unsigned(s.count));
  if (bf16) cast_segments_kernel<__nv_bfloat16><<<grid, 256, 0, stream>>>(s);
  else cast_segments_kernel<__half><<<grid, 256, 0, stream>>>(s);
  return cudaGetLastError();
}

}  // namespace msa::smxx
