// Index top-k (SPEC 2), Hopper path (sm90a): the scores on warpgroup tensor cores (wgmma), the same
// causal max-pool and streaming exp-free top list as the portable kernel (sm80/index_topk).
//
// A CTA owns 64 * WG query rows (WG = 4 warpgroups, or 2 where the 4-warpgroup grid would not fill the GPU
// once: the CTAs then hold half the rows and the longest one, which sets the kernel's time at short N, half the
// work): TM = 64 WG / Hr tokens x the Hr = Hi / Hki index heads of one index key head, a warpgroup per 64 rows. Each warpgroup keeps its rows' Q in registers (the A operand of an
// RS wgmma, loaded once) and multiplies it by 128-key sub-tiles of K (one block of 128 or two of 64)
// that one thread streams into shared memory with TMA (4 stages: a "full" mbarrier per stage completes
// with the TMA bytes, an "empty" one when all the CTA's warps are done reading it, so the thread refills it)
// in the 128-byte-swizzled K-major layout wgmma reads. Per sub-tile a warpgroup issues D / 16 wgmma m64n128k16 and
// waits (the plain top-k's: twice D / 16 m64n64k16, one 64-key half after the other, each waited for). No CTA
// barrier in the loop: the warpgroups drift apart, and one group's row-max epilogue overlaps the others' MMAs
// (benchmarks/NOTES.md s13 has the versions and their timings).
// As in the portable kernel, every block before a row's own block is fully visible and the own block
// is forced in, so no causal mask is needed: the CTA scores blocks [0, block of its last token) and a
// row ignores the blocks at or past its own.
// A negative index scale is folded into Q (sign flip, exact): the block score is then |scale| times
// the max of the flipped dot products, with no per-element select.
//
// kLse = true is the index branch's logsumexp (warmup, SPEC 5: lse_idx, natural log of the scaled logits over
// every causally visible key) on the same tiles, K ring and GEMMs: no top list; each thread keeps a running max
// and sum of 2^x per row over its 32 columns of the sub-tile (one exponential per score: MUFU and the tensor
// pipe are about equally loaded at Di = 128), the sub-tiles run through the last token's own key, those that
// reach past the first token's position are masked per row, and the four lanes of a row merge at the end.
//
// kSel = true (the sparse path's top-k in msa_fwd): the top list also carries, per kept block, the sum of 2^x
// over the block's keys relative to its max (x = the logit in the log2 domain), computed when a warp has a
// row that takes the block (every key of a kept block is visible: no mask); the write-out adds each row's
// kept blocks' (max, sum) to p.sel_stats. The sparse forward's stats pass then scores the index branch on
// the rows' own blocks only (SparseFwdParams::idx_own_only). The sums cost an exponential per score of every
// block a warp's row takes, almost every block scored: msa_fwd takes this mode for short sequences only
// (api/sparse_fwd.cpp, sel_stats_applies).
//
// kFp8 = true (the top-k only: select_blocks on FP8 inputs, SPEC 2 with index_dtype): q_idx and k_idx hold e4m3
// bytes. Everything but the MMA moves them as 16-bit elements (T = bf16 storage, D = Di / 2: the gather, the TMA
// boxes, the swizzled tiles and ldmatrix see the same bytes), and each k-step of D / 16 is one m64n128k32 e4m3
// wgmma (twice the bf16 rate) over those 32 bytes, into f16 accumulators (32 registers, not 64; the row max on
// paired f16 maxima, half the instructions). The copies keep |value| <= 16 (smxx/fp8_copies), so no sum of Di <= 128
// products passes 32768, within f16's 65504. With two accumulator sets the sub-tiles go in pairs, both MMAs issued
// before the epilogues, the pair's second sub-tile offered one pair late (benchmarks/NOTES.md s66, s69, s70). A
// negative scale flips the sign bit of every byte.
#pragma once
#include <cuda.h>  // CUtensorMap (types only: the encoder is reached through the runtime)
#include <cudaTypedefs.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdlib>

#include "common/mma_sm80.h"
#include "common/index_topk_tile.cuh"
#include "common/tma_map.h"
#include "common/top_list.cuh"
#include "common/wgmma_sm90.h"
#include "params.h"

#include <type_traits>

