// The backward's small kernels (bwd_delta.cu), any arch.
#pragma once
#include <cuda_runtime_api.h>

#include <cstdint>

#include "params.h"

namespace msa::smxx {
// delta = rowsum(dout * out) per (head, token); bf16 or fp16 by `bf16`.
cudaError_t launch_bwd_delta(const BwdDeltaParams& p, bool bf16, cudaStream_t stream);
// Up to kMaxCastSegments fp32 arrays cast to bf16 or fp16 (by `bf16`) in one launch: out = T((in + lo) * scale).
struct CastSegment {
  const float* in = nullptr;     // 16-byte aligned
  void* out = nullptr;           // n elements of the output dtype, 8-byte aligned
  int64_t n = 0;                 // a multiple of 4 (D, Di are multiples of 8)
  const float* scale = nullptr;  // a device scalar the values are multiplied by, or nullptr
  const float* lo = nullptr;     // added to in first (fp32, 16-byte aligned), or nullptr
};
inline constexpr int kMaxCastSegments = 5;
struct CastSegments {
  CastSegment seg[kMaxCastSegments];
  int count = 0;
  // false (nothing added) when full.
  bool add(const float* in, void* out, int64_t n, const float* scale = nullptr, const float* lo = nullptr) {
    if (count == kMaxCastSegments) return false;
    seg[count++] = {in, out, n, scale, lo};
    return true;
  }
};
cudaError_t launch_cast_segments(const CastSegments& s, bool bf16, cudaStream_t stream);
}  // namespace msa::smxx
