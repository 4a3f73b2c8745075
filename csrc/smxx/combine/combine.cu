// The stats and KL combines of the sparse forward (see combine_out.cuh for the math).
#include "common/mma_sm80.h"
#include "smxx/combine/combine.h"

namespace msa::smxx {
using namespace sm80;  // common/mma_sm80.h: pack / ldmatrix / mma.sync helpers (sm80 and later)
namespace {

// A slot's (max, sum): sum 0 = no keys (never written, or nothing visible); a NaN sum (non-finite
// scores) counts, so the row's lse is NaN, as in the reference. The row's slots (count <= kMaxTopk) are
// loaded first, all in flight together, then reduced in slot order, then `extra` (the same form: the index
// top-k's (max, sum) of the row's other blocks where the stats pass scored only its own, else (0, 0)).
constexpr int kMaxTopk = 32;  // api/index_topk.cpp and sparse_fwd.cpp check topk <= 32
__device__ __forceinline__ float combine_lse(const float2* st, int64_t first, int64_t stride, int count,
                                             float2 extra = make_float2(0.f, 0.f)) {
  float2 x[kMaxTopk];
#pragma unroll
  for (int s = 0; s < kMaxTopk; ++s) x[s] = s < count ? st[first + s * stride] : make_float2(0.f, 0.f);
  float m = -__builtin_huge_valf();
#pragma unroll
  for (int s = 0; s < kMaxTopk; ++s)
    if (x[s].y != 0.f) m = fmaxf(m, x[s].x);
  if (extra.y != 0.f) m = fmaxf(m, extra.x);
  float l = 0.f;
#pragma unroll
  for (int s = 0; s < kMaxTopk; ++s)
    if (x[s].y != 0.f) l += x[s].y * exp2f(x[s].x - m);
  if (extra.y != 0.f) l += extra.y * exp2f(extra.x - m);
  return l == 0.f ? -__builtin_huge_valf() : (m + log2f(l)) * kLn2;
}

// One thread per (index group, token, head of the group) of the chunk, then per (index head, token).
__global__ void sparse_combine_stats_kernel(SparseCombineParams p) {
  const int G = p.hq / p.hi;
  const int64_t main_rows = int64_t(p.hq) * p.chunk_tokens;
  const int64_t rows = main_rows + (p.idx_stats ? int64_t(p.hi) * p.chunk_tokens : 0);
  const int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x;
  if (i >= rows) return;
  if (i < main_rows) {
    if (!p.main) return;
    // The group's heads fastest: a warp reads slot s of 32 / G tokens as whole (G x 8)-byte rows.
    const int hh = int(i % G);
    const int64_t q = i / G;
    const int r = int(q / p.chunk_tokens), tl = int(q % p.chunk_tokens);
    const int64_t e0 = (int64_t(r) * p.chunk_tokens + tl) * p.topk;
    p.lse[int64_t(r * G + hh) * p.total_tokens + p.chunk_begin + tl] = combine_lse(p.stats, e0 * G + hh, G, p.topk);
  } else {
    const int64_t k = i - main_rows;
    const int r = int(k / p.chunk_tokens), tl = int(k % p.chunk_tokens);
    const int64_t e0 = (int64_t(r) * p.chunk_tokens + tl) * p.topk;
    const int64_t row = int64_t(r) * p.total_tokens + p.chunk_begin + tl;
    p.lse_idx[row] = combine_lse(p.idx_stats, e0, 1, p.topk, p.sel_stats ? p.sel_stats[row] : make_float2(0.f, 0.f));
  }
}

// One thread per (index head, token) of the chunk.
__global__ void sparse_combine_kl_kernel(SparseCombineParams p) {
  const int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x;
  if (i >= int64_t(p.hi) * p.chunk_tokens) return;
  const int r = int(i / p.chunk_tokens), tl = int(i % p.chunk_tokens);
  const int64_t e0 = (int64_t(r) * p.chunk_tokens + tl) * p.topk;
  float acc = 0.f;
  bool any = false;
  for (int s = 0; s < p.topk; ++s) {
    // Without idx_stats (warmup given lse_idx: no stats pass) every slot counts; the empty ones hold 0.
    if (p.idx_stats == nullptr || p.idx_stats[e0 + s].y != 0.f) {  // NaN counts (combine_lse)
      acc += p.kl_part[e0 + s];
      any = true;
    }
  }
  const int64_t row = int64_t(r) * p.total_tokens + p.chunk_begin + tl;
  p.kl_rows[row] = any ? acc + p.lse_idx[row] : 0.f;
}

unsigned blocks_for(int64_t threads) { return unsigned((threads + 255) / 256); }

}  // namespace

cudaError_t launch_sparse_combine_stats(const SparseCombineParams& p, cudaStream_t stream) {
  const int64_t rows = int64_t(p.hq + (p.idx_stats ? p.hi : 0)) * p.chunk_tokens;
  if (rows == 0) return cudaSuccess;
  sparse_combine_stats_kernel<<<blocks_for(rows), 256, 0, stream>>>(p);
  return cudaGetLastError();
}

cudaError_t launch_sparse_combine_kl(const SparseCombineParams& p, cudaStream_t stream) {
  const int64_t rows = int64_t(p.hi) * p.chunk_tokens;
  if (rows == 0 || p.kl_part == nullptr) return cudaSuccess;
  sparse_combine_kl_kernel<<<blocks_for(rows), 256, 0, stream>>>(p);
  return cudaGetLastError();
}

}  // namespace msa::smxx
