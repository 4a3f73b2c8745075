// Host-side pieces of the dense KL pass that do not depend on the dtype: shared memory and the KL finish.
#include "sm90/dense_kl/dense_kl_kernel.cuh"

namespace msa::sm90 {
namespace {

__global__ void dense_kl_finish_kernel(const unsigned long long* kl_fixed, const unsigned int* kl_bad,
                                       const float* lse_idx, float* kl_rows, int64_t n) {
  const int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x;
  if (i >= n) return;
  const double sum = double(static_cast<long long>(kl_fixed[i])) * 0x1p-32;
  // In double: the two terms nearly cancel when the index scores are large.
  kl_rows[i] = kl_bad[i] ? __int_as_float(0x7fc00000) : float(sum * dense_kl::kLn2 + double(lse_idx[i]));
}

}  // namespace

int dense_kl_smem_bytes(int d, int di, int g) {
  // The smallest configuration (3 Q slots): the launch takes more slots where they fit.
  auto pick = [&](auto dd, auto dii) { return dense_kl::Smem<decltype(dd)::value, decltype(dii)::value>::bytes(g, 3); };
  using D64 = std::integral_constant<int, 64>;
  using D128 = std::integral_constant<int, 128>;
  const int b = d == 64 ? (di == 64 ? pick(D64{}, D64{}) : pick(D64{}, D128{}))
                        : (di == 64 ? pick(D128{}, D64{}) : pick(D128{}, D128{}));
  return b + 1024;  // the alignment of the tiles
}

cudaError_t launch_dense_kl_finish(const unsigned long long* kl_fixed, const unsigned int* kl_bad, const float* lse_idx,
                                   float* kl_rows, int64_t n, cudaStream_t stream) {
  if (n == 0) return cudaSuccess;
  dense_kl_finish_kernel<<<unsigned((n + 255) / 256), 256, 0, stream>>>(kl_fixed, kl_bad, lse_idx, kl_rows, n);
  return cudaGetLastError();
}

}  // namespace msa::sm90
