// The sparse backward on Hopper, warp-specialized (issue 17 item 2). Same work items, inputs and fp32
// accumulators as the general kernel (smxx/sparse_bwd/sparse_bwd_body.cuh, its top comment has the
// math and the item layout); every head layout it takes (any Gu <= 64, J >= 1), the deterministic mode too.
//
// A CTA takes one work item (a kv block of one index group and up to units_per_item of the units that
// selected it) with 3 warpgroups:
//  - warpgroup 0 (setmaxnreg down to 40) has two jobs:
//    - warps 0-2 (deterministic mode: 0-1), the gatherers: each tile's 64 rows (U = 64 / Gu units x Gu heads:
//      Q, dO, lse, delta, and per row its token, head and last visible key) into a ring of two stages, reused
//      once both consumers released a stage ("empty": right after their dV / dK GEMMs, before dQ). With kTma
//      (launch() below: Gu 4 or 8 by default, also 1 or 2 with MSA_BWD_WS_TMA=1), a unit's Q and dO rows are one
//      TMA box per 64-column panel, issued by the thread of its first row and counted by bytes on the stage's
//      "full" mbarrier; the 64 table threads store the rest and arrive without waiting for the data. Else by
//      16-byte cp.async: each gatherer waits for its copies, fences them to the async proxy (wgmma reads Q and
//      dO) and arrives;
//    - warp 3 (deterministic mode: 2-3), the dQ writer: per tile it adds the tile's fp32 dQ from shared memory
//      (one of two buffers) to dq_accum (one bulk reduction per row; the deterministic mode: 16-byte reds of
//      its hi / lo split), so no consumer waits for an atomic.
//  - warpgroups 1 and 2, the consumers (setmaxnreg up to 232): consumer c owns keys [64 c, +64) of the
//    block for the whole item, dK and dV of them in registers (m64nD each). Per tile, in two halves of 32
//    rows, transposed (keys as the MMA's M):
//      S^T = K_c Q^T, dP^T = V_c dO^T   wgmma m64n32 SS (both operands K-major by descriptor);
//      P^T = exp2(S^T c - lse), 0 past the row's last visible key; dS^T = P^T (dP^T - delta);
//      dV += P^T dO, dK += dS^T Q       wgmma m64nD RS (P^T, dS^T from registers; dO, Q MN-major),
//                                       left running while the next half's exponentials are computed;
//      dS^T into the consumer's own shared tile, then dQ:
//      D = 128: dQ[:, 64 c, +64) = dS K[:, 64 c, +64) over all 128 keys, wgmma m64n64 SS (dS read MN-major from
//                both consumers' dS^T tiles after a barrier of the two, K MN-major), issued at the tile's end
//                and left running under the next tile's stage wait and first S^T / dP^T; then stored into
//                the previous tile's dQ buffer (fp32, its own 64 columns) and a second barrier of the two
//                frees the dS^T tiles;
//      D = 64:  dQ_c = dS_c K_c over its 64 keys, wgmma m64n64 RS (dS by transposed ldmatrix, K MN-major):
//                consumer 0 stores its partial (fp32) into the tile's dQ buffer, consumer 1 adds its own.
// The consumers meet there (D = 128: two barriers of the two per tile; D = 64: consumer 1 waits for consumer 0's
// partial), on the stages and (J > 1) on the K / V reload.
#pragma once
#include <cuda_runtime.h>

#include <cstdint>

#include "common/block_span.h"
#include "common/det_sum.h"
#include "common/mma_sm80.h"
#include "common/tma_map.h"
#include "common/wgmma_sm90.h"
#include "params.h"
#include "smxx/sparse_bwd/sparse_bwd_body.cuh"
#include "sm90/sparse_fwd/out_pass_ws.cuh"  // setmaxnreg_*, group_sync

