// The sparse forward's output pass on Hopper, warp-specialized (issue 17 item 1), for the layout with
// Gu = 4 query heads per unit and J = 1 (G = Hq / Hi = 4, Hkv <= Hi: the bench configuration) with the
// index branch and the main output. Same work items, inputs and partials as the general pass
// (smxx/sparse_fwd/sparse_fwd_body.cuh, its top comment has the math); other layouts run that one.
//
// A CTA takes one work item (a kv block of one index group and up to 512 of the units that selected it)
// with 4 warpgroups: the producer, then three consumers, or (with the index gradient) two consumers and the
// dK warpgroup:
//  - warpgroup 0, the producer (setmaxnreg down to 40): gathers each tile's rows (16 units: Q of their 4
//    heads, 64 rows; Q_idx; lse; lse_idx) by cp.async into a ring of kStages stages, tile t completing on
//    full[t % full_bars] (cp.async.mbarrier.arrive.noinc, one arrival per producer thread), and reuses a
//    stage once its consumer released it ("empty": one arrival per consumer thread).
//  - warpgroups 1 .. kConsumers, the consumers (setmaxnreg up to 152): consumer c takes tiles c, c + kConsumers,
//    ... of the item, so they run on their own (no CTA barrier after the prologue): one warpgroup's exponentials, KL
//    terms and reds overlap the others' tensor-core work. (Three consumers since s47, 2.46 -> 2.28 ms at 32K:
//    the pass was bound by each consumer's per-tile chain at two consumer warps per scheduler, s28's ablation;
//    two ran at 232 registers.) Per tile, warp w of the group holds rows [16 w, +16) (units 4 w .. 4 w + 3,
//    head = row % 4):
//      S = Q K^T        wgmma m64n128 RS (Q by ldmatrix from the stage, K by descriptor), issued first;
//      S_idx = Q_idx K_idx^T (16 units x 128 keys, warp w keys [32 w, +32)) on mma.sync while the
//                       wgmma runs, into the group's S_idx tile (log2 domain);
//      P = exp2(S c - lse), 0 past the visible keys; summed over the unit's 4 heads by a reduce-scatter
//                       over lanes (a lane keeps a quarter of the unit sums);
//      O = P V          wgmma m64nD RS (P from registers, V MN-major), issued and left running under
//      KL terms per (unit, key) and dsi = Pidx - Pm into the group's dsi tile (one named barrier of the
//                       group before them: S_idx); then O is staged in the warp's own Q rows of the stage
//                       (dead after Q K^T) and stored by TMA, one box per unit (s54), the unit's KL sum
//                       written to kl_part;
//      dsi handed to the dK warpgroup (a proxy fence and dsi_full; the tile is rewritten after its dsi_empty);
//      dq_idx += dsi K_idx (warp w: Di columns [32 w, +32), mma.sync) as 16-byte reds (a second named barrier:
//                       dsi complete); the stage released once the warp's TMA stores have read it.
//  - with the index gradient, warpgroup 3, the dK warpgroup (setmaxnreg up to 168): index dk folded in
//    (dk_warpgroup below; it replaced the index dk kernel and the dsi_part round trip, s51).
// K, V and K_idx of the block are loaded once by the consumers (cp.async, a proxy fence for the wgmma
// reads of K and V, one barrier of the consumers) while the producer reads the unit table and gathers the first
// tiles. Measured at 32K (s16): 3.55 ms for the general sm_90a pass, 2.81 for this one as first built, 2.74
// with P V under the KL terms, 2.68 with the prologue overlapped too. s29: every shared-memory address of the
// consumers' loop from a per-lane base and one XOR per step (ncu: ~40% of their instructions were address
// arithmetic, recomputed per tile).
#pragma once
#include <cuda.h>  // CUtensorMap (types only)
#include <cuda_runtime.h>

#include <cstdint>

#include "common/block_span.h"
#include "common/fwd_item.cuh"
#include "common/det_sum.h"
#include "common/mma_sm80.h"
#include "common/tma_map.h"
#include "common/wgmma_sm90.h"
#include "params.h"
#include "sm80/sparse_fwd/sparse_fwd.h"
#include "sm90/sparse_fwd/sparse_fwd.h"

