// Warmup's dense KL pass on Hopper (SPEC 4 over the full causal set of SPEC 5), given lse and lse_idx.
//
// Key-major, as a flash backward: a CTA holds one 128-key tile of K and K_idx (two consumer warpgroups,
// 64 keys each) and walks a chunk of 64-row query tiles, for every index group r of its index-key head.
// Per (query tile, group), transposed (keys as the MMA's M):
//   S_idx^T = K_idx Q_idx^T              m64n64, K = Di   (A: K_idx by ldmatrix, B: Q_idx K-major)
//   S_h^T   = K Q_h^T, h in the group    m64n64, K = D    (A: K by ldmatrix,     B: Q_h K-major)
//   Pbar = mean_h exp2(S_h * c - lse_h),  Pidx = exp2(S_idx * ci - lse_idx)      (masked: key <= query)
//   KL partial per query = sum over the tile's keys of Pbar (log2 Pbar - S_idx * ci)   (log2 units)
//   dS^T = Pidx - Pbar
//   dK_idx += dS^T Q_idx                 m64nDi, K = 64   (A: dS^T from registers, B: Q_idx MN-major)
//   dQ_idx  = dS K_idx                   m64n64, K = 128  (A: dS by ldmatrix.trans of dS^T in shared
//                                                          memory, B: K_idx MN-major), red.v4 to global
// dK_idx stays in registers over the CTA's whole walk (one red.v4 flush at the end); the KL partials
// are summed in fixed point (int64 atomics: the KL value does not depend on the order). FLOPs per
// (query tile, group): 128 x 64 x (2 D G + 6 Di); useful (causal pairs only): N (N + 1) / 2 x (2 D G + 6 Di)
// per group and sequence.
//
// Loads (v2): Q and Q_idx tiles by TMA (boxes of 64 columns x 1 head x 64 rows, 128-byte swizzle: the
// KMajorSw128 panels), issued by thread 0 into rings with a "full" mbarrier per slot (the TMA bytes) and
// an "empty" one (one arrival per warp once its wgmma read the slot): no CTA barrier per head, so the two
// warpgroups drift apart. Q load n (step n / G, head n % G) lands in slot n % slots; thread 0 issues load
// n + slots - 1 once load n is consumed (its slot held load n - 1). lse / lse_idx of step s + 1 are
// cp.async'd by every thread during step s into the other of two buffers; an mbarrier of 256 async
// arrivals says they landed. K and K_idx: cp.async at the start and when the kv head changes (a CTA
// barrier then). One CTA barrier per step: dS^T and the KL partials (double buffered) before dQ_idx.
#pragma once
#include <cuda.h>  // CUtensorMap (types only: the encoder is reached through the runtime)
#include <cudaTypedefs.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <type_traits>

#include "common/mma_sm80.h"
#include "common/wgmma_sm90.h"
#include "params.h"
#include "sm90/dense_kl/dense_kl.h"

namespace msa::sm90 {
namespace dense_kl {

using sm80::cp_async_16;
using sm80::cp_async_4;
using sm80::fast_exp2;
using sm80::fast_log2;
using sm80::ldmatrix_x4_trans;
using sm80::pack2;
using sm80::smem_addr;

constexpr int kKeys = 128;   // keys per CTA (two warpgroups of 64)
constexpr int kRows = 64;    // query rows per step
constexpr int kMaxSlots = 5;  // Q ring: 5 slots where the shared memory allows, else 4 or 3
constexpr int kThreads = 256;
constexpr float kLog2e = 1.4426950408889634f;
constexpr float kLn2 = 0.6931471805599453f;
constexpr float kMinNormal = 1.17549435e-38f;

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
  static constexpr int bars = kl + 2 * 8 * kRows * 4;           // 2 x kMaxSlots (Q) + 2 x 2 (Q_idx) + 2 (lse)
  static constexpr int q = bars + 1024;                         // the Q slots, 1024-byte aligned
  static constexpr int lse_bytes(int g) { return 2 * (g + 1) * kRows * 4; }  // 2 buffers x (G lse + lse_idx)
  static constexpr int bytes(int g, int slots) { return q + slots * kRows * D * 2 + lse_bytes(g); }
};

// The most Q slots (<= kMaxSlots, >= 3) whose shared memory fits `limit` bytes (0: none fits).
template <int D, int Di>
inline int q_slots(int g, int limit) {
  for (int s = kMaxSlots; s >= 3; --s)
    if (Smem<D, Di>::bytes(g, s) + 1024 <= limit) return s;
  return 0;
}

__device__ __forceinline__ void cp_async_mbar_arrive(uint64_t* bar) {
  asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];\n"
               ::"r"(static_cast<uint32_t>(__cvta_generic_to_shared(bar))) : "memory");
}

