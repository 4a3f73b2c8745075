// The Hopper index dk kernel (wgmma, sm_90a builds only): smxx/index_dk/index_dk_body.cuh over
// sm90/index_dk/mainloop.cuh.
#include "sm90/index_dk/index_dk.h"
#include "sm90/index_dk/mainloop.cuh"
#include "smxx/index_dk/index_dk_body.cuh"

namespace msa::sm90 {
cudaError_t launch_index_dk(const IndexDkParams& p, bool bf16, cudaStream_t stream) {
  return smxx::launch_index_dk_with<DkMma>(p, bf16, stream);
}
}  // namespace msa::sm90