namespace msa::sm90::out_ws {

using sm80::cp_async_16;
using sm80::cp_async_4;
using sm80::fast_exp2;
using sm80::kl_term_log2;
using sm80::kLn2;
using sm80::kLog2e;
using sm80::ldmatrix_x4;
using sm80::MmaOp;
using sm80::pack2;
using sm80::smem_addr;
using sm80::SwizzledTile;

constexpr int kGu = kOutWsGu;          // query heads per unit (sparse_fwd.h's out_ws_applies dispatches on it)
constexpr int kKeys = 128;             // keys of a block (block_size 64 uses the first half)
constexpr int kUnits = 16;             // units per tile: one consumer warpgroup's 64 rows
constexpr int kRows = kUnits * kGu;    // 64
constexpr int kDi = 128;               // index head dim in shared memory (Di = 64 zero-filled)
constexpr int kStages = 4;             // the producer's ring: 4 / 3 tiles ahead per consumer
constexpr int kThreads = 512;          // the producer and three more warpgroups
// Without the index gradient (kDsi = false) the three are consumers; with it two consumers and the dK warpgroup
// (index dk folded in: dK_idx of the item's block accumulated in its registers). Tile t goes to consumer
// t % consumers<kDsi>().
template <bool kDsi>
constexpr int consumers() { return kDsi ? 2 : 3; }
// Tile t's "full" barrier is t % full_bars(): kStages where a stage's tiles all go to one consumer, else kStages x
// consumers, so that every barrier's phases are waited for in order by one consumer. A parity wait tells only the
// current phase from the one before: with three consumers on four stages, a consumer waiting for tile t on stage t % 4
// could otherwise see the phase of tile t - 4 (another consumer's) still pending or, had it polled ahead, take it for
// its own (PTX does not order one producer thread's cp.async arrives on two barriers; s61's review; a wait on both
// phases in turn deadlocks where tile t has already landed, as s61's memcheck run found).
template <int kConsumers, int kRing = kStages>
constexpr int full_bars() { return kRing % kConsumers == 0 ? kRing : kRing * kConsumers; }
constexpr int kSiS = kKeys + 8;        // floats per S_idx row: the 8 units of a fragment in distinct banks
constexpr int kProducerRegs = 40, kConsumerRegs = 152, kDkRegs = 168;
// setmaxnreg moves registers within the CTA's pool from the launch (128 per thread at 512 threads, by
// __launch_bounds__): a request past it would never be granted (the consumers would wait forever).
static_assert(kProducerRegs + kConsumerRegs * 3 <= 512 && kProducerRegs + kConsumerRegs * 2 + kDkRegs <= 512,
              "register pool");
// Named barriers: 1 .. 3 = consumer warpgroup cw + 1 (group_sync); kBarConsumers = every warpgroup but the producer.
constexpr int kBarConsumers = 4;
constexpr float kNegInf = -__builtin_huge_valf();

template <typename T, int D, int kConsumers>
struct Smem {  // byte offsets from the 1024-aligned base
  using KT = KMajorSw128<kKeys, D>;     // K and V (V read MN-major)
  using KiT = KMajorSw128<kKeys, kDi>;  // K_idx
  using DsiT = KMajorSw128<kUnits, kKeys>;  // a consumer's dsi tile (the dK warpgroup's B operand, MN-major)
  static constexpr int k = 0;
  static constexpr int v = k + kKeys * D * 2;
  static constexpr int ki = v + kKeys * D * 2;
  // One stage: Q (64 rows, SwizzledTile<D>; then O), Q_idx (16 units, SwizzledTile<kDi>), lse, lse_idx;
  // stages start 1024-byte aligned, so the swizzled addresses can be XORed whole.
  static constexpr int s_q = 0;
  static constexpr int s_qi = s_q + kRows * D * 2;
  static constexpr int s_lse = s_qi + kUnits * kDi * 2;
  static constexpr int s_lse_idx = s_lse + kRows * 4;
  static constexpr int stage_bytes = (s_lse_idx + kUnits * 4 + 1023) / 1024 * 1024;
  static constexpr int stage0 = ki + kKeys * kDi * 2;
  // Per consumer: dsi (DsiT, input dtype; 1024-aligned for wgmma) and S_idx (fp32, log2 domain).
  static constexpr int c_dsi = 0;
  static constexpr int c_si = c_dsi + kUnits * kKeys * 2;
  static constexpr int cons_bytes = (c_si + kUnits * kSiS * 4 + 1023) / 1024 * 1024;
  static constexpr int cons0 = stage0 + kStages * stage_bytes;
  static constexpr int table = cons0 + kConsumers * cons_bytes;  // the item's units: local entry ids, tokens
  // full[full_bars], empty[kStages], then dsi_full[2], dsi_empty[2] (consumer c's dsi tile, for the dK warpgroup)
  static constexpr int bars = table + 2 * sm80::kFwdMaxItemUnits * 4;
  static constexpr int bytes = bars + (full_bars<kConsumers>() + kStages + 4) * 8;
  static_assert(stage0 % 1024 == 0 && stage_bytes % 1024 == 0 && s_qi % 1024 == 0 && cons_bytes % 1024 == 0 &&
                    c_dsi % 1024 == 0 && c_si % 256 == 0,
                "tiles aligned for the XOR addressing and the descriptors");
};

// The 128 threads of consumer warpgroup `id - 1` (named barrier id 1, 2 or 3; 0 is __syncthreads).
__device__ __forceinline__ void group_sync(int id) { asm volatile("bar.sync %0, 128;\n" ::"r"(id) : "memory"); }
__device__ __forceinline__ void cp_async_mbar_arrive(uint64_t* bar) {
  asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];\n" ::"r"(smem_addr(bar)) : "memory");
}
// The ring's barriers (one thread, before a CTA barrier): full (one per stage, or n_full of them) completes on
// the 128 producer threads' cp.async arrivals, empty on the consuming warpgroup's 128 threads (and the dK
// warpgroup's: empty_count 256); dsi_full / dsi_empty (kDk) on consumer c's / the dK warpgroup's 128 threads.
__device__ __forceinline__ void init_ring(uint64_t* full, uint64_t* empty, int stages, bool kDk = false,
                                          int n_full = 0) {
  for (int s = 0; s < stages; ++s) {
    mbar_init(&full[s], 128);
    mbar_init(&empty[s], kDk ? 256 : 128);
  }
  for (int s = stages; s < n_full; ++s) mbar_init(&full[s], 128);
  if (kDk) {
    for (int i = 0; i < 4; ++i) mbar_init(&empty[stages + i], 128);  // dsi_full[2], dsi_empty[2]
  }
  mbar_fence_init();
}

