// Warmup's dense KL pass on Hopper (SPEC 4 over the full causal set of SPEC 5), given lse and lse_idx.
//
// Key-major, as a flash backward: a CTA holds one 128-key tile of K and K_idx (two consumer warpgroups,
// 64 keys each) and walks a chunk of 64-row query tiles, for every index group r of its index-key head.
// Per (query tile, group), transposed (keys as the MMA's M):
//   S_idx^T = K_idx Q_idx^T              m64n64, K = Di   (A: K_idx, B: Q_idx, both K-major by descriptor)
//   S_h^T   = K Q_h^T, h in the group    m64n64, K = D    (A: K,     B: Q_h,   both K-major by descriptor)
//   Pbar = mean_h exp2(S_h * c - lse_h),  Pidx = exp2(S_idx * ci - lse_idx)      (masked: key <= query)
//   KL partial per query = sum over the tile's keys of Pbar (log2 Pbar - S_idx * ci)   (log2 units)
//   dS^T = Pidx - Pbar
//   dK_idx += dS^T Q_idx                 m64nDi, K = 64   (A: dS^T from registers, B: Q_idx MN-major)
//   dQ_idx  = dS K_idx                   m64n64, K = 128  (A: dS by ldmatrix.trans of dS^T in shared
//                                                          memory, B: K_idx MN-major), 8-byte reds
// dK_idx stays in registers over the CTA's whole walk (one red.v4 flush at the end); the KL partials
// are summed in fixed point (int64 atomics: the KL value does not depend on the order; a non-finite
// partial flags the row, whose KL is then NaN). FLOPs per (query tile, group): 128 x 64 x (2 D G + 6 Di);
// useful (causal pairs only): N (N + 1) / 2 x (2 D G + 6 Di) per group and sequence.
//
// Heads: with G = kG at compile time (kG = 4, the common 16 / 4 layout) head h + 1's S^T (after the last
// head, S_idx^T) is issued before head h's exponentials, so the tensor cores run under them (two
// accumulators); kG = 0 (any other G) runs S_idx^T first and one head at a time. Full tiles (below the
// diagonal, inside the sequence) take an unmasked path. Per-step and per-head positions are counters,
// never integer divisions.
//
// Loads: Q and Q_idx tiles by TMA (boxes of 64 columns x 1 head x 64 rows, 128-byte swizzle: the
// KMajorSw128 panels), issued by thread 0 into rings with a "full" mbarrier per slot (the TMA bytes) and
// an "empty" one (one arrival per warp once its wgmma read the slot): no CTA barrier per head. Q loads go
// in (step, head) order through `slots` slots (5 where the shared memory allows, else 4 or 3); `prefetch`
// of them are in flight ahead of the one being read, and thread 0 issues load n + prefetch once load n is
// consumed (its slot held load n + prefetch - slots: the other warpgroup may lag by slots - prefetch
// heads before thread 0 waits for it). lse / lse_idx of step s + 1 are cp.async'd by every (heads) thread at the
// top of step s into the next of two buffers (three with kWs); at its end each thread turns its own values into
// the exponents' offsets in place and arrives on an mbarrier of 256 arrivals, which step s + 1 waits for. K and
// K_idx: cp.async at the start and when the kv head changes (a barrier then: the CTA's, with kWs the heads').
// Without kWs, one CTA barrier per step: dS^T and the KL partials (double buffered) before dQ_idx; with kWs none
// (the index warpgroup's mbarriers, below).
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <type_traits>

#include "common/mma_sm80.h"
#include "common/tma_map.h"
#include "common/wgmma_sm90.h"
#include "params.h"
#include "sm90/dense_kl/dense_kl.h"