// rows x (W 16-bit elements) tile at global rows [row0, row0 + rows) (stride in elements), rows at or
// past `limit` zero-filled, into a KMajorSw128 tile.
template <typename Tile, int W>
__device__ __forceinline__ void load_tile(void* dst, const void* src, int64_t stride, int row0, int rows, int limit,
                                          int tid) {
  constexpr int kChunks = W / 8;
  const char* s = static_cast<const char*>(src);
  for (int i = tid; i < rows * kChunks; i += kThreads) {
    const int r = i / kChunks, c = i % kChunks;
    const bool ok = row0 + r < limit;
    const char* g = s + (int64_t(ok ? row0 + r : 0) * stride + c * 8) * 2;
    cp_async_16(static_cast<char*>(dst) + Tile::offset(r, c) * 2, g, ok);
  }
}

}  // namespace dense_kl

template <typename T, int D, int Di>
__global__ void __launch_bounds__(dense_kl::kThreads, 1)
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
  // The swizzled tiles must start 1024-byte aligned.
  char* smem = reinterpret_cast<char*>((reinterpret_cast<uintptr_t>(smem_raw) + 1023) & ~uintptr_t(1023));
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
  float* sLse0 = reinterpret_cast<float*>(smem + L::q + slots * kRows * D * 2);

  const int tid = threadIdx.x, lane = tid % 32, warp = tid / 32, wg = warp / 4, wq = warp % 4;
  const int g = lane / 4, t = lane % 4;

  // This CTA's (key tile, query chunk): chunks of one key tile are consecutive CTAs, so the CTAs that
  // run at the same time add into disjoint dQ_idx rows (same-address atomics serialise in L2).
  const int tile = blockIdx.x / p.max_chunks, chunk = blockIdx.x % p.max_chunks;
  if (tile >= p.tile_offsets[p.num_seqs]) return;
  int lo = 0, hi = p.num_seqs - 1;
  while (lo < hi) {
    const int mid = (lo + hi + 1) / 2;
    if (p.tile_offsets[mid] <= tile) lo = mid; else hi = mid - 1;
  }
  const int base = p.cu_seqlens[lo], len = p.cu_seqlens[lo + 1] - base;
  const int k0 = (tile - p.tile_offsets[lo]) * kKeys;
  const int n_qt = (len + kRows - 1) / kRows;
  const int qt_begin = k0 / kRows + chunk * p.chunk_tiles;
  if (qt_begin >= n_qt) return;
  const int nqt = min(p.chunk_tiles, n_qt - qt_begin);
  const int hk = blockIdx.y;
  const int G = p.hq / p.hi, groups = p.hi / p.hki, r0 = hk * groups;
  const int steps = groups * nqt, loads = steps * G;
  const bool grad = p.dq_idx != nullptr;
  const int kv_per = p.hq / p.hkv;  // query heads per kv head

  const T* q = static_cast<const T*>(p.q);
  const T* k = static_cast<const T*>(p.k);
  const T* qi = static_cast<const T*>(p.q_idx);
  const T* ki = static_cast<const T*>(p.k_idx);

  auto step_group = [&](int s) { return r0 + s / nqt; };
  auto step_row0 = [&](int s) { return (qt_begin + s % nqt) * kRows; };
  if (tid == 0) {
    for (int i = 0; i < slots; ++i) {
      mbar_init(full_q + i, 1);
      mbar_init(empty_q + i, 8);
    }
    for (int i = 0; i < 2; ++i) {
      mbar_init(full_a + i, 1);
      mbar_init(empty_a + i, 8);
      mbar_init(lse_full + i, kThreads);
    }
    mbar_fence_init();
  }
  __syncthreads();
  // Thread 0's TMA loads: Q load m (step m / G, head m % G) and Q_idx of step m, each after the slot's
  // previous use was released by all 8 warps.
  auto issue_q = [&](int m) {
    if (m >= loads) return;
    const int slot = m % slots, u = m / slots, s = m / G;
    if (u > 0) mbar_wait(empty_q + slot, (u - 1) & 1);
    T* dst = sQ + slot * kRows * D;
    mbar_arrive_expect_tx(full_q + slot, kRows * D * 2);
#pragma unroll
    for (int panel = 0; panel < D / 64; ++panel) {
      tma_load_3d(dst + panel * QT::kPanelElems, &q_map, panel * 64, step_group(s) * G + m % G,
                  base + step_row0(s), full_q + slot);
    }
  };
  auto issue_a = [&](int s) {
    if (s >= steps) return;
    const int slot = s & 1, u = s / 2;
    if (u > 0) mbar_wait(empty_a + slot, (u - 1) & 1);
    T* dst = sQi + slot * kRows * Di;
    mbar_arrive_expect_tx(full_a + slot, kRows * Di * 2);
#pragma unroll
    for (int panel = 0; panel < Di / 64; ++panel) {
      tma_load_3d(dst + panel * QiT::kPanelElems, &qi_map, panel * 64, step_group(s), base + step_row0(s),
                  full_a + slot);
    }
  };
  // Every thread: its share of step s's lse (G heads) and lse_idx, then an async arrival on lse_full.
  // Buffer s & 1 was last read in step s - 2, before that step's CTA barrier.
  auto issue_lse = [&](int s) {
    if (s >= steps) return;
    const int b = s & 1, r = step_group(s), row0 = step_row0(s);
    float* dst = sLse0 + b * (G + 1) * kRows;
    for (int i = tid; i < (G + 1) * kRows; i += kThreads) {
      const int hh = i / kRows, row = i % kRows;
      const bool ok = row0 + row < len;
      const int tok = base + (ok ? row0 + row : 0);
      const float* src_row = hh < G ? p.lse + int64_t(r * G + hh) * p.total_tokens : p.lse_idx + int64_t(r) * p.total_tokens;
      cp_async_4(dst + i, src_row + tok, ok);
    }
    cp_async_mbar_arrive(lse_full + b);
  };
  auto load_k = [&](int kvh) {  // every thread; then cp.async.wait_all + a CTA barrier
    load_tile<KT, D>(sK, k + base * p.k_stride_t + kvh * p.k_stride_h, p.k_stride_t, k0, kKeys, len, tid);
    sm80::cp_async_commit();
  };

  // Prologue: K_idx and K of the first group (cp.async), step 0's Q_idx, lse and the first Q loads.
  load_tile<KiT, Di>(sKi, ki + base * p.ki_stride_t + hk * p.ki_stride_h, p.ki_stride_t, k0, kKeys, len, tid);
  int kv_loaded = r0 * G / kv_per;
  load_k(kv_loaded);
  sm80::cp_async_wait<0>();
  fence_proxy_async_smem();
  __syncthreads();
  issue_lse(0);
  if (tid == 0) {
    issue_a(0);
    for (int m = 0; m < slots - 1; ++m) issue_q(m);
  }

  float dk[Di / 2];  // this warpgroup's 64 keys x Di of d kl / d k_idx (before grad_scale)