// K (and, kV, V) of the index group's kv head and K_idx of the item's block into their KMajorSw128 tiles,
// keys past blen and Di past di zero-filled, by threads i0, i0 + step, ... (one cp.async group, committed).
template <typename T, int D, bool kV>
__device__ __forceinline__ void load_block(const SparseFwdParams& p, const FwdItem& f, T* sK, T* sV, T* sKi, int i0,
                                           int step) {
  using KT = KMajorSw128<kKeys, D>;
  using KiT = KMajorSw128<kKeys, kDi>;
  constexpr int kChunks = D / 8;
  const int tok0 = f.span.k_start + f.span.key0, blen = f.span.blen;
  const int kvh = (f.r * kGu) / (p.hq / p.hkv);
  const T* ks = static_cast<const T*>(p.k) + int64_t(tok0) * p.k_stride_t + int64_t(kvh) * p.k_stride_h;
  const T* vs = static_cast<const T*>(p.v) + int64_t(tok0) * p.v_stride_t + int64_t(kvh) * p.v_stride_h;
  for (int i = i0; i < kKeys * kChunks; i += step) {
    const int row = i / kChunks, c = i % kChunks;
    const bool ok = row < blen;
    const int rr = ok ? row : 0;
    cp_async_16(sK + KT::offset(row, c), ks + int64_t(rr) * p.k_stride_t + c * 8, ok);
    if constexpr (kV) cp_async_16(sV + KT::offset(row, c), vs + int64_t(rr) * p.v_stride_t + c * 8, ok);
  }
  const int kih = f.r / (p.hi / p.hki);
  const T* kis = static_cast<const T*>(p.k_idx) + int64_t(tok0) * p.ki_stride_t + int64_t(kih) * p.ki_stride_h;
  const int di_chunks = p.di / 8;
  for (int i = i0; i < kKeys * (kDi / 8); i += step) {
    const int row = i / (kDi / 8), c = i % (kDi / 8);
    const bool ok = row < blen && c < di_chunks;
    cp_async_16(sKi + KiT::offset(row, c), kis + (ok ? int64_t(row) * p.ki_stride_t + c * 8 : 0), ok);
  }
  sm80::cp_async_commit();
}

// Producer thread tid (of 128): its share of one tile's rows, Q of the nu units' kGu heads (64 rows,
// SwizzledTile<D>) and their Q_idx (SwizzledTile<kDi>), tokens tok[0 .. nu); rows of absent units and Di
// past di zero-filled. A thread copies one 16-byte column of rows tid / (D / 8) + 128 / (D / 8) i: one head.
template <typename T, int D>
__device__ __forceinline__ void gather_q(const SparseFwdParams& p, int r, const int* tok, int nu, T* sQ, T* sQi,
                                         int tid) {
  constexpr int kChunks = D / 8;
  constexpr int kRowStep = 128 / kChunks;
  static_assert(kRowStep % kGu == 0, "one head per producer thread");
  const int c = tid % kChunks;
  const T* qh = static_cast<const T*>(p.q) + int64_t(r * kGu + (tid / kChunks) % kGu) * p.q_stride_h + c * 8;
#pragma unroll 2
  for (int row = tid / kChunks; row < kRows; row += kRowStep) {
    const int u = row / kGu;
    const bool ok = u < nu;
    cp_async_16(sQ + SwizzledTile<D>::offset(row, c), qh + int64_t(ok ? tok[u] : 0) * p.q_stride_t, ok);
  }
  const T* QI = static_cast<const T*>(p.q_idx);
  const int di_chunks = p.di / 8;
#pragma unroll
  for (int i = tid; i < kUnits * (kDi / 8); i += 128) {
    const int u = i / (kDi / 8), ci = i % (kDi / 8);
    const bool ok = u < nu && ci < di_chunks;
    cp_async_16(sQi + SwizzledTile<kDi>::offset(u, ci),
                QI + (ok ? int64_t(tok[u]) * p.qi_stride_t + int64_t(r) * p.qi_stride_h + ci * 8 : 0), ok);
  }
}