namespace msa::sm90::bwd_ws {

using out_ws::group_sync;
using sm80::cp_async_16;
using sm80::cp_async_4;
using sm80::fast_exp2;
using sm80::kLog2e;
using sm80::ldmatrix_x4_trans;
using sm80::pack2;
using sm80::smem_addr;

constexpr int kKeys = 128;     // keys of a block (block_size 64: keys past it are masked, K / V zero)
constexpr int kRows = 64;      // rows per tile
constexpr int kStages = 2;
constexpr int kThreads = 384;  // producer / writer + two consumers
// Gatherer threads: warps 0-2 (s41: 3.938 -> 3.452 ms at 32K against two, where the consumers waited for the
// stages), the last warp of warpgroup 0 writes dQ; deterministic mode: warps 0-1, two writer warps adding the exact
// sums.
template <bool kDet>
constexpr int kGatherOf = kDet ? 64 : 96;
constexpr int kProducerRegs = 40, kConsumerRegs = 232;
static_assert(kProducerRegs * 128 + kConsumerRegs * 256 <= (65536 / kThreads & ~7) * kThreads, "register pool");
// Named barriers: 1, 2 = consumer warpgroup 0, 1 (out_ws::group_sync); 3 = both consumers; 4 = gatherers.
constexpr int kBarConsumers = 3, kBarGather = 4;

template <typename T, int D>
struct Smem {  // byte offsets from the 1024-aligned base
  using KT = KMajorSw128<kKeys, D>;   // K and V
  using QT = KMajorSw128<kRows, D>;   // Q and dO of a stage
  using DsT = KMajorSw128<64, kRows>; // a consumer's dS^T: rows = its 64 keys, 64 rows per key
  static constexpr int kDqStride = D + 8;  // floats per dQ partial row: the consumers' float2 stores conflict-free
  static constexpr int k = 0;
  static constexpr int v = k + kKeys * D * 2;
  // One stage: Q, dO, lse, delta, token, head (absolute), last visible key (block-relative, -1: no row).
  static constexpr int s_q = 0;
  static constexpr int s_do = s_q + kRows * D * 2;
  static constexpr int s_lse = s_do + kRows * D * 2;
  static constexpr int s_delta = s_lse + kRows * 4;
  static constexpr int s_tok = s_delta + kRows * 4;
  static constexpr int s_head = s_tok + kRows * 4;
  static constexpr int s_lim = s_head + kRows * 4;
  static constexpr int stage_bytes = (s_lim + kRows * 4 + 1023) / 1024 * 1024;  // Q / dO tiles 1024-aligned
  static constexpr int stage0 = v + kKeys * D * 2;
  static constexpr int ds = stage0 + kStages * stage_bytes;  // two DsT tiles
  // Two dQ buffers (tiles i % 2), kRows x kDqStride fp32 each, with their rows' tokens and heads.
  static constexpr int dq = ds + 2 * 64 * kRows * 2;
  static constexpr int dq_tok = dq + 2 * kRows * kDqStride * 4;
  static constexpr int dq_head = dq_tok + 2 * kRows * 4;
  static constexpr int bars = dq_head + 2 * kRows * 4;
  static constexpr int bytes = bars + (2 * kStages + 6) * 8;
  static_assert(stage_bytes % 1024 == 0 && ds % 1024 == 0, "wgmma tiles 1024-aligned");
};

// Whether the warp-specialized kernel runs: the host's choice (it takes every layout the general one does; like the
// general sm_90a kernel it ignores small_smem).
inline bool applies(const SparseBwdParams& p) { return p.ws; }

// A warp's rows qrow and qrow + 8 of a 64-column dQ accumulator slice (acc[4 n + e]: columns col0 + 8 n and + 1, col0
// holding the lane's 2 tq), times scale, into the fp32 dQ buffer buf (kStride floats a row); add: onto the values there.
template <int kStride>
__device__ __forceinline__ void put_dq_rows(float* buf, int qrow, int col0, const float (&acc)[32], float scale,
                                            bool add) {
#pragma unroll
  for (int n = 0; n < 8; ++n) {
    float2* d0 = reinterpret_cast<float2*>(buf + qrow * kStride + col0 + n * 8);
    float2* d1 = reinterpret_cast<float2*>(buf + (qrow + 8) * kStride + col0 + n * 8);
    float2 v0 = make_float2(acc[4 * n] * scale, acc[4 * n + 1] * scale);
    float2 v1 = make_float2(acc[4 * n + 2] * scale, acc[4 * n + 3] * scale);
    if (add) {
      const float2 a0 = *d0, a1 = *d1;
      v0 = make_float2(a0.x + v0.x, a0.y + v0.y);
      v1 = make_float2(a1.x + v1.x, a1.y + v1.y);
    }
    *d0 = v0;
    *d1 = v1;
  }
}

// kTma: the TMA unit gather (a template parameter, so a profile names the path that ran); q_map / do_map: Q and dO
// as (tokens, heads, D) in boxes of 64 columns x Gu heads x 1 token (unused without kTma).
template <typename T, int D, bool kDet, bool kTma>
__global__ void __launch_bounds__(kThreads, 1)
    sparse_bwd_ws_kernel(SparseBwdParams p, const __grid_constant__ CUtensorMap q_map,
                         const __grid_constant__ CUtensorMap do_map) {
  using L = Smem<T, D>;
  using KT = typename L::KT;
  using QT = typename L::QT;
  using DsT = typename L::DsT;
  constexpr int kChunks = D / 8;
  constexpr int kGather = kGatherOf<kDet>;
  // D = 128: consumer c computes dQ's columns [64 c, +64) over all 128 keys (both dS^T tiles); D = 64: its 64 keys'
  // partial over all columns, consumer 1 adding its own to consumer 0's.
  constexpr bool kColSplit = D == 128;
  extern __shared__ __align__(128) unsigned char smem_raw[];
  unsigned char* smem = smem_raw + ((1024 - (smem_addr(smem_raw) & 1023)) & 1023);
  T* sK = reinterpret_cast<T*>(smem + L::k);
  T* sV = reinterpret_cast<T*>(smem + L::v);
  float* sDq = reinterpret_cast<float*>(smem + L::dq);
  int* sDqTok = reinterpret_cast<int*>(smem + L::dq_tok);
  int* sDqHead = reinterpret_cast<int*>(smem + L::dq_head);
  uint64_t* full = reinterpret_cast<uint64_t*>(smem + L::bars);
  uint64_t* empty = full + kStages;
  // dQ buffer b: dq_half (D = 64: consumer 0's partial stored), dq_full (complete: D = 128 both consumers' columns,
  // D = 64 consumer 1's sum), dq_empty (written out).
  uint64_t* dq_half = empty + kStages;
  uint64_t* dq_full = dq_half + 2;
  uint64_t* dq_empty = dq_full + 2;

  smxx::BwdItem bi;
  if (!smxx::bwd_item(p, bi)) return;
  const int item = bi.item, r = bi.r, u_begin = bi.u_begin, u_end = bi.u_end;
  const int krow0 = bi.krow0, kpos0 = bi.kpos0, blen = bi.blen;
  const int G = bi.G, J = bi.J, Gu = bi.Gu;
  const int U = kRows / Gu;  // units per tile
  const int n_tiles = (u_end - u_begin + U - 1) / U;
  const int n_all = J * n_tiles;  // tiles of all kv heads, in (j, tile) order
  const int tid = threadIdx.x;

  if (tid == 0) {
    for (int s = 0; s < kStages; ++s) {
      mbar_init(&full[s], kTma ? kRows : kGather);  // TMA: the table threads (and the boxes' bytes)
      mbar_init(&empty[s], 256);
    }
    for (int b = 0; b < 2; ++b) {
      mbar_init(&dq_half[b], 128);
      mbar_init(&dq_full[b], kColSplit ? 256 : 128);
      mbar_init(&dq_empty[b], 128 - kGather);
    }
    mbar_fence_init();
  }
  __syncthreads();

  if (tid < 128) {
    setmaxnreg_dec<kProducerRegs>();
    if (kTma && tid < kGather) {
      // TMA gather: thread trow = tid < 64 stores row trow of each tile's table; the thread of a unit's first row
      // issues its boxes of Q and dO (a token past the end for a missing unit: the boxes read zeros) and arrives
      // with their bytes expected; no thread waits for the data (the consumers wait on the full mbarrier).
      if (tid >= kRows) return;
      const int trow = tid;
      for (int i = 0; i < n_all; ++i) {
        const int s = i % kStages;
        const int j = i / n_tiles, t = i - j * n_tiles;
        const int h0 = r * G + j * Gu;
        const int u = trow / Gu, uu = u_begin + t * U + u;
        const bool tok_ok = u < U && uu < u_end;
        const int ttok = tok_ok ? p.tokens[uu] : -1;  // these loads before the stage is free
        const int head = h0 + (trow - u * Gu);
        const int64_t o = tok_ok ? int64_t(head) * p.total_tokens + ttok : 0;
        const float lse_v = tok_ok ? __ldg(p.lse + o) : 0.f, delta_v = tok_ok ? __ldg(p.delta + o) : 0.f;
        if (i >= kStages) mbar_wait(&empty[s], ((i / kStages) - 1) & 1);
        unsigned char* st = smem + L::stage0 + s * L::stage_bytes;
        const bool issuer = trow % Gu == 0 && u < U;
        if (issuer) {
          const int tcoord = tok_ok ? ttok : p.total_tokens;
#pragma unroll
          for (int panel = 0; panel < D / 64; ++panel) {
            tma_load_3d(st + L::s_q + panel * QT::kPanelElems * 2 + trow * 128, &q_map, panel * 64, h0, tcoord,
                        &full[s]);
            tma_load_3d(st + L::s_do + panel * QT::kPanelElems * 2 + trow * 128, &do_map, panel * 64, h0, tcoord,
                        &full[s]);
          }
        }
        reinterpret_cast<int*>(st + L::s_tok)[trow] = ttok;
        reinterpret_cast<int*>(st + L::s_head)[trow] = head;
        reinterpret_cast<int*>(st + L::s_lim)[trow] = tok_ok ? min(blen - 1, ttok - kpos0) : -1;
        reinterpret_cast<float*>(st + L::s_lse)[trow] = lse_v;
        reinterpret_cast<float*>(st + L::s_delta)[trow] = delta_v;
        // The arrival releases this thread's table stores; the issuer's counts its boxes' bytes first, so the
        // phase cannot complete before they land.
        if (issuer) mbar_arrive_expect_tx(&full[s], 2 * (D / 64) * Gu * 128);
        else mbar_arrive(&full[s]);
      }
      return;
    }
    if (tid < kGather) {
      // Gatherers (cp.async): tile i into stage i % 2. Tile i - 1's copies are waited for (then fenced and announced)
      // before tile i's stage is awaited, so a stage is announced about one gather latency after its issue.
      for (int i = 0; i <= n_all; ++i) {
        if (i > 0) {
          sm80::cp_async_wait<0>();
          fence_proxy_async_smem();  // this thread's copies -> the consumers' wgmma reads
          mbar_arrive(&full[(i - 1) % kStages]);
        }
        if (i == n_all) break;
        const int s = i % kStages;
        const int j = i / n_tiles, t = i - j * n_tiles;
        const int h0 = r * G + j * Gu;
        // This thread's row of tile i's table (token, head, last visible key): its token is loaded before the
        // stage is free, so the load's latency runs under the wait.
        static_assert(kGather >= kRows, "one row per gatherer thread");
        const int trow = tid, u = trow / Gu, uu = u_begin + t * U + u;
        const bool tok_ok = trow < kRows && u < U && uu < u_end;
        const int ttok = tok_ok ? p.tokens[uu] : -1;
        if (i >= kStages) mbar_wait(&empty[s], ((i / kStages) - 1) & 1);
        unsigned char* st = smem + L::stage0 + s * L::stage_bytes;
        int* sTok = reinterpret_cast<int*>(st + L::s_tok);
        int* sHead = reinterpret_cast<int*>(st + L::s_head);
        if (trow < kRows) {  // token, head, last visible key; lse and delta
          const int head = h0 + (trow - u * Gu);
          sTok[trow] = ttok;
          sHead[trow] = head;
          reinterpret_cast<int*>(st + L::s_lim)[trow] = tok_ok ? min(blen - 1, ttok - kpos0) : -1;
          const int64_t o = tok_ok ? int64_t(head) * p.total_tokens + ttok : 0;
          cp_async_4(st + L::s_lse + trow * 4, p.lse + o, tok_ok);
          cp_async_4(st + L::s_delta + trow * 4, p.delta + o, tok_ok);
        }
        asm volatile("bar.sync %0, %1;\n" ::"n"(kBarGather), "n"(kGather) : "memory");  // the row table
        const T* Q = static_cast<const T*>(p.q);
        const T* dO = static_cast<const T*>(p.dout);
        T* sQ = reinterpret_cast<T*>(st + L::s_q);
        T* sdO = reinterpret_cast<T*>(st + L::s_do);
        const int c = tid % kChunks;
#pragma unroll 2
        for (int row = tid / kChunks; row < kRows; row += kGather / kChunks) {
          const int tok = sTok[row];
          const bool ok = tok >= 0;
          const int64_t tt = ok ? tok : 0, hh = sHead[row];
          cp_async_16(sQ + QT::offset(row, c), Q + tt * p.q_stride_t + hh * p.q_stride_h + c * 8, ok);
          cp_async_16(sdO + QT::offset(row, c), dO + tt * p.do_stride_t + hh * p.do_stride_h + c * 8, ok);
        }
        sm80::cp_async_commit();
      }
      return;
    }
    // The dQ writer: tile i's dQ (both consumers' sum, scaled already) from buffer i % 2 to dq_accum.
    constexpr int kWriters = 128 - kGather;
    const int wt = tid - kGather;
    static_assert(L::kDqStride * 4 % 16 == 0 && L::dq % 16 == 0, "bulk reductions read 16-byte aligned rows");
    if constexpr (!kDet) {
      // One bulk reduction per row (D fp32, 512 or 256 contiguous bytes at (token, head)), issued by writer
      // thread row % kWriters; the buffer goes back to the consumers once the reductions have read it.
      for (int i = 0; i < n_all; ++i) {
        const int b = i & 1;
        mbar_wait(&dq_full[b], (i >> 1) & 1);
        const float* buf = sDq + b * kRows * L::kDqStride;
        for (int row = wt; row < kRows; row += kWriters) {
          const int tok = sDqTok[b * kRows + row];
          if (tok >= 0)
            bulk_reduce_add_f32(p.dq_accum + (int64_t(tok) * p.hq + sDqHead[b * kRows + row]) * D,
                                buf + row * L::kDqStride, D * 4);
        }
        bulk_commit();
        bulk_wait<0, true>();
        mbar_arrive(&dq_empty[b]);
      }
      bulk_wait<0, false>();
      return;
    }
    // Deterministic mode: the exact hi / lo sums, two float4 per thread and step, both loaded before either
    // red (a red through a generic pointer would otherwise order the next shared load after it).
    const float4 grid = __ldg(p.dq_grid);
    for (int i = 0; i < n_all; ++i) {
      const int b = i & 1;
      mbar_wait(&dq_full[b], (i >> 1) & 1);
      const float* buf = sDq + b * kRows * L::kDqStride;
      for (int idx0 = wt; idx0 < kRows * (D / 4); idx0 += 2 * kWriters) {
        float4 x[2];
        int tok[2];
        int64_t o[2];
#pragma unroll
        for (int u = 0; u < 2; ++u) {
          const int idx = idx0 + u * kWriters, row = idx / (D / 4), c4 = idx % (D / 4);
          tok[u] = sDqTok[b * kRows + row];
          o[u] = (int64_t(tok[u]) * p.hq + sDqHead[b * kRows + row]) * D + 4 * c4;
          x[u] = *reinterpret_cast<const float4*>(buf + row * L::kDqStride + 4 * c4);
        }
#pragma unroll
        for (int u = 0; u < 2; ++u) {
          if (tok[u] >= 0) det_add4(p.dq_accum + o[u], p.dq_lo + o[u], x[u], grid);
        }
      }
      mbar_arrive(&dq_empty[b]);
    }
    return;
  }

  // Consumers.
  setmaxnreg_inc<kConsumerRegs>();
  const int wg = tid / 128 - 1, ctid = tid % 128, wq = ctid / 32, lane = tid % 32, g = lane / 4, tq = lane % 4;
  const int ct = tid - 128;  // 0 .. 255
  T* sDs = reinterpret_cast<T*>(smem + L::ds + wg * 64 * kRows * 2);
  const uint32_t k_addr = smem_addr(sK), v_addr = smem_addr(sV);
  const uint32_t ka = k_addr + wg * 64 * 128, va = v_addr + wg * 64 * 128;  // this consumer's 64 keys (A of S^T)
  const int key_row = wq * 16 + g;                                          // in the consumer's 64
  const int kabs0 = wg * 64 + key_row, kabs1 = kabs0 + 8;                   // in the block
  auto load_kv = [&](int j) {
    const int kvh = (r * G + j * Gu) / (p.hq / p.hkv);
    const T* ks = static_cast<const T*>(p.k) + int64_t(krow0) * p.k_stride_t + int64_t(kvh) * p.k_stride_h;
    const T* vs = static_cast<const T*>(p.v) + int64_t(krow0) * p.v_stride_t + int64_t(kvh) * p.v_stride_h;
    for (int i = ct; i < kKeys * kChunks; i += 256) {
      const int row = i / kChunks, c = i % kChunks;
      const bool ok = row < blen;
      const int rr = ok ? row : 0;
      cp_async_16(sK + KT::offset(row, c), ks + int64_t(rr) * p.k_stride_t + c * 8, ok);
      cp_async_16(sV + KT::offset(row, c), vs + int64_t(rr) * p.v_stride_t + c * 8, ok);
    }
    sm80::cp_async_commit();
    sm80::cp_async_wait<0>();
    fence_proxy_async_smem();
    asm volatile("bar.sync %0, 256;\n" ::"n"(kBarConsumers) : "memory");
  };

  int i = 0;  // tile of all kv heads
  for (int j = 0; j < J; ++j) {
    const int kvh = (r * G + j * Gu) / (p.hq / p.hkv);
    if (j > 0) asm volatile("bar.sync %0, 256;\n" ::"n"(kBarConsumers) : "memory");  // K / V of j - 1 are read
    load_kv(j);
    float dk[D / 8][4], dv[D / 8][4];
#pragma unroll
    for (int n = 0; n < D / 8; ++n)
#pragma unroll
      for (int e = 0; e < 4; ++e) dk[n][e] = dv[n][e] = 0.f;
    float(&dv_w)[D / 2] = *reinterpret_cast<float(*)[D / 2]>(&dv[0][0]);
    float(&dk_w)[D / 2] = *reinterpret_cast<float(*)[D / 2]>(&dk[0][0]);

    // kColSplit: tile i - 1's dQ GEMM (SS, no A registers) left running under tile i's first S / dP; its result
    // stored once that has been issued.
    float dq_c[32];
    bool dq_pending = false;
    int dq_tok = -1, dq_head = 0;
    // Tile ti's dQ columns [64 wg, +64) (dq_c, finished) into buffer ti % 2 once the writer is done with tile ti - 2.
    auto store_dq = [&](int ti) {
      const int b = ti & 1, qrow = wq * 16 + g;
      float* buf = sDq + b * kRows * L::kDqStride;
      if (ti >= 2) mbar_wait(&dq_empty[b], ((ti >> 1) - 1) & 1);
      if (wg == 0 && ctid < kRows) {
        sDqTok[b * kRows + ctid] = dq_tok;
        sDqHead[b * kRows + ctid] = dq_head;
      }
      put_dq_rows<L::kDqStride>(buf, qrow, wg * 64 + 2 * tq, dq_c, p.scale, false);
      if (!kDet) fence_proxy_async_smem();  // the writer's bulk reductions read the buffer through the async proxy
      mbar_arrive(&dq_full[b]);
    };
    for (int t = 0; t < n_tiles; ++t, ++i) {
      const int s = i % kStages;
      mbar_wait(&full[s], (i / kStages) & 1);
      const unsigned char* st = smem + L::stage0 + s * L::stage_bytes;
      const uint32_t q_addr = smem_addr(st + L::s_q), do_addr = smem_addr(st + L::s_do);
      const float* sLse = reinterpret_cast<const float*>(st + L::s_lse);
      const float* sDelta = reinterpret_cast<const float*>(st + L::s_delta);
      const int* sLim = reinterpret_cast<const int*>(st + L::s_lim);

      // S^T and dP^T of half h (rows [32 h, +32)): issued and committed as one group.
      auto issue_sdp = [&](float (&sacc)[16], float (&dpacc)[16], int h) {
        wgmma_fence();
#pragma unroll
        for (int ks = 0; ks < D / 16; ++ks)
          WgmmaSS<T, 32>::run(sacc, KT::desc(ka, ks), QT::desc(q_addr + h * 32 * 128, ks), ks > 0);
#pragma unroll
        for (int ks = 0; ks < D / 16; ++ks)
          WgmmaSS<T, 32>::run(dpacc, KT::desc(va, ks), QT::desc(do_addr + h * 32 * 128, ks), ks > 0);
        wgmma_commit();
      };
      // P^T and dS^T of half h as A fragments (pa, da: k-steps of 16 rows) and dS^T into sDs. Element
      // 4 jj + e of an accumulator: key kabs0 (e < 2) or kabs1, row 32 h + 8 jj + 2 tq + (e & 1). Branch
      // free (selects): the previous half's wgmmas may be running.
      auto p_ds = [&](float (&sacc)[16], float (&dpacc)[16], uint32_t (&pa)[2][4], uint32_t (&da)[2][4], int h) {
#pragma unroll
        for (int jj = 0; jj < 4; ++jj) {
          const int row = h * 32 + jj * 8 + 2 * tq;
          const float2 lse = *reinterpret_cast<const float2*>(sLse + row);
          const float2 dl = *reinterpret_cast<const float2*>(sDelta + row);
          const int2 lim = *reinterpret_cast<const int2*>(sLim + row);
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            const int kb = e < 2 ? kabs0 : kabs1;
            const bool odd = (e & 1) != 0;
            const float pv = kb <= (odd ? lim.y : lim.x)
                                 ? fast_exp2(fmaf(sacc[4 * jj + e], p.scale_log2, -(odd ? lse.y : lse.x) * kLog2e))
                                 : 0.f;
            sacc[4 * jj + e] = pv;
            dpacc[4 * jj + e] = pv * (dpacc[4 * jj + e] - (odd ? dl.y : dl.x));
          }
        }
#pragma unroll
        for (int kk = 0; kk < 2; ++kk) {
          sm80::a_frag<T>(sacc + 8 * kk, pa[kk]);
          sm80::a_frag<T>(dpacc + 8 * kk, da[kk]);
#pragma unroll
          for (int hf = 0; hf < 2; ++hf) {
            const int chunk = h * 4 + 2 * kk + hf;  // rows [8 chunk, +8)
            *reinterpret_cast<uint32_t*>(sDs + DsT::offset(key_row, chunk) + 2 * tq) = da[kk][2 * hf];
            *reinterpret_cast<uint32_t*>(sDs + DsT::offset(key_row + 8, chunk) + 2 * tq) = da[kk][2 * hf + 1];
          }
        }
      };
      auto issue_dvdk = [&](const uint32_t (&pa)[2][4], const uint32_t (&da)[2][4], int h) {
        wgmma_fence();
#pragma unroll
        for (int kk = 0; kk < 2; ++kk) {
          WgmmaRS<T, D, true>::run(dv_w, pa[kk], QT::desc_mn(do_addr, 2 * h + kk), true);
          WgmmaRS<T, D, true>::run(dk_w, da[kk], QT::desc_mn(q_addr, 2 * h + kk), true);
        }
        wgmma_commit();
      };

      float s0[16], dp0[16], s1[16], dp1[16];
      uint32_t pa0[2][4], da0[2][4], pa1[2][4], da1[2][4];
      // Every warp of this consumer is done with the previous tile's dS^T (its dQ fragments are loaded); kColSplit:
      // both consumers' dQ GEMMs of the previous tile (they read both dS^T tiles) are done, below.
      if constexpr (!kColSplit) group_sync(1 + wg);
      if constexpr (kColSplit) {
        // Defined here, before the wgmmas' fence: left undefined, the compiler copies registers in, and where
        // those are the running dQ GEMM's, ptxas waits for it before this issue (C7517).
#pragma unroll
        for (int e = 0; e < 16; ++e) s0[e] = dp0[e] = 0.f;
        fence_regs(s0);
        fence_regs(dp0);
      }
      issue_sdp(s0, dp0, 0);
      if constexpr (kColSplit) {
        // The previous tile's dQ (none at the first tile) and this tile's S^T, dP^T are done: the dQ GEMM ran under
        // the stage wait and this issue. (wait<1> would leave S^T, dP^T running under the dQ stores, but ptxas then
        // serialises every wgmma of the kernel, C7514: it does not see dq_c's group complete. Unconditional, as a
        // conditional wait before dq_c is read injects one, C7517.)
        wgmma_wait<0>();
        fence_regs(dq_c);
        if (dq_pending) store_dq(i - 1);
        dq_pending = false;
        asm volatile("bar.sync %0, 256;\n" ::"n"(kBarConsumers) : "memory");  // both dQ GEMMs done: dS^T free
      }
      wgmma_wait<0>();
      fence_regs(s0);
      fence_regs(dp0);
      p_ds(s0, dp0, pa0, da0, 0);
      issue_sdp(s1, dp1, 1);
      issue_dvdk(pa0, da0, 0);
      wgmma_wait<1>();  // S^T, dP^T of half 1 (the older group); half 0's dV, dK may still run
      fence_regs(s1);
      fence_regs(dp1);
      p_ds(s1, dp1, pa1, da1, 1);
      issue_dvdk(pa1, da1, 1);
      // (Waited for here, not under dQ: with half 1's fragments, dQ's and dK / dV live together, ptxas
      // serialises every wgmma of the kernel for registers, C7512.)
      wgmma_wait<0>();
      // The stage is read (Q, dO by dV / dK; lse, delta, limits by P / dS): consumer 0 keeps its row table for the
      // dQ buffer, and the stage goes back to the gatherers before dQ.
      int tab_tok = -1, tab_head = 0;
      if (wg == 0 && ctid < kRows) {
        tab_tok = reinterpret_cast<const int*>(st + L::s_tok)[ctid];
        tab_head = reinterpret_cast<const int*>(st + L::s_head)[ctid];
      }
      mbar_arrive(&empty[s]);
      if constexpr (kColSplit) {
        // dQ[:, 64 wg, +64) = dS K[:, 64 wg, +64) over all 128 keys: A = dS read MN-major from both consumers'
        // dS^T tiles (keys [16 ks, +16)), B = K's panel wg read MN-major. Issued and left running.
        fence_proxy_async_smem();  // this thread's dS^T stores -> the wgmmas' reads
        asm volatile("bar.sync %0, 256;\n" ::"n"(kBarConsumers) : "memory");  // both consumers' dS^T complete
        const uint32_t ds_addr = smem_addr(smem + L::ds), b_addr = k_addr + wg * KT::kPanelElems * 2;
        wgmma_fence();
#pragma unroll
        for (int ks = 0; ks < 8; ++ks)
          WgmmaSS<T, 64, true, true>::run(dq_c, DsT::desc_mn(ds_addr + (ks / 4) * 64 * kRows * 2, ks % 4),
                                          KT::desc_mn(b_addr, ks), ks > 0);
        wgmma_commit();
        dq_pending = true;
        dq_tok = tab_tok;
        dq_head = tab_head;
        continue;
      }
      group_sync(1 + wg);  // dS^T of the consumer's 64 keys complete
      const int qrow = wq * 16 + g;
      const int b = i & 1;
      float* buf = sDq + b * kRows * L::kDqStride;

      // dQ_c = dS_c K_c: A = dS by transposed ldmatrix of dS^T (rows [16 wq, +16), keys [16 kk, +16)), B =
      // K's rows of these keys read MN-major, one 64-column panel at a time.
      uint32_t a[4][4];
#pragma unroll
      for (int kk = 0; kk < 4; ++kk) {
        const int mi = lane / 8;
        ldmatrix_x4_trans(a[kk], sDs + DsT::offset(16 * kk + (mi / 2) * 8 + lane % 8, 2 * wq + mi % 2));
      }
#pragma unroll
      for (int panel = 0; panel < D / 64; ++panel) {
        float dq[32];
        const uint32_t b_addr = k_addr + panel * KT::kPanelElems * 2;
        wgmma_fence();
#pragma unroll
        for (int kk = 0; kk < 4; ++kk) WgmmaRS<T, 64, true>::run(dq, a[kk], KT::desc_mn(b_addr, 4 * wg + kk), kk > 0);
        wgmma_commit();
        wgmma_wait<0>();
        fence_regs(dq);
        if (panel == 0) {
          // Consumer 0 stores its partial into buffer b once the writer has written out tile i - 2 from it;
          // consumer 1 adds its own once consumer 0's is there.
          if (wg == 0) {
            if (i >= 2) mbar_wait(&dq_empty[b], ((i >> 1) - 1) & 1);
            if (ctid < kRows) {
              sDqTok[b * kRows + ctid] = tab_tok;
              sDqHead[b * kRows + ctid] = tab_head;
            }
          }
          if (wg == 1) mbar_wait(&dq_half[b], (i >> 1) & 1);
        }
        put_dq_rows<L::kDqStride>(buf, qrow, panel * 64 + 2 * tq, dq, p.scale, wg == 1);
      }
      // The writer's bulk reductions read the buffer through the async proxy: each consumer's stores fenced (consumer
      // 1 rewrites every element consumer 0 stored, but the fence should not rest on that coverage; s61's review).
      if (!kDet) fence_proxy_async_smem();
      mbar_arrive(wg == 0 ? &dq_half[b] : &dq_full[b]);
    }
    if constexpr (kColSplit) {
      wgmma_wait<0>();
      fence_regs(dq_c);
      if (dq_pending) store_dq(i - 1);
    }
    fence_regs(dk_w);
    fence_regs(dv_w);
    smxx::flush_dkv<D, kDet>(p, dk, dv, wg * 4 + wq, g, tq, item * J + j, blen, krow0, kvh);
  }
}

