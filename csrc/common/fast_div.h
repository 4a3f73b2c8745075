// Division of non-negative int32 values by a divisor fixed for a launch, as one 32 x 32 -> 64-bit
// multiply and a shift (a runtime `/` is ~20 instructions: IABS, I2F, MUFU.RCP, F2I and fix-ups).
// Granlund and Montgomery: with l = ceil(log2 d), p = 31 + l and m = ceil(2^p / d), m d - 2^p < d <= 2^l, so
// floor(n m / 2^p) = floor(n / d) for every 0 <= n < 2^31; m <= 2^32 - 1 for d >= 1 (d = 2^l gives m = 2^31).
#pragma once
#include <cstdint>

namespace msa {

struct FastDiv {
  uint32_t d = 1;     // the divisor
  uint32_t mul = 0;   // m
  uint32_t shift = 0; // p
};

// d in [1, 2^31).
inline FastDiv make_fast_div(int64_t d) {
  FastDiv f;
  f.d = uint32_t(d);
  int l = 0;
  while ((int64_t(1) << l) < d) ++l;
  f.shift = uint32_t(31 + l);
  f.mul = uint32_t(((uint64_t(1) << f.shift) + uint64_t(d) - 1) / uint64_t(d));
  return f;
}

#ifdef __CUDACC__
// n / d for 0 <= n < 2^31.
__device__ __forceinline__ int fast_div(int n, const FastDiv& f) {
  return int((uint64_t(uint32_t(n)) * f.mul) >> f.shift);
}
// n % d for 0 <= n < 2^31.
__device__ __forceinline__ int fast_mod(int n, const FastDiv& f) { return n - fast_div(n, f) * int(f.d); }
#endif

}  // namespace msa
