#pragma once
#include <cuda_runtime_api.h>

#include "params.h"

namespace msa {

// Bytes of radix-sort workspace for `num_entries` (key, token) pairs.
size_t reverse_index_sort_bytes(int num_entries, int num_keys);
// block_offsets (num_seqs + 1) = prefix sums of ceil(len / block_size) over the sequences of cu_seqlens.
cudaError_t launch_block_offsets(const int32_t* cu_seqlens, int32_t* block_offsets, int num_seqs, int block_size,
                                 cudaStream_t stream);
// Builds the reverse index on `stream`; no host synchronisation.
cudaError_t run_reverse_index(const ReverseIndexParams& p, cudaStream_t stream);

}  // namespace msa