namespace msa::sm90 {
namespace dense_kl {

using sm80::cp_async_16;
using sm80::cp_async_4;
using sm80::fast_exp2;
using sm80::kl_term_log2;
using sm80::kLog2e;
using sm80::ldmatrix_x4_trans;
using sm80::pack2;
using sm80::smem_addr;

constexpr int kKeys = 128;   // keys per CTA (two warpgroups of 64)
constexpr int kRows = 64;    // query rows per step
constexpr int kMaxSlots = 5;  // Q ring: 5 slots where the shared memory allows, else 4 or 3
constexpr int kLseBufs = 3;   // lse buffers in shared memory (the kernel without kWs uses two)
constexpr int kThreads = 256;     // the heads' two warpgroups (every thread of the CTA without kWs)
constexpr int kThreadsWs = 384;   // kWs: and the index warpgroup
// kWs: setmaxnreg from the launch's 168 per thread (65536 / 384, rounded down to 8): the heads' warpgroups give
// 16 each to the index warpgroup, whose dK_idx (128 keys x Di fp32) takes 128 registers per thread at Di = 128.
constexpr int kHeadRegs = 152, kIdxRegs = 200;
static_assert(2 * kHeadRegs + kIdxRegs <= 3 * 168, "register pool");
constexpr int kBarHeads = 1;  // kWs: named barrier of the heads' 256 threads (0 is __syncthreads)
constexpr double kLn2 = 0.6931471805599453;  // the finish (in double)

template <int D, int Di>
struct Smem {
  using KT = KMajorSw128<kKeys, D>;
  using KiT = KMajorSw128<kKeys, Di>;
  using QT = KMajorSw128<kRows, D>;
  using QiT = KMajorSw128<kRows, Di>;
  using DsT = KMajorSw128<kKeys, kRows>;  // dS^T: rows = keys, 64 queries per row
  static constexpr int k = 0;
  static constexpr int ki = k + kKeys * D * 2;
  static constexpr int qi = ki + kKeys * Di * 2;               // 2 slots
  static constexpr int ds = qi + 2 * kRows * Di * 2;            // 2 buffers
  static constexpr int kl = ds + 2 * kKeys * kRows * 2;         // 2 buffers x 8 warps x 64 queries, fp32
  // 2 x kMaxSlots (Q) + 2 x 2 (Q_idx) + kLseBufs (lse) + 2 x 2 (dS) barriers
  static constexpr int bars = kl + 2 * 8 * kRows * 4;
  static constexpr int q = bars + 1024;                         // the Q slots, 1024-byte aligned
  // kLseBufs buffers x (G lse + lse_idx): two without kWs, three with it (the heads' warpgroups meet at no barrier).
  static constexpr int lse_bytes(int g) { return kLseBufs * (g + 1) * kRows * 4; }
  static constexpr int bytes(int g, int slots) { return q + slots * kRows * D * 2 + lse_bytes(g); }
};

// The most Q slots (<= kMaxSlots, >= 3) whose shared memory fits `limit` bytes (0: none fits).
template <int D, int Di>
inline int q_slots(int g, int limit) {
  for (int s = kMaxSlots; s >= 3; --s)
    if (Smem<D, Di>::bytes(g, s) + 1024 <= limit) return s;
  return 0;
}

// f(i) for i = tid, tid + kThreads, ... below n. kRolled: one call per loop trip (kWs: no per-trip addresses
// hoisted out of the caller's step loop and held in registers); else as the compiler unrolls it.
template <bool kRolled, typename F>
__device__ __forceinline__ void for_thread_share(int tid, int n, F&& f) {
  if constexpr (kRolled) {
#pragma unroll 1
    for (int i = tid; i < n; i += kThreads) f(i);
  } else {
    for (int i = tid; i < n; i += kThreads) f(i);
  }
}

// rows x (W 16-bit elements) tile at global rows [row0, row0 + rows) (stride in elements), rows at or
// past `limit` zero-filled, into a KMajorSw128 tile.
template <typename Tile, int W, bool kRolled = false>
__device__ __forceinline__ void load_tile(void* dst, const void* src, int64_t stride, int row0, int rows, int limit,
                                          int tid) {
  constexpr int kChunks = W / 8;
  const char* s = static_cast<const char*>(src);
  for_thread_share<kRolled>(tid, rows * kChunks, [&](int i) {
    const int r = i / kChunks, c = i % kChunks;
    const bool ok = row0 + r < limit;
    const char* g = s + (int64_t(ok ? row0 + r : 0) * stride + c * 8) * 2;
    cp_async_16(static_cast<char*>(dst) + Tile::offset(r, c) * 2, g, ok);
  });
}

// A k-step's descriptor from the tile's k-step 0 descriptor: the start address (bits 0-13, in 16-byte
// units) advanced by KMajorSw128::kstep_bytes, as desc does; addresses stay below 256 KB, so the field
// never carries.
template <typename Tile>
__device__ __forceinline__ uint64_t desc_step(uint64_t d0, int ks) {
  return d0 + uint64_t(Tile::kstep_bytes(ks) >> 4);
}

// acc (64 x 64) = A B^T over kSteps k-steps, both operands by descriptor, issued and committed as one
// group (not waited for).
// kOpaque: the base descriptors hidden from the optimiser at each call, so that the k-steps' descriptors are
// formed here, not hoisted out of the caller's loop and held in registers (kWs: 2 x 8 64-bit values per GEMM).
template <typename T, typename ATile, typename BTile, int kSteps, bool kOpaque = false>
__device__ __forceinline__ void issue_ss(float (&acc)[32], uint64_t a0, uint64_t b0) {
  if constexpr (kOpaque) asm volatile("" : "+l"(a0), "+l"(b0));
  wgmma_fence();
#pragma unroll
  for (int ks = 0; ks < kSteps; ++ks) {
    WgmmaSS<T, 64>::run(acc, desc_step<ATile>(a0, ks), desc_step<BTile>(b0, ks), ks > 0);
  }
  wgmma_commit();
}

}  // namespace dense_kl

// kG > 0: G = kG query heads per index group at compile time, and head h + 1's S^T (or, after the last
// head, S_idx^T) runs on the tensor cores while head h's exponentials run (two accumulators). kG = 0: G
// from the params, one head at a time, S_idx^T first (with kWs after the heads).
//
// kWs (the default; MSA_DENSE_KL_WS=0 for the kernel above): a third warpgroup, the index warpgroup, takes the
// gradient GEMMs off the heads' warpgroups, which keep the heads, S_idx^T, the KL terms and dS^T. Per step the
// heads' warpgroups store dS^T and their KL partials (buffer s & 1), fence them to the async proxy and arrive on
// ds_full; the index warpgroup waits for it, runs dK_idx += dS^T Q_idx for all 128 keys (two m64nDi SS wgmmas,
// A = dS^T K-major) and dQ_idx = dS K_idx (SS, A = dS read MN-major from the same tile) by column halves with
// their reds, adds the step's KL rows, and arrives on ds_empty, which the heads wait for before they refill the
// buffer two steps on. No CTA barrier per step: the heads run up to two steps ahead, and their registers no
// longer hold dK_idx (the index warpgroup's 128 at Di = 128). Q_idx slot s & 1 goes back after S_idx^T (heads)
// and dK_idx (index warpgroup): 12 arrivals; thread 0 refills it once step s's heads are done.
template <typename T, int D, int Di, int kG, bool kWs>
__global__ void __launch_bounds__(kWs ? dense_kl::kThreadsWs : dense_kl::kThreads, 1)
    dense_kl_kernel(const DenseKlParams p, const __grid_constant__ CUtensorMap q_map,
                    const __grid_constant__ CUtensorMap qi_map, const int slots) {
  using namespace dense_kl;
  using L = Smem<D, Di>;
  using KT = typename L::KT;
  using KiT = typename L::KiT;
  using QT = typename L::QT;
  using QiT = typename L::QiT;
  using DsT = typename L::DsT;
  extern __shared__ __align__(1024) char smem_raw[];
  // The swizzled tiles must start 1024-byte aligned. An offset of smem_raw (not an integer cast back to
  // a pointer) keeps the compiler's knowledge that these are shared addresses: LDS / STS, not LD / ST.
  char* smem = smem_raw + ((1024u - (smem_addr(smem_raw) & 1023u)) & 1023u);
  T* sK = reinterpret_cast<T*>(smem + L::k);
  T* sKi = reinterpret_cast<T*>(smem + L::ki);
  T* sQ = reinterpret_cast<T*>(smem + L::q);
  T* sQi = reinterpret_cast<T*>(smem + L::qi);
  T* sDs0 = reinterpret_cast<T*>(smem + L::ds);
  float* sKl0 = reinterpret_cast<float*>(smem + L::kl);
  uint64_t* full_q = reinterpret_cast<uint64_t*>(smem + L::bars);
  uint64_t* empty_q = full_q + kMaxSlots;
  uint64_t* full_a = empty_q + kMaxSlots;
  uint64_t* empty_a = full_a + 2;
  uint64_t* lse_full = empty_a + 2;
  uint64_t* ds_full = lse_full + kLseBufs;  // kWs: dS^T and the KL partials of buffer b stored (256 arrivals)
  uint64_t* ds_empty = ds_full + 2;  // kWs: ... and read by the index warpgroup (128 arrivals)
  float* sLse0 = reinterpret_cast<float*>(smem + L::q + slots * kRows * D * 2);

  const int tid = threadIdx.x, lane = tid % 32, warp = tid / 32, wg = warp / 4, wq = warp % 4;
  const int g = lane / 4, t = lane % 4;

  // This CTA's (key tile, query chunk). Tile-major (p.chunk_major = 0): chunks of one key tile are
  // consecutive CTAs, so the CTAs that run at the same time add into disjoint dQ_idx rows (same-address
  // atomics serialise in L2), but together they span every query row: at long N most Q loads and dQ_idx
  // reds go to DRAM. Chunk-major (1): key tiles of one chunk are consecutive CTAs and chunks are aligned
  // ranges of query tiles, so the CTAs in flight share one chunk's Q tiles and dQ_idx rows in L2; each
  // starts its walk at its own query tile (rot), so that they do not add into the same rows at once.
  // Chunk-major is the default (MSA_DENSE_KL_ORDER=tile for the other; s73, H100: 204 against 256 ms at 128K).
  const bool chunk_major = p.chunk_major != 0;
  const int tile = chunk_major ? blockIdx.x % p.num_tiles : blockIdx.x / p.max_chunks;
  const int chunk = chunk_major ? blockIdx.x / p.num_tiles : blockIdx.x % p.max_chunks;
  if (tile >= p.tile_offsets[p.num_seqs]) return;
  int lo = 0, hi = p.num_seqs - 1;
  while (lo < hi) {
    const int mid = (lo + hi + 1) / 2;
    if (p.tile_offsets[mid] <= tile) lo = mid; else hi = mid - 1;
  }
  // Query rows [base_q, base_q + len_q) are the last len_q of the sequence's len_k key positions: query
  // row qr (local) sits at position qr + shift (shift = 0 without a key layout: cu_seqlens_k is then
  // cu_seqlens). k0q: the first query row that sees the tile's first key (negative: all of them do).
  const int base_q = p.cu_seqlens[lo], len_q = p.cu_seqlens[lo + 1] - base_q;
  const int base_k = p.cu_seqlens_k[lo], len_k = p.cu_seqlens_k[lo + 1] - base_k;
  const int k0 = (tile - p.tile_offsets[lo]) * kKeys, k0q = k0 - (len_k - len_q);
  const int n_qt = (len_q + kRows - 1) / kRows;
  const int qt_first = max(k0q, 0) / kRows;  // the first query tile that sees the key tile
  const int qt_begin = chunk_major ? max(qt_first, chunk * p.chunk_tiles) : qt_first + chunk * p.chunk_tiles;
  const int nqt = min(n_qt, chunk_major ? (chunk + 1) * p.chunk_tiles : qt_begin + p.chunk_tiles) - qt_begin;
  if (nqt <= 0) return;
  // The walk's first query tile (in the chunk); group r + 1 starts where group r did.
  const int rot = chunk_major ? tile % nqt : 0;
  const int hk = blockIdx.y;
  const int G = kG > 0 ? kG : p.hq / p.hi, groups = p.hi / p.hki, r0 = hk * groups;
  const int steps = groups * nqt, loads = steps * G;
  const bool grad = p.dq_idx != nullptr;
  const int kv_per = p.hq / p.hkv;  // query heads per kv head
  // The walk's next step from (query tile qt, group r): query tiles from rot round the chunk, then the next group.
  // Thread 0's Q loads and the step loop both follow it.
  auto advance = [&](int& qt, int& r) {
    if (++qt == nqt) qt = 0;
    if (qt == rot) ++r;
  };
  // Q loads in flight ahead of the one being read: thread 0 refills the slot of the load `slots -
  // prefetch` before (so it rarely waits for the other warpgroup), and at least two are ahead (the
  // pipelined heads wait for load n + 1 before they release load n).
  const int prefetch = slots >= 4 ? slots - 2 : 2;

  const T* k = static_cast<const T*>(p.k);
  const T* ki = static_cast<const T*>(p.k_idx);

  if (tid == 0) {
    for (int i = 0; i < slots; ++i) {
      mbar_init(full_q + i, 1);
      mbar_init(empty_q + i, 8);
    }
    for (int i = 0; i < 2; ++i) {
      mbar_init(full_a + i, 1);
      mbar_init(empty_a + i, kWs ? 12 : 8);
      mbar_init(ds_full + i, kThreads);
      mbar_init(ds_empty + i, 128);
    }
    for (int i = 0; i < kLseBufs; ++i) mbar_init(lse_full + i, kThreads);
    mbar_fence_init();
  }
  __syncthreads();
  // Thread 0's Q loads, in (step, head) order: the next one's slot, the parity of that slot's use, and
  // its (query tile, group, head). Counters, not divisions: this runs once per head.
  int pq_n = 0, pq_slot = 0, pq_phase = 0, pq_qt = rot, pq_r = r0, pq_h = 0;
  auto issue_q = [&]() {
    if (pq_n >= loads) return;
    if (pq_n >= slots) mbar_wait(empty_q + pq_slot, pq_phase ^ 1);  // the slot's previous use released
    T* dst = sQ + pq_slot * kRows * D;
    mbar_arrive_expect_tx(full_q + pq_slot, kRows * D * 2);
#pragma unroll
    for (int panel = 0; panel < D / 64; ++panel) {
      tma_load_3d(dst + panel * QT::kPanelElems, &q_map, panel * 64, pq_r * G + pq_h,
                  base_q + (qt_begin + pq_qt) * kRows, full_q + pq_slot);
    }
    ++pq_n;
    if (++pq_slot == slots) pq_slot = 0, pq_phase ^= 1;
    if (++pq_h == G) {
      pq_h = 0;
      advance(pq_qt, pq_r);
    }
  };
  // Thread 0: Q_idx of step s (query tile qt, group r) into slot s & 1, after its use by step s - 2.
  auto issue_a = [&](int s, int qt, int r) {
    const int slot = s & 1, u = s >> 1;
    if (u > 0) mbar_wait(empty_a + slot, (u - 1) & 1);
    T* dst = sQi + slot * kRows * Di;
    mbar_arrive_expect_tx(full_a + slot, kRows * Di * 2);
#pragma unroll
    for (int panel = 0; panel < Di / 64; ++panel) {
      tma_load_3d(dst + panel * QiT::kPanelElems, &qi_map, panel * 64, r, base_q + (qt_begin + qt) * kRows,
                  full_a + slot);
    }
  };
  // Every thread: its share of step s's lse (G heads) and lse_idx into buffer lb, one cp.async group, issued at the
  // top of step s - 1 (finish_lse turns them into exponent offsets at its end and arrives on lse_full). The buffers
  // go round (two; three with kWs): buffer lb was last read in step s - 2 (s - 3 with kWs), which every thread has
  // finished: without kWs, step s - 2's CTA barrier says so; with kWs, the caller's wait in step s - 2 for lse_full
  // (every heads thread's finish_lse at the end of step s - 3).
  constexpr int kBufs = kWs ? kLseBufs : 2;
  const float nlog2g = -__log2f(float(G));  // Pbar = sum_h exp2(S_h c - lse_h log2 e - log2 G)
  auto issue_lse = [&](int lb, int qt, int r) {
    const int row0 = (qt_begin + qt) * kRows;
    float* dst = sLse0 + lb * (G + 1) * kRows;
    for_thread_share<kWs>(tid, (G + 1) * kRows, [&](int i) {
      const int hh = i / kRows, row = i % kRows;
      const bool ok = row0 + row < len_q;
      const int tok = base_q + (ok ? row0 + row : 0);
      const float* src_row = hh < G ? p.lse + int64_t(r * G + hh) * p.total_tokens : p.lse_idx + int64_t(r) * p.total_tokens;
      cp_async_4(dst + i, src_row + tok, ok);
    });
    sm80::cp_async_commit();
  };
  // Every thread, once step s's lse copies have had a step to land: its own values turned in place into the
  // exponents' offsets, -(lse_h log2 e + log2 G) for the heads and lse_idx log2 e, then its arrival on
  // lse_full. The heads' exponents read them after the wgmma wait (s34: converted by each reader, the FFMAs
  // ran before the wait and stalled on the shared loads: ~10% of the kernel's stall samples).
  auto finish_lse = [&](int lb) {
    float* dst = sLse0 + lb * (G + 1) * kRows;
    sm80::cp_async_wait<0>();
    // A plain loop, not for_thread_share<kWs> as in issue_lse: rolled, the kG = 4 kWs kernel spills 8 bytes (s78).
    for (int i = tid; i < (G + 1) * kRows; i += kThreads) {
      const float x = dst[i];
      dst[i] = i < G * kRows ? fmaf(x, -kLog2e, nlog2g) : x * kLog2e;
    }
    mbar_arrive(lse_full + lb);
  };
  auto load_k = [&](int kvh) {  // every heads thread; then cp.async.wait_all + their barrier (the CTA's without kWs)
    load_tile<KT, D, kWs>(sK, k + base_k * p.k_stride_t + kvh * p.k_stride_h, p.k_stride_t, k0, kKeys, len_k, tid);
    sm80::cp_async_commit();
  };

  // The KL partials of a step's 64 query rows (8 warps' sums in sKl) added into kl_fixed: thread i < 64 takes row i.
  auto kl_row_add = [&](const float* sKl, int row0, int r, int i) {
    if (i < kRows && row0 + i < len_q) {  // KL in fixed point: the order of the adds does not matter
      float v = 0.f;
#pragma unroll
      for (int w = 0; w < 8; ++w) v += sKl[w * kRows + i];
      const int64_t row = int64_t(r) * p.total_tokens + base_q + row0 + i;
      if (isfinite(v)) {
        atomicAdd(p.kl_fixed + row, static_cast<unsigned long long>(__float2ll_rn(v * 4294967296.f)));
      } else {
        atomicOr(p.kl_bad + row, 1u);  // the fixed point cannot hold it: the finish writes NaN
      }
    }
  };
  // A 64-query x 64-column block of dQ_idx (the accumulator of an m64n64 wgmma, columns [col0, +64)) added by
  // reds straight from the accumulator layout (rows wq 16 + g and + 8, column pairs 8 j + 2 t): 8-byte reds, no
  // shuffles (the same 32-byte sectors per warp as 16-byte reds after a quad exchange).
  auto dq_reds = [&](const float (&dq)[32], int row0, int r, int col0) {
    const int qrow = wq * 16 + g;
    const bool ok0 = row0 + qrow < len_q, ok1 = row0 + qrow + 8 < len_q;
    float* dst0 = p.dq_idx + (int64_t(base_q + row0 + qrow) * p.hi + r) * Di + col0 + 2 * t;
    float* dst1 = dst0 + int64_t(8) * p.hi * Di;
#pragma unroll
    for (int j = 0; j < 8; ++j) {
      if (ok0) sm80::atomic_add2(dst0 + 8 * j, dq[4 * j] * p.grad_scale, dq[4 * j + 1] * p.grad_scale);
      if (ok1) sm80::atomic_add2(dst1 + 8 * j, dq[4 * j + 2] * p.grad_scale, dq[4 * j + 3] * p.grad_scale);
    }
  };
  // dK_idx of 64 keys (the accumulator of an m64nDi wgmma whose rows are the tile's keys from key_base) added by
  // 16-byte reds after a quad exchange, once per CTA.
  auto dk_flush = [&](const float (&dk)[Di / 2], int key_base) {
    const int krow = key_base + wq * 16 + g + ((t & 1) ? 8 : 0);
    const bool ok = k0 + krow < len_k;
    float* dst = p.dk_idx + (int64_t(base_k + k0 + (ok ? krow : 0)) * p.hki + hk) * Di + 2 * (t & ~1);
#pragma unroll
    for (int j = 0; j < Di / 8; ++j) {
      const float c4[4] = {dk[4 * j], dk[4 * j + 1], dk[4 * j + 2], dk[4 * j + 3]};
      const float4 v = sm80::quad_rows4(c4, t);
      if (ok) {
        sm80::atomic_add4(dst + 8 * j,
                          make_float4(v.x * p.grad_scale, v.y * p.grad_scale, v.z * p.grad_scale, v.w * p.grad_scale));
      }
    }
  };

  // Prologue: K_idx and K of the first group (cp.async), step 0's Q_idx, lse and the first Q loads.
  int kv_loaded = r0 * G / kv_per;
  if (tid < kThreads) {
    load_tile<KiT, Di>(sKi, ki + base_k * p.ki_stride_t + hk * p.ki_stride_h, p.ki_stride_t, k0, kKeys, len_k, tid);
    load_k(kv_loaded);
    sm80::cp_async_wait<0>();
    fence_proxy_async_smem();
  }
  __syncthreads();
  const uint32_t ki_addr = smem_addr(sKi);

  if constexpr (kWs) {
    if (wg == 2) {  // the index warpgroup: dK_idx, dQ_idx and the KL rows of every step, in the heads' order
      setmaxnreg_inc<kIdxRegs>();
      float dk[2][Di / 2];  // keys [0, 64) and [64, 128) of the tile
#pragma unroll
      for (int m = 0; m < 2; ++m) {
#pragma unroll
        for (int i = 0; i < Di / 2; ++i) dk[m][i] = 0.f;
      }
      const uint32_t ds_base = smem_addr(sDs0), qi_base = smem_addr(sQi);
      // dQ_idx's columns [64 hf, +64) (Di = 128) or all 64 (Di = 64) over the tile's 128 keys: A = dS, read
      // MN-major from the dS^T tile (rows = keys), B = K_idx's panel hf read MN-major. Issued and committed.
      auto issue_dq = [&](float (&dq)[32], uint32_t ds_addr, int hf) {
        const uint32_t b_addr = ki_addr + hf * KiT::kPanelElems * 2;
        wgmma_fence();
#pragma unroll
        for (int ks = 0; ks < 8; ++ks)
          WgmmaSS<T, 64, true, true>::run(dq, DsT::desc_mn(ds_addr, ks), KiT::desc_mn(b_addr, ks), ks > 0);
        wgmma_commit();
      };
      int qt = rot, r = r0;
      for (int s = 0; s < steps; ++s) {
        const int b = s & 1, row0 = (qt_begin + qt) * kRows;
        const float* sKl = sKl0 + b * 8 * kRows;
        mbar_wait(ds_full + b, (s >> 1) & 1);
        if (grad) {
          mbar_wait(full_a + b, (s >> 1) & 1);  // Q_idx of the step (landed before the heads' S_idx^T)
          const uint32_t ds_addr = ds_base + b * kKeys * kRows * 2, qi_addr = qi_base + b * kRows * Di * 2;
          wgmma_fence();
#pragma unroll
          for (int m = 0; m < 2; ++m) {
#pragma unroll
            for (int kk = 0; kk < 4; ++kk)
              WgmmaSS<T, Di, false, true>::run(dk[m], DsT::desc(ds_addr + m * 64 * 128, kk), QiT::desc_mn(qi_addr, kk),
                                               true);
          }
          wgmma_commit();
          float dq[32];
          issue_dq(dq, ds_addr, 0);
          kl_row_add(sKl, row0, r, tid - kThreads);  // under the wgmmas
          wgmma_wait<0>();
          fence_regs(dk[0]);
          fence_regs(dk[1]);
          fence_regs(dq);
          if (lane == 0) mbar_arrive(empty_a + b);  // this warp's reads of the Q_idx slot are done
          dq_reds(dq, row0, r, 0);
          if constexpr (Di == 128) {
            issue_dq(dq, ds_addr, 1);
            wgmma_wait<0>();
            fence_regs(dq);
            dq_reds(dq, row0, r, 64);
          }
        } else {
          if (lane == 0) mbar_arrive(empty_a + b);  // Q_idx not read here: the slot's arrival of this warp
          kl_row_add(sKl, row0, r, tid - kThreads);
        }
        mbar_arrive(ds_empty + b);  // the buffer's dS^T (read by the wgmmas, waited for) and KL partials
        advance(qt, r);
      }
      if (grad) {
        dk_flush(dk[0], 0);
        dk_flush(dk[1], 64);
      }
      return;
    }
    setmaxnreg_dec<kHeadRegs>();
  }
  issue_lse(0, rot, r0);
  finish_lse(0);
  int lb = 0, lph = 0;  // step s's lse buffer and the parity of its use
  if (tid == 0) {
    issue_a(0, rot, r0);
    for (int i = 0; i < prefetch; ++i) issue_q();
  }

  float dk[kWs ? 1 : Di / 2];  // without kWs: this warpgroup's 64 keys x Di of d kl / d k_idx (before grad_scale)
#pragma unroll
  for (int i = 0; i < (kWs ? 1 : Di / 2); ++i) dk[i] = 0.f;

  // A = this warpgroup's 64 rows of the key tiles (row 64 wg of each 128-byte panel), by descriptor.
  const uint64_t k_d0 = KT::desc(smem_addr(sK) + wg * 64 * 128, 0);
  const uint64_t ki_d0 = KiT::desc(ki_addr + wg * 64 * 128, 0);
  const int key_row = wg * 64 + wq * 16 + g;  // this thread's keys: key_row and key_row + 8 of the tile
  const int key0 = k0q + key_row, key1 = key0 + 8;  // as the first query rows that see them

  int c_slot = 0, c_phase = 0;  // the next Q load to read: its slot and the parity of that slot's use
  int qt = rot, r = r0;         // step s's query tile (in the chunk) and index group
  for (int s = 0; s < steps; ++s) {
    int qt_next = qt, r_next = r;
    advance(qt_next, r_next);
    const int b = s & 1, row0 = (qt_begin + qt) * kRows;
    const int kvh = r * G / kv_per;
    T* sDs = sDs0 + b * kKeys * kRows;
    float* sKl = sKl0 + b * 8 * kRows;
    if (kvh != kv_loaded) {  // a new kv head for this group: every read of sK ended before the last (kWs: next) barrier
      // kWs: the heads' 256 threads only (the index warpgroup never reads sK); else the CTA.
      auto heads_sync = []() {
        if constexpr (kWs) asm volatile("bar.sync %0, %1;\n" ::"n"(kBarHeads), "n"(kThreads) : "memory");
        else __syncthreads();
      };
      if constexpr (kWs) heads_sync();
      load_k(kvh);
      sm80::cp_async_wait<0>();
      fence_proxy_async_smem();
      heads_sync();
      kv_loaded = kvh;
    }
    const int lb_next = lb + 1 == kBufs ? 0 : lb + 1;
    if (s + 1 < steps) {
      issue_lse(lb_next, qt_next, r_next);
      if (!kWs && tid == 0) issue_a(s + 1, qt_next, r_next);
    }
    // kWs: the heads' reads of this step's Q_idx slot are done (after S_idx^T); thread 0 then refills the other
    // slot, whose last use (step s - 1) the index warpgroup has usually finished by now.
    auto q_idx_done = [&]() {
      if constexpr (kWs) {
        if (lane == 0) mbar_arrive(empty_a + b);
        if (tid == 0 && s + 1 < steps) issue_a(s + 1, qt_next, r_next);
      }
    };
    mbar_wait(full_a + b, (s >> 1) & 1);
    mbar_wait(lse_full + lb, lph);
    const float* lse_b = sLse0 + lb * (G + 1) * kRows;
    const uint32_t qi_addr = smem_addr(sQi + b * kRows * Di);
    const uint64_t qi_d0 = QiT::desc(qi_addr, 0);

    // The mask: a tile entirely below the diagonal and inside the sequence needs none (the branches on
    // `full` are uniform over the CTA). Keys past len_k need no test: a visible key is at a position
    // <= qr + shift < len_k.
    const bool full = row0 >= k0q + kKeys && row0 + kRows <= len_q;
    auto visible = [&](int e, int j) {
      const int qr = row0 + 8 * j + 2 * t + (e & 1);
      return (e < 2 ? key0 : key1) <= qr && qr < len_q;
    };

    // Pbar^T (keys x queries): the group's heads, Q through the ring.
    float pb[32];
#pragma unroll
    for (int i = 0; i < 32; ++i) pb[i] = 0.f;
    // This thread's 16 queries' -(lse_h log2 e + log2 G) of head hh (hh = G: lse_idx log2 e), as finish_lse
    // left them, read before the wgmma wait that precedes their use (the wait's memory clobber would keep them
    // after it).
    auto load_lv = [&](int hh, float (&lv)[16]) {
      const float* lh = lse_b + hh * kRows;
#pragma unroll
      for (int j = 0; j < 8; ++j) {
        const float2 x = *reinterpret_cast<const float2*>(lh + 8 * j + 2 * t);
        lv[2 * j] = x.x;
        lv[2 * j + 1] = x.y;
      }
    };
    // Head hh's exponentials into pb. kWs: the lse offsets read from shared memory as they are used (registers: the
    // heads' warpgroups run at kHeadRegs); otherwise from lv, loaded by load_lv before the wgmma wait.
    auto head_terms = [&](const float (&sc)[32], const float (&lv)[16], int hh) {
      const float* lh = lse_b + hh * kRows;
      auto lse_pair = [&](int j) {
        if constexpr (kWs) return *reinterpret_cast<const float2*>(lh + 8 * j + 2 * t);
        else return make_float2(lv[2 * j], lv[2 * j + 1]);
      };
      if (full) {
#pragma unroll
        for (int j = 0; j < 8; ++j) {
          const float2 o = lse_pair(j);
#pragma unroll
          for (int e = 0; e < 4; ++e)
            pb[4 * j + e] += fast_exp2(fmaf(sc[4 * j + e], p.scale_log2, (e & 1) ? o.y : o.x));
        }
      } else {
#pragma unroll
        for (int j = 0; j < 8; ++j) {
          const float2 o = lse_pair(j);
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            const float x = fast_exp2(fmaf(sc[4 * j + e], p.scale_log2, (e & 1) ? o.y : o.x));
            pb[4 * j + e] += visible(e, j) ? x : 0.f;
          }
        }
      }
    };
    auto next_slot = [&]() {
      if (++c_slot == slots) c_slot = 0, c_phase ^= 1;
    };
    float si[32];
    float lv[16];  // after the heads: lse_idx log2 e
    if constexpr (kG > 0) {
      float sc[2][32];
      mbar_wait(full_q + c_slot, c_phase);
      issue_ss<T, KT, QT, D / 16, kWs>(sc[0], k_d0, QT::desc(smem_addr(sQ + c_slot * kRows * D), 0));
#pragma unroll
      for (int hh = 0; hh < kG; ++hh) {
        const int slot = c_slot;
        next_slot();
        if (hh + 1 < kG) {
          mbar_wait(full_q + c_slot, c_phase);
          issue_ss<T, KT, QT, D / 16, kWs>(sc[(hh + 1) & 1], k_d0, QT::desc(smem_addr(sQ + c_slot * kRows * D), 0));
        } else {
          issue_ss<T, KiT, QiT, Di / 16, kWs>(si, ki_d0, qi_d0);
        }
        if constexpr (!kWs) load_lv(hh, lv);
        wgmma_wait<1>();  // head hh's S^T is done, the next GEMM runs under its exponentials
        fence_regs(sc[hh & 1]);
        if (lane == 0) mbar_arrive(empty_q + slot);  // this warp is done with the slot
        if (tid == 0) issue_q();
        head_terms(sc[hh & 1], lv, hh);
      }
      load_lv(G, lv);
      wgmma_wait<0>();
      fence_regs(si);
      q_idx_done();
    } else {
      // One head at a time. kWs: S_idx^T after the heads (registers: the other warpgroups' GEMMs overlap these
      // exponentials); otherwise before them.
      auto s_idx = [&]() {
        issue_ss<T, KiT, QiT, Di / 16, kWs>(si, ki_d0, qi_d0);
        wgmma_wait<0>();
        fence_regs(si);
        q_idx_done();
      };
      if constexpr (!kWs) s_idx();
      for (int hh = 0; hh < G; ++hh) {
        float sc[32];
        mbar_wait(full_q + c_slot, c_phase);
        issue_ss<T, KT, QT, D / 16, kWs>(sc, k_d0, QT::desc(smem_addr(sQ + c_slot * kRows * D), 0));
        if constexpr (!kWs) load_lv(hh, lv);
        wgmma_wait<0>();
        fence_regs(sc);
        if (lane == 0) mbar_arrive(empty_q + c_slot);
        next_slot();
        if (tid == 0) issue_q();
        head_terms(sc, lv, hh);
      }
      if constexpr (kWs) s_idx();
      load_lv(G, lv);
    }

    // Pidx, dS^T (into si) and the KL terms (into pb). Masked keys have pb = 0 (no KL term); their dS is
    // zeroed here.
    {
      auto terms = [&](auto masked) {
#pragma unroll
        for (int j = 0; j < 8; ++j) {
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            const float pm = pb[4 * j + e];
            const float s2 = si[4 * j + e] * p.iscale_log2;
            const float ds = fast_exp2(s2 - lv[2 * j + (e & 1)]) - pm;
            pb[4 * j + e] = kl_term_log2(pm, s2);
            if constexpr (decltype(masked)::value) {
              si[4 * j + e] = visible(e, j) ? ds : 0.f;
            } else {
              si[4 * j + e] = ds;
            }
          }
        }
      };
      if (full) terms(std::false_type{}); else terms(std::true_type{});
    }
    // KL per query: the thread's two keys, the warp's 16 (lanes of equal t), then the 8 warps in shared
    // memory (without kWs after the dK_idx GEMM is issued: the shuffles run under it). kG > 0: the warp's sum
    // as a reduce-scatter over g (lane bits 2-4): at each bit a lane keeps half of its query tiles and sends the
    // other half, so lane (g, t) ends with query tile g's two columns: 14 shuffles a step instead of 48, one
    // store a lane (s78, A/B on an H100: the kernel -1.5 / -0.6 / -1.1% at 8K / 32K / 128K). kG = 0 keeps the
    // all-reduce (the reduce-scatter spills there at kHeadRegs).
    auto kl_partials = [&]() {
      if constexpr (kG > 0) {
        float v[2][8];
#pragma unroll
        for (int j = 0; j < 8; ++j)
#pragma unroll
          for (int e = 0; e < 2; ++e) v[e][j] = pb[4 * j + e] + pb[4 * j + e + 2];
#pragma unroll
        for (int half = 4; half >= 1; half >>= 1) {
          const bool hi = (g & half) != 0;
#pragma unroll
          for (int j = 0; j < half; ++j) {
#pragma unroll
            for (int e = 0; e < 2; ++e) {
              const float send = hi ? v[e][j] : v[e][j + half];
              const float keep = hi ? v[e][j + half] : v[e][j];
              v[e][j] = keep + __shfl_xor_sync(0xffffffffu, send, 4 * half);
            }
          }
        }
        *reinterpret_cast<float2*>(sKl + warp * kRows + 8 * g + 2 * t) = make_float2(v[0][0], v[1][0]);
      } else {
#pragma unroll
        for (int j = 0; j < 8; ++j) {
#pragma unroll
          for (int e = 0; e < 2; ++e) {
            float v = pb[4 * j + e] + pb[4 * j + e + 2];
            v += __shfl_xor_sync(0xffffffffu, v, 4);
            v += __shfl_xor_sync(0xffffffffu, v, 8);
            v += __shfl_xor_sync(0xffffffffu, v, 16);
            if (g == 0) sKl[warp * kRows + 8 * j + 2 * t + e] = v;
          }
        }
      }
    };

