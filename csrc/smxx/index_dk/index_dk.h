// The KL's k_idx gradient of one query chunk, any arch (mma.sync: sm80+; index_dk.cu). Hopper: sm90/index_dk.
#pragma once
#include <cuda_runtime_api.h>

#include "params.h"

namespace msa::smxx {
cudaError_t launch_index_dk(const IndexDkParams& p, bool bf16, cudaStream_t stream);
}  // namespace msa::smxx