#pragma unroll
  for (int i = 0; i < Di / 2; ++i) dk[i] = 0.f;

  const uint32_t k_addr = smem_addr(sK), ki_addr = smem_addr(sKi);
  const int key_row = wg * 64 + wq * 16 + g;  // this thread's keys: key_row and key_row + 8 of the tile
  const int key0 = k0 + key_row, key1 = key0 + 8;

  for (int s = 0; s < steps; ++s) {
    const int b = s & 1, r = step_group(s), row0 = step_row0(s);
    const int kvh = r * G / kv_per;
    T* sDs = sDs0 + b * kKeys * kRows;
    float* sKl = sKl0 + b * 8 * kRows;
    if (kvh != kv_loaded) {  // a new kv head for this group: every read of sK ended before the last barrier
      load_k(kvh);
      sm80::cp_async_wait<0>();
      fence_proxy_async_smem();
      __syncthreads();
      kv_loaded = kvh;
    }
    issue_lse(s + 1);
    if (tid == 0) issue_a(s + 1);
    mbar_wait(full_a + b, (s / 2) & 1);
    mbar_wait(lse_full + b, (s / 2) & 1);
    const float* sLseIdx = sLse0 + b * (G + 1) * kRows + G * kRows;

    // S_idx^T: keys x queries.
    float si[32];
    const uint32_t qi_addr = smem_addr(sQi + b * kRows * Di);
    // A = this warpgroup's 64 rows of the key tiles (row 64 wg of each 128-byte panel), by descriptor.
    const uint32_t ki_rows = ki_addr + wg * 64 * 128, k_rows = k_addr + wg * 64 * 128;
    wgmma_ss64_ksteps<T, Di / 16>(si, [&](int ks) { return KiT::desc(ki_rows, ks); },
                                  [&](int ks) { return QiT::desc(qi_addr, ks); }, false);

    // The mask: a tile entirely below the diagonal and inside the sequence needs none.
    const bool full = row0 >= k0 + kKeys && row0 + kRows <= len;
    auto visible = [&](int key, int col) {
      const int qr = row0 + col;
      return full || (key <= qr && qr < len);
    };

    // Pbar^T: the group's heads, Q through the ring.
    float pb[32];
#pragma unroll
    for (int i = 0; i < 32; ++i) pb[i] = 0.f;
    const float* lse_b = sLse0 + b * (G + 1) * kRows;
    for (int hh = 0; hh < G; ++hh) {
      const int n = s * G + hh, slot = n % slots;
      mbar_wait(full_q + slot, (n / slots) & 1);
      const uint32_t q_addr = smem_addr(sQ + slot * kRows * D);
      float sc[32];
      wgmma_ss64_ksteps<T, D / 16>(sc, [&](int ks) { return KT::desc(k_rows, ks); },
                                   [&](int ks) { return QT::desc(q_addr, ks); }, false);
      if (lane == 0) mbar_arrive(empty_q + slot);  // this warp is done with the slot
      if (tid == 0) issue_q(n + slots - 1);        // into the slot of load n - 1
      const float* lh = lse_b + hh * kRows;
#pragma unroll
      for (int j = 0; j < 8; ++j) {
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int col = 8 * j + 2 * t + (e & 1);
          const int key = e < 2 ? key0 : key1;
          const float x = fast_exp2(fmaf(sc[4 * j + e], p.scale_log2, -lh[col] * kLog2e));
          pb[4 * j + e] += visible(key, col) ? x : 0.f;
        }
      }
    }

    // Pidx, dS^T (into si) and the KL terms (into pb).
    const float inv_g = 1.f / float(G);
    const float* li = sLseIdx;
