// The KL's k_idx gradient of one query chunk (index_dk.cu), any arch (mma.sync: sm80+).
#pragma once
#include <cuda_runtime_api.h>

#include "params.h"

namespace msa::smxx {
cudaError_t launch_index_dk(const IndexDkParams& p, bool bf16, cudaStream_t stream);
}  // namespace msa::smxx