namespace msa::sm90 {

template <int WG, bool kSum = false>
struct IndexTopkShape {
  static constexpr int kWarpgroups = WG;
  static constexpr int kThreads = kWarpgroups * 128;
  static constexpr int kRows = kWarpgroups * 64;
  static constexpr int kKeys = 128;  // keys per sub-tile: one block of 128 or two of 64
  static constexpr int kStages = 4;  // K sub-tiles in flight
  static constexpr int kSlots = SmemTopHeap::kSlots;
  template <int D, typename T>
  static constexpr int k_bytes() { return kStages * kKeys * D * int(sizeof(T)); }
  // Q is staged once (then kept in registers) in the space the top lists use afterwards.
  template <int D, typename T>
  static constexpr int q_bytes() { return kRows * D * int(sizeof(T)); }
  static constexpr int list_bytes() { return kRows * kSlots * (kSum ? 12 : 8); }  // score, block (, sum)
  template <int D, typename T>
  static constexpr int q_or_list_bytes() { return q_bytes<D, T>() > list_bytes() ? q_bytes<D, T>() : list_bytes(); }
  // + 1 KB: the K stages must start 1024-byte aligned (the swizzle is on address bits); then two
  // mbarriers (full, empty) per stage.
  template <int D, typename T>
  static constexpr int smem_bytes() { return 1024 + k_bytes<D, T>() + q_or_list_bytes<D, T>() + 2 * kStages * 8; }
};

// kLse, one 128-key sub-tile: the thread's columns col0 + 8 j + e (j < 16, e < 2) of rows g (r = 0: c[4 j + e])
// and g + 8 (r = 1: c[4 j + 2 + e]) fold into its running (max, sum) of 2^x per row, x = c * sl2 (sl2 > 0: the
// max is taken on c, then scaled). kMasked: columns past the row's position pos_r[r] are out (the sub-tiles
// that reach past the CTA's first token). An all-out row keeps max -inf and sum 0 (the exponent base is 0
// then, so no -inf - -inf).
template <bool kMasked>
__device__ __forceinline__ void lse_tile_update(const float (&c)[64], float (&run_m)[2], float (&run_l)[2],
                                                float sl2, int col0, const int (&pos_r)[2]) {
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int lim = kMasked ? pos_r[r] - col0 : 1 << 30;  // column offset 8 j + e visible iff <= lim
    float t[16];
#pragma unroll
    for (int j = 0; j < 16; ++j) {
      const float v0 = 8 * j <= lim ? c[4 * j + 2 * r] : kNegInf;
      const float v1 = 8 * j + 1 <= lim ? c[4 * j + 2 * r + 1] : kNegInf;
      t[j] = fmaxf(v0, v1);
    }
#pragma unroll
    for (int j = 0; j < 8; ++j) t[j] = fmaxf(t[j], t[j + 8]);
#pragma unroll
    for (int j = 0; j < 4; ++j) t[j] = fmaxf(t[j], t[j + 4]);
    const float m_new = fmaxf(run_m[r], fmaxf(fmaxf(t[0], t[2]), fmaxf(t[1], t[3])) * sl2);
    const float base = m_new == kNegInf ? 0.f : m_new;
    float sum[4] = {0.f, 0.f, 0.f, 0.f};  // four chains
#pragma unroll
    for (int j = 0; j < 16; ++j) {
      const float e0 = 8 * j <= lim ? sm80::fast_exp2(fmaf(c[4 * j + 2 * r], sl2, -base)) : 0.f;
      const float e1 = 8 * j + 1 <= lim ? sm80::fast_exp2(fmaf(c[4 * j + 2 * r + 1], sl2, -base)) : 0.f;
      sum[j % 4] += e0 + e1;
    }
    run_l[r] = fmaf(run_l[r], sm80::fast_exp2(run_m[r] - base), (sum[0] + sum[1]) + (sum[2] + sum[3]));
    run_m[r] = m_new;
  }
}

// kLse, after the loop: the four lanes of a row (a quad) merge their (max, sum); lane tq = 0 writes the row's
// natural-log lse = ln 2 (max + log2 sum) to p.lse (Hi, T) for the tile's valid rows (row0 = the warp's row g).
__device__ __forceinline__ void lse_write_rows(const IndexTopkParams& p, const IndexTopkTile& tl, float (&run_m)[2],
                                               float (&run_l)[2], int row0, int lane) {
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    float m = run_m[r];
#pragma unroll
    for (int off = 1; off <= 2; off <<= 1) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, off));
    const float base = m == kNegInf ? 0.f : m;
    float l = run_l[r] * sm80::fast_exp2(run_m[r] - base);
#pragma unroll
    for (int off = 1; off <= 2; off <<= 1) l += __shfl_xor_sync(0xffffffffu, l, off);
    const int row = row0 + 8 * r, tok = tl.tok0 + row / tl.hr;
    if (lane % 4 == 0 && row < tl.rows_used && tok < tl.n) {
      p.lse[int64_t(tl.kh * tl.hr + row % tl.hr) * p.total_tokens + tl.seq_start + tok] =
          (m + sm80::fast_log2(l)) * sm80::kLn2;
    }
  }
}

// kSel, one block of the sub-tile (the thread's 8-column slices J0 .. J0 + NJ - 1): the sum of 2^((x - mx) sl2)
// over the block's keys for rows g (l[0]) and g + 8 (l[1]), mx the row's block max (raw; every lane of the quad
// holds it), then summed over the quad's four lanes.
template <int J0, int NJ>
__device__ __forceinline__ void block_sums(const float (&c)[64], const float (&mx)[2], float sl2, float (&l)[2]) {
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const float base = mx[r] * sl2;
    float sum[4] = {0.f, 0.f, 0.f, 0.f};  // four chains
#pragma unroll
    for (int j = J0; j < J0 + NJ; ++j) {
      sum[j % 4] += sm80::fast_exp2(fmaf(c[4 * j + 2 * r], sl2, -base)) +
                    sm80::fast_exp2(fmaf(c[4 * j + 2 * r + 1], sl2, -base));
    }
    l[r] = (sum[0] + sum[1]) + (sum[2] + sum[3]);
#pragma unroll
    for (int off = 1; off <= 2; off <<= 1) l[r] += __shfl_xor_sync(0xffffffffu, l[r], off);
  }
}