// The dK warpgroup (kDsi: index dk folded into the pass; IndexDkParams' math): per tile t, after the stage's
// Q_idx landed (full) and consumer t % kConsumers wrote and fenced its dsi tile (dsi_full),
//   dK_idx^T[Di, keys] += Q_idx^T[Di, 16 units] dsi[16 units, keys]
// as two wgmma m64n128k16 RS (A = Q_idx^T by transposing ldmatrix from the stage, Di rows [64 h, +64); B = the dsi
// tile MN-major), then the dsi tile and the stage released. The accumulator stays in registers over the item (warp
// dw: Di rows 64 h + 16 dw + g, + 8; keys 8 n + 2 tq, + 1); at the end, scaled by dqi_scale, it goes out as 16-byte
// reds into dki_accum (keys < blen, Di < di) or stores into dki_part[item] (every key row: deterministic), after a
// 4 x 4 transpose over the lanes g % 4 that gives each lane 4 consecutive Di of one key.
template <typename T, int D, int kConsumers>
__device__ __forceinline__ void dk_warpgroup(const SparseFwdParams& p, const FwdItem& f, unsigned char* smem,
                                             uint64_t* full, uint64_t* empty, uint64_t* dsi_full, uint64_t* dsi_empty,
                                             int n_tiles, int dw, int lane) {
  using L = Smem<T, D, kConsumers>;
  using DsiT = typename L::DsiT;
  using QiTile = SwizzledTile<kDi>;
  const uint32_t smem0 = smem_addr(smem);
  const int g = lane / 4, tq = lane % 4;
  // ldmatrix.trans x4: matrix j = lane / 8 is (units 8 (j / 2) + lane % 8) x (Di chunk 2 dw + j % 2 of half h).
  const uint32_t qi_t = QiTile::bytes((lane & 7) + 8 * (lane >> 4), 2 * dw + ((lane >> 3) & 1));
  float acc[2][kKeys / 2];
  const bool two = p.di > 64;  // Di = 64: the second half of Q_idx^T is zero-filled, skipped
  for (int t = 0; t < n_tiles; ++t) {
    const int s = t % kStages, c = t % kConsumers;
    constexpr int kFull = full_bars<kConsumers>();
    mbar_wait(&full[t % kFull], (t / kFull) & 1);
    const uint32_t qi_addr = smem0 + L::stage0 + s * L::stage_bytes + L::s_qi + qi_t;
    uint32_t a[2][4];
#pragma unroll
    for (int h = 0; h < 2; ++h) sm80::ldmatrix_x4_trans_at(a[h], qi_addr ^ (h << 7));  // chunk + 8 h
    mbar_wait(&dsi_full[c], (t / kConsumers) & 1);
    const uint64_t b = DsiT::desc_mn(smem0 + L::cons0 + c * L::cons_bytes + L::c_dsi, 0);
    wgmma_fence();
#pragma unroll
    for (int h = 0; h < 2; ++h)
      if (h == 0 || two) WgmmaRS<T, kKeys, true>::run(acc[h], a[h], b, t > 0);
    wgmma_commit();
    wgmma_wait<0>();
    fence_regs(acc[0]);
    fence_regs(acc[1]);
    mbar_arrive(&dsi_empty[c]);
    mbar_arrive(&empty[s]);
  }
  const float sc = p.dqi_scale;
  const int tok0 = f.span.k_start + f.span.key0, blen = f.span.blen;
  const int kih = f.r / (p.hi / p.hki);
  const int gb = g & 3;
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    if (h == 1 && !two) break;
#pragma unroll
    for (int n = 0; n < kKeys / 8; n += 2) {
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        // x[j]: Di row g (+ 8 half), key 8 n + 2 tq + (j & 1) + 8 (j >> 1); after the transpose over gb: key
        // index j = gb, Di rows 4 (g / 4) + i (+ 8 half) for x[i].
        float x[4] = {acc[h][4 * n + 2 * half], acc[h][4 * n + 2 * half + 1], acc[h][4 * n + 4 + 2 * half],
                      acc[h][4 * n + 5 + 2 * half]};
#pragma unroll
        for (int m = 1; m < 4; m <<= 1) {
          const bool hi = (gb & m) != 0;
#pragma unroll
          for (int j0 = 0; j0 < 4; ++j0) {
            if ((j0 & m) == 0) {
              const float recv = __shfl_xor_sync(0xffffffffu, hi ? x[j0] : x[j0 | m], 4 * m);
              if (hi) x[j0] = recv; else x[j0 | m] = recv;
            }
          }
        }
        const int key = 8 * n + 2 * tq + (gb & 1) + 8 * (gb >> 1);
        const int d0 = 64 * h + 16 * dw + 8 * half + 4 * (g >> 2);
        const float4 v = make_float4(x[0] * sc, x[1] * sc, x[2] * sc, x[3] * sc);
        if (d0 < p.di) {
          if (p.dki_part != nullptr) {
            *reinterpret_cast<float4*>(p.dki_part + (int64_t(f.item) * kKeys + key) * p.di + d0) = v;
          } else if (key < blen) {
            sm80::atomic_add4(p.dki_accum + (int64_t(tok0 + key) * p.hki + kih) * p.di + d0, v);
          }
        }
      }
    }
  }
}

