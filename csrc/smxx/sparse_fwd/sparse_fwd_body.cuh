// Sparse forward (SPEC 3) with the KL terms (SPEC 4), KV-outer: the passes shared by the portable path and
// the general Hopper passes, templated on the mainloop Mma that runs their GEMMs (sm80/sparse_fwd/mainloop.cuh:
// mma.sync; sm90/sparse_fwd/mainloop.cuh: wgmma). Launchers: sm80/sparse_fwd/sparse_fwd_kernel.cuh and
// sm90/sparse_fwd/sparse_fwd.cuh.
//
// A work item is one kv block of one index group (a key of the reverse index) and up to
// units_per_item of the units that selected it; a unit is (token, group) and holds the group's
// G = Hq / Hi query heads, split over J = max(1, Hkv / Hi) kv heads of Gu = G / J heads each. The
// CTA keeps the block's K (and V, and the index key block) in shared memory and streams tiles of
// gathered units through it: R = Gu * U main rows (<= 128, in row groups of 16) and U <= 32 index rows
// per step; a step is (tile, kv head of the group). Both passes keep one buffer of rows and fetch the
// next step's rows as soon as every warp has read this step's (right after Q K^T), so the gather
// overlaps the rest of the step. The stats pass runs eight warps (a row group each) and fits two CTAs
// per SM (<= 128 registers, 108 KB); the output pass runs sixteen (a pair per row group, see
// SparseFwdShape; eight in the sm_90a variant) in one CTA per SM (215 KB), or in 64-row tiles eight
// (157 KB: the A100's 163 KB per block). MMA loops run over
// compile-time extents: the whole 128-key tile and Di = 128, shorter blocks and Di = 64 being
// zero-filled in shared memory.
//
// Two passes over the same items (kOut = false, then true):
//  - stats pass: per (entry, head) the max and the sum of exp of the block's logits (log2 domain),
//    and the same for the index logits (per warp over its 16 keys in registers, then merged per unit
//    in shared memory); a combine turns them into lse and lse_idx;
//  - output pass: P = exp(s - lse) with the final lse, the partial output P V per (entry, head), and
//    per entry sum_j Pm_j (ln Pm_j - S_idx_j), Pm = the group's mean of P (needs all G heads: they
//    meet in shared memory). The combine sums the partials in slot order: deterministic. With
//    dsi_part, also the KL's index gradient for d_kl = 1: dsi = Pidx - Pm per (entry, key), stored in
//    reverse-index order, and
//    dq_idx += dsi K_idx (smxx/index_dk/index_dk.cu turns dsi into dk_idx).
// Warmup (dense mode) runs the same kernel with main_stats = write_out = false: the KL part only.
// Only the unit's own block needs the causal mask; keys past the sequence end are masked too.
//
// Small-smem configuration (kSmall, SparseFwdParams::small_smem: GPUs with 99 KB of shared memory per
// block, sm_86 / sm_89 / sm_120), both passes in 64-row tiles of eight warps (a pair per row group):
//  - stats pass (92160 bytes at D = 128): K and K_idx of the whole block resident as above; the pair splits
//    the keys and merges its two (max, sum) per row in shared memory before the store;
//  - output pass (95680 bytes at D = 128): K, V and K_idx held 64 keys at a time (kStage), the block's
//    two halves one after the other, each over all of the item's steps. With the final lse given,
//    a half's terms simply add: its P V is added to the partial output the first half stored (the
//    same thread reads back its own bf16 / fp16 store), its KL sums meet per unit in shared memory,
//    its dsi columns are its own, and its dq_idx is added like the other kv heads' (twice the
//    contributions per element: the deterministic grid's margin covers them). A block of <= 64 keys
//    (block_size 64, or a short last block) has one half.
// Same work items, partial layouts and combines as the default configuration.
#pragma once
#include <cuda_runtime.h>

#include <type_traits>

#include "common/block_span.h"
#include "common/fwd_item.cuh"
#include "common/det_sum.h"
#include "common/mma_sm80.h"
#include "params.h"
#include "sm80/sparse_fwd/sparse_fwd.h"