// The row maxima of 64 keys, the 8-column slices J0 .. J0 + 7 of an fp32 accumulator (m[0] for row g, m[1] for row
// g + 8): a pairwise tree over the 16 values of each row (short dependency chains).
template <int J0, int N>
__device__ __forceinline__ void row_max_64(const float (&c)[N], float (&m)[2]) {
  static_assert(4 * (J0 + 8) <= N, "row_max_64: slices within the accumulator");
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    float t[8];
#pragma unroll
    for (int j = 0; j < 8; ++j) t[j] = fmaxf(c[4 * (J0 + j) + 2 * r], c[4 * (J0 + j) + 2 * r + 1]);
#pragma unroll
    for (int w = 4; w >= 1; w /= 2)
#pragma unroll
      for (int j = 0; j < w; ++j) t[j] = fmaxf(t[j], t[j + w]);
    m[r] = t[0];
  }
}

// A sub-tile's row maxima per 64-key half (m[h], rows g and g + 8: two floats, or one half2 for kFp8): one 128-key
// block (nb == 1) takes both halves.
__device__ __forceinline__ void max_into(float (&a)[2], const float (&b)[2]) {
  a[0] = fmaxf(a[0], b[0]);
  a[1] = fmaxf(a[1], b[1]);
}
__device__ __forceinline__ void max_into(__half2& a, __half2 b) { a = __hmax2(a, b); }
template <typename P>
__device__ __forceinline__ void merge_halves(P (&m)[2], int nb) {
  if (nb == 1) max_into(m[0], m[1]);
}

// One block's maxima (mh: this thread's of rows g, g + 8) over the quad's four lanes, in place; returns the score of
// the row this lane keeps (tq & 1), times |scale|.
__device__ __forceinline__ float quad_block_score(float (&mh)[2], float abs_scale, int tq) {
#pragma unroll
  for (int off = 1; off <= 2; off <<= 1) {
    mh[0] = fmaxf(mh[0], __shfl_xor_sync(0xffffffffu, mh[0], off));
    mh[1] = fmaxf(mh[1], __shfl_xor_sync(0xffffffffu, mh[1], off));
  }
  return abs_scale * ((tq & 1) ? mh[1] : mh[0]);
}

// kFp8, one 128-key sub-tile's f16 scores (register i = columns 2 i, 2 i + 1 of the fp32 layout's c[4 j + 2 r + e]):
// the row max of each 64-key half, m[h] = (row g's, row g + 8's) (8 pairs each: 7 paired maxima, then the pair's two
// halves, both rows in one).
__device__ __forceinline__ void row_max_f16(const uint32_t (&c16)[32], __half2 (&m)[2]) {
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    __half2 t[2][8];
#pragma unroll
    for (int r = 0; r < 2; ++r) {
#pragma unroll
      for (int j = 0; j < 8; ++j) t[r][j] = *reinterpret_cast<const __half2*>(&c16[2 * (8 * h + j) + r]);
#pragma unroll
      for (int w = 4; w >= 1; w /= 2)
#pragma unroll
        for (int j = 0; j < w; ++j) t[r][j] = __hmax2(t[r][j], t[r][j + w]);
    }
    m[h] = __hmax2(__lows2half2(t[0][0], t[1][0]), __highs2half2(t[0][0], t[1][0]));
  }
}

// A kBits-wide IEEE value's bits (f16: 16, fp32: 32) as an order-preserving unsigned value: negatives' bits flipped,
// positives' sign bit set, -0 as +0 (their tie). -max .. +inf map to kLo .. kHi; -inf to kLo - 1, NaNs outside.
template <int kBits>
struct OrderedBits {
  static constexpr uint32_t kSign = 1u << (kBits - 1), kMask = kSign | (kSign - 1u);
  static constexpr uint32_t kInf = kBits == 16 ? 0x7c00u : 0x7f800000u;
  static constexpr uint32_t kLo = kSign - kInf, kHi = kSign | kInf;  // f16: 0x0400, 0xfc00; fp32: 0x00800000, 0xff800000
  __device__ __forceinline__ static uint32_t map(uint32_t u) {
    if (u == kSign) u = 0u;
    return (u & kSign) ? (~u & kMask) : (u | kSign);
  }
  // Whether a mapped value may enter a list: not -inf, not NaN (as TopHeap's s > thr).
  __device__ __forceinline__ static bool taken(uint32_t u) { return u - kLo <= kHi - kLo; }
};