    // dS^T as the A operand's packed pairs (input dtype): n-tiles 2 kk, 2 kk + 1 are queries [16 kk, +16); and
    // into shared memory for dQ_idx (rows = keys), the same pairs.
    auto pack_ds = [&](uint32_t (&pa)[4][4]) {
#pragma unroll
      for (int kk = 0; kk < 4; ++kk) sm80::a_frag<T>(si + 8 * kk, pa[kk]);
#pragma unroll
      for (int kk = 0; kk < 4; ++kk) {
#pragma unroll
        for (int hf = 0; hf < 2; ++hf) {
          const int chunk = 2 * kk + hf;
          *reinterpret_cast<uint32_t*>(sDs + DsT::offset(key_row, chunk) + 2 * t) = pa[kk][2 * hf];
          *reinterpret_cast<uint32_t*>(sDs + DsT::offset(key_row + 8, chunk) + 2 * t) = pa[kk][2 * hf + 1];
        }
      }
    };
    if constexpr (kWs) {
      // The buffer's last use (step s - 2) read by the index warpgroup; then this step's dS^T and KL partials.
      if (s >= 2) mbar_wait(ds_empty + b, ((s >> 1) + 1) & 1);
      // The KL partials before dS^T's packing where kG > 0 (the reduce-scatter's registers), after it at kG = 0: each
      // order the one without spills at kHeadRegs (nvcc 13.0).
      if constexpr (kG > 0) kl_partials();
      if (grad) {
        uint32_t pa[4][4];
        pack_ds(pa);
        fence_proxy_async_smem();  // the stores -> the index warpgroup's wgmma reads
      }
      if constexpr (kG == 0) kl_partials();
      mbar_arrive(ds_full + b);
    } else {
      if (grad) {  // CTA-uniform
        uint32_t pa[4][4];
        pack_ds(pa);
        // dK_idx += dS^T Q_idx (the stores above came before the wgmma: its A registers may not be read while it runs).
        wgmma_fence();
#pragma unroll
        for (int kk = 0; kk < 4; ++kk) WgmmaRS<T, Di, true>::run(dk, pa[kk], QiT::desc_mn(qi_addr, kk), true);
        wgmma_commit();
        kl_partials();
        wgmma_wait<0>();
        fence_regs(dk);
      } else {
        kl_partials();
      }
      if (lane == 0) mbar_arrive(empty_a + b);  // this warp's reads of the Q_idx slot are done
      __syncthreads();  // sDs and sKl complete

      kl_row_add(sKl, row0, r, tid);
      if (grad) {
        // dQ_idx (64 queries x Di) = dS K_idx: Di = 128, warpgroup wg takes columns [64 wg, +64) over all 128
        // keys; Di = 64, keys [64 wg, +64) of all columns.
        float dq[32];
        constexpr int kSteps = Di == 128 ? 8 : 4;
        const int kk0 = Di == 128 ? 0 : 4 * wg;
        const uint32_t b_addr = ki_addr + (Di == 128 ? wg * KiT::kPanelElems * 2 : 0);
        uint32_t a[kSteps][4];
#pragma unroll
        for (int i = 0; i < kSteps; ++i) {
          const int kk = kk0 + i, mi = lane / 8;
          ldmatrix_x4_trans(a[i], sDs + DsT::offset(16 * kk + (mi / 2) * 8 + lane % 8, 2 * wq + mi % 2));
        }
        wgmma_fence();
#pragma unroll
        for (int i = 0; i < kSteps; ++i) WgmmaRS<T, 64, true>::run(dq, a[i], KiT::desc_mn(b_addr, kk0 + i), i > 0);
        wgmma_commit();
        wgmma_wait<0>();
        fence_regs(dq);
        dq_reds(dq, row0, r, Di == 128 ? 64 * wg : 0);
      }
    }
    if (s + 1 < steps) finish_lse(lb_next);
    qt = qt_next, r = r_next;
    lph ^= lb_next == 0 ? 1 : 0;
    lb = lb_next;
  }
  sm80::cp_async_wait<0>();
  if constexpr (!kWs) {
    if (grad) dk_flush(dk, wg * 64);  // rows = this warpgroup's keys
  }
}