#pragma unroll
    for (int j = 0; j < 8; ++j) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int col = 8 * j + 2 * t + (e & 1);
        const bool vis = visible(e < 2 ? key0 : key1, col);
        const float pm = pb[4 * j + e] * inv_g;
        const float s2 = si[4 * j + e] * p.iscale_log2;
        const float pidx = vis ? fast_exp2(s2 - li[col] * kLog2e) : 0.f;
        pb[4 * j + e] = vis && !(pm < kMinNormal) ? pm * (fast_log2(pm) - s2) : 0.f;  // NaN P: a NaN row
        si[4 * j + e] = vis ? pidx - pm : 0.f;
      }
    }
    // KL per query: the thread's two keys, the warp's 16 (lanes of equal t), then the 8 warps in shared
    // memory.
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

    if (grad) {  // CTA-uniform
      // dS^T as the A operand (input dtype): n-tiles 2 kk, 2 kk + 1 are queries [16 kk, +16).
      uint32_t pa[4][4];
#pragma unroll
      for (int kk = 0; kk < 4; ++kk) {
        pa[kk][0] = pack2<T>(si[8 * kk + 0], si[8 * kk + 1]);
        pa[kk][1] = pack2<T>(si[8 * kk + 2], si[8 * kk + 3]);
        pa[kk][2] = pack2<T>(si[8 * kk + 4], si[8 * kk + 5]);
        pa[kk][3] = pack2<T>(si[8 * kk + 6], si[8 * kk + 7]);
      }
      // dS^T to shared memory for dQ_idx (rows = keys): the same packed pairs (before the wgmma: its A
      // registers may not be read while it runs).
#pragma unroll
      for (int kk = 0; kk < 4; ++kk) {
#pragma unroll
        for (int hf = 0; hf < 2; ++hf) {
          const int chunk = 2 * kk + hf;
          *reinterpret_cast<uint32_t*>(sDs + DsT::offset(key_row, chunk) + 2 * t) = pa[kk][2 * hf];
          *reinterpret_cast<uint32_t*>(sDs + DsT::offset(key_row + 8, chunk) + 2 * t) = pa[kk][2 * hf + 1];
        }
      }
      // dK_idx += dS^T Q_idx.
      wgmma_fence();
#pragma unroll
      for (int kk = 0; kk < 4; ++kk) WgmmaRS<T, Di, true>::run(dk, pa[kk], QiT::desc_mn(qi_addr, kk), true);
      wgmma_commit();
      wgmma_wait<0>();
    }
    if (lane == 0) mbar_arrive(empty_a + b);  // this warp's reads of the Q_idx slot are done
    __syncthreads();  // sDs and sKl complete

    if (tid < kRows && row0 + tid < len) {  // KL in fixed point: the order of the adds does not matter
      float v = 0.f;
#pragma unroll
      for (int w = 0; w < 8; ++w) v += sKl[w * kRows + tid];
      const int64_t row = int64_t(r) * p.total_tokens + base + row0 + tid;
      if (isfinite(v)) {
        atomicAdd(p.kl_fixed + row, static_cast<unsigned long long>(__float2ll_rn(v * 4294967296.f)));
      } else {
        atomicOr(p.kl_bad + row, 1u);  // the fixed point cannot hold it: the finish writes NaN
      }
    }
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
      const int col0 = Di == 128 ? 64 * wg : 0;
      const int qrow = wq * 16 + g + ((t & 1) ? 8 : 0);
      const bool ok = row0 + qrow < len;
      float* dst = p.dq_idx + (int64_t(base + row0 + (ok ? qrow : 0)) * p.hi + r) * Di + col0 + 2 * (t & ~1);