// kFp8: block b's key for RegKeyList<uint32_t> from its maxima m (rows g, g + 8; this thread's, reduced over the quad
// here), for the row this lane keeps (tq & 1); 0 (never taken) where the float form's score would not be taken either
// (-inf, NaN). The key orders as abs_scale times the f16 maximum does in fp32 (TopHeap's order): f16's bits mapped
// to an order-preserving 16 bits (-0 as +0: fp32's tie), and with scale 0 every finite maximum the same (a tie).
// Exact for abs_scale 0 or in [2^-125, 2^112], where fp32's products of distinct f16 values stay distinct (checked
// over every f16 value, s69): the caller takes the shared heaps outside it (products there tie or overflow).
__device__ __forceinline__ uint32_t fp8_block_key(__half2 m, int tq, int b, bool zero_scale) {
  using O = OrderedBits<16>;
#pragma unroll
  for (int off = 1; off <= 2; off <<= 1) m = __hmax2(m, __shfl_xor_sync(0xffffffffu, m, off));
  uint32_t u = O::map(__half_as_ushort((tq & 1) ? __high2half(m) : __low2half(m)));
  if (zero_scale) u = u - O::kLo < O::kHi - O::kLo ? O::kSign : 0u;  // finite: 0 * max, a tie (+0); inf, NaN: NaN
  return O::taken(u) ? RegKeyList<uint32_t>::block_key(u, b) : 0u;
}

// The 16-bit top-k: block b's key for RegKeyList<uint64_t> from its fp32 score s (quad_block_score's); 0 (never taken)
// for -inf and NaN, as TopHeap's s > thr.
__device__ __forceinline__ uint64_t f32_block_key(float s, int b) {
  using O = OrderedBits<32>;
  const uint32_t u = O::map(__float_as_uint(s));
  return O::taken(u) ? RegKeyList<uint64_t>::block_key(u, b) : 0ull;
}