template <typename T, int D, int Di>
cudaError_t launch_dense_kl(const DenseKlParams& p, cudaStream_t stream) {
  const int G = p.hq / p.hi;
  int device = 0, limit = 0;
  cudaError_t err = cudaGetDevice(&device);
  if (err == cudaSuccess) err = cudaDeviceGetAttribute(&limit, cudaDevAttrMaxSharedMemoryPerBlockOptin, device);
  if (err != cudaSuccess) return err;
  const int slots = dense_kl::q_slots<D, Di>(G, limit);
  if (slots == 0) return cudaErrorInvalidConfiguration;
  CUtensorMap q_map, qi_map;
  err = make_rows_map<T>(p.q, D, p.hq, p.total_tokens, p.q_stride_h, p.q_stride_t, dense_kl::kRows, &q_map);
  if (err == cudaSuccess) {
    err = make_rows_map<T>(p.q_idx, Di, p.hi, p.total_tokens, p.qi_stride_h, p.qi_stride_t, dense_kl::kRows, &qi_map);
  }
  if (err != cudaSuccess) return err;
  const int smem = dense_kl::Smem<D, Di>::bytes(G, slots) + 1024;
  // G = 4 (e.g. 16 query heads over 4 index heads) pipelines its heads; other G run the general kernel. p.ws: the
  // index warpgroup (three warpgroups) or the two-warpgroup kernel.
  auto kernel = p.ws ? (G == 4 ? dense_kl_kernel<T, D, Di, 4, true> : dense_kl_kernel<T, D, Di, 0, true>)
                     : (G == 4 ? dense_kl_kernel<T, D, Di, 4, false> : dense_kl_kernel<T, D, Di, 0, false>);
  err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
  if (err != cudaSuccess) return err;
  const dim3 grid(unsigned(p.num_tiles) * unsigned(p.max_chunks), p.hki);
  kernel<<<grid, p.ws ? dense_kl::kThreadsWs : dense_kl::kThreads, smem, stream>>>(p, q_map, qi_map, slots);
  return cudaGetLastError();
}

}  // namespace msa::sm90
