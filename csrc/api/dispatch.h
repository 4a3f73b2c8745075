// Launch-error check and the one runtime -> template switch (dtype x head dim) of the CUDA entry points.
#pragma once
#include <ATen/ATen.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime_api.h>

// Fails with "msa::<what> launch failed: <cuda error>" unless expr returned cudaSuccess.
#define MSA_LAUNCH_CHECK(expr, what)                                                             \
  do {                                                                                           \
    const cudaError_t err_ = (expr);                                                             \
    TORCH_CHECK(err_ == cudaSuccess, "msa::" what " launch failed: ", cudaGetErrorString(err_)); \
  } while (0)

namespace msa::api {

// Calls f.template operator()<T, D>() for the element type of `dt` (bf16 or fp16) and head dim d (64 or
// 128); the callers have checked both.
template <typename F>
void dispatch_dtype_dim(at::ScalarType dt, int64_t d, F&& f) {
  if (dt == at::kBFloat16) {
    if (d == 64) f.template operator()<__nv_bfloat16, 64>(); else f.template operator()<__nv_bfloat16, 128>();
  } else {
    if (d == 64) f.template operator()<__half, 64>(); else f.template operator()<__half, 128>();
  }
}

}  // namespace msa::api