template <typename T, int D>
cudaError_t launch(const SparseBwdParams& p, cudaStream_t stream) {
  if (p.max_items == 0) return cudaSuccess;
  constexpr int smem = Smem<T, D>::bytes + 1024;
  // The TMA gather where a unit's Gu heads make a box of 4 or 8 rows (kWsTmaOn: also 1 or 2) and TMA can describe Q
  // and dO (16-byte aligned, strides multiples of 16 bytes); else the cp.async gather.
  const int gu = p.hq / p.hi / smxx::bwd_kv_per_group(p);
  CUtensorMap q_map{}, do_map{};
  bool tma = p.ws_tma == kWsTmaOn ? (gu == 1 || gu == 2 || gu == 4 || gu == 8)
                                  : p.ws_tma == kWsTmaAuto && (gu == 4 || gu == 8);
  if (tma) {
    tma = make_rows_map<T>(p.q, D, p.hq, p.total_tokens, p.q_stride_h, p.q_stride_t, 1, &q_map, gu) == cudaSuccess &&
          make_rows_map<T>(p.dout, D, p.hq, p.total_tokens, p.do_stride_h, p.do_stride_t, 1, &do_map, gu) ==
              cudaSuccess;
    if (!tma) (void)cudaGetLastError();  // a failed driver entry-point lookup leaves the runtime's last error set
  }
  const bool det = p.dq_lo != nullptr;
  auto kernel = det ? (tma ? sparse_bwd_ws_kernel<T, D, true, true> : sparse_bwd_ws_kernel<T, D, true, false>)
                    : (tma ? sparse_bwd_ws_kernel<T, D, false, true> : sparse_bwd_ws_kernel<T, D, false, false>);
  cudaError_t err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
  if (err != cudaSuccess) return err;
  kernel<<<unsigned(p.max_items), kThreads, smem, stream>>>(p, q_map, do_map);
  return cudaGetLastError();
}

}  // namespace msa::sm90::bwd_ws