template <typename T, int D, int WG, bool kLse, bool kSel = false, bool kFp8 = false>
__global__ void __launch_bounds__(IndexTopkShape<WG>::kThreads, 1)
    index_topk_sm90_kernel(const IndexTopkParams p, const __grid_constant__ CUtensorMap k_map) {
  static_assert(!(kLse && kSel), "kSel is a top-k mode");
  static_assert(!kFp8 || (std::is_same_v<T, __nv_bfloat16> && !kLse && !kSel), "kFp8: the plain top-k on bf16 storage");
  using S = IndexTopkShape<WG, kSel>;
  using KTile = KMajorSw128<S::kKeys, D>;
  using QTile = sm80::SwizzledTile<D>;
  extern __shared__ unsigned char smem_raw[];
  unsigned char* smem = smem_raw + ((1024 - (sm80::smem_addr(smem_raw) & 1023)) & 1023);
  T* sK = reinterpret_cast<T*>(smem);
  T* sQ = reinterpret_cast<T*>(smem + S::template k_bytes<D, T>());
  float* sScore = reinterpret_cast<float*>(smem + S::template k_bytes<D, T>());  // after Q is in registers
  int* sBlock = reinterpret_cast<int*>(sScore + S::kRows * S::kSlots);
  float* sSum = kSel ? reinterpret_cast<float*>(sBlock + S::kRows * S::kSlots) : nullptr;
  uint64_t* full = reinterpret_cast<uint64_t*>(smem + S::template k_bytes<D, T>() + S::template q_or_list_bytes<D, T>());
  uint64_t* empty = full + S::kStages;

  const IndexTopkTile tl = IndexTopkTile::make(p, S::kRows);
  if (tl.empty()) return;
  // Positions of the tile's first and last tokens (blocks count keys: IndexTopkTile).
  const int hr = tl.hr, kh = tl.kh, k_start = tl.k_start, pos0 = tl.tok0 + tl.shift, last_pos = tl.last_tok + tl.shift;
  const int nb = kLse ? 1 : S::kKeys / p.block_size;  // blocks per sub-tile
  const int blocks = last_pos / p.block_size;  // the blocks before the last token's
  // Sub-tiles: the top list's blocks, or (kLse) every key through the last token's position.
  const int total = kLse ? last_pos / S::kKeys + 1 : (blocks + nb - 1) / nb;

  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;

  gather_index_q<T, D>(sQ, p, tl, S::kRows, tid, S::kThreads);
  sm80::cp_async_commit();
  // Sub-tile it (keys it * 128 ...) into stage `stage`: D / 64 boxes of 64 Di x 128 keys, one per
  // 128-byte panel. Keys past the tensor read as zeros; keys of a following sequence belong to blocks
  // no row of this CTA offers.
  auto load_k = [&](int it, int stage) {
    mbar_arrive_expect_tx(full + stage, S::kKeys * D * int(sizeof(T)));
#pragma unroll
    for (int panel = 0; panel < D / 64; ++panel) {
      tma_load_3d(sK + stage * S::kKeys * D + panel * S::kKeys * 64, &k_map, panel * 64, kh,
                  k_start + it * S::kKeys, full + stage);
    }
  };
  if (tid == 0) {
    for (int st = 0; st < S::kStages; ++st) {
      mbar_init(full + st, 1);
      mbar_init(empty + st, S::kThreads / 32);
    }
    mbar_fence_init();
  }
  __syncthreads();
  if (tid == 0) {
    for (int st = 0; st < S::kStages - 1 && st < total; ++st) load_k(st, st);
  }
  sm80::cp_async_wait<0>();  // Q
  __syncthreads();

  // This warp's 16 rows of Q, all of Di, in registers for the whole loop (the wgmma A operand).
  const uint32_t flip = p.scale < 0.f ? (kFp8 ? 0x80808080u : 0x80008000u) : 0u;  // negate every element
  uint32_t a[D / 16][4];
#pragma unroll
  for (int ks = 0; ks < D / 16; ++ks) {
    sm80::ldmatrix_x4(a[ks], sQ + QTile::offset(warp * 16 + (lane % 16), ks * 2 + lane / 16));
#pragma unroll
    for (int e = 0; e < 4; ++e) a[ks][e] ^= flip;
  }
  const float abs_scale = fabsf(p.scale);
  __syncthreads();  // Q is in registers: its space now holds the top lists
  if (!kLse && tid < S::kRows) TopHeap<kSel>(sScore, sBlock, tid, p.topk, sSum).init();
  __syncthreads();  // a list is initialised by thread `row` and used by the row's owner lane

  // Lanes t = 0 and 1 of each quad keep the lists of rows g and g + 8 of the warp's 16 (SPEC 2 order).
  const int g = lane / 4, tq = lane % 4;
  const bool owner = tq < 2;
  const int my_row = warp * 16 + g + 8 * (tq & 1);
  const int my_local = (pos0 + my_row / hr) / p.block_size;
  TopHeap<kSel> heap(sScore, sBlock, my_row, p.topk, sSum);
  float thr = p.topk > 1 ? kNegInf : kPosInf;
  // kLse: rows g and g + 8 (r = 0, 1): running max and sum of 2^x over this thread's columns, x = the score
  // times |scale| log2(e); pos_r the row's position (keys at or before it are visible).
  const float sl2 = abs_scale * sm80::kLog2e;
  float run_m[2] = {kNegInf, kNegInf}, run_l[2] = {0.f, 0.f};
  const int pos_r[2] = {pos0 + (warp * 16 + g) / hr, pos0 + (warp * 16 + g + 8) / hr};

  // The plain top-k's lists in registers where they fit (RegKeyList: topk <= 17, CTA-uniform), else the shared heaps
  // (kSel's carry the blocks' sums: always the heaps). FP8: 32-bit keys (blocks < 65536 and fp8_block_key's scales as
  // well); 16-bit: 64-bit ones. s68, H100, probe_fp8_index, RegTopList (the float form before the keys) against the
  // heaps: FP8 -14% / -18% at 128K / 32K; 16-bit -17% at 8K (2 warpgroups), -4% at 32K.
  using Key = std::conditional_t<kFp8, uint32_t, uint64_t>;
  const bool zero_scale = abs_scale == 0.f;
  const bool keys = !kLse && !kSel && p.topk - 1 <= 2 * RegKeyList<Key>::kPerLane &&
                    (!kFp8 || (blocks <= 65536 && (zero_scale || (abs_scale >= 0x1p-125f && abs_scale <= 0x1p112f))));
  const int half = tq >> 1;
  RegKeyList<Key> kl;
  Key thr_key = RegKeyList<Key>::kPad;
  if (keys) {
    kl.init(p.topk - 1, half);
    thr_key = kl.exchange();
  }
  // Offers block b (ascending), its key, to this thread's row's register list. Warp-uniform (a shuffle): both of a
  // row's lanes decide alike (same key, position and threshold).
  auto offer_key = [&](Key key, int b) {
    const bool take = b < my_local && key > thr_key;
    if (__any_sync(0xffffffffu, take)) {
      if (take && kl.hold) kl.replace(key);
      thr_key = kl.exchange();
    }
  };
  // The same, score s, to the row's shared heap (its owner lane).
  auto offer_block = [&](float s, int b) {
    if (owner && b < my_local && s > thr) thr = heap.replace_root(s, b);
  };

  auto release = [&](int it) {
    if (lane == 0) mbar_arrive(empty + it % S::kStages);  // this warp is done reading the stage
  };

  if constexpr (kFp8) {
    // The scores in f16 (the copies' scales keep every partial sum within f16's range: fp8_copies, |value| <= 16
    // each, so |sum| <= Di 256), two accumulator sets: sub-tiles in pairs, both MMAs issued, then the epilogues under
    // them: the last pair's second sub-tile's offer (one pair late: its per-thread maxima were taken before the
    // back-edge), then, after the first MMA's wait, the first sub-tile's. At the top of a pair nothing is in flight
    // (ptxas serialises every wgmma of the kernel when one is in flight across a loop back-edge or an mbarrier wait
    // loop, C7514, s63): thread 0 first refills the stages of the last pair with it + 2, it + 3. A warp releases a
    // stage as soon as the MMA that read it completed (the late offer reads registers only), so that refill never
    // waits for an offer. Blocks still reach each row in ascending order (the late one first), as the lists need.
    static_assert(S::kStages == 4, "two pairs of sub-tiles in the ring: this one and the next");
    uint32_t c0[S::kKeys / 4], c1[S::kKeys / 4];
#pragma unroll
    for (int e = 0; e < S::kKeys / 4; ++e) c0[e] = c1[e] = 0u;
    auto mma = [&](uint32_t (&acc)[S::kKeys / 4], int it) {
      const uint32_t k_addr = sm80::smem_addr(sK + (it % S::kStages) * S::kKeys * D);
      fence_regs(acc);
      wgmma_fence();
#pragma unroll
      for (int ks = 0; ks < D / 16; ++ks) WgmmaRSE4m3N128F16::run(acc, a[ks], KTile::desc(k_addr, ks), ks > 0);
      wgmma_commit();
      fence_regs(acc);
    };
    // A sub-tile's maxima per block (rows g, g + 8; this thread's columns).
    auto maxima = [&](const uint32_t (&acc)[S::kKeys / 4], __half2 (&m)[2]) {
      row_max_f16(acc, m);
      merge_halves(m, nb);
    };
    // Their offer to the rows' lists (reduced over the quad).
    auto offer = [&](const __half2 (&m)[2], int it) {
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        if (h < nb) {  // warp-uniform
          const int b = it * nb + h;
          if (keys) {  // warp-uniform (CTA-uniform)
            offer_key(fp8_block_key(m[h], tq, b, zero_scale), b);
          } else {
            float mh[2] = {__low2float(m[h]), __high2float(m[h])};
            offer_block(quad_block_score(mh, abs_scale, tq), b);
          }
        }
      }
    };
    bool late = false;  // m1 holds the last pair's second sub-tile's maxima, not yet offered (CTA-uniform)
    __half2 m1[2];
    for (int it = 0; it < total; it += 2) {
      if (tid == 0) {
#pragma unroll
        for (int nx = it + 2; nx <= it + 3; ++nx) {
          if (nx >= S::kStages - 1 && nx < total) {  // the prologue loaded 0 .. kStages - 2
            if (nx >= S::kStages) mbar_wait(empty + nx % S::kStages, ((nx - S::kStages) / S::kStages) & 1);
            load_k(nx, nx % S::kStages);
          }
        }
      }
      const bool two = it + 1 < total;  // warp-uniform
      mbar_wait(full + it % S::kStages, (it / S::kStages) & 1);
      if (two) mbar_wait(full + (it + 1) % S::kStages, ((it + 1) / S::kStages) & 1);
      mma(c0, it);
      if (two) {  // each branch its own wait (ptxas does not correlate two tests of `two`: C7514)
        mma(c1, it + 1);
        if (late) offer(m1, it - 1);
        wgmma_wait<1>();
      } else {
        if (late) offer(m1, it - 1);
        wgmma_wait<0>();
      }
      fence_regs(c0);
      release(it);
      __half2 m0[2];
      maxima(c0, m0);
      offer(m0, it);
      wgmma_wait<0>();  // on every path (ptxas does not correlate the two tests of `two`: C7517 at the back-edge)
      if (two) {
        fence_regs(c1);
        release(it + 1);
        maxima(c1, m1);  // here: ptxas waits on any GMMA-defined register read across the back-edge (C7517)
      }
      late = two;
    }
    if (late) offer(m1, total - 1);
    if (keys) kl.store(heap, half);  // the rows' TopHeap slots, each initialised by its own thread before the loop
    __syncthreads();
    write_index_row<false>(p, tl, sScore, sBlock, tid, nullptr);
  } else {
    // kHalves (the plain top-k at 4 warpgroups): a sub-tile as two m64n64 wgmmas into one 32-register set, each
    // half's row maxima taken before the next half's MMA; the 32 registers this frees keep the register lists
    // unspilled (the fused m64n128 form: 128 registers, 96 bytes spilled). At 2 warpgroups (153 registers with s71's
    // late offer) the fused form keeps one wait per sub-tile.
    constexpr bool kPlain = !kLse && !kSel;
    constexpr bool kHalves = kPlain && WG == 4;
    constexpr int kAcc = kHalves ? S::kKeys / 4 : S::kKeys / 2;
    float c[kAcc];
#pragma unroll
    for (int e = 0; e < kAcc; ++e) c[e] = 0.f;
    // The row max of each 64-key half: m[h][0] for row g, m[h][1] for row g + 8. The plain top-k offers a sub-tile's
    // under the next one's MMA, before that sub-tile's maxima overwrite them (`late`: m holds maxima not yet offered,
    // CTA-uniform).
    float m[2][2];
    bool late = false;
    auto offer_late = [&](int it) {  // sub-tile it's blocks, ascending, as the lists need
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        if (h < nb) {  // warp-uniform
          const float s = quad_block_score(m[h], abs_scale, tq);
          const int b = it * nb + h;
          if (keys) {  // warp-uniform (CTA-uniform)
            offer_key(f32_block_key(s, b), b);
          } else {
            offer_block(s, b);
          }
        }
      }
    };
    // D / 16 RS wgmmas of the warp's Q rows by the keys at addr into c (m64 x 2 kAcc, fp32); then, while they run, the
    // previous sub-tile's offers (`late`, the plain top-k: registers and shuffles only), then the wait.
    auto mma_wait = [&](uint32_t addr, int it, bool offer_under) {
      wgmma_fence();
#pragma unroll
      for (int ks = 0; ks < D / 16; ++ks) WgmmaRS<T, 2 * kAcc>::run(c, a[ks], KTile::desc(addr, ks), ks > 0);
      wgmma_commit();
      if constexpr (kPlain) {
        fence_regs(c);
        if (offer_under && late) offer_late(it - 1);
      }
      wgmma_wait<0>();
      fence_regs(c);  // no use of the scores moves above the wait
    };
    for (int it = 0; it < total; ++it) {
      // Thread 0 refills the stage of sub-tile it - 1 with it + kStages - 1 once every warp has released
      // it - 1 (use (it - 1) / kStages of that stage's empty barrier); then every warp waits for
      // sub-tile it (use it / kStages of its stage's full barrier).
      if (tid == 0 && it + S::kStages - 1 < total) {
        const int next = it + S::kStages - 1, stage = next % S::kStages;
        if (it >= 1) mbar_wait(empty + stage, ((it - 1) / S::kStages) & 1);
        load_k(next, stage);
      }
      mbar_wait(full + it % S::kStages, (it / S::kStages) & 1);
      const uint32_t k_addr = sm80::smem_addr(sK + (it % S::kStages) * S::kKeys * D);
      if constexpr (kHalves) {
#pragma unroll
        for (int h = 0; h < 2; ++h) {  // keys 64 h .. 64 h + 63: rows of the stage's panels, 1024-byte atoms kept
          mma_wait(k_addr + uint32_t(h * (S::kKeys / 2) * 64 * int(sizeof(T))), it, h == 0);
          row_max_64<0>(c, m[h]);
        }
      } else {
        mma_wait(k_addr, it, true);
      }
      release(it);
      if constexpr (kLse) {
        if ((it + 1) * S::kKeys - 1 <= pos0) {  // every row sees every key of the sub-tile
          lse_tile_update<false>(c, run_m, run_l, sl2, it * S::kKeys + 2 * tq, pos_r);
        } else {
          lse_tile_update<true>(c, run_m, run_l, sl2, it * S::kKeys + 2 * tq, pos_r);
        }
      } else {
        if constexpr (!kHalves) {  // 8-column slices 8h .. 8h + 7
          row_max_64<0>(c, m[0]);
          row_max_64<8>(c, m[1]);
        }
        merge_halves(m, nb);
        if constexpr (kPlain) {
          late = true;  // offered under the next sub-tile's MMA (the last one after the loop)
        } else {  // kSel: the offer reads the sums from c now
#pragma unroll
          for (int h = 0; h < 2; ++h) {
            if (h < nb) {  // warp-uniform
              const float s = quad_block_score(m[h], abs_scale, tq);
              const int b = it * nb + h;  // blocks are offered in ascending order
              const bool take = owner && b < my_local && s > thr;
              if (__any_sync(0xffffffffu, take)) {  // warp-uniform: the quad's lanes sum together
                float l[2];
                if (nb == 1) {
                  block_sums<0, 16>(c, m[0], sl2, l);
                } else if (h == 0) {  // two blocks of 64 keys: columns 0..63, then 64..127
                  block_sums<0, 8>(c, m[0], sl2, l);
                } else {
                  block_sums<8, 8>(c, m[1], sl2, l);
                }
                if (take) thr = heap.replace_root(s, b, (tq & 1) ? l[1] : l[0]);
              }
            }
          }
        }
      }
    }
    if (kPlain && late) offer_late(total - 1);

    if constexpr (kLse) {
      lse_write_rows(p, tl, run_m, run_l, warp * 16 + g, lane);
    } else {
      if constexpr (!kSel) {
        if (keys) kl.store(heap, half);  // as the FP8 loop's
      }
      __syncthreads();
      write_index_row<kSel>(p, tl, sScore, sBlock, tid, sSum);
    }
  }
}