template <typename T, int D, bool kDsi>
__global__ void __launch_bounds__(kThreads, 1) out_pass_ws_kernel(SparseFwdParams p, const __grid_constant__ CUtensorMap o_map) {
  constexpr int kConsumers = consumers<kDsi>();
  using L = Smem<T, D, kConsumers>;
  using DsiT = typename L::DsiT;
  using KT = typename L::KT;
  using KiT = typename L::KiT;
  using QTile = SwizzledTile<D>;
  using QiTile = SwizzledTile<kDi>;
  extern __shared__ __align__(128) unsigned char smem_raw[];
  unsigned char* smem = smem_raw + ((1024 - (smem_addr(smem_raw) & 1023)) & 1023);
  T* sK = reinterpret_cast<T*>(smem + L::k);
  T* sV = reinterpret_cast<T*>(smem + L::v);
  T* sKi = reinterpret_cast<T*>(smem + L::ki);
  int* sEntryAll = reinterpret_cast<int*>(smem + L::table);
  int* sTokAll = sEntryAll + sm80::kFwdMaxItemUnits;
  constexpr int kFull = full_bars<kConsumers>();
  uint64_t* full = reinterpret_cast<uint64_t*>(smem + L::bars);
  uint64_t* empty = full + kFull;
  uint64_t* dsi_full = empty + kStages;  // [2] (kDsi)
  uint64_t* dsi_empty = dsi_full + 2;    // [2]

  FwdItem f;
  if (!fwd_item(p, f)) return;
  const int r = f.r, n_units = f.n_units;
  // The query row at the block's first key's position: a query row t sees the block's keys up to t - kpos0.
  const int kpos0 = f.span.q_origin + f.span.key0, blen = f.span.blen;
  const int n_tiles = (n_units + kUnits - 1) / kUnits;
  const int tid = threadIdx.x;

  // Prologue: the producer reads the unit table, the consumers start K, V and K_idx; after one CTA barrier
  // (the table and the mbarriers) the producer gathers the first tiles while those loads are in flight.
  if (tid < 128) {
    load_unit_table(p, f, sEntryAll, sTokAll, tid, 128);
    if (tid == 0) init_ring(full, empty, kStages, kDsi, kFull);
  } else {
    load_block<T, D, true>(p, f, sK, sV, sKi, tid - 128, kThreads - 128);
  }
  __syncthreads();

  if (tid < 128) {
    // Producer: tile t into stage t % kStages, once its consumer released the tile kStages before.
    setmaxnreg_dec<kProducerRegs>();
    for (int t = 0; t < n_tiles; ++t) {
      const int s = t % kStages;
      if (t >= kStages) mbar_wait(&empty[s], ((t / kStages) - 1) & 1);
      unsigned char* st = smem + L::stage0 + s * L::stage_bytes;
      const int ub = t * kUnits, nu = min(kUnits, n_units - ub);
      const int* tok = sTokAll + ub;
      gather_q<T, D>(p, r, tok, nu, reinterpret_cast<T*>(st + L::s_q), reinterpret_cast<T*>(st + L::s_qi), tid);
      if (tid < kRows) {
        const int u = tid / kGu;
        const bool ok = u < nu;
        cp_async_4(st + L::s_lse + tid * 4,
                   p.lse + (ok ? int64_t(r * kGu + tid % kGu) * p.total_tokens + tok[u] : 0), ok);
      } else if (tid < kRows + kUnits) {
        const int u = tid - kRows;
        const bool ok = kDsi && u < nu;
        cp_async_4(st + L::s_lse_idx + u * 4, ok ? p.lse_idx + int64_t(r) * p.total_tokens + tok[u] : p.lse, ok);
      }
      cp_async_mbar_arrive(&full[t % kFull]);
    }
    asm volatile("cp.async.wait_all;\n" ::: "memory");  // (uncommitted copies: wait_group 0 would not wait)
    return;
  }

  // Consumers (and the dK warpgroup): K, V and K_idx landed (each thread's own copies, then all of their
  // threads), made visible to wgmma (async proxy) by each writer's fence.
  sm80::cp_async_wait<0>();
  fence_proxy_async_smem();
  asm volatile("bar.sync %0, %1;\n" ::"n"(kBarConsumers), "n"(kThreads - 128) : "memory");
  const int cw = tid / 128 - 1;  // consumer 0 .. kConsumers - 1 (kConsumers: the dK warpgroup)
  const int ctid = tid % 128, wq = ctid / 32, lane = tid % 32, g = lane / 4, tq = lane % 4;
  if constexpr (kDsi) {
    if (cw == kConsumers) {
      setmaxnreg_inc<kDkRegs>();
      dk_warpgroup<T, D, kConsumers>(p, f, smem, full, empty, dsi_full, dsi_empty, n_tiles, wq, lane);
      return;
    }
  }
  setmaxnreg_inc<kConsumerRegs>();
  const uint32_t smem0 = smem_addr(smem);
  const int gi = g & (kGu - 1);  // the row's head in its unit
  float* sSi = reinterpret_cast<float*>(smem + L::cons0 + cw * L::cons_bytes + L::c_si);
  const uint32_t dsi_addr = smem0 + L::cons0 + cw * L::cons_bytes + L::c_dsi;
  const float iscale2 = p.index_scale * kLog2e;
  const float inv_g = 1.f / float(kGu);
  const uint32_t k_addr = smem_addr(sK), v_addr = smem_addr(sV);
  const int row0 = wq * 16 + g, row1 = row0 + 8;
  const int uu0 = row0 / kGu, uu1 = row1 / kGu;  // the rows' units in the tile
  // Shared-memory addresses: each lane's base once, then one XOR (and immediates) per k-step or chunk
  // (SwizzledTile / KMajorSw128::bytes), so the loop does not rebuild the swizzle per tile.
  const int l8 = lane & 7, l16 = lane >> 4, b8 = (lane >> 3) & 1;
  // S's A fragments: rows 16 wq + lane % 16 of the stage's Q, chunk 2 ks + l16 -> base ^ (ks << 5).
  const uint32_t q_frag = QTile::bytes(wq * 16 + (lane & 15), l16);
  // S_idx: A = rows lane % 16 of the stage's Q_idx (the same form); B = rows 32 wq + 16 np + l8 + 8 l16 of
  // K_idx, chunk 2 ks + b8 -> panel ks / 4, base ^ ((ks % 4) << 5), + 2048 np (16 rows).
  const uint32_t qi_frag = QiTile::bytes(lane & 15, l16);
  const uint32_t ki_frag = smem0 + L::ki + KiT::bytes(wq * 32 + l8 + 8 * l16, b8);
  // O staged in the warp's rows as the TMA store's box (make_rows_store_map): the rows in order, 16-byte chunk c of
  // 128-byte line L at c ^ (L % 8) (D = 128; line 2 row + panel) or c ^ (L % 4) (D = 64; line = row), so (row0,
  // chunk 8 panel + n) + 2 tq elements -> (o_stage(panel) ^ (n << 4)) + 128 panel, row1 at + 16 D (the same L mod 8).
  auto o_stage = [&](int panel) {
    const int line = row0 * (2 * D / 128) + panel;
    return uint32_t(row0 * 2 * D + 4 * tq + ((line & (D == 128 ? 7 : 3)) << 4));
  };
  // dsi of the units uu0, uu1, chunk n + gi (n % 4 = 0; DsiT: 64-key panels) + 2 tq elements ->
  // (base ^ ((n % 8) << 4)) + panel n / 8.
  const uint32_t dsi_w0 = dsi_addr + DsiT::bytes(uu0, gi) + 4 * tq, dsi_w1 = dsi_addr + DsiT::bytes(uu1, gi) + 4 * tq;
  // dq_idx += dsi K_idx: A = dsi rows lane % 16, chunk 2 kk + l16 -> (base ^ ((kk % 4) << 5)) + panel kk / 4; B =
  // K_idx read transposed, rows 16 kk + l8 + 8 b8, chunk 4 wq + 2 dp + l16 -> base ^ (dp << 5) + 2048 kk.
  const uint32_t dsi_frag = dsi_addr + DsiT::bytes(lane & 15, l16);
  const uint32_t kit_frag = smem0 + L::ki + KiT::bytes(l8 + 8 * b8, 4 * wq + l16);
  for (int t = cw; t < n_tiles; t += kConsumers) {
    const int s = t % kStages;
    const int k_own = t / kConsumers;  // this consumer's tile count so far
    mbar_wait(&full[t % kFull], (t / kFull) & 1);
    unsigned char* st = smem + L::stage0 + s * L::stage_bytes;
    const uint32_t st_addr = smem0 + L::stage0 + s * L::stage_bytes;
    const float* sLse = reinterpret_cast<const float*>(st + L::s_lse);
    const float* sLseIdx = reinterpret_cast<const float*>(st + L::s_lse_idx);
    const int ub = t * kUnits, nu = min(kUnits, n_units - ub);
    const int* sEntry = sEntryAll + ub;
    const int* sTok = sTokAll + ub;

    // S = Q K^T: every A fragment loaded, then the wgmmas issued as one group (waited for below).
    float sw[kKeys / 2];
    {
      uint32_t a[D / 16][4];
#pragma unroll
      for (int ks = 0; ks < D / 16; ++ks) sm80::ldmatrix_x4_at(a[ks], (st_addr + L::s_q + q_frag) ^ (ks << 5));
      wgmma_fence();
#pragma unroll
      for (int ks = 0; ks < D / 16; ++ks) WgmmaRS<T, kKeys>::run(sw, a[ks], KT::desc(k_addr, ks), ks > 0);
      wgmma_commit();
      // S_idx under it: warp wq's 32 keys of the tile's 16 units (keys past blen and Di past di read
      // zeros: no branch here, after the wgmma issue).
      float ci[4][4];
      sm80::zero_acc(ci);
#pragma unroll
      for (int ks = 0; ks < kDi / 16; ++ks) {
        uint32_t fa[4];
        sm80::ldmatrix_x4_at(fa, (st_addr + L::s_qi + qi_frag) ^ (ks << 5));
#pragma unroll
        for (int np = 0; np < 2; ++np) {
          uint32_t b[4];
          sm80::ldmatrix_x4_at(b, (ki_frag ^ ((ks & 3) << 5)) + (ks >> 2) * (KiT::kPanelElems * 2) + np * 16 * 128);
          MmaOp<T>::run(ci[2 * np], fa, b[0], b[1]);
          MmaOp<T>::run(ci[2 * np + 1], fa, b[2], b[3]);
        }
      }
#pragma unroll
      for (int n = 0; n < 4; ++n) {
        const int col = wq * 32 + n * 8 + 2 * tq;
        *reinterpret_cast<float2*>(sSi + g * kSiS + col) = make_float2(ci[n][0] * iscale2, ci[n][1] * iscale2);
        *reinterpret_cast<float2*>(sSi + (g + 8) * kSiS + col) = make_float2(ci[n][2] * iscale2, ci[n][3] * iscale2);
      }
      wgmma_wait<0>();
      fence_regs(sw);
    }
    float c[kKeys / 8][4];
#pragma unroll
    for (int n = 0; n < kKeys / 8; ++n)
#pragma unroll
      for (int e = 0; e < 4; ++e) c[n][e] = sw[4 * n + e];

    const float e0 = sLse[row0] * kLog2e, e1 = sLse[row1] * kLog2e;
    const float li0 = kDsi ? sLseIdx[uu0] * kLog2e : 0.f, li1 = kDsi ? sLseIdx[uu1] * kLog2e : 0.f;
    // Last visible key (block-relative) of a unit, -1 past the tile's units.
    auto key_limit = [&](int u) { return u < nu ? min(blen - 1, sTok[u] - kpos0) : -1; };
    const int lim0 = key_limit(uu0), lim1 = key_limit(uu1);
    // Units are in token order: when the first sees the whole block, every unit does.
    const bool full_tile = blen == kKeys && sTok[0] - kpos0 >= kKeys - 1;
    auto exp_tile = [&](auto masked) {
      constexpr bool kMasked = decltype(masked)::value;
#pragma unroll
      for (int n = 0; n < kKeys / 8; ++n) {
        const int col = n * 8 + 2 * tq;
        c[n][0] = !kMasked || col <= lim0 ? fast_exp2(fmaf(c[n][0], p.scale_log2, -e0)) : 0.f;
        c[n][1] = !kMasked || col + 1 <= lim0 ? fast_exp2(fmaf(c[n][1], p.scale_log2, -e0)) : 0.f;
        c[n][2] = !kMasked || col <= lim1 ? fast_exp2(fmaf(c[n][2], p.scale_log2, -e1)) : 0.f;
        c[n][3] = !kMasked || col + 1 <= lim1 ? fast_exp2(fmaf(c[n][3], p.scale_log2, -e1)) : 0.f;
      }
    };
    if (full_tile) exp_tile(std::false_type{}); else exp_tile(std::true_type{});

    // P in the input dtype as the A operand of P V: n-tiles 2 kk, 2 kk + 1 are the fragment of keys
    // [16 kk, +16).
    uint32_t pa[kKeys / 16][4];
#pragma unroll
    for (int kk = 0; kk < kKeys / 16; ++kk) sm80::a_frag<T>(&c[2 * kk][0], pa[kk]);
    // Sum of P over the unit's 4 heads (lane bits 2-3): at bit b a lane keeps one n-tile of each pair
    // (n, n | b) and sends the other; afterwards slot n (n % 4 = 0) of lane gi holds n-tile n + gi.
#pragma unroll
    for (int b = 1; b < kGu; b <<= 1) {
      const bool hi = (gi & b) != 0;
#pragma unroll
      for (int n = 0; n < kKeys / 8; ++n) {
        if ((n & (2 * b - 1)) == 0) {
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            const float send = hi ? c[n][e] : c[n | b][e];
            const float keep = hi ? c[n | b][e] : c[n][e];
            c[n][e] = keep + __shfl_xor_sync(0xffffffffu, send, 4 * b);
          }
        }
      }
    }

    // O = P V, one 64-column panel of V per group of wgmmas, left running under the KL terms (they need
    // only the unit sums of P and S_idx: no branch and no read of the wgmma's registers in between),
    // then staged in the warp's own Q rows (its Q K^T is done) and stored as whole units: a unit's 4 rows
    // are 4 D contiguous outputs of part.
    float ow[D / 64][32];
#pragma unroll
    for (int panel = 0; panel < D / 64; ++panel) {
      wgmma_fence();
#pragma unroll
      for (int kk = 0; kk < kKeys / 16; ++kk)
        WgmmaRS<T, 64, true>::run(ow[panel], pa[kk], KT::desc_mn(v_addr + panel * KT::kPanelElems * 2, kk), kk > 0);
      wgmma_commit();
    }

    group_sync(1 + cw);  // S_idx of all the group's keys
    // The dK warpgroup has read this consumer's previous dsi tile.
    if (kDsi && k_own > 0) mbar_wait(&dsi_empty[cw], (k_own - 1) & 1);
    // KL terms: lane gi holds the unit sums of n-tiles n + gi (n % 4 = 0) of rows g, g + 8.
    float acc0 = 0.f, acc1 = 0.f;  // log2 domain: sum pm (log2 pm - si)
#pragma unroll
    for (int n = 0; n < kKeys / 8; n += kGu) {
      const int col = (n + gi) * 8 + 2 * tq;
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int u = h ? uu1 : uu0;
        const float2 si = *reinterpret_cast<const float2*>(sSi + u * kSiS + col);
        const float pm0 = c[n][2 * h] * inv_g, pm1 = c[n][2 * h + 1] * inv_g;
        const float term = kl_term_log2(pm0, si.x) + kl_term_log2(pm1, si.y);
        if (h) acc1 += term; else acc0 += term;
        if constexpr (kDsi) {  // SPEC 4: Pidx - Pm, 0 past the visible keys
          const int lim = h ? lim1 : lim0;
          const float li = h ? li1 : li0;
          const float d0 = col <= lim ? fast_exp2(si.x - li) - pm0 : 0.f;
          const float d1 = col + 1 <= lim ? fast_exp2(si.y - li) - pm1 : 0.f;
          const uint32_t a = ((h ? dsi_w1 : dsi_w0) ^ ((n & 7) << 4)) + (n >> 3) * (DsiT::kPanelElems * 2);
          *reinterpret_cast<uint32_t*>(smem + (a - smem0)) = pack2<T>(d0, d1);
        }
      }
    }
    if constexpr (kDsi) {  // this thread's dsi writes, to the dK warpgroup's wgmma (async proxy)
      fence_proxy_async_smem();
      mbar_arrive(&dsi_full[cw]);
    }
