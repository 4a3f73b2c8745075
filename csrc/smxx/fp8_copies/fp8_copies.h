// The FP8 selection's inputs (index_dtype, SPEC 2): e4m3 copies of q_idx / k_idx, each q_idx row and each k_idx
// head scaled by a power of two (msa.fp8_index_copies has the rule; the CPU runs the same formula in PyTorch).
#pragma once
#include <cuda_runtime_api.h>

#include <cstdint>

namespace msa::smxx {

// One (T, H, D) tensor of 16-bit values (T = __nv_bfloat16 or __half), strides in elements, last dim contiguous,
// D in {64, 128}; out is contiguous (T, H, D) e4m3 bytes.
struct Fp8CopyArgs {
  const void* x;
  uint8_t* out;
  int64_t rows, stride_t, stride_h;
  int heads, dim;
};

// k_amax (Hki floats, zeroed by the caller) = max |k| per head; then q rows scaled each by its own row's power of
// two, k rows by their head's. Two launches.
template <typename T>
cudaError_t launch_fp8_index_copies(const Fp8CopyArgs& q, const Fp8CopyArgs& k, float* k_amax, cudaStream_t stream);

}  // namespace msa::smxx