namespace msa::smxx {
using namespace sm80;  // common/mma_sm80.h: tiles, cp.async, ldmatrix, mma.sync and fragment helpers

struct SparseFwdShape {
  // Stats pass: eight warps of 16 rows x all 128 keys (two CTAs per SM). Output pass: sixteen warps,
  // a pair per 16 rows that splits the keys for Q K^T and the KL terms and D for P V (P meets in
  // shared memory), so that each thread holds 64 accumulators and 16 warps fit in the registers.
  // The sm_90a output pass (kWgmma) runs eight warps of 16 rows x all 128 keys, P kept in registers.
  // kRows: main rows per tile (128; the portable output pass also comes with 64, in 8 warps and 157 KB
  // of shared memory at D = 128, for GPUs with less than Hopper's 227 KB per block such as the A100).
  template <bool kOut, bool kWgmma = false, int kRows = 128>
  static constexpr int threads() { return kOut && !kWgmma ? 4 * kRows : 256; }
  static constexpr int kKeys = 128;     // MMA columns: one block (block_size 64 uses the first half)
  static constexpr int kMaxRows = 128;  // rows per tile (kRows: 128 or 64); units per tile are kRows / 4
  static constexpr int kMaxItemUnits = kFwdMaxItemUnits;  // per work item (sparse_fwd.h)
  static constexpr int kMaxDi = 128;
  // Floats per unit row of the output pass's index logits: 8 more than the keys, so that the eight
  // units of an m16n8 fragment's rows (g = lane / 4) land in different banks. At a stride of 128 the
  // epilogue's stores were 8-way bank conflicts (NOTES s43).
  static constexpr int kSiStride = kKeys + 8;
  // kSmall (64-row tiles only): the small-smem configuration (see the top of the file); its output pass
  // holds kStage = 64 keys of K, V and K_idx at a time.
  template <typename T, int D, bool kOut, int kRows = kMaxRows, bool kSmall = false>
  struct Smem {  // byte offsets; the stats pass has no V, S_idx, P or dsi tiles (two CTAs per SM)
    static constexpr int kUnits = kRows / 4;
    static constexpr int kStage = kOut && kSmall ? kKeys / 2 : kKeys;  // keys resident at a time
    static constexpr int kSiS = kStage + 8;  // kSiStride for a stage of keys
    static constexpr int k = 0;
    static constexpr int v = k + kStage * D * int(sizeof(T));
    static constexpr int ki = v + (kOut ? kStage * D * int(sizeof(T)) : 0);
    static constexpr int q = ki + kStage * kMaxDi * int(sizeof(T));
    static constexpr int qi = q + kRows * D * int(sizeof(T));
    static constexpr int si = qi + kUnits * kMaxDi * int(sizeof(T));
    // Output pass: index logits per (unit, key). Stats pass: per (warp, unit) max and sum of the index
    // logits over the warp's 16 keys.
    static constexpr int p = si + (kOut ? kUnits * kSiS * 4 : 8 * kUnits * 8);
    static constexpr int psum = p + (kOut ? kRows * kStage * int(sizeof(T)) : 0);  // P in the input dtype
    static constexpr int dsi = psum + (kOut ? kUnits * kStage * 4 : 0);
    static constexpr int lse = dsi + (kOut ? kUnits * kStage * int(sizeof(T)) : 0);
    static constexpr int kl = lse + (kOut ? kRows * 4 : 0);  // per key half and unit: the KL sums
    static constexpr int lse_idx = kl + (kOut ? 2 * kUnits * 4 : 0);  // per unit (register KL path)
    static constexpr int unit = lse_idx + (kOut ? kUnits * 4 : 0);
    static constexpr int rows = unit + 2 * kMaxItemUnits * 4;  // row -> (unit, head) tables
    // kSmall: output pass, the KL sum of each of the item's units over the first key half; stats
    // pass, the second key half's (max, sum) per row.
    static constexpr int part = rows + 2 * kRows * 4;
    static constexpr int bytes = part + (kSmall ? (kOut ? kMaxItemUnits * 4 : kRows * 8) : 0);
  };
};

constexpr float kFwdNegInf = -__builtin_huge_valf();

// Rows per tile for Gu heads per unit: kRows / 4 units, at most kRows rows.
__host__ __device__ inline int sparse_rows_per_tile(int gu, int rows) { return gu >= 4 ? rows : rows / 4 * gu; }

// Mma::kWgmma (sm90::FwdMma, compiled for sm_90a only: csrc/instantiations/sparse_fwd_sm90_*.cu): eight warps in both
// passes, warpgroup i (warps 4 i .. 4 i + 3) holding rows [64 i, +64) x all 128 keys. The main Q K^T
// runs on warpgroup tensor cores (wgmma, Q from registers, K from shared memory in the
// 128-byte-swizzled K-major layout); in the output pass P stays in registers as the A operand of an
// RS wgmma P V (V in the same layout, read MN-major); O leaves through shared memory in 16-byte
// chunks before the KL terms run (holding it across them spills). Everything else is shared with the
// portable mainloop.
//
// kGu > 0 (the sm_90a passes only): the launch has Gu = kGu heads per unit and J = 1. With the index
// branch the register KL path applies and its loops are compile-time. It sums P over the unit's
// heads before P V, which lets the reduce-scatter free three quarters of the fp32 P first; rows map to
// (unit, head) arithmetically. The registers this frees go to batching Q K^T and the index logits
// into one wgmma group each (Gu = 4: 252 registers, no spill, none either under a cap of 216; the
// runtime-Gu kernel holds all of P across P V).
//
// kSmall: the small-smem configuration (top of the file): 64-row tiles, the stats pass's warp pairs split
// the keys, the output pass stages the block in two 64-key halves (kSplit).
template <class Mma, typename T, int D, bool kOut, int kRows = 128, int kGu = 0, bool kSmall = false>
__global__ void __launch_bounds__(SparseFwdShape::threads<kOut, Mma::kWgmma, kRows>(), kOut ? 1 : 2)
    sparse_fwd_kernel(SparseFwdParams p) {
  using Sh = SparseFwdShape;
  constexpr bool kWgmma = Mma::kWgmma;
  static_assert(Mma::kKeys == Sh::kKeys && Mma::kMaxDi == Sh::kMaxDi, "the mainloop's tile extents");
  static_assert(kRows == 128 || (kRows == 64 && (kOut || kSmall) && !kWgmma),
                "64-row tiles: portable output pass and small-smem passes only");
  static_assert(kGu == 0 || (kWgmma && kRows == 128), "compile-time Gu: sm_90a passes only");
  static_assert(!kSmall || (!kWgmma && kRows == 64 && kGu == 0), "small-smem configuration: portable 64-row tiles");
  using L = typename Sh::template Smem<T, D, kOut, kRows, kSmall>;
  constexpr int kUnitsT = L::kUnits;      // units per tile
  constexpr int kRowGroups = kRows / 16;  // 16-row groups: a warp each (a warp pair in the portable output pass)
  // kSplit: the output pass of the small-smem configuration, K, V and K_idx staged in halves of kStage keys.
  constexpr bool kSplit = kOut && kSmall;
  constexpr int kStage = L::kStage;  // keys resident at a time: 128 (the block), or 64 (kSplit)
  static_assert(kStage == Sh::kKeys || (kSplit && 2 * kStage == Sh::kKeys), "a block is one stage or two halves");
  using Tile = SwizzledTile<D>;
  using QTile = typename Mma::template QTile<D, kOut>;  // the gathered Q rows (Hopper stats pass: wgmma's layout)
  using PTile = SwizzledTile<kStage>;  // P and dsi tiles: rows x the stage's keys
  constexpr int kThreadsT = Sh::template threads<kOut, kWgmma, kRows>();
  constexpr int kWarpsT = kThreadsT / 32;
  // A warp pair per 16 rows: the portable output pass, and the small-smem stats pass.
  constexpr bool kPair = (kOut && !kWgmma) || kSmall;
  constexpr int kN8 = (kPair ? kStage / 2 : kStage) / 8;  // n8 key tiles per warp (8, 16; kSplit 4)
  constexpr int kDo = kPair ? D / 2 : D;   // P V output columns per warp
  constexpr int kKeyGroups = kStage / 16;  // the index logits' 16-key groups: a warp each (8; kSplit 4)
  constexpr int kChunks = Tile::kChunks;
  extern __shared__ __align__(128) unsigned char smem_raw[];
  // The wgmma variant's K tile must start 1024-byte aligned (the swizzle is on address bits).
  unsigned char* smem = kWgmma ? smem_raw + ((1024 - (smem_addr(smem_raw) & 1023)) & 1023) : smem_raw;
  using KvTile = typename Mma::template KTile<D>;  // K and V
  T* sK = reinterpret_cast<T*>(smem + L::k);
  T* sV = reinterpret_cast<T*>(smem + L::v);
  T* sKi = reinterpret_cast<T*>(smem + L::ki);
  T* sQ = reinterpret_cast<T*>(smem + L::q);
  T* sQi = reinterpret_cast<T*>(smem + L::qi);
  float* sSi = reinterpret_cast<float*>(smem + L::si);      // output pass
  float2* sIPart = reinterpret_cast<float2*>(smem + L::si);  // stats pass
  T* sP = reinterpret_cast<T*>(smem + L::p);
  float* sPsum = reinterpret_cast<float*>(smem + L::psum);
  T* sDsi = reinterpret_cast<T*>(smem + L::dsi);
  float* sLse = reinterpret_cast<float*>(smem + L::lse);
  float* sKl = reinterpret_cast<float*>(smem + L::kl);
  float* sLseIdx = reinterpret_cast<float*>(smem + L::lse_idx);
  float* sKlAcc = reinterpret_cast<float*>(smem + L::part);    // kSplit: per item unit, first half's KL
  float2* sMPart = reinterpret_cast<float2*>(smem + L::part);  // kSmall stats pass: per row, second key half
  int* sEntryAll = reinterpret_cast<int*>(smem + L::unit);  // the item's units: local entry ids, tokens
  int* sTokAll = sEntryAll + Sh::kMaxItemUnits;
  int* sRowU = reinterpret_cast<int*>(smem + L::rows);  // tile row -> unit (-1: padding) and head in unit
  int* sRowH = sRowU + kRows;

  FwdItem f;
  if (!fwd_item(p, f)) return;
  const int r = f.r, u_begin = f.u_begin, n_units = f.n_units;
  // The block's first key row, and the query row at its first key's position (one value without a key
  // layout): a query row t sees the block's keys up to t - kpos0.
  const int krow0 = f.span.k_start + f.span.key0, kpos0 = f.span.q_origin + f.span.key0, blen = f.span.blen;

  const int G = p.hq / p.hi;
  const int J = kGu > 0 ? 1 : (p.hkv > p.hi ? p.hkv / p.hi : 1);  // kGu: J = 1 (no division per step below)
  const int Gu = kGu > 0 ? kGu : G / J;
  const int R = sparse_rows_per_tile(Gu, kRows);
  const int U = min(R / Gu, kUnitsT);
  const bool index = p.q_idx != nullptr;
  // KL terms in the MMA register layout when a unit's heads sit in one warp's rows (J = 1, Gu a power
  // of two <= 8); otherwise P goes through shared memory and a per-unit loop.
  // (The reduce-scatter below needs Gu <= kN8: kSplit's warps hold 4 n-tiles, so Gu = 8 takes the loop.)
  const bool fast_kl =
      kOut && index && (kGu > 0 || (J == 1 && (Gu == 1 || Gu == 2 || Gu == 4 || (Gu == 8 && kN8 >= 8))));
  // Loops run over compile-time extents (the whole 128-key tile, Di = 128): shorter blocks and Di = 64
  // are zero-filled in shared memory and masked, so the MMA loops have no runtime bounds or branches.
  using ITile = SwizzledTile<Sh::kMaxDi>;  // index tiles, Di = 64 padded with zeros
  constexpr int kIChunks = Sh::kMaxDi / 8;
  using KiTile = typename Mma::template KTile<Sh::kMaxDi>;  // K_idx (wgmma: the index logits' B operand)
  const int di = p.di, di_chunks = p.di / 8;  // Di is 64 or 128

  // D = 128: the warp index through a shuffle from lane 0, known warp-uniform, so what derives from it (row
  // group, wgmma descriptors) stays in uniform registers (ptxas, s29: the stats pass 4080 -> 3472 instructions
  // with J = 1 above, no spill; at D = 64 the same change spills 56 bytes in the stats pass, so D = 64 keeps
  // the plain index).
  const int tid = threadIdx.x, warp = D == 128 ? __shfl_sync(0xffffffffu, tid / 32, 0) : tid / 32, lane = tid % 32;
  const int g = lane / 4, tq = lane % 4;
  // Row group (16 rows), key half (output pass: also the half of D in P V), first key (of the stage),
  // the 16 columns of Di of dq_idx and the 16 keys of the index logits of this warp.
  const int rg = warp % kRowGroups, kh = kOut || kSmall ? warp / kRowGroups : 0, kb = kh * kN8 * 8, kw = warp % 8;
  const int kwi = warp % kKeyGroups;
  const T* Q = static_cast<const T*>(p.q);
  const T* K = static_cast<const T*>(p.k);
  const T* V = static_cast<const T*>(p.v);
  const T* QI = static_cast<const T*>(p.q_idx);
  const T* KI = static_cast<const T*>(p.k_idx);

  // Row -> (unit, head) once: the hot loops below do no runtime division.
  for (int row = tid; row < kRows; row += kThreadsT) {
    const int u = row / Gu;
    sRowU[row] = (row < R && u < U) ? u : -1;
    sRowH[row] = row % Gu;
  }
  // Row -> unit (-1: padding) and head in unit: the tables, or arithmetic when Gu is compile-time
  // (kGu: R = 128 rows of 32 units, no padding rows).
  auto row_unit = [&](int row) -> int {
    if constexpr (kGu > 0) return int(unsigned(row) / kGu); else return sRowU[row];
  };
  auto row_head = [&](int row) -> int {
    if constexpr (kGu > 0) return int(unsigned(row) % kGu); else return sRowH[row];
  };

  // The item's unit table, once.
  load_unit_table(p, f, sEntryAll, sTokAll, tid, kThreadsT);
  const int kih = r / (p.hi / p.hki);
  const float iscale2 = p.index_scale * kLog2e;  // index logits in the log2 domain
  // K (and V) of kv head j of the group, and K_idx: the stage's keys [ko, ko + kStage) of the block
  // (ko = 0 but in kSplit's second half).
  auto load_kv = [&](int j, int ko) {
    const int kvh = (r * G + j * Gu) / (p.hq / p.hkv);
    const T* ks = K + int64_t(krow0 + ko) * p.k_stride_t + int64_t(kvh) * p.k_stride_h;
    const T* vs = V + int64_t(krow0 + ko) * p.v_stride_t + int64_t(kvh) * p.v_stride_h;
    for (int i = tid; i < kStage * kChunks; i += kThreadsT) {
      const int row = i / kChunks, c = i % kChunks;
      const bool ok = row < blen - ko;
      const int rr = ok ? row : 0;
      const int off = KvTile::offset(row, c);
      cp_async_16(sK + off, ks + int64_t(rr) * p.k_stride_t + c * 8, ok);
      if constexpr (kOut) cp_async_16(sV + off, vs + int64_t(rr) * p.v_stride_t + c * 8, ok);
    }
  };
  auto load_ki = [&](int ko) {
    const T* src = KI + int64_t(krow0 + ko) * p.ki_stride_t + int64_t(kih) * p.ki_stride_h;
    for (int i = tid; i < kStage * kIChunks; i += kThreadsT) {
      const int row = i / kIChunks, c = i % kIChunks;
      const bool ok = row < blen - ko && c < di_chunks;
      cp_async_16(sKi + KiTile::offset(row, c), src + (ok ? int64_t(row) * p.ki_stride_t + c * 8 : 0), ok);
    }
  };
  load_kv(0, 0);
  if (index) load_ki(0);
  __syncthreads();  // the unit table is read by every thread below

  // Stats pass with idx_own_only: a unit whose token is not in this block has its index (max, sum) from the
  // top-k kernel (sel_unit). A tile of units from ub on takes the index branch unless every unit is such
  // (units are in token order: its first is past the block).
  auto sel_unit = [&](int u) {  // u: index into the item's units
    return p.idx_own_only && sTokAll[u] - kpos0 >= blen;
  };
  auto index_tile = [&](int ub) { return index && (kOut || !sel_unit(ub)); };
  // Steps = (tile, kv head of the group); the next step's rows are fetched while this one computes.
  const int n_tiles = (n_units + U - 1) / U;
  const int steps = n_tiles * J;
  auto fetch_step = [&](int s) {
    const int tile = s / J, j = s % J;
    const int ub = tile * U, nu = min(U, n_units - ub);
    const int h0 = r * G + j * Gu;
    // Each thread copies one 16-byte chunk column of rows tid / kChunks, + kThreadsT / kChunks, ...
    static_assert(kThreadsT % kChunks == 0 && kThreadsT % kIChunks == 0, "chunk columns per thread");
    const int c = tid % kChunks;
    if constexpr (kGu > 0) {
      // A thread's rows are kThreadsT / kChunks apart, a multiple of kGu: its head, and with it the
      // head and chunk part of the address, is the same on every pass.
      static_assert((kThreadsT / kChunks) % kGu == 0, "one head per thread");
      const T* qh = Q + int64_t(h0 + row_head(tid / kChunks)) * p.q_stride_h + c * 8;
      for (int row = tid / kChunks; row < R; row += kThreadsT / kChunks) {
        const int u = row_unit(row);
        const bool ok = u < nu;
        cp_async_16(sQ + QTile::offset(row, c), qh + int64_t(ok ? sTokAll[ub + u] : 0) * p.q_stride_t, ok);
      }
    } else {
      for (int row = tid / kChunks; row < R; row += kThreadsT / kChunks) {
        const int u = row_unit(row);
        const bool ok = u >= 0 && u < nu;
        const T* src =
            Q + int64_t(ok ? sTokAll[ub + u] : 0) * p.q_stride_t + int64_t(h0 + row_head(row)) * p.q_stride_h + c * 8;
        cp_async_16(sQ + QTile::offset(row, c), src, ok);
      }
    }
    if constexpr (kOut) {
      for (int row = tid; row < R; row += kThreadsT) {
        const int u = row_unit(row);
        const bool ok = u >= 0 && u < nu;
        cp_async_4(sLse + row,
                   p.lse + (ok ? int64_t(h0 + row_head(row)) * p.total_tokens + sTokAll[ub + u] : 0), ok);
      }
    }
    if (index_tile(ub) && j == 0) {
      const int ci = tid % kIChunks;
      for (int u = tid / kIChunks; u < kUnitsT; u += kThreadsT / kIChunks) {
        const bool ok = u < nu && ci < di_chunks;
        const T* src = QI + (ok ? int64_t(sTokAll[ub + u]) * p.qi_stride_t + int64_t(r) * p.qi_stride_h + ci * 8 : 0);
        cp_async_16(sQi + ITile::offset(u, ci), src, ok);
      }
      if (kOut && p.dsi_part != nullptr) {  // lse_idx per unit, for the register KL path's dsi
        for (int u = tid; u < nu; u += kThreadsT)
          cp_async_4(sLseIdx + u, p.lse_idx + int64_t(r) * p.total_tokens + sTokAll[ub + u], true);
      }
    }
  };
  fetch_step(0);
  cp_async_commit();

  // kSplit: the block's halves one after the other, each over all the steps (the second half only when
  // the block has more than kStage keys); hs = half * steps + step.
  const int nh = kSplit && blen > kStage ? 2 : 1;
  for (int hs = 0; hs < (kSplit ? nh * steps : steps); ++hs) {
    const int bh = kSplit ? hs / steps : 0;  // the block half
    const int step = kSplit ? hs - bh * steps : hs;
    const int ko = kSplit ? bh * kStage : 0;  // the stage's first key in the block
    const int tile = step / J, j = step % J;
    const int ub = tile * U;
    const int nu = min(U, n_units - ub);
    const int* sEntry = sEntryAll + ub;
    const int* sTok = sTokAll + ub;
    // Last visible key (block-relative) for a unit of this tile, -1 when the unit slot is empty.
    auto key_limit = [&](int u, int nu_) {
      return u < nu_ ? min(blen - 1, sTok[u] - kpos0) : -1;
    };
    if constexpr (kSplit) {
      // The second half: every step of the first is done with K, V and K_idx (its rows were fetched
      // during the first half's last step).
      if (step == 0 && bh > 0) {
        __syncthreads();
        load_kv(0, ko);
        if (index) load_ki(ko);
        cp_async_commit();
      }
    }
    if (J > 1 && step > 0) {  // every read of K / V ended before a barrier of the previous step: K/V are free
      load_kv(j, ko);
      cp_async_commit();
    }
    cp_async_commit();  // this step's rows were fetched during the previous step (after its Q K^T)
    cp_async_wait<0>();
    // K (and, in the stats pass, each step's Q) written by cp.async (generic proxy) is read by wgmma (async proxy);
    // nothing is in flight here.
    if (kWgmma && (step == 0 || J > 1 || !kOut)) Mma::fence_operands();
    __syncthreads();

    // Units are in token order, so when the tile's first unit sees the whole block (kSplit: the whole
    // stage) every unit does and the tile needs no mask (padding rows then hold finite values that are
    // never stored).
    const bool full = kSplit ? blen >= ko + kStage && sTok[0] - kpos0 >= ko + kStage - 1
                             : blen == Sh::kKeys && sTok[0] - kpos0 >= Sh::kKeys - 1;
    // Index logits of the tile's units (once per tile) as m16n8 fragments ci[NI] of units mt * 16 + g
    // (+ 8) x keys kc0 + 8 n + 2 tq (+ 1): the output pass stores them (log2 domain); the stats pass
    // reduces them to this part's (max, sum) per unit, merged after the step's last barrier. one_row (the
    // sm_90a stats pass at D = 128): unit 8 mt + g in rows g only (rows g + 8 are padding).
    auto index_epilogue = [&](const auto& ci, int mt, int kc0, int part, auto one_row) {
      constexpr int NI = sizeof(ci) / sizeof(ci[0]);
      constexpr bool kOneRow = decltype(one_row)::value;
      if constexpr (kOut) {
        static_assert(!kOneRow, "the output pass keeps two unit rows per lane");
#pragma unroll
        for (int n = 0; n < NI; ++n) {
          const int col = kc0 + n * 8 + 2 * tq;
          const int row = mt * 16 + g;
          *reinterpret_cast<float2*>(sSi + row * L::kSiS + col) =
              make_float2(ci[n][0] * iscale2, ci[n][1] * iscale2);
          *reinterpret_cast<float2*>(sSi + (row + 8) * L::kSiS + col) =
              make_float2(ci[n][2] * iscale2, ci[n][3] * iscale2);
        }
      } else {
        constexpr int kR = kOneRow ? 1 : 2;  // unit rows per lane
        const int ua = kOneRow ? mt * 8 + g : mt * 16 + g, ub2 = ua + 8;
        float m[2], l[2];
        if (full && iscale2 > 0.f) {  // every unit sees every key (padding units: zero rows, never merged)
          quad_row_ref_sum<kR>(ci, m, l, iscale2);
        } else {
          const int lima = key_limit(ua, nu), limb = kOneRow ? -1 : key_limit(ub2, nu);
          float x[NI][4];
          masked_scaled(ci, iscale2, kc0, tq, lima, limb, x);
          quad_row_max_sum<kR>(x, m, l);
        }
        if (tq == 0) {
          sIPart[part * kUnitsT + ua] = make_float2(m[0], l[0]);
          if constexpr (!kOneRow) sIPart[part * kUnitsT + ub2] = make_float2(m[1], l[1]);
        }
      }
    };
    if (index_tile(ub) && j == 0) {  // CTA-uniform
      // One unit row per lane in the sm_90a stats pass at D = 128 (at D = 64 it spills 8 bytes: the two-row layout).
      // All of Di in one batch where the registers allow it: the output pass with kGu, and (s48) the sm_90a stats
      // pass at D = 128 with kGu, its main Q K^T no longer holding Q in registers (128 registers, no spill).
      constexpr bool kIdxBatch = kGu > 0 && (kOut || (kWgmma && D == 128));
      Mma::template index_logits<T, kIdxBatch, kKeyGroups, kWarpsT, (kWgmma && !kOut && D == 128)>(
          p, sQi, sKi, warp, kwi, lane, ko, nu, index_epilogue);
    }

    // Main logits: warp (rg, kh) takes rows [16 rg, 16 rg + 16) against keys [kb, kb + 8 kN8).
    const bool live = kGu > 0 || rg * 16 < R;  // kGu = 4: R = 128, every row group
    const bool active = live && (kOut || p.main_stats);
    const int row0 = rg * 16 + g, row1 = row0 + 8;
    float c[kN8][4];
    zero_acc(c);
    // wgmma: every warp of a group takes part (rows past R compute values that are never stored).
    if (kWgmma ? kOut || p.main_stats : active)  // CTA-uniform with wgmma
      Mma::template main_logits<T, D, kN8, (kGu > 0 && kOut), kOut>(c, sQ, sK, rg, kb, lane);
    float e0 = 0.f, e1 = 0.f, li0 = 0.f, li1 = 0.f;  // lse and, for the register KL path, lse_idx (log2)
    if constexpr (kOut) {
      if (live) {
        e0 = sLse[row0] * kLog2e;
        e1 = sLse[row1] * kLog2e;
        if (fast_kl && p.dsi_part != nullptr) {
          const int uu0 = row_unit(row0), uu1 = row_unit(row1);
          if (uu0 >= 0 && uu0 < nu) li0 = sLseIdx[uu0] * kLog2e;
          if (uu1 >= 0 && uu1 < nu) li1 = sLseIdx[uu1] * kLog2e;
        }
      }
    }
    // One buffer: once every warp has read this step's Q, Q_idx, lse and lse_idx, the next step's rows are
    // fetched into it while the rest of this step runs.
    __syncthreads();
    if constexpr (kSplit) {
      if (hs + 1 < nh * steps) fetch_step(step + 1 < steps ? step + 1 : 0);  // the next half's first step
    } else {
      if (step + 1 < steps) fetch_step(step + 1);
    }
    cp_async_commit();

    const int u0 = max(row_unit(row0), 0), u1 = max(row_unit(row1), 0);
    const int hh0 = row_head(row0), hh1 = row_head(row1);
    const int lim0 = live && row_unit(row0) >= 0 ? key_limit(u0, nu) : -1;
    const int lim1 = live && row_unit(row1) >= 0 ? key_limit(u1, nu) : -1;
    if (kOut) {
      // P = 2^(s scale_log2 - lse log2 e), 0 past the visible keys. Two copies: most tiles are full
      // (every non-local block), and theirs has no compare and no predicate per element (NOTES s44).
      auto exp_tile = [&](auto masked) {
        constexpr bool kMasked = decltype(masked)::value;
#pragma unroll
        for (int n = 0; n < kN8; ++n) {
          const int col = ko + kb + n * 8 + 2 * tq;  // block-relative (the masks)
          c[n][0] = !kMasked || col <= lim0 ? fast_exp2(fmaf(c[n][0], p.scale_log2, -e0)) : 0.f;
          c[n][1] = !kMasked || col + 1 <= lim0 ? fast_exp2(fmaf(c[n][1], p.scale_log2, -e0)) : 0.f;
          c[n][2] = !kMasked || col <= lim1 ? fast_exp2(fmaf(c[n][2], p.scale_log2, -e1)) : 0.f;
          c[n][3] = !kMasked || col + 1 <= lim1 ? fast_exp2(fmaf(c[n][3], p.scale_log2, -e1)) : 0.f;
        }
      };
      if (active) {
        if (full) exp_tile(std::false_type{}); else exp_tile(std::true_type{});
      }
    } else if (active && (!full || !(p.scale_log2 > 0.f))) {
      // Stats pass: the row max and sum below take the raw logits and apply a positive scale themselves
      // (one FMA per exponent; the max of x then equals the max of x * scale). A scale <= 0 (allowed,
      // if odd) is applied here instead. Masked logits are -inf.
      const float pre = p.scale_log2 > 0.f ? 1.f : p.scale_log2;
#pragma unroll
      for (int n = 0; n < kN8; ++n) {
        const int col = kb + n * 8 + 2 * tq;
        c[n][0] = full || col <= lim0 ? c[n][0] * pre : kFwdNegInf;
        c[n][1] = full || col + 1 <= lim0 ? c[n][1] * pre : kFwdNegInf;
        c[n][2] = full || col <= lim1 ? c[n][2] * pre : kFwdNegInf;
        c[n][3] = full || col + 1 <= lim1 ? c[n][3] * pre : kFwdNegInf;
      }
    }
    // kSmall stats pass: the first warp of the pair's (max, sum) of rows row0, row1 over keys [0, 64),
    // merged with the second's after the step's barrier below.
    [[maybe_unused]] float2 st0 = make_float2(0.f, 0.f), st1 = make_float2(0.f, 0.f);
    if constexpr (!kOut) {
      if (active) {
        float m[2], l[2];
        // A full tile (every entry visible) with the usual positive scale: no row max on the critical path
        // (quad_row_ref_sum); the masked or rescaled tiles take the max.
        if (full && p.scale_log2 > 0.f) {
          quad_row_ref_sum(c, m, l, p.scale_log2);
        } else {
          quad_row_max_sum(c, m, l, p.scale_log2 > 0.f ? p.scale_log2 : 1.f);
        }
        if constexpr (kSmall) {
          if (kh == 0) {
            st0 = make_float2(m[0], l[0]);
            st1 = make_float2(m[1], l[1]);
          } else if (tq == 0) {
            sMPart[row0] = make_float2(m[0], l[0]);
            sMPart[row1] = make_float2(m[1], l[1]);
          }
        } else if (tq == 0) {
          if (lim0 >= 0) p.stats[int64_t(sEntry[u0]) * G + j * Gu + hh0] = make_float2(m[0], l[0]);
          if (lim1 >= 0) p.stats[int64_t(sEntry[u1]) * G + j * Gu + hh1] = make_float2(m[1], l[1]);
        }
      }
    } else {
      // sm_90a: P V on wgmma, P (input dtype) in registers as the A operand: the S accumulator of
      // n-tiles 2 kk, 2 kk + 1 is the m16n8k16 A fragment of keys [16 kk, +16). With a runtime Gu, P V
      // and the stores of O run first (holding O across the KL terms spills); with kGu, after the
      // reduce-scatter of the KL block (see above).
      [[maybe_unused]] uint32_t pa[kWgmma ? Sh::kKeys / 16 : 1][4];
      if constexpr (kWgmma) {
        if (p.write_out) {
#pragma unroll
          for (int kk = 0; kk < Sh::kKeys / 16; ++kk) a_frag<T>(&c[2 * kk][0], pa[kk]);
        }
      }
      // (Generic in the mainloop M = Mma, so that only the wgmma instantiation, the one that calls it, has it.)
      [[maybe_unused]] auto pv_out = [&](auto mma) {
        using M = decltype(mma);
        if (!p.write_out) return;  // CTA-uniform: every warp of a group takes part
        // One 64-column panel of V (and of O) at a time: 32 accumulators instead of D / 2, so P (fp32,
        // kept for the KL terms), its packed copy and O fit in the registers without spilling. O is
        // staged in the warp's own rows of sP (P is not there: in registers, and the slow KL path
        // writes it after this), then leaves in 16-byte chunks, a row per 16 (D = 128) or 8 lanes.
        const uint32_t v_addr = smem_addr(sV);
        auto stage = [&](const float(&ow)[32], int panel) {
          if (live) {
#pragma unroll
            for (int n = 0; n < 8; ++n) {
              *reinterpret_cast<uint32_t*>(sP + PTile::offset(row0, panel * 8 + n) + 2 * tq) =
                  pack2<T>(ow[4 * n], ow[4 * n + 1]);
              *reinterpret_cast<uint32_t*>(sP + PTile::offset(row1, panel * 8 + n) + 2 * tq) =
                  pack2<T>(ow[4 * n + 2], ow[4 * n + 3]);
            }
          }
        };
        auto issue = [&](float(&ow)[32], int panel) { M::template pv_issue<T, D>(ow, pa, v_addr, panel); };
        if constexpr (kGu > 0 && D == 128) {
          // Both panels in flight (P V runs after the reduce-scatter here: the registers allow it); the
          // first is staged while the second computes.
          float ow0[32], ow1[32];
          issue(ow0, 0);
          issue(ow1, 1);
          M::template wait<1>();
          stage(ow0, 0);
          M::template wait<0>();
          stage(ow1, 1);
        } else {
#pragma unroll
          for (int panel = 0; panel < D / 64; ++panel) {
            float ow[32];
            issue(ow, panel);
            M::template wait<0>();
            stage(ow, panel);
          }
        }
        if (live) {
          __syncwarp();
          T* part = static_cast<T*>(p.out_part);
          if constexpr (kGu > 0) {
            // J = 1 and G = kGu: a unit's kGu rows are one contiguous run of kGu * D outputs in part, so
            // the warp's 16 rows (16 / kGu units) leave as whole units, 16-byte chunk c of a unit
            // being chunk c % (D / 8) of its row c / (D / 8). One table lookup per unit.
            constexpr int kUnitChunks = kGu * D / 8;
            static_assert(kUnitChunks % 32 == 0, "a unit's chunks fill whole warp passes");
#pragma unroll 4
            for (int i = lane; i < 16 * (D / 8); i += 32) {
              const int uw = i / kUnitChunks, c = i % kUnitChunks;
              const int u = rg * (16 / kGu) + uw;
              if (u < nu)
                *reinterpret_cast<uint4*>(part + int64_t(sEntry[u]) * (kGu * D) + c * 8) =
                    *reinterpret_cast<const uint4*>(sP + PTile::offset(u * kGu + c / (D / 8), c % (D / 8)));
            }
          } else {
#pragma unroll 1
            for (int i = lane; i < 16 * (D / 8); i += 32) {
              const int row = rg * 16 + i / (D / 8), ch = i % (D / 8);
              const int u = row_unit(row);
              if (u >= 0 && u < nu)
                *reinterpret_cast<uint4*>(part + (int64_t(sEntry[u]) * G + j * Gu + row_head(row)) * D + ch * 8) =
                    *reinterpret_cast<const uint4*>(sP + PTile::offset(row, ch));
            }
          }
          __syncwarp();
        }
      };
      if constexpr (kWgmma) {
        if (kGu == 0 || !fast_kl) pv_out(Mma{});  // kGu with the index branch: after the reduce-scatter
      }
      if (active) {
        // P in the input dtype in shared memory: the portable pass's A operand of P V (both key halves
        // of the rows meet there) and, off the register path, the KL terms' input.
        if (!kWgmma || (index && !fast_kl)) {
#pragma unroll
          for (int n = 0; n < kN8; ++n) {
            const int col = kb + n * 8 + 2 * tq;
            *reinterpret_cast<uint32_t*>(sP + PTile::offset(row0, col / 8) + col % 8) = pack2<T>(c[n][0], c[n][1]);
            *reinterpret_cast<uint32_t*>(sP + PTile::offset(row1, col / 8) + col % 8) = pack2<T>(c[n][2], c[n][3]);
          }
        }
        if (fast_kl) {
          // Pm * G per (unit, key): the unit's rows differ in the low log2(Gu) bits of g (lane bits 2..).
          // (In place: P V is done, or reads P from shared memory or from its packed copy pa.)
          float (&v)[kN8][4] = c;
          // Reduce-scatter over the unit's Gu lanes (lane bits 2.. = low bits gi of g): at bit b the
          // lane keeps one n-tile of each pair (n, n | b) and sends the other, so afterwards slot n
          // (low log2(Gu) bits zero) of lane gi holds the unit's sum for n-tile n + gi.
          const int gi = g & (Gu - 1);
#pragma unroll
          for (int b = 1; b <= 4; b <<= 1) {
            if (b < Gu && b < kN8) {  // (b < kN8: compile-time, kSplit's fast path has Gu <= 4)
              const bool hi = (gi & b) != 0;
#pragma unroll
              for (int n = 0; n < kN8; ++n) {
                if ((n & (2 * b - 1)) == 0) {
#pragma unroll
                  for (int e = 0; e < 4; ++e) {
                    const float send = hi ? v[n][e] : v[n | b][e];
                    const float keep = hi ? v[n | b][e] : v[n][e];
                    v[n][e] = keep + __shfl_xor_sync(0xffffffffu, send, 4 * b);
                  }
                }
              }
            }
          }
          // kGu: P V now, P being in pa and the unit sums in 1 / Gu of v (every warp is active: R = 128).
          if constexpr (kWgmma && kGu > 0) pv_out(Mma{});
          const int uu0 = row_unit(row0), uu1 = row_unit(row1);
          const bool grad = p.dsi_part != nullptr;
          const bool ok0 = uu0 >= 0 && uu0 < nu, ok1 = uu1 >= 0 && uu1 < nu;
          const float inv_g = 1.f / float(G);
          float acc0 = 0.f, acc1 = 0.f;  // log2 domain: sum pm (log2 pm - si log2 e)
          // kGu: instantiated with and without dsi (a CTA-uniform choice), and every row is a unit's (no
          // padding rows), so the body has no branches and the compiler can overlap the pairs' LDS ->
          // MUFU chains (NOTES s41). The general kernel tests both at run time (one copy: registers).
          auto kl_terms = [&](auto mode) {  // mode: 0 = no dsi, 1 = dsi, 2 = dsi when grad
            constexpr int kMode = decltype(mode)::value;
#pragma unroll
            for (int n = 0; n < kN8; ++n) {
              if ((n & (Gu - 1)) == 0) {
                const int col = kb + (n + gi) * 8 + 2 * tq;  // this lane's key pair
#pragma unroll
                for (int h = 0; h < 2; ++h) {  // rows g and g + 8: accumulator entries 2 h, 2 h + 1
                  const int u = h ? uu1 : uu0;
                  if (kGu > 0 || u >= 0) {
                    const float2 si = *reinterpret_cast<const float2*>(sSi + u * L::kSiS + col);
                    const float pm0 = v[n][2 * h] * inv_g, pm1 = v[n][2 * h + 1] * inv_g;
                    // Past block_size or blen the index logits were never written (NOTES s35).
                    const float term = kl_term_log2(pm0, si.x) + kl_term_log2(pm1, si.y);
                    if (h) acc1 += term; else acc0 += term;
                    // SPEC 4: Pidx - P (times d_kl / rows later); 0 past the visible keys.
                    if (kMode == 1 || (kMode == 2 && grad)) {
                      const int lim = h ? lim1 : lim0;
                      const float li = h ? li1 : li0;
                      const float d0 = ko + col <= lim ? fast_exp2(si.x - li) - pm0 : 0.f;
                      const float d1 = ko + col + 1 <= lim ? fast_exp2(si.y - li) - pm1 : 0.f;
                      *reinterpret_cast<uint32_t*>(sDsi + PTile::offset(u, col / 8) + col % 8) = pack2<T>(d0, d1);
                    }
                  }
                }
              }
            }
          };
          if constexpr (kGu > 0) {
            if (grad) kl_terms(std::integral_constant<int, 1>{}); else kl_terms(std::integral_constant<int, 0>{});
          } else {
            kl_terms(std::integral_constant<int, 2>{});
          }
#pragma unroll
          for (int off = 1; off <= 2; off <<= 1) {
            acc0 += __shfl_xor_sync(0xffffffffu, acc0, off);
            acc1 += __shfl_xor_sync(0xffffffffu, acc1, off);
          }
          for (int off = 4; off < 4 * Gu; off <<= 1) {
            acc0 += __shfl_xor_sync(0xffffffffu, acc0, off);
            acc1 += __shfl_xor_sync(0xffffffffu, acc1, off);
          }
          if (tq == 0 && gi == 0) {  // this key half's KL sum per unit; the halves are added below
            if (ok0) sKl[kh * kUnitsT + uu0] = acc0 * kLn2;
            if (ok1) sKl[kh * kUnitsT + uu1] = acc1 * kLn2;
          }
        }
      }
      if constexpr (!kWgmma) {
        __syncthreads();  // P of both key halves
        if (live && p.write_out) {  // write_out = false: KL only (warmup), no P V
          // P V for this warp's half of D over all keys of the block (kSplit: of the stage), into the
          // partial output. kSplit's second half adds its share to the first half's store (the same
          // thread's, read back before the MMAs so that the load overlaps them), and leaves the rows that
          // see none of its keys as they are.
          [[maybe_unused]] uint32_t prev[2][kSplit ? kDo / 8 : 1];
          if constexpr (kSplit) {
            if (bh > 0) {
              const T* first = static_cast<const T*>(p.out_part);
#pragma unroll
              for (int h = 0; h < 2; ++h) {
                const bool has = (h ? lim1 : lim0) >= ko;  // a row of the tile with keys in this half
                const int64_t e = has ? (h ? sEntry[u1] : sEntry[u0]) : 0;
                const uint32_t* src =
                    reinterpret_cast<const uint32_t*>(first + (e * G + j * Gu + (h ? hh1 : hh0)) * D + kh * kDo);
#pragma unroll
                for (int n = 0; n < kDo / 8; ++n) prev[h][n] = has ? src[n * 4 + tq] : 0u;
              }
            }
          }
          float o[kDo / 8][4];
          zero_acc(o);
          mma_rows_keys<T, Tile, kStage>(o, sP, rg * 16, sV, kh * (kDo / 8), lane);
          if constexpr (kSplit) {
            if (bh > 0) {
#pragma unroll
              for (int n = 0; n < kDo / 8; ++n) {
                const float2 x0 = unpack2<T>(prev[0][n]), x1 = unpack2<T>(prev[1][n]);
                o[n][0] += x0.x;
                o[n][1] += x0.y;
                o[n][2] += x1.x;
                o[n][3] += x1.y;
              }
            }
          }
          T* part = static_cast<T*>(p.out_part);
          if (lim0 >= ko) {
            uint32_t* dst =
                reinterpret_cast<uint32_t*>(part + (int64_t(sEntry[u0]) * G + j * Gu + hh0) * D + kh * kDo);
#pragma unroll
            for (int n = 0; n < kDo / 8; ++n) dst[n * 4 + tq] = pack2<T>(o[n][0], o[n][1]);
          }
          if (lim1 >= ko) {
            uint32_t* dst =
                reinterpret_cast<uint32_t*>(part + (int64_t(sEntry[u1]) * G + j * Gu + hh1) * D + kh * kDo);
#pragma unroll
            for (int n = 0; n < kDo / 8; ++n) dst[n * 4 + tq] = pack2<T>(o[n][2], o[n][3]);
          }
        }
      }
    }
    // The KL sum of unit u of the tile; kSplit: the block's halves meet in sKlAcc (the first's sum plus
    // the second's, in this order).
    [[maybe_unused]] auto kl_store = [&](int u, float x) {
      if constexpr (kSplit) {
        if (bh > 0) x = sKlAcc[ub + u] + x;
        if (bh + 1 < nh) sKlAcc[ub + u] = x; else p.kl_part[sEntry[u]] = x;
      } else {
        p.kl_part[sEntry[u]] = x;
      }
    };
    // The output pass's per-unit sums and the small-smem stats pass's pairs meet in shared memory here. The
    // other stats passes need no barrier: the index parts they merge below were complete at the step's
    // barrier after Q K^T (the index logits run before it), the next step writes them only after its first
    // barrier, and nothing after that barrier reads K (a J > 1 reload at the next step's top is safe).
    if constexpr (kOut || kSmall) __syncthreads();
    if constexpr (kOut) {
      if (fast_kl) {  // the KL sum per unit: both key halves, in a fixed order
        for (int u = tid; u < nu; u += kThreadsT) kl_store(u, kPair ? sKl[u] + sKl[kUnitsT + u] : sKl[u]);
      }
      if (index && J > 1) {  // the group's heads meet here: sum this pass's heads per (unit, key)
        for (int i = tid; i < U * kStage; i += kThreadsT) {
          const int u = i / kStage, col = i % kStage;
          float s = 0.f;
          for (int hh = 0; hh < Gu; ++hh) s += float(sP[PTile::offset(u * Gu + hh, col / 8) + col % 8]);
          sPsum[i] = j == 0 ? s : sPsum[i] + s;
        }
        __syncthreads();
      }
    }

    if constexpr (!kOut && kSmall) {
      // The pair's two (max, sum) per row: keys [0, 64) from registers, [64, 128) from shared memory.
      if (active && kh == 0 && tq == 0) {
        auto merged = [](float2 a, float2 b) {
          const float m = fmaxf(a.x, b.x);
          if (m == kFwdNegInf) return make_float2(m, 0.f);  // no visible key
          return make_float2(m, a.y * exp2f(a.x - m) + b.y * exp2f(b.x - m));
        };
        if (lim0 >= 0) p.stats[int64_t(sEntry[u0]) * G + j * Gu + hh0] = merged(st0, sMPart[row0]);
        if (lim1 >= 0) p.stats[int64_t(sEntry[u1]) * G + j * Gu + hh1] = merged(st1, sMPart[row1]);
      }
    }
    if constexpr (!kOut) {
      // Index stats per unit: merge the parts' (max, sum), in part order (a warp's 16 keys; in the wgmma
      // variant a warpgroup's 64).
      if (index && j == 0 && !index_tile(ub)) {  // every unit's (max, sum) is the top-k's
        for (int u = tid; u < nu; u += kThreadsT) p.idx_stats[sEntry[u]] = make_float2(kFwdNegInf, 1.f);
      } else if (index && j == 0) {
        const int nw = kWgmma ? (p.block_size + 63) / 64 : min(8, p.block_size / 16);  // parts
        for (int u = tid; u < nu; u += kThreadsT) {
          if (sel_unit(ub + u)) {  // the top-k's
            p.idx_stats[sEntry[u]] = make_float2(kFwdNegInf, 1.f);
            continue;
          }
          float m = kFwdNegInf;
          for (int w2 = 0; w2 < nw; ++w2) m = fmaxf(m, sIPart[w2 * kUnitsT + u].x);
          float l = 0.f;
          for (int w2 = 0; w2 < nw; ++w2) {
            const float2 part = sIPart[w2 * kUnitsT + u];
            if (part.y != 0.f) l += part.y * exp2f(part.x - m);  // empty parts hold 0; a NaN sum stays
          }
          p.idx_stats[sEntry[u]] = make_float2(m, l);
        }
      }
    }

    // Per unit, once the tile's last kv head is done (warp w takes units w, w + 16, ...; lane takes keys
    // lane + 32 i): KL terms, when the register path above does not apply.
    if (kOut && index && j == J - 1) {
      for (int u = warp; u < nu && !fast_kl; u += kWarpsT) {
        const int lim = key_limit(u, nu);
        const float* si = sSi + u * L::kSiS;
        const float inv_g = 1.f / float(G);
        const bool grad = p.dsi_part != nullptr;
        const float lse_idx2 = grad ? p.lse_idx[int64_t(r) * p.total_tokens + sTok[u]] * kLog2e : 0.f;
        float acc = 0.f;
        // The stage's columns col (keys ko + col); without dsi, the visible ones only.
        const int n_cols = grad ? kStage : (kSplit ? min(kStage, lim - ko + 1) : lim + 1);
        for (int col = lane; col < n_cols; col += 32) {
          float pm = 0.f, dsi = 0.f;
          if (ko + col <= lim) {
            float s = 0.f;
            if (J > 1) {
              s = sPsum[u * kStage + col];
            } else {
              for (int hh = 0; hh < Gu; ++hh) s += float(sP[PTile::offset(u * Gu + hh, col / 8) + col % 8]);
            }
            pm = s * inv_g;
            acc = kl_term_log2_add(acc, pm, si[col]);  // log2 domain (si too)
            dsi = fast_exp2(si[col] - lse_idx2) - pm;  // SPEC 4: Pidx - P (times d_kl / rows later)
          }
          if (grad) sDsi[PTile::offset(u, col / 8) + col % 8] = T(dsi);
        }
#pragma unroll
        for (int off = 16; off >= 1; off >>= 1) acc += __shfl_xor_sync(0xffffffffu, acc, off);
        if (lane == 0) kl_store(u, acc * kLn2);
      }
      if (p.dsi_part != nullptr) {
        // dsi of the tile's units to the chunk's buffer at their places in the reverse index (the
        // item's units are consecutive there: one contiguous run of nu rows, which index_dk.cu then
        // streams in order), 16 bytes per thread and row chunk; and dq_idx:
        // dsi (units x keys) K_idx (keys x Di); warp w takes the units' m-tiles w / 8, w / 8 + kWarpsT
        // / 8, ... and 16 columns of Di. The register KL path wrote dsi before the barrier after the
        // KL block; only the per-unit loop above needs another (the next step's writes to dsi come
        // after the barriers at its start).
        // kSplit: the stage's columns [ko, ko + 64) of the rows; a block of one half (<= 64 keys) also
        // stores the zeros of columns [64, 128), which the default configuration writes too.
        if (!fast_kl) __syncthreads();
        for (int i = tid; i < nu * (kStage / 8); i += kThreadsT) {
          const int u = i / (kStage / 8), ch = i % (kStage / 8);
          *reinterpret_cast<uint4*>(static_cast<T*>(p.dsi_part) + int64_t(u_begin + ub + u) * Sh::kKeys + ko + ch * 8) =
              *reinterpret_cast<const uint4*>(sDsi + PTile::offset(u, ch));
        }
        if constexpr (kSplit) {
          if (nh == 1) {
            for (int i = tid; i < nu * (kStage / 8); i += kThreadsT) {
              const int u = i / (kStage / 8), ch = i % (kStage / 8);
              *reinterpret_cast<uint4*>(static_cast<T*>(p.dsi_part) + int64_t(u_begin + ub + u) * Sh::kKeys + kStage +
                                        ch * 8) = make_uint4(0, 0, 0, 0);
            }
          }
        }
        for (int mt = warp / 8; mt * 16 < nu && kw * 16 < di; mt += kWarpsT / 8) {
          float dq[2][4];
          zero_acc(dq);
          mma_rows_keys<T, KiTile, kStage>(dq, sDsi, mt * 16, sKi, kw * 2, lane);
          // One 16-byte atomic per lane and n-tile: even tq lanes add unit mt * 16 + g, odd ones + 8
          // (deterministic mode: the exact hi / lo split of common/det_sum.h).
          const int uq = mt * 16 + g + ((tq & 1) ? 8 : 0);
          const int64_t o = (int64_t(sTok[uq < nu ? uq : 0]) * p.hi + r) * di + kw * 16 + 2 * (tq & ~1);
#pragma unroll
          for (int n = 0; n < 2; ++n) {
            const float4 v = quad_rows4(dq[n], tq);
            const float s = p.dqi_scale;
            const float4 x = make_float4(v.x * s, v.y * s, v.z * s, v.w * s);
            if (uq < nu) {
              if (p.dqi_lo != nullptr) det_add4(p.dqi_accum + o + n * 8, p.dqi_lo + o + n * 8, x, __ldg(p.dqi_grid));
              else atomic_add4(p.dqi_accum + o + n * 8, x);
            }
          }
        }
      }
    }
  }
}

// One pass over the forward's work list with the mainloop Mma (sm80::FwdMma or sm90::FwdMma).
template <class Mma, typename T, int D, bool kOut, int kRows = 128, int kGu = 0, bool kSmall = false>
cudaError_t launch_sparse_fwd_pass(const SparseFwdParams& p, cudaStream_t stream) {
  if (p.work.max_items == 0) return cudaSuccess;
  constexpr int smem = SparseFwdShape::Smem<T, D, kOut, kRows, kSmall>::bytes + Mma::kSmemSlack;
  auto kernel = sparse_fwd_kernel<Mma, T, D, kOut, kRows, kGu, kSmall>;
  cudaError_t err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
  // The stats pass runs two CTAs per SM: ask for the largest shared-memory carve-out.
  if (err == cudaSuccess)
    err = cudaFuncSetAttribute(kernel, cudaFuncAttributePreferredSharedMemoryCarveout, cudaSharedmemCarveoutMaxShared);
  if (err != cudaSuccess) return err;
  kernel<<<p.work.max_items, SparseFwdShape::threads<kOut, Mma::kWgmma, kRows>(), smem, stream>>>(p);
  return cudaGetLastError();
}

}  // namespace msa::smxx
