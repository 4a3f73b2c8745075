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
// Loads: cp.async, 16 bytes per thread and chunk. The Q tiles of the heads go through a ring of kSlots
// slots in (step, head) order: load n lands in slot n % kSlots and is issued once load n - kSlots has
// been consumed by both warpgroups, so the next heads (and the next step's) load while this one
// computes. Q_idx, lse and lse_idx of step s + 1 load during step s (two buffers).
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>

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
constexpr int kSlots = 4;    // Q ring
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
  static constexpr int q = ki + kKeys * Di * 2;
  static constexpr int qi = q + kSlots * kRows * D * 2;
  static constexpr int ds = qi + 2 * kRows * Di * 2;
  static constexpr int kl = ds + kKeys * kRows * 2;          // 8 warps x 64 queries, fp32
  static constexpr int lse_idx = kl + 8 * kRows * 4;         // 2 x 64
  static constexpr int lse = lse_idx + 2 * kRows * 4;        // 2 x G x 64
  static constexpr int bytes(int g) { return lse + 2 * g * kRows * 4; }
};

// cp.async.wait_group with a runtime count (the pending groups allowed).
__device__ __forceinline__ void wait_pending(int n) {
  switch (n) {
    case 0: sm80::cp_async_wait<0>(); break;
    case 1: sm80::cp_async_wait<1>(); break;
    case 2: sm80::cp_async_wait<2>(); break;
    case 3: sm80::cp_async_wait<3>(); break;
    case 4: sm80::cp_async_wait<4>(); break;
    case 5: sm80::cp_async_wait<5>(); break;
    case 6: sm80::cp_async_wait<6>(); break;
    default: sm80::cp_async_wait<7>(); break;  // groups complete in order: waiting for more is safe
  }
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
__global__ void __launch_bounds__(dense_kl::kThreads, 1) dense_kl_kernel(DenseKlParams p) {
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
  T* sDs = reinterpret_cast<T*>(smem + L::ds);
  float* sKl = reinterpret_cast<float*>(smem + L::kl);
  float* sLseIdx = reinterpret_cast<float*>(smem + L::lse_idx);
  float* sLse = reinterpret_cast<float*>(smem + L::lse);

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

  int issued = 0;  // commit groups issued (uniform over the CTA)
  int pos_q[kSlots], pos_a[2], pos_k = 0;
  auto commit = [&]() {
    sm80::cp_async_commit();
    return issued++;
  };
  auto wait_for = [&](int pos) {
    wait_pending(issued - 1 - pos);
    fence_proxy_async_smem();  // cp.async (generic proxy) writes, read by wgmma (async proxy)
    __syncthreads();
  };
  auto step_group = [&](int s) { return r0 + s / nqt; };
  auto step_row0 = [&](int s) { return (qt_begin + s % nqt) * kRows; };
  auto issue_q = [&](int n) {  // Q load n: step n / G, head n % G
    if (n >= loads) return;
    const int s = n / G, hh = n % G, h = step_group(s) * G + hh;
    load_tile<QT, D>(sQ + (n % kSlots) * kRows * D, q + base * p.q_stride_t + h * p.q_stride_h, p.q_stride_t,
                     step_row0(s), kRows, len, tid);
    pos_q[n % kSlots] = commit();
  };
  auto issue_a = [&](int s) {  // Q_idx, lse_idx and the group's lse of step s
    if (s >= steps) return;
    const int b = s & 1, r = step_group(s), row0 = step_row0(s);
    load_tile<QiT, Di>(sQi + b * kRows * Di, qi + base * p.qi_stride_t + r * p.qi_stride_h, p.qi_stride_t, row0,
                       kRows, len, tid);
    for (int i = tid; i < (G + 1) * kRows; i += kThreads) {
      const int hh = i / kRows, row = i % kRows;
      const bool ok = row0 + row < len;
      const int tok = base + (ok ? row0 + row : 0);
      if (hh < G) {
        cp_async_4(sLse + (b * G + hh) * kRows + row, p.lse + int64_t(r * G + hh) * p.total_tokens + tok, ok);
      } else {
        cp_async_4(sLseIdx + b * kRows + row, p.lse_idx + int64_t(r) * p.total_tokens + tok, ok);
      }
    }
    pos_a[b] = commit();
  };
  auto issue_k = [&](int kvh) {
    load_tile<KT, D>(sK, k + base * p.k_stride_t + kvh * p.k_stride_h, p.k_stride_t, k0, kKeys, len, tid);
    pos_k = commit();
  };

  // Prologue: K_idx and K of the first group, step 0's Q_idx and lse, the first kSlots Q loads.
  load_tile<KiT, Di>(sKi, ki + base * p.ki_stride_t + hk * p.ki_stride_h, p.ki_stride_t, k0, kKeys, len, tid);
  int kv_loaded = r0 * G / kv_per;
  issue_k(kv_loaded);
  issue_a(0);
  for (int n = 0; n < kSlots; ++n) issue_q(n);

  float dk[Di / 2];  // this warpgroup's 64 keys x Di of d kl / d k_idx (before grad_scale)
#pragma unroll
  for (int i = 0; i < Di / 2; ++i) dk[i] = 0.f;

  const uint32_t k_addr = smem_addr(sK), ki_addr = smem_addr(sKi);
  const int key_row = wg * 64 + wq * 16 + g;  // this thread's keys: key_row and key_row + 8 of the tile
  const int key0 = k0 + key_row, key1 = key0 + 8;

  for (int s = 0; s < steps; ++s) {
    const int b = s & 1, r = step_group(s), row0 = step_row0(s);
    const int kvh = r * G / kv_per;
    if (kvh != kv_loaded) {  // a new kv head for this group: every read of sK finished at the last barrier
      issue_k(kvh);
      kv_loaded = kvh;
    }
    issue_a(s + 1);  // buffer b ^ 1: last read in step s - 1
    wait_for(max(pos_a[b], pos_k));

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
    const float* lse_b = sLse + b * G * kRows;
    for (int hh = 0; hh < G; ++hh) {
      const int n = s * G + hh;
      wait_for(pos_q[n % kSlots]);
      if (hh > 0) issue_q(n - 1 + kSlots);  // the slot of load n - 1: both warpgroups are past it
      const uint32_t q_addr = smem_addr(sQ + (n % kSlots) * kRows * D);
      float sc[32];
      wgmma_ss64_ksteps<T, D / 16>(sc, [&](int ks) { return KT::desc(k_rows, ks); },
                                   [&](int ks) { return QT::desc(q_addr, ks); }, false);
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
    const float* li = sLseIdx + b * kRows;
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
    __syncthreads();  // sDs, sKl, sK and the last Q slot are free
    issue_q(s * G + G - 1 + kSlots);
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

template <typename T, int D, int Di>
cudaError_t launch_dense_kl(const DenseKlParams& p, cudaStream_t stream) {
  const int G = p.hq / p.hi;
  const int smem = dense_kl_smem_bytes(D, Di, G);
  auto kernel = dense_kl_kernel<T, D, Di>;
  cudaError_t err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
  if (err != cudaSuccess) return err;
  const dim3 grid(unsigned(p.num_tiles) * unsigned(p.max_chunks), p.hki);
  kernel<<<grid, dense_kl::kThreads, smem, stream>>>(p);
  return cudaGetLastError();
}

}  // namespace msa::sm90