#pragma unroll
      for (int j = 0; j < 8; ++j) {
        const float c4[4] = {dq[4 * j], dq[4 * j + 1], dq[4 * j + 2], dq[4 * j + 3]};
        const float4 v = sm80::quad_rows4(c4, t);
        if (ok) {
          sm80::atomic_add4(dst + 8 * j, make_float4(v.x * p.grad_scale, v.y * p.grad_scale, v.z * p.grad_scale,
                                                     v.w * p.grad_scale));
        }
      }
    }
  }
  sm80::cp_async_wait<0>();

  if (grad) {  // dK_idx: rows = this warpgroup's keys, Di columns
    const int krow = key_row + ((t & 1) ? 8 : 0);
    const bool ok = k0 + krow < len;
    float* dst = p.dk_idx + (int64_t(base + k0 + (ok ? krow : 0)) * p.hki + hk) * Di + 2 * (t & ~1);
#pragma unroll
    for (int j = 0; j < Di / 8; ++j) {
      const float c4[4] = {dk[4 * j], dk[4 * j + 1], dk[4 * j + 2], dk[4 * j + 3]};
      const float4 v = sm80::quad_rows4(c4, t);
      if (ok) {
        sm80::atomic_add4(dst + 8 * j,
                          make_float4(v.x * p.grad_scale, v.y * p.grad_scale, v.z * p.grad_scale, v.w * p.grad_scale));
      }
    }
  }
}

