// The FP8 selection's inputs (index_dtype, SPEC 2): e4m3 copies of q_idx / k_idx, each q_idx row scaled by its own
// power of two and each k_idx (sequence, head) by its own (msa.fp8_index_copies has the rule; PyTorch ops compute the
// same bytes elsewhere for finite inputs: msa/_ops.py fp8_copies_torch).
#pragma once
#include <cuda_runtime_api.h>

#include <cstdint>

namespace msa::smxx {

// One (T, H, D) tensor of 16-bit values (T = __nv_bfloat16 or __half), strides in elements, last dim contiguous,
// D in {64, 128}; out is contiguous (T, H, D) e4m3 bytes.
struct Fp8CopyArgs {
  const void* x;
  uint8_t* out;
  int64_t rows, stride_t, stride_h;
  int heads, dim;
};

// k's sequences: cu (S + 1 int32 offsets) where given, else consecutive runs of seq_len rows.
struct Fp8KeySeqs {
  const int32_t* cu;
  int64_t seq_len;
  int num_seqs;
};

// k_amax (S x Hki floats, zeroed by the caller) = max |k| per (sequence, head); then q rows scaled each by its own
// row's power of two, k rows by their (sequence, head)'s. Two launches.
template <typename T>
cudaError_t launch_fp8_index_copies(const Fp8CopyArgs& q, const Fp8CopyArgs& k, const Fp8KeySeqs& seqs,
                                    float* k_amax, cudaStream_t stream);

}  // namespace msa::smxx
