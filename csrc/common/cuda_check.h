#pragma once
#include <cstdio>
#include <cstdlib>
#include <cuda_runtime_api.h>

// Kernel-side launch check: the launch wrappers return the error, csrc/api turns it into a torch error.
#define MSA_CUDA_TRY(expr)                          \
  do {                                              \
    cudaError_t msa_err_ = (expr);                  \
    if (msa_err_ != cudaSuccess) return msa_err_;   \
  } while (0)