// The TMA descriptor of a (T, H, W) tensor (strides in elements): boxes of 64 columns x 1 head x 64 rows,
// 128-byte swizzle (the KMajorSw128 panel layout), zeros out of bounds.
template <typename T>
cudaError_t make_row_map(const void* ptr, int w, int heads, int tokens, int64_t stride_h, int64_t stride_t,
                         CUtensorMap* map) {
  static PFN_cuTensorMapEncodeTiled_v12000 encode = nullptr;
  if (encode == nullptr) {
    cudaDriverEntryPointQueryResult found{};
    void* fn = nullptr;
    const cudaError_t err = cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &fn, 12000, cudaEnableDefault,
                                                             &found);
    if (err != cudaSuccess || found != cudaDriverEntryPointSuccess || fn == nullptr) return cudaErrorNotSupported;
    encode = reinterpret_cast<PFN_cuTensorMapEncodeTiled_v12000>(fn);
  }
  const cuuint64_t dims[3] = {cuuint64_t(w), cuuint64_t(heads), cuuint64_t(tokens)};
  const cuuint64_t strides[2] = {cuuint64_t(stride_h) * sizeof(T), cuuint64_t(stride_t) * sizeof(T)};
  const cuuint32_t box[3] = {64, 1, cuuint32_t(dense_kl::kRows)};
  const cuuint32_t elem_strides[3] = {1, 1, 1};
  const CUresult r = encode(map, std::is_same_v<T, __half> ? CU_TENSOR_MAP_DATA_TYPE_FLOAT16 : CU_TENSOR_MAP_DATA_TYPE_BFLOAT16,
                            3, const_cast<void*>(ptr), dims, strides, box, elem_strides, CU_TENSOR_MAP_INTERLEAVE_NONE,
                            CU_TENSOR_MAP_SWIZZLE_128B, CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
                            CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  return r == CUDA_SUCCESS ? cudaSuccess : cudaErrorNotSupported;
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
  err = make_row_map<T>(p.q, D, p.hq, p.total_tokens, p.q_stride_h, p.q_stride_t, &q_map);
  if (err == cudaSuccess) err = make_row_map<T>(p.q_idx, Di, p.hi, p.total_tokens, p.qi_stride_h, p.qi_stride_t, &qi_map);
  if (err != cudaSuccess) return err;
  const int smem = dense_kl::Smem<D, Di>::bytes(G, slots) + 1024;
  auto kernel = dense_kl_kernel<T, D, Di>;
  err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
  if (err != cudaSuccess) return err;
  const dim3 grid(unsigned(p.num_tiles) * unsigned(p.max_chunks), p.hki);
  kernel<<<grid, dense_kl::kThreads, smem, stream>>>(p, q_map, qi_map, slots);
  return cudaGetLastError();
}

}  // namespace msa::sm90