#pragma unroll
    for (int off = 1; off < 4 * kGu; off <<= 1) {  // over tq, then over the unit's lanes gi
      acc0 += __shfl_xor_sync(0xffffffffu, acc0, off);
      acc1 += __shfl_xor_sync(0xffffffffu, acc1, off);
    }

    wgmma_wait<0>();
#pragma unroll
    for (int panel = 0; panel < D / 64; ++panel) {
      fence_regs(ow[panel]);
#pragma unroll
      for (int n = 0; n < 8; ++n) {
        unsigned char* o = st + L::s_q + (o_stage(panel) ^ (n << 4)) + panel * 128;
        *reinterpret_cast<uint32_t*>(o) = pack2<T>(ow[panel][4 * n], ow[panel][4 * n + 1]);
        *reinterpret_cast<uint32_t*>(o + 8 * 2 * D) = pack2<T>(ow[panel][4 * n + 2], ow[panel][4 * n + 3]);
      }
    }
    // The warp's units out by TMA stores of whole units (a unit's kGu rows are kGu D contiguous outputs of part):
    // this thread's writes to the async proxy, then lane l stores unit (16 / kGu) wq + l. The stage is released at the
    // tile's end, once the stores have read it.
    fence_proxy_async_smem();
    __syncwarp();
    if (lane < 16 / kGu && wq * (16 / kGu) + lane < nu) {
      const int u = wq * (16 / kGu) + lane;
      tma_store_3d(&o_map, st + L::s_q + u * (kGu * D * 2), 0, 0, sEntry[u] * kGu);
      bulk_commit();
    }
    if (tq == 0 && gi == 0) {
      if (uu0 < nu) p.kl_part[sEntry[uu0]] = acc0 * kLn2;
      if (uu1 < nu) p.kl_part[sEntry[uu1]] = acc1 * kLn2;
    }
    // dsi of all the group's units complete, and every read of S_idx done (the next tile rewrites it).
    group_sync(1 + cw);
    if constexpr (kDsi) {
      // dq_idx += dsi K_idx: warp wq takes Di columns [32 wq, +32) of the 16 units.
      if (wq * 32 < p.di) {
        float dq[4][4];
        sm80::zero_acc(dq);
#pragma unroll
        for (int kk = 0; kk < kKeys / 16; ++kk) {
          uint32_t fa[4];
          sm80::ldmatrix_x4_at(fa, (dsi_frag ^ ((kk & 3) << 5)) + (kk >> 2) * (DsiT::kPanelElems * 2));
#pragma unroll
          for (int dp = 0; dp < 2; ++dp) {
            uint32_t fb[4];
            sm80::ldmatrix_x4_trans_at(fb, (kit_frag ^ (dp << 5)) + kk * 16 * 128);
            MmaOp<T>::run(dq[2 * dp], fa, fb[0], fb[1]);
            MmaOp<T>::run(dq[2 * dp + 1], fa, fb[2], fb[3]);
          }
        }
        // One 16-byte red per lane and n-tile: even tq lanes add unit g, odd ones g + 8.
        const int uq = g + ((tq & 1) ? 8 : 0);
        float4 x[4];
        const float sc = p.dqi_scale;
#pragma unroll
        for (int n = 0; n < 4; ++n) {
          const float4 v = sm80::quad_rows4(dq[n], tq);
          x[n] = make_float4(v.x * sc, v.y * sc, v.z * sc, v.w * sc);
        }
        if (uq < nu) {
          const int64_t o = (int64_t(sTok[uq]) * p.hi + r) * p.di + wq * 32 + 2 * (tq & ~1);
          float* dst = p.dqi_accum + o;
          if (p.dqi_lo != nullptr) {
            const float4 grid = __ldg(p.dqi_grid);
#pragma unroll
            for (int n = 0; n < 4; ++n) det_add4(dst + n * 8, p.dqi_lo + o + n * 8, x[n], grid);
          } else {
#pragma unroll
            for (int n = 0; n < 4; ++n) sm80::atomic_add4(dst + n * 8, x[n]);
          }
        }
      }
    }
    if (lane < 16 / kGu) bulk_wait<0, true>();  // this warp's stores have read the stage
    __syncwarp();
    mbar_arrive(&empty[s]);  // this thread's reads of the stage are done
  }
  if (lane < 16 / kGu) bulk_wait<0, false>();  // the partials written before the CTA ends
}

