// The portable index dk kernel (mma.sync): smxx/index_dk/index_dk_body.cuh over sm80/index_dk/mainloop.cuh.
#include "sm80/index_dk/mainloop.cuh"
#include "smxx/index_dk/index_dk.h"
#include "smxx/index_dk/index_dk_body.cuh"

namespace msa::smxx {
cudaError_t launch_index_dk(const IndexDkParams& p, bool bf16, cudaStream_t stream) {
  return launch_index_dk_with<sm80::DkMma>(p, bf16, stream);
}
}  // namespace msa::smxx