// The TMA descriptor of k_idx, a (Tk, Hki, Di) tensor with strides in elements: boxes of 64 Di x 1 head
// x 128 tokens, 128-byte swizzle (the KMajorSw128 panel layout), zeros out of bounds.
template <typename T, int D>
cudaError_t make_k_map(const IndexTopkParams& p, CUtensorMap* map) {
  return make_rows_map<T>(p.k_idx, D, p.num_key_heads, p.total_tokens_k, p.k_stride_h, p.k_stride_t,
                          IndexTopkShape<4>::kKeys, map);
}

// Warpgroups per CTA: 4 (256 rows), or 2 where the 4-warpgroup grid fits in one wave of the GPU's SMs (N <= 8K
// in the bench configuration): there every CTA starts at once and the longest (the last tile of the longest
// sequence, scoring every earlier block) alone sets the kernel's time. 128-row CTAs halve that CTA's work; at
// Di = 128 one of them still fills an SM's shared memory (~161 KB), so their twice as many CTAs run in about two
// waves, longest first, which balances them. MSA_TOPK_WG=2|4 forces one (tests compare the two).
inline int topk_warpgroups(int ctas4) {
  const char* env = std::getenv("MSA_TOPK_WG");
  if (env != nullptr && (env[0] == '2' || env[0] == '4') && env[1] == '\0') return env[0] - '0';
  int dev = 0, sms = 0;
  if (cudaGetDevice(&dev) != cudaSuccess || cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev) != cudaSuccess) {
    return 4;
  }
  return ctas4 <= sms ? 2 : 4;
}

