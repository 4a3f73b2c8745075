#include "smxx/fill/fill.h"

namespace msa::smxx {
namespace {

__global__ void iota_int32_kernel(int32_t* out, int64_t n, int32_t step) {
  const int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i < n) out[i] = int32_t(i) * step;
}

}  // namespace

cudaError_t launch_iota_int32(int32_t* out, int64_t n, int32_t step, cudaStream_t stream) {
  if (n == 0) return cudaSuccess;
  iota_int32_kernel<<<unsigned((n + 255) / 256), 256, 0, stream>>>(out, n, step);
  return cudaGetLastError();
}

}  // namespace msa::smxx
