// Host side of the Hopper kernels' TMA copies: the descriptor of a (tokens, heads, width) tensor read in
// tiles of 64 columns x 1 head x R tokens, and that of the backward's fp32 dQ accumulator reduced into.
#pragma once
#include <cuda.h>  // CUtensorMap (types only: the encoder is reached through the runtime)
#include <cudaTypedefs.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <type_traits>

namespace msa {

// The driver's cuTensorMapEncodeTiled through the runtime (nullptr where the driver offers none).
inline PFN_cuTensorMapEncodeTiled_v12000 tensor_map_encoder() {
  static PFN_cuTensorMapEncodeTiled_v12000 encode = nullptr;
  if (encode == nullptr) {
    cudaDriverEntryPointQueryResult found{};
    void* fn = nullptr;
    const cudaError_t err = cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &fn, 12000, cudaEnableDefault,
                                                             &found);
    if (err != cudaSuccess || found != cudaDriverEntryPointSuccess || fn == nullptr) return nullptr;
    encode = reinterpret_cast<PFN_cuTensorMapEncodeTiled_v12000>(fn);
  }
  return encode;
}

// The encoding every map below shares: a 3-D tiled map of dims / strides (bytes, dims 1 and 2) / box over ptr,
// unit element strides, no interleave, zeros out of bounds; cudaErrorNotSupported where the driver offers no encoder
// or cannot describe the tensor (e.g. a stride that is not a multiple of 16 bytes): nothing has been launched then.
inline cudaError_t encode_map_3d(CUtensorMap* map, CUtensorMapDataType dtype, const void* ptr, const cuuint64_t (&dims)[3],
                                 const cuuint64_t (&strides)[2], const cuuint32_t (&box)[3], CUtensorMapSwizzle swizzle,
                                 CUtensorMapL2promotion promotion) {
  const PFN_cuTensorMapEncodeTiled_v12000 encode = tensor_map_encoder();
  if (encode == nullptr) return cudaErrorNotSupported;
  const cuuint32_t elem_strides[3] = {1, 1, 1};
  const CUresult r = encode(map, dtype, 3, const_cast<void*>(ptr), dims, strides, box, elem_strides,
                            CU_TENSOR_MAP_INTERLEAVE_NONE, swizzle, promotion, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  return r == CUDA_SUCCESS ? cudaSuccess : cudaErrorNotSupported;
}

// The map's data type of the 16-bit T (__half or __nv_bfloat16).
template <typename T>
constexpr CUtensorMapDataType tma_dtype_16() {
  return std::is_same_v<T, __half> ? CU_TENSOR_MAP_DATA_TYPE_FLOAT16 : CU_TENSOR_MAP_DATA_TYPE_BFLOAT16;
}

// The TMA descriptor of a (tokens, heads, w) tensor of 16-bit T at ptr (strides in elements): boxes of 64
// columns x box_heads heads x box_rows tokens, 128-byte swizzle (the KMajorSw128 panel layout), zeros out of bounds.
// cudaErrorNotSupported as encode_map_3d.
template <typename T>
cudaError_t make_rows_map(const void* ptr, int w, int heads, int tokens, int64_t stride_h, int64_t stride_t,
                          int box_rows, CUtensorMap* map, int box_heads = 1) {
  const cuuint64_t dims[3] = {cuuint64_t(w), cuuint64_t(heads), cuuint64_t(tokens)};
  const cuuint64_t strides[2] = {cuuint64_t(stride_h) * sizeof(T), cuuint64_t(stride_t) * sizeof(T)};
  const cuuint32_t box[3] = {64, cuuint32_t(box_heads), cuuint32_t(box_rows)};
  return encode_map_3d(map, tma_dtype_16<T>(), ptr, dims, strides, box, CU_TENSOR_MAP_SWIZZLE_128B,
                       CU_TENSOR_MAP_L2_PROMOTION_L2_256B);
}

// The descriptor of an fp32 (rows, w) matrix at ptr (w a multiple of 32, rows contiguous), seen as (rows, w / 32
// segments, 32 columns) so that one box, 32 columns x 2 segments x box_rows rows, covers 64 columns of box_rows
// consecutive rows while its shared-memory side keeps 128-byte lines (row r, segment s: line 2 r + s) under the
// 128-byte swizzle (16-byte chunk j of line L at j ^ (L % 8)): the backward's dQ reductions
// (sm90/sparse_bwd/mainloop.cuh). cudaErrorNotSupported as encode_map_3d.
inline cudaError_t make_f32_rows_reduce_map(float* ptr, int w, int64_t rows, int box_rows, CUtensorMap* map) {
  const cuuint64_t dims[3] = {32, cuuint64_t(w / 32), cuuint64_t(rows)};
  const cuuint64_t strides[2] = {32 * sizeof(float), cuuint64_t(w) * sizeof(float)};
  const cuuint32_t box[3] = {32, 2, cuuint32_t(box_rows)};
  return encode_map_3d(map, CU_TENSOR_MAP_DATA_TYPE_FLOAT32, ptr, dims, strides, box, CU_TENSOR_MAP_SWIZZLE_128B,
                       CU_TENSOR_MAP_L2_PROMOTION_NONE);
}

// The descriptor of a (rows, d) matrix of 16-bit T at ptr (rows contiguous, d = 64 or 128) written by TMA stores of
// box_rows whole rows: seen as (rows, 2 segments, d / 2 columns) under the swizzle of the segment's width (64 bytes
// at d = 64, 128 at d = 128), so the box's shared-memory side is the rows in order (d elements each) with the
// 16-byte chunks of each 128-byte line L at chunk ^ (L % 8) (d = 128) or ^ (L % 4) (d = 64): the output pass's O
// (sm90/sparse_fwd/out_pass_ws.cuh). cudaErrorNotSupported as encode_map_3d, and for another d or no rows.
template <typename T>
cudaError_t make_rows_store_map(void* ptr, int d, int64_t rows, int box_rows, CUtensorMap* map) {
  if ((d != 64 && d != 128) || rows < 1) return cudaErrorNotSupported;
  const cuuint64_t dims[3] = {cuuint64_t(d / 2), 2, cuuint64_t(rows)};
  const cuuint64_t strides[2] = {cuuint64_t(d / 2) * sizeof(T), cuuint64_t(d) * sizeof(T)};
  const cuuint32_t box[3] = {cuuint32_t(d / 2), 2, cuuint32_t(box_rows)};
  return encode_map_3d(map, tma_dtype_16<T>(), ptr, dims, strides, box,
                       d == 128 ? CU_TENSOR_MAP_SWIZZLE_128B : CU_TENSOR_MAP_SWIZZLE_64B, CU_TENSOR_MAP_L2_PROMOTION_NONE);
}

}  // namespace msa
