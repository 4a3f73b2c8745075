// Small fills the host code would otherwise ask ATen for (the stable ABI has no arange).
#pragma once
#include <cuda_runtime_api.h>

#include <cstdint>

namespace msa::smxx {

// out[i] = i * step for i < n (int32): the offsets of n - 1 sequences of `step` tokens each.
cudaError_t launch_iota_int32(int32_t* out, int64_t n, int32_t step, cudaStream_t stream);

}  // namespace msa::smxx
