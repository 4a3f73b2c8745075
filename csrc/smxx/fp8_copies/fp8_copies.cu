// e4m3 copies of q_idx / k_idx for the FP8 selection: one warp per (token, head) row of D = 64 or 128 values (2 or
// 4 per lane); k's scales per (sequence, head). The power-of-two scale is exact in fp32 and the conversion rounds
// to nearest even, as PyTorch's float -> float8_e4m3fn does: for finite inputs the bytes equal the PyTorch formula's
// (msa/_ops.py fp8_copies_torch; fmaxf drops a NaN from a maximum, torch's max keeps it).
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>

#include <type_traits>

#include "smxx/fp8_copies/fp8_copies.h"

namespace msa::smxx {
namespace {

constexpr int kWarps = 8;  // rows per CTA

template <typename T>
__device__ __forceinline__ float to_float(T v) {
  if constexpr (std::is_same_v<T, __half>) return __half2float(v); else return __bfloat162float(v);
}

// Lane `lane`'s values of a row: D / 32 consecutive elements (2-byte loads; the warp's together coalesced).
template <typename T, int kPer>
__device__ __forceinline__ void load_row(const T* row, int lane, float (&v)[kPer]) {
#pragma unroll
  for (int i = 0; i < kPer; ++i) v[i] = to_float(row[lane * kPer + i]);
}

// 2^s for the largest s with amax 2^s <= 16 = 0.5 2^5 (so that a Di <= 128 dot product of two copies, and each of
// its partial sums, stays within f16's 65504: the Hopper FP8 top-k accumulates in f16), s clamped to [-126, 126],
// amax raised to the smallest normal float first (zero rows): torch.frexp's (m, e) with m in [0.5, 1).
__device__ __forceinline__ float pow2_scale(float amax) {
  int e;
  const float m = frexpf(fmaxf(amax, 1.17549435e-38f), &e);
  const int s = min(max(m <= 0.5f ? 5 - e : 4 - e, -126), 126);
  return ldexpf(1.f, s);
}

template <int kPer>
__device__ __forceinline__ void store_row(uint8_t* out, int lane, const float (&v)[kPer], float scale) {
  uint8_t b[kPer];
#pragma unroll
  for (int i = 0; i < kPer; ++i) {
    b[i] = static_cast<uint8_t>(__nv_cvt_float_to_fp8(v[i] * scale, __NV_NOSAT, __NV_E4M3));
  }
  if constexpr (kPer == 4) {
    *reinterpret_cast<uint32_t*>(out + lane * 4) = uint32_t(b[0]) | uint32_t(b[1]) << 8 | uint32_t(b[2]) << 16 |
                                                    uint32_t(b[3]) << 24;
  } else {
    *reinterpret_cast<uint16_t*>(out + lane * 2) = uint16_t(b[0] | b[1] << 8);
  }
}

__device__ __forceinline__ float warp_max(float x) {
#pragma unroll
  for (int off = 16; off >= 1; off >>= 1) x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, off));
  return x;
}

// The sequence of key row t: the last s with cu[s] <= t (binary search), or t / seq_len.
__device__ __forceinline__ int key_seq(const Fp8KeySeqs& seqs, int64_t t) {
  if (seqs.cu == nullptr) return int(t / seqs.seq_len);
  int lo = 0, hi = seqs.num_seqs - 1;
  while (lo < hi) {
    const int mid = (lo + hi + 1) / 2;
    if (seqs.cu[mid] <= t) lo = mid; else hi = mid - 1;
  }
  return lo;
}

// amax[s * H + h] = max |k| per (sequence, head): a warp takes kRun consecutive tokens of one head, keeps its lanes'
// maxima and adds them with one atomicMax per sequence it meets (non-negative floats order as their bits): one atomic
// per kRun rows instead of one per row, which at 128K put ~130,000 atomics on one address (0.70 ms, s63 probe).
constexpr int kRun = 32, kBatch = 4;