template <typename T, int D, int WG, bool kLse, bool kSel, bool kFp8>
cudaError_t launch_index_topk_wg(const IndexTopkParams& p, const CUtensorMap& k_map, cudaStream_t stream) {
  using S = IndexTopkShape<WG, kSel>;
  const int hr = p.num_heads / p.num_key_heads;
  const int tm = S::kRows / hr;
  if (tm == 0) return cudaErrorInvalidValue;
  const int tiles = (p.max_seqlen + tm - 1) / tm;
  const dim3 grid(unsigned(tiles) * unsigned(p.num_seqs), unsigned(p.num_key_heads));
  constexpr int smem = S::template smem_bytes<D, T>();
  auto kernel = index_topk_sm90_kernel<T, D, WG, kLse, kSel, kFp8>;
  const cudaError_t err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
  if (err != cudaSuccess) return err;
  kernel<<<grid, S::kThreads, smem, stream>>>(p, k_map);
  return cudaGetLastError();
}

// cudaErrorNotSupported (before any launch) when the TMA descriptor cannot describe k_idx (e.g. a zero
// stride): the caller then takes the portable kernel (select_blocks) or the dense forward (lse).
template <typename T, int D, bool kLse, bool kSel = false, bool kFp8 = false>
cudaError_t launch_index_scores(const IndexTopkParams& p, cudaStream_t stream) {
  const int hr = p.num_heads / p.num_key_heads;
  const int tm4 = IndexTopkShape<4>::kRows / hr;
  // Hr <= 64 (select_blocks' check; index_lse_cuda's condition): a 2-warpgroup CTA holds at least 2 tokens, a
  // 4-warpgroup one at least 4.
  if (tm4 == 0 || IndexTopkShape<2>::kRows / hr == 0) return cudaErrorInvalidValue;
  CUtensorMap k_map;
  const cudaError_t err = make_k_map<T, D>(p, &k_map);
  if (err != cudaSuccess) return err;
  const int64_t ctas4 = int64_t((p.max_seqlen + tm4 - 1) / tm4) * p.num_seqs * p.num_key_heads;
  return topk_warpgroups(int(std::min<int64_t>(ctas4, 1 << 30))) == 2
             ? launch_index_topk_wg<T, D, 2, kLse, kSel, kFp8>(p, k_map, stream)
             : launch_index_topk_wg<T, D, 4, kLse, kSel, kFp8>(p, k_map, stream);
}

