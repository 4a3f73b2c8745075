// index dk's per-tile GEMM on warpgroup tensor cores (wgmma, sm_90a): the mainloop policy of the Hopper kernel
// (smxx/index_dk/index_dk_body.cuh, instantiated in sm90/index_dk/index_dk.cu). Warpgroup i (warps 4 i ..
// 4 i + 3) computes keys [64 i, +64) x all 128 columns of Di, dK_idx += dsi^T q_idx, as two m64n128k16 SS
// wgmmas per tile: A = the warpgroup's 64-key panel of the dsi tile read MN-major (its rows, the units, run
// along K), B = the q_idx tile read MN-major. The accumulator of warp w (rows [16 (w % 4), +16) of the group's
// 64) is the same m16n8 layout as the portable policy's acc[16][4], so the body's epilogue serves both.
#pragma once
#include <cuda_runtime.h>

#include "common/mma_sm80.h"
#include "common/wgmma_sm90.h"

namespace msa::sm90 {

struct DkMma {
  static constexpr bool kAsync = true;  // issue() starts the wgmmas; the next tile's copies go out under them
  static constexpr int kDetBlocks = 1;  // the deterministic variant spills 200 bytes at two CTAs per SM
  static constexpr int kStages = 4;     // the ring: 4 x 16 KB (two CTAs per SM: 130 KB)
  static constexpr int kAlign = 1024;   // KMajorSw128 tiles start 1024-byte aligned
  using Tile = KMajorSw128<32, 128>;  // 32 units x 128 keys (dsi) or Di (q_idx): two 64-column panels
  // Tiles written by cp.async (generic proxy) are read by wgmma (async proxy).
  __device__ __forceinline__ static void fence_operands() { fence_proxy_async_smem(); }

  template <typename T>
  __device__ __forceinline__ static void issue(float (&acc)[16][4], const T* ds, const T* qi, int warp, int,
                                               bool first) {
    float(&d)[64] = *reinterpret_cast<float(*)[64]>(&acc[0][0]);
    const uint32_t ds_addr = sm80::smem_addr(ds) + (warp / 4) * (Tile::kPanelElems * 2);  // the group's 64 keys
    const uint32_t qi_addr = sm80::smem_addr(qi);
    wgmma_fence();
#pragma unroll
    for (int ks = 0; ks < 2; ++ks)
      WgmmaSS<T, 128, true, true>::run(d, Tile::desc_mn(ds_addr, ks), Tile::desc_mn(qi_addr, ks), !first || ks > 0);
    wgmma_commit();
  }
  __device__ __forceinline__ static void wait(float (&acc)[16][4]) {
    wgmma_wait<0>();
    fence_regs(*reinterpret_cast<float(*)[64]>(&acc[0][0]));
  }
};

}  // namespace msa::sm90
