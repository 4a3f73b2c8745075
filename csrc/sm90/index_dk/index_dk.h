// The KL's k_idx gradient of one query chunk on Hopper (index_dk.cu; sm_90a builds only, MSA_WITH_SM90).
#pragma once
#include <cuda_runtime_api.h>

#include "params.h"

namespace msa::sm90 {
cudaError_t launch_index_dk(const IndexDkParams& p, bool bf16, cudaStream_t stream);
}  // namespace msa::sm90