// With p.sel_stats also each row's kept blocks' (max, sum) of the index logits (kSel).
template <typename T, int D>
cudaError_t launch_index_topk(const IndexTopkParams& p, cudaStream_t stream) {
  return p.sel_stats != nullptr ? launch_index_scores<T, D, false, true>(p, stream)
                                : launch_index_scores<T, D, false, false>(p, stream);
}

// FP8 (e4m3) q_idx / k_idx of head dim Di (128: a 128-byte row is one swizzle panel), strides in elements (bytes):
// the kernel reads them as bf16 rows of Di / 2 (kFp8 above), so every stride must be even.
template <int Di>
cudaError_t launch_index_topk_fp8(const IndexTopkParams& p, cudaStream_t stream) {
  static_assert(Di == 128, "the FP8 top-k takes Di = 128");
  if (p.sel_stats != nullptr || (p.q_stride_t | p.q_stride_h | p.k_stride_t | p.k_stride_h) & 1) {
    return cudaErrorInvalidValue;
  }
  IndexTopkParams h = p;
  h.q_stride_t /= 2, h.q_stride_h /= 2, h.k_stride_t /= 2, h.k_stride_h /= 2;
  return launch_index_scores<__nv_bfloat16, Di / 2, false, false, true>(h, stream);
}

// p.lse (Hi, T) = the natural-log logsumexp of p.scale * q_idx . k_idx over each row's causal keys (p.indices,
// p.topk and p.block_size unused).
template <typename T, int D>
cudaError_t launch_index_lse(const IndexTopkParams& p, cudaStream_t stream) {
  return launch_index_scores<T, D, true>(p, stream);
}

}  // namespace msa::sm90
