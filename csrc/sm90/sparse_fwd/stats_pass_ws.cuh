// The sparse forward's stats pass on Hopper, warp-specialized, for the same layout as out_pass_ws.cuh
// (Gu = 4 query heads per unit, J = 1, with the index branch and the main stats). Per (entry, head) the
// max and the sum of exp of the block's logits (log2 domain), per entry the same for the index logits:
// the general pass's outputs (smxx/sparse_fwd/sparse_fwd_body.cuh, kOut = false), which the stats
// combine turns into lse and lse_idx.
//
// A CTA takes one work item with 3 warpgroups: warpgroup 0 gathers each tile's rows (16 units: Q of
// their 4 heads and Q_idx) into a ring of kStages stages (as the output pass's producer, without lse);
// consumers 1 and 2 take tiles c, c + 2, ... (three consumers at 152 registers spilled 72 bytes; two
// use 180 of their 232). Per tile, warp w of a consumer holds rows [16 w, +16):
//   S = Q K^T (wgmma m64n128 RS) issued first; the index logits of warp w's 32 keys for the 16 units on
//   mma.sync under it, reduced to (max, sum) per unit over those keys; the stage is released; then the
//   row (max, sum) of S per (entry, head); after one named barrier of the group, the index parts merge
//   per unit in key order (double-buffered, so no second barrier).
#pragma once
#include "sm90/sparse_fwd/out_pass_ws.cuh"