template <typename T, int kPer>
__global__ void head_amax_kernel(const Fp8CopyArgs k, const Fp8KeySeqs seqs, float* amax) {
  const int lane = threadIdx.x % 32;
  const int64_t w = int64_t(blockIdx.x) * kWarps + threadIdx.x / 32;
  const int h = int(w % k.heads);
  const int64_t t0 = (w / k.heads) * kRun;
  if (t0 >= k.rows) return;
  const int64_t t1 = t0 + kRun < k.rows ? t0 + kRun : k.rows;
  int s = key_seq(seqs, t0);
  // The last sequence takes every row after it (as key_seq does): no read past cu[num_seqs].
  auto seq_end = [&](int q) {
    if (q + 1 >= seqs.num_seqs) return k.rows;
    return seqs.cu ? int64_t(seqs.cu[q + 1]) : int64_t(q + 1) * seqs.seq_len;
  };
  int64_t end = seq_end(s);
  const T* x = static_cast<const T*>(k.x) + h * k.stride_h;
  float m = 0.f;
  // The warp's maximum of its rows of sequence s into amax (lane 0; non-negative floats order as their bits).
  auto flush = [&] {
    const float wm = warp_max(m);
    if (lane == 0) atomicMax(reinterpret_cast<unsigned*>(amax) + int64_t(s) * k.heads + h, __float_as_uint(wm));
  };
  for (int64_t tb = t0; tb < t1; tb += kBatch) {  // t is warp-uniform: so are the flushes
    float v[kBatch][kPer];  // kBatch rows' loads in flight before the first flush
#pragma unroll
    for (int u = 0; u < kBatch; ++u) {
      if (tb + u < t1) load_row<T, kPer>(x + (tb + u) * k.stride_t, lane, v[u]);
    }
#pragma unroll
    for (int u = 0; u < kBatch; ++u) {
      const int64_t t = tb + u;
      if (t >= t1) break;
      if (t >= end) {
        flush();
        m = 0.f;
        while (t >= end) end = seq_end(++s);  // empty sequences between
      }
#pragma unroll
      for (int i = 0; i < kPer; ++i) m = fmaxf(m, fabsf(v[u][i]));
    }
  }
  flush();
}

// Rows [0, q.rows * q.heads) are q's (their own scale), the next k.rows * k.heads are k's (their (sequence, head)'s).
template <typename T, int kPer>
__global__ void quantize_kernel(const Fp8CopyArgs q, const Fp8CopyArgs k, const Fp8KeySeqs seqs, const float* k_amax) {
  const int lane = threadIdx.x % 32;
  int64_t row = int64_t(blockIdx.x) * kWarps + threadIdx.x / 32;
  const int64_t q_rows = q.rows * q.heads;
  const bool is_q = row < q_rows;
  const Fp8CopyArgs a = is_q ? q : k;  // by value: a reference to either parameter put both in local memory
  if (!is_q) row -= q_rows;
  if (row >= a.rows * a.heads) return;
  const int64_t t = row / a.heads;
  const int h = int(row % a.heads);
  float v[kPer];
  load_row<T, kPer>(static_cast<const T*>(a.x) + t * a.stride_t + h * a.stride_h, lane, v);
  float scale;
  if (is_q) {
    float m = 0.f;
#pragma unroll
    for (int i = 0; i < kPer; ++i) m = fmaxf(m, fabsf(v[i]));
    scale = pow2_scale(warp_max(m));
  } else {
    scale = pow2_scale(k_amax[int64_t(key_seq(seqs, t)) * a.heads + h]);
  }
  store_row<kPer>(a.out + row * a.dim, lane, v, scale);
}

template <typename T, int kPer>
cudaError_t launch(const Fp8CopyArgs& q, const Fp8CopyArgs& k, const Fp8KeySeqs& seqs, float* k_amax,
                   cudaStream_t stream) {
  const int64_t k_rows = k.rows * k.heads, all = q.rows * q.heads + k_rows;
  const int64_t k_warps = (k.rows + kRun - 1) / kRun * k.heads;
  if (k_rows > 0) head_amax_kernel<T, kPer><<<unsigned((k_warps + kWarps - 1) / kWarps), kWarps * 32, 0, stream>>>(
      k, seqs, k_amax);
  if (all > 0) quantize_kernel<T, kPer><<<unsigned((all + kWarps - 1) / kWarps), kWarps * 32, 0, stream>>>(
      q, k, seqs, k_amax);
  return cudaGetLastError();
}

}  // namespace

template <typename T>
cudaError_t launch_fp8_index_copies(const Fp8CopyArgs& q, const Fp8CopyArgs& k, const Fp8KeySeqs& seqs,
                                    float* k_amax, cudaStream_t stream) {
  if (q.dim != k.dim || (q.dim != 64 && q.dim != 128) || seqs.num_seqs < 1 || (!seqs.cu && seqs.seq_len < 1)) {
    return cudaErrorInvalidValue;
  }
  return q.dim == 128 ? launch<T, 4>(q, k, seqs, k_amax, stream) : launch<T, 2>(q, k, seqs, k_amax, stream);
}

template cudaError_t launch_fp8_index_copies<__nv_bfloat16>(const Fp8CopyArgs&, const Fp8CopyArgs&,
                                                            const Fp8KeySeqs&, float*, cudaStream_t);
template cudaError_t launch_fp8_index_copies<__half>(const Fp8CopyArgs&, const Fp8CopyArgs&, const Fp8KeySeqs&, float*,
                                                     cudaStream_t);

}  // namespace msa::smxx
