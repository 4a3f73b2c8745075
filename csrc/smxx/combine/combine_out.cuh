// Combine of the sparse forward's per-entry results (one query chunk), in slot order: deterministic.
//   stats: lse[h, t] = ln 2 * (M + log2 sum_s l_s 2^(m_s - M)) over the row's valid slots (l_s > 0),
//          the same for lse_idx; a row with no valid slot gets -inf.
//   out:   out[t, h] = sum_s partial_s (the partials already carry exp(s - lse)).
//   kl:    kl_row[r, t] = sum_s kl_part_s + lse_idx[r, t]   (SPEC 4 with sum_j P_j = 1).
#pragma once
#include <cuda_runtime.h>

#include <type_traits>

#include "common/mma_sm80.h"
#include "params.h"
#include "smxx/combine/combine.h"

namespace msa::smxx {
using namespace sm80;  // common/mma_sm80.h: pack / ldmatrix / mma.sync helpers (sm80 and later)

// One warp per (token, head); lane holds D / 32 consecutive elements. The slots' validity comes first
// in one load per lane (lane s: slot s) and a ballot, so the partial loads of kUnroll slots are
// independent and in flight together (a load per slot after its own stats load was latency-bound:
// ~2.7 TB/s at 32K).
template <typename T, int D>
__global__ void sparse_combine_out_kernel(SparseCombineParams p) {
  constexpr int kPer = D / 32;  // 2 or 4 elements: one 4- or 8-byte load per slot
  constexpr int kUnroll = 8;
  using Vec = std::conditional_t<kPer == 4, uint2, uint32_t>;
  const int G = p.hq / p.hi;
  const int64_t wid = (blockIdx.x * int64_t(blockDim.x) + threadIdx.x) / 32;
  const int lane = threadIdx.x % 32;
  if (wid >= int64_t(p.chunk_tokens) * p.hq) return;  // whole warps: the grid is in warps
  const int tl = int(wid / p.hq), h = int(wid % p.hq);
  const int64_t row0 = (int64_t(h / G) * p.chunk_tokens + tl) * p.topk * G + h % G;  // slot s: row0 + s * G
  // Slot s holds a partial unless its stats say it has no keys (l = 0: never written, garbage); a NaN
  // l keeps its partial, so NaN inputs stay visible in out.
  const bool has = lane < p.topk && !(p.stats[row0 + int64_t(lane) * G].y <= 0.f);
  const uint32_t valid = __ballot_sync(0xffffffffu, has);
  const Vec* src = reinterpret_cast<const Vec*>(static_cast<const T*>(p.out_part) + row0 * D) + lane;
  const int64_t slot_stride = int64_t(G) * D * sizeof(T) / sizeof(Vec);
  float acc[kPer];
#pragma unroll
  for (int x = 0; x < kPer; ++x) acc[x] = 0.f;
  for (int s0 = 0; s0 < p.topk; s0 += kUnroll) {
    Vec v[kUnroll];
#pragma unroll
    for (int j = 0; j < kUnroll; ++j) {
      const int s = s0 + j;
      v[j] = Vec{};
      if (s < p.topk && ((valid >> s) & 1u)) v[j] = __ldg(src + s * slot_stride);
    }
#pragma unroll
    for (int j = 0; j < kUnroll; ++j) {  // slot order, as before; a skipped slot adds +0
      const uint32_t* w = reinterpret_cast<const uint32_t*>(&v[j]);
#pragma unroll
      for (int x = 0; x < kPer / 2; ++x) {
        const float2 f = unpack2<T>(w[x]);
        acc[2 * x] += f.x;
        acc[2 * x + 1] += f.y;
      }
    }
  }
  T* out = static_cast<T*>(p.out) + int64_t(p.chunk_begin + tl) * p.out_stride_t + int64_t(h) * p.out_stride_h;
  uint32_t* dst = reinterpret_cast<uint32_t*>(out + lane * kPer);
#pragma unroll
  for (int x = 0; x < kPer / 2; ++x) dst[x] = pack2<T>(acc[2 * x], acc[2 * x + 1]);
}

template <typename T, int D>
cudaError_t launch_sparse_combine_out(const SparseCombineParams& p, cudaStream_t stream) {
  const int64_t threads = int64_t(p.chunk_tokens) * p.hq * 32;
  if (threads == 0) return cudaSuccess;
  sparse_combine_out_kernel<T, D><<<unsigned((threads + 255) / 256), 256, 0, stream>>>(p);
  return cudaGetLastError();
}

}  // namespace msa::smxx
