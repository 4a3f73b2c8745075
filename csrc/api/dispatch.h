// Launch-error check and the one runtime -> template switch (dtype x head dim) of the CUDA entry points.
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime_api.h>

#include <cstdlib>
#include <cstring>

#include "api/stable.h"

// Fails with "msa::<what> launch failed: <cuda error>" unless expr returned cudaSuccess.
#define MSA_LAUNCH_CHECK(expr, what)                                                             \
  do {                                                                                           \
    const cudaError_t err_ = (expr);                                                             \
    MSA_CHECK(err_ == cudaSuccess, "msa::" what " launch failed: ", cudaGetErrorString(err_));   \
  } while (0)

namespace msa::api {

// Calls f.template operator()<T, D>() for the element type of `dt` (bf16 or fp16) and head dim d (64 or
// 128); the callers have checked both.
template <typename F>
void dispatch_dtype_dim(ScalarType dt, int64_t d, F&& f) {
  if (dt == kBFloat16) {
    if (d == 64) f.template operator()<__nv_bfloat16, 64>(); else f.template operator()<__nv_bfloat16, 128>();
  } else {
    if (d == 64) f.template operator()<__half, 64>(); else f.template operator()<__half, 128>();
  }
}

// The value of environment variable `name` when it is set to a positive integer, else `fallback`: the
// test and experiment knobs (MSA_PARTIAL_BUDGET, MSA_FWD_UNITS_PER_ITEM, MSA_BWD_UNITS_PER_ITEM,
// MSA_FWD_ROWS).
inline int64_t env_positive(const char* name, int64_t fallback) {
  const char* env = std::getenv(name);
  const long long v = env != nullptr ? std::atoll(env) : 0;
  return v > 0 ? int64_t(v) : fallback;
}

// Whether environment variable `name` is set to exactly `value` (the on/off knobs: MSA_PORTABLE_KERNELS=1,
// MSA_SMALL_SMEM=1,
// MSA_ITEM_ORDER=0, MSA_FWD_FIXED_GU=0).
inline bool env_is(const char* name, const char* value) {
  const char* env = std::getenv(name);
  return env != nullptr && std::strcmp(env, value) == 0;
}

// The Hopper kernels when this build has them (MSA_CUDA_ARCHS with 90a), the GPU is sm_90 and
// MSA_PORTABLE_KERNELS is not 1 (which keeps the portable kernels: tests compare the two).
inline bool use_sm90_kernels() {
#ifdef MSA_WITH_SM90
  if (env_is("MSA_PORTABLE_KERNELS", "1")) return false;
  int device = 0, major = 0, minor = 0;
  if (cudaGetDevice(&device) != cudaSuccess) return false;
  if (cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device) != cudaSuccess) return false;
  if (cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, device) != cudaSuccess) return false;
  return major == 9 && minor == 0;
#else
  return false;
#endif
}

}  // namespace msa::api
