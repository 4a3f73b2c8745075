// Exact order-independent fp32 sums for the deterministic mode (params.h, DetGridParams): one
// contribution split on the grid into hi and lo, each added to its own accumulator.
#pragma once
#include <cuda_runtime.h>

#include "common/mma_sm80.h"

namespace msa {

__device__ __forceinline__ float det_hi(float x, const float4& g) { return rintf(x * g.x) * g.y; }
__device__ __forceinline__ float det_lo(float x, float hi, const float4& g) { return rintf((x - hi) * g.z) * g.w; }

// hi[0..3] += the grid's hi parts of v, lo[0..3] += its lo parts (16-byte aligned). g.y == 0: no grid.
__device__ __forceinline__ void det_add4(float* hi, float* lo, float4 v, const float4 g) {
  if (g.y == 0.f) {
    sm80::atomic_add4(hi, v);
    return;
  }
  const float4 h = make_float4(det_hi(v.x, g), det_hi(v.y, g), det_hi(v.z, g), det_hi(v.w, g));
  sm80::atomic_add4(hi, h);
  sm80::atomic_add4(lo, make_float4(det_lo(v.x, h.x, g), det_lo(v.y, h.y, g), det_lo(v.z, h.z, g), det_lo(v.w, h.w, g)));
}

}  // namespace msa