namespace msa::sm90::stats_ws {

using namespace out_ws;  // the layout constants and helpers of the output pass
using sm80::masked_scaled;
using sm80::quad_row_max_sum;

constexpr int kStages = 6;
constexpr int kConsumers = 2;
constexpr int kThreads = 128 * (1 + kConsumers);
constexpr int kProducerRegs = 40, kConsumerRegs = 232;
static_assert(kProducerRegs * 128 + kConsumerRegs * 128 * kConsumers <= (65536 / kThreads & ~7) * kThreads,
              "register pool");
constexpr int kParts = kKeys / 32;                      // index-logit parts: a warp's 32 keys each

template <typename T, int D>
struct Smem {  // byte offsets from the 1024-aligned base
  using KT = KMajorSw128<kKeys, D>;
  using KiT = KMajorSw128<kKeys, kDi>;
  static constexpr int k = 0;
  static constexpr int ki = k + kKeys * D * 2;
  static constexpr int s_q = 0;
  static constexpr int s_qi = s_q + kRows * D * 2;
  static constexpr int stage_bytes = s_qi + kUnits * kDi * 2;
  static constexpr int stage0 = ki + kKeys * kDi * 2;
  // Per consumer, 2 buffers x kParts x kUnits (max, sum) of the index logits.
  static constexpr int cons_bytes = 2 * kParts * kUnits * 8;
  static constexpr int cons0 = stage0 + kStages * stage_bytes;
  static constexpr int table = cons0 + kConsumers * cons_bytes;
  static constexpr int bars = table + 2 * sm80::kFwdMaxItemUnits * 4;
  static constexpr int bytes = bars + 2 * kStages * 8;
};

template <typename T, int D>
__global__ void __launch_bounds__(kThreads, 1) stats_pass_ws_kernel(SparseFwdParams p) {
  using L = Smem<T, D>;
  using KT = typename L::KT;
  using KiT = typename L::KiT;
  using QTile = SwizzledTile<D>;
  using QiTile = SwizzledTile<kDi>;
  extern __shared__ __align__(128) unsigned char smem_raw[];
  unsigned char* smem = smem_raw + ((1024 - (smem_addr(smem_raw) & 1023)) & 1023);
  T* sK = reinterpret_cast<T*>(smem + L::k);
  T* sKi = reinterpret_cast<T*>(smem + L::ki);
  int* sEntryAll = reinterpret_cast<int*>(smem + L::table);
  int* sTokAll = sEntryAll + sm80::kFwdMaxItemUnits;
  uint64_t* full = reinterpret_cast<uint64_t*>(smem + L::bars);
  uint64_t* empty = full + kStages;

  FwdItem f;
  if (!fwd_item(p, f)) return;
  const int r = f.r, n_units = f.n_units;
  // The query row at the block's first key's position: a query row t sees the block's keys up to t - kpos0.
  const int kpos0 = f.span.q_origin + f.span.key0, blen = f.span.blen;
  const int n_tiles = (n_units + kUnits - 1) / kUnits;
  const int tid = threadIdx.x;

  // Prologue: the producer reads the unit table, the consumers start K and K_idx (as the output pass).
  if (tid < 128) {
    load_unit_table(p, f, sEntryAll, sTokAll, tid, 128);
    if (tid == 0) init_ring(full, empty, kStages);
  } else {
    load_block<T, D, false>(p, f, sK, nullptr, sKi, tid - 128, kThreads - 128);
  }
  __syncthreads();

  if (tid < 128) {
    setmaxnreg_dec<kProducerRegs>();
    for (int t = 0; t < n_tiles; ++t) {
      const int s = t % kStages;
      if (t >= kStages) mbar_wait(&empty[s], ((t / kStages) - 1) & 1);
      unsigned char* st = smem + L::stage0 + s * L::stage_bytes;
      const int ub = t * kUnits;
      gather_q<T, D>(p, r, sTokAll + ub, min(kUnits, n_units - ub), reinterpret_cast<T*>(st + L::s_q),
                     reinterpret_cast<T*>(st + L::s_qi), tid);
      cp_async_mbar_arrive(&full[s]);
    }
    asm volatile("cp.async.wait_all;\n" ::: "memory");
    return;
  }

  setmaxnreg_inc<kConsumerRegs>();
  sm80::cp_async_wait<0>();
  fence_proxy_async_smem();  // K (cp.async) is read by wgmma
  asm volatile("bar.sync 4, %0;\n" ::"n"(kThreads - 128) : "memory");
  const int cw = tid / 128 - 1;
  const int ctid = tid % 128, wq = ctid / 32, lane = tid % 32, g = lane / 4, tq = lane % 4;
  const int gi = g & (kGu - 1);
  float2* sPart = reinterpret_cast<float2*>(smem + L::cons0 + cw * L::cons_bytes);
  const float iscale2 = p.index_scale * kLog2e;
  const uint32_t k_addr = smem_addr(sK);
  const int row0 = wq * 16 + g, row1 = row0 + 8;
  const int uu0 = row0 / kGu, uu1 = row1 / kGu;
  // Index parts that exist: a warp's 32 keys each (block_size 64: the first two).
  const int n_parts = min(kParts, (p.block_size + 31) / 32);
  const float mscale = p.scale_log2 > 0.f ? p.scale_log2 : 1.f;
  const float pre = p.scale_log2 > 0.f ? 1.f : p.scale_log2;
  int buf = 0;
  for (int t = cw; t < n_tiles; t += kConsumers, buf ^= 1) {
    const int s = t % kStages;
    mbar_wait(&full[s], (t / kStages) & 1);
    unsigned char* st = smem + L::stage0 + s * L::stage_bytes;
    const T* sQ = reinterpret_cast<const T*>(st + L::s_q);
    const T* sQi = reinterpret_cast<const T*>(st + L::s_qi);
    const int ub = t * kUnits, nu = min(kUnits, n_units - ub);
    const int* sEntry = sEntryAll + ub;
    const int* sTok = sTokAll + ub;
    auto key_limit = [&](int u) { return u < nu ? min(blen - 1, sTok[u] - kpos0) : -1; };
    float2* part = sPart + buf * kParts * kUnits;

    float sw[kKeys / 2];
    {
      uint32_t a[D / 16][4];
#pragma unroll
      for (int ks = 0; ks < D / 16; ++ks) ldmatrix_x4(a[ks], sQ + QTile::offset(wq * 16 + lane % 16, ks * 2 + lane / 16));
      wgmma_fence();
#pragma unroll
      for (int ks = 0; ks < D / 16; ++ks) WgmmaRS<T, kKeys>::run(sw, a[ks], KT::desc(k_addr, ks), ks > 0);
      wgmma_commit();
      float ci[4][4];
      sm80::zero_acc(ci);
#pragma unroll
      for (int ks = 0; ks < kDi / 16; ++ks) {
        uint32_t fa[4];
        ldmatrix_x4(fa, sQi + QiTile::offset(lane % 16, ks * 2 + lane / 16));
#pragma unroll
        for (int np = 0; np < 2; ++np) {
          uint32_t b[4];
          ldmatrix_x4(b, sKi + KiT::offset(wq * 32 + np * 16 + (lane % 8) + (lane / 16) * 8, ks * 2 + (lane / 8) % 2));
          MmaOp<T>::run(ci[2 * np], fa, b[0], b[1]);
          MmaOp<T>::run(ci[2 * np + 1], fa, b[2], b[3]);
        }
      }
      wgmma_wait<0>();
      fence_regs(sw);
      // Every read of the stage is done (the fragments are in registers).
      mbar_arrive(&empty[s]);
      // Index logits of units g, g + 8 over this warp's keys: (max, sum) per unit, the masked ones -inf.
      const int lima = key_limit(g), limb = key_limit(g + 8);
      float x[4][4];
      masked_scaled(ci, iscale2, wq * 32, tq, lima, limb, x);
      float m[2], l[2];
      quad_row_max_sum(x, m, l);
      if (tq == 0) {
        part[wq * kUnits + g] = make_float2(m[0], l[0]);
        part[wq * kUnits + g + 8] = make_float2(m[1], l[1]);
      }
    }
    // Main (max, sum) per (entry, head) of rows row0, row1 (raw logits, the scale applied inside).
    {
      float c[kKeys / 8][4];
#pragma unroll
      for (int n = 0; n < kKeys / 8; ++n)
#pragma unroll
        for (int e = 0; e < 4; ++e) c[n][e] = sw[4 * n + e];
      const int lim0 = key_limit(uu0), lim1 = key_limit(uu1);
      const bool full_tile = blen == kKeys && sTok[0] - kpos0 >= kKeys - 1;
      if (!full_tile || !(p.scale_log2 > 0.f)) {
#pragma unroll
        for (int n = 0; n < kKeys / 8; ++n) {
          const int col = n * 8 + 2 * tq;
          c[n][0] = full_tile || col <= lim0 ? c[n][0] * pre : kNegInf;
          c[n][1] = full_tile || col + 1 <= lim0 ? c[n][1] * pre : kNegInf;
          c[n][2] = full_tile || col <= lim1 ? c[n][2] * pre : kNegInf;
          c[n][3] = full_tile || col + 1 <= lim1 ? c[n][3] * pre : kNegInf;
        }
      }
      float m[2], l[2];
      quad_row_max_sum(c, m, l, mscale);
      if (tq == 0) {
        if (lim0 >= 0) p.stats[int64_t(sEntry[uu0]) * kGu + gi] = make_float2(m[0], l[0]);
        if (lim1 >= 0) p.stats[int64_t(sEntry[uu1]) * kGu + gi] = make_float2(m[1], l[1]);
      }
    }
    group_sync(1 + cw);  // the index parts of all the group's warps
    if (ctid < nu) {
      float m = kNegInf;
      for (int q = 0; q < n_parts; ++q) m = fmaxf(m, part[q * kUnits + ctid].x);
      float l = 0.f;
      for (int q = 0; q < n_parts; ++q) {
        const float2 x = part[q * kUnits + ctid];
        if (x.y != 0.f) l += x.y * exp2f(x.x - m);  // empty parts hold 0; a NaN sum stays
      }
      p.idx_stats[sEntry[ctid]] = make_float2(m, l);
    }
  }
}

// Whether the warp-specialized stats pass applies: the output pass's layout, with the main stats.
inline bool applies(const SparseFwdParams& p) { return p.stats_ws && out_ws_applies(p) && p.main_stats; }

template <typename T, int D>
cudaError_t launch(const SparseFwdParams& p, cudaStream_t stream) {
  return launch_items(stats_pass_ws_kernel<T, D>, kThreads, Smem<T, D>::bytes, p, stream);
}

}  // namespace msa::sm90::stats_ws