// One CTA per work item of the chunk, `smem` bytes of dynamic shared memory (+ 1024 for the alignment); `extra`:
// the kernel's arguments after p.
template <typename Kernel, typename... Extra>
cudaError_t launch_items(Kernel kernel, int threads, int smem, const SparseFwdParams& p, cudaStream_t stream,
                         const Extra&... extra) {
  if (p.work.max_items == 0) return cudaSuccess;
  cudaError_t err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem + 1024);
  if (err != cudaSuccess) return err;
  kernel<<<p.work.max_items, threads, smem + 1024, stream>>>(p, extra...);
  return cudaGetLastError();
}

template <typename T, int D>
cudaError_t launch(const SparseFwdParams& p, cudaStream_t stream) {
  if (p.work.max_items == 0) return cudaSuccess;
  // The output partials' store map: rows of D, boxes of one unit's kGu rows (entries < 2^31 / kGu: the partials'
  // bytes, 2 kGu D per entry, would exceed any GPU's memory first).
  CUtensorMap o_map;
  const cudaError_t err = make_rows_store_map<T>(p.out_part, D, p.out_entries * kGu, kGu, &o_map);
  if (err != cudaSuccess) return err;
  return p.dki_accum != nullptr  // the index gradient (kDsi): out_ws_fuses_index_dk
             ? launch_items(out_pass_ws_kernel<T, D, true>, kThreads, Smem<T, D, consumers<true>()>::bytes, p, stream, o_map)
             : launch_items(out_pass_ws_kernel<T, D, false>, kThreads, Smem<T, D, consumers<false>()>::bytes, p, stream,
                            o_map);
}

}  // namespace msa::sm90::out_ws
