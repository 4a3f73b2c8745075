// The KL's k_idx gradient (SPEC 4) for one query chunk, d_kl = 1 and unscaled:
//   dki[j] += sum over the entries (unit u) that selected j's block of dsi[u, j] * q_idx[u].
// One CTA per key (index group, kv block) owns the block's 128 x Di accumulator in registers (warp w:
// keys [16w, 16w + 16)) and streams the key's units in tiles of 16 (the MMA's k dimension), reading
// the dsi rows the output pass wrote. Several groups and chunks add into one fp32 buffer.
#include "common/block_span.h"
#include "common/mma_sm80.h"
#include "sm80/sparse_fwd/sparse_fwd.h"

namespace msa::sm80 {
namespace {

constexpr int kDkThreads = 256;
constexpr int kDkKeys = 128;
constexpr int kDkUnits = 16;

template <typename T>
__global__ void __launch_bounds__(kDkThreads) index_dk_kernel(IndexDkParams p) {
  using KTile = SwizzledTile<kDkKeys>;
  __shared__ __align__(128) T sDs[kDkUnits * kDkKeys];
  __shared__ __align__(128) T sQi[kDkUnits * 128];
  __shared__ int sTok[kDkUnits];
  const SparseWork& w = p.work;
  const int r = blockIdx.x % p.hi, gb = blockIdx.x / p.hi;  // block-major: hot keys first
  const int key = r * w.max_blocks + gb;
  const int u_begin = w.offsets[key], u_end = w.offsets[key + 1];
  if (u_begin == u_end) return;
  const BlockSpan span = block_span(w.block_offsets, p.cu_seqlens, p.num_seqs, gb, p.block_size);
  const int seq_start = span.seq_start, key0 = span.key0, blen = span.blen;
  const int di = p.di, di_chunks = di / 8;
  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
  const T* QI = static_cast<const T*>(p.q_idx);
  const T* DS = static_cast<const T*>(p.dsi_part);

  float acc[16][4];
#pragma unroll
  for (int n = 0; n < 16; ++n)
#pragma unroll
    for (int e = 0; e < 4; ++e) acc[n][e] = 0.f;

  for (int ub = u_begin; ub < u_end; ub += kDkUnits) {
    const int nu = min(kDkUnits, u_end - ub);
    __syncthreads();
    if (tid < kDkUnits) {
      int64_t el = -1;
      int t = -1;
      if (tid < nu) {
        const int e = w.entries[ub + tid];
        const int slot = e % p.topk;
        t = (e / p.topk) % p.total_tokens;
        el = (int64_t(r) * p.chunk_tokens + (t - p.chunk_begin)) * p.topk + slot;
      }
      sTok[tid] = t;
      // Row u of the dsi tile.
      for (int c = 0; c < kDkKeys / 8; ++c)
        cp_async_16(sDs + KTile::offset(tid, c), DS + (el >= 0 ? el : 0) * kDkKeys + c * 8, el >= 0);
    }
    __syncthreads();
    for (int i = tid; i < kDkUnits * di_chunks; i += kDkThreads) {
      const int u = i / di_chunks, c = i % di_chunks;
      const int t = sTok[u];
      cp_async_16(sQi + swizzled_offset(u, c, di), QI + int64_t(t >= 0 ? t : 0) * p.qi_stride_t +
                                                       int64_t(r) * p.qi_stride_h + c * 8, t >= 0);
    }
    cp_async_commit();
    cp_async_wait<0>();
    __syncthreads();
    if (warp * 16 < p.block_size) {
      uint32_t a[4];  // dsi^T: m = keys, k = units
      ldmatrix_x4_trans(a, sDs + KTile::offset((lane % 8) + (lane / 16) * 8, warp * 2 + (lane / 8) % 2));
#pragma unroll
      for (int dp = 0; dp < 8; ++dp) {
        if (dp * 16 < di) {
          uint32_t b[4];
          ldmatrix_x4_trans(b, sQi + swizzled_offset((lane % 8) + ((lane / 8) % 2) * 8, dp * 2 + lane / 16, di));
          MmaOp<T>::run(acc[2 * dp], a, b[0], b[1]);
          MmaOp<T>::run(acc[2 * dp + 1], a, b[2], b[3]);
        }
      }
    }
  }
  if (warp * 16 < p.block_size) {
    const int kih = r / (p.hi / p.hki);
    const int g = lane / 4, tq = lane % 4;
#pragma unroll
    for (int n = 0; n < 16; ++n) {
      if (n * 8 < di) {
        const int col = n * 8 + 2 * tq;
        for (int half = 0; half < 2; ++half) {
          const int kr = warp * 16 + g + 8 * half;
          if (kr < blen) {
            float* d = p.dki_accum + (int64_t(seq_start + key0 + kr) * p.hki + kih) * di + col;
            atomicAdd(d, acc[n][2 * half]);
            atomicAdd(d + 1, acc[n][2 * half + 1]);
          }
        }
      }
    }
  }
}

}  // namespace

cudaError_t launch_index_dk(const IndexDkParams& p, bool bf16, cudaStream_t stream) {
  const int64_t grid = int64_t(p.hi) * p.work.max_blocks;
  if (grid == 0) return cudaSuccess;
  if (bf16) index_dk_kernel<__nv_bfloat16><<<unsigned(grid), kDkThreads, 0, stream>>>(p);
  else index_dk_kernel<__half><<<unsigned(grid), kDkThreads, 0, stream>>>(p);
  return cudaGetLastError();
}

}  // namespace msa::sm80
