#pragma once
#include <cstdio>
#include <cstdlib>
#include <cuda_runtime_api.h>

#include <atomic>

// Kernel-side launch check: the launch wrappers return the error, csrc/api turns it into a torch error.
#define MSA_CUDA_TRY(expr)                          \
  do {                                              \
    cudaError_t msa_err_ = (expr);                  \
    if (msa_err_ != cudaSuccess) return msa_err_;   \
  } while (0)

// The kernel's dynamic shared-memory limit (cudaFuncAttributeMaxDynamicSharedMemorySize) raised to `bytes` on the
// current device, the driver called only when more than the largest value set so far is asked (per kernel and
// device; the attribute lasts as long as the device's context): cudaFuncSetAttribute costs microseconds of host
// time on every launch otherwise (s31: the step's first launch, the index top-k, is on the bench's host lead).
template <auto kKernel>
inline cudaError_t ensure_dynamic_smem(int bytes) {
  constexpr int kDevices = 64;
  static std::atomic<int> set[kDevices] = {};
  int device = 0;
  cudaError_t err = cudaGetDevice(&device);
  if (err != cudaSuccess) return err;
  const bool cached = device >= 0 && device < kDevices;
  if (cached && set[device].load(std::memory_order_acquire) >= bytes) return cudaSuccess;
  err = cudaFuncSetAttribute(kKernel, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes);
  if (err == cudaSuccess && cached) {
    int cur = set[device].load(std::memory_order_relaxed);
    while (cur < bytes && !set[device].compare_exchange_weak(cur, bytes, std::memory_order_release)) {
    }
  }
  return err;
}
