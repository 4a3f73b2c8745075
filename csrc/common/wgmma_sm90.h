// Thin wrappers over the sm90a warpgroup tensor-core path (wgmma.mma_async), written from the PTX ISA.
//
// A warpgroup is 4 consecutive warps (128 threads, the first warp's index a multiple of 4). One
// m64nNk16 wgmma multiplies a 64 x 16 A tile by a 16 x N B tile into a 64 x N fp32 accumulator that
// the warpgroup holds in registers:
//   A from registers ("RS"): warp w of the group holds rows 16 w .. 16 w + 15 in the m16n8k16 A
//     fragment layout of mma.sync (see mma_sm80.h), 4 x 32-bit registers per thread.
//   B from shared memory through a 64-bit descriptor (below).
//   D: warp w holds rows 16 w + g and 16 w + g + 8 (g = lane / 4), t = lane % 4; d[4 j + 0, 1] are
//     (row g, cols 8 j + 2 t, + 1) and d[4 j + 2, 3] the same columns of row g + 8: the mma.sync C
//     fragment of each 8-column slice, in order.
// Issue order: wgmma_fence() (registers written by ordinary instructions are now visible), the
// wgmmas, wgmma_commit(), then wgmma_wait<n>() before the accumulators are read.
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>

namespace msa::sm90 {

__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
template <int N>
__device__ __forceinline__ void wgmma_wait() {
  asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory");
}
// Pins the reads of wgmma-written registers after the wait that precedes it (NVVM does not know that
// wgmma.wait_group defines them): the accumulators as a dependency of the code that follows the wait.
template <int N>
__device__ __forceinline__ void fence_regs(float (&r)[N]) {
#pragma unroll
  for (int i = 0; i < N; ++i) asm volatile("" : "+f"(r[i])::"memory");
}
template <int N>
__device__ __forceinline__ void fence_regs(uint32_t (&r)[N]) {
#pragma unroll
  for (int i = 0; i < N; ++i) asm volatile("" : "+r"(r[i])::"memory");
}
// Warp specialisation: a warpgroup gives registers back to the CTA's pool (dec) or takes them from it (inc);
// every thread of the warpgroup executes it. The pool is the launch's registers per thread times the threads.
template <int N>
__device__ __forceinline__ void setmaxnreg_dec() { asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(N)); }
template <int N>
__device__ __forceinline__ void setmaxnreg_inc() { asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(N)); }
// mbarrier (shared memory, 8 bytes) and TMA tensor loads, for a CTA without clusters.
__device__ __forceinline__ void mbar_init(uint64_t* bar, int count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(static_cast<uint32_t>(__cvta_generic_to_shared(bar))),
               "r"(count) : "memory");
}
// After the inits, before other threads or the TMA unit use the barriers (then a CTA barrier).
__device__ __forceinline__ void mbar_fence_init() { asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory"); }
// The calling thread's arrival, announcing `bytes` of TMA transactions that complete the phase.
__device__ __forceinline__ void mbar_arrive_expect_tx(uint64_t* bar, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n"
               ::"r"(static_cast<uint32_t>(__cvta_generic_to_shared(bar))), "r"(bytes) : "memory");
}
// A plain arrival (one of the barrier's expected count).
__device__ __forceinline__ void mbar_arrive(uint64_t* bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n"
               ::"r"(static_cast<uint32_t>(__cvta_generic_to_shared(bar))) : "memory");
}
// Spins until the phase with parity `parity` of the barrier has completed.
__device__ __forceinline__ void mbar_wait(uint64_t* bar, uint32_t parity) {
  const uint32_t addr = static_cast<uint32_t>(__cvta_generic_to_shared(bar));
  uint32_t done = 0;
  do {
    asm volatile(
        "{\n.reg .pred p;\nmbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\nselp.u32 %0, 1, 0, p;\n}\n"
        : "=r"(done) : "r"(addr), "r"(parity) : "memory");
  } while (!done);
}
// 3-D TMA tile load (coordinates innermost first) into shared memory, completing on `bar`.
__device__ __forceinline__ void tma_load_3d(void* dst, const void* tensor_map, int x, int y, int z, uint64_t* bar) {
  asm volatile(
      "cp.async.bulk.tensor.3d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3, %4}], [%5];\n"
      ::"r"(static_cast<uint32_t>(__cvta_generic_to_shared(dst))), "l"(tensor_map), "r"(x), "r"(y), "r"(z),
        "r"(static_cast<uint32_t>(__cvta_generic_to_shared(bar)))
      : "memory");
}

// Bulk reduction (the TMA unit's): adds `bytes` (a multiple of 16; both addresses 16-byte aligned) of fp32
// from shared memory to global memory, in this thread's current bulk group. The shared source must have
// been fenced to the async proxy (fence_proxy_async_smem by its writers) and synchronised with this thread.
__device__ __forceinline__ void bulk_reduce_add_f32(float* dst, const float* src, int bytes) {
  asm volatile("cp.reduce.async.bulk.global.shared::cta.bulk_group.add.f32 [%0], [%1], %2;\n"
               ::"l"(dst), "r"(static_cast<uint32_t>(__cvta_generic_to_shared(src))), "r"(bytes) : "memory");
}
// Tensor bulk reduction: adds the box of `tensor_map` at coordinates (x, y, z) (innermost first) from shared
// memory at `src` (laid out as the map's box, swizzle included), in this thread's current bulk group; the
// element type and the add come from the map. Same fencing as bulk_reduce_add_f32.
__device__ __forceinline__ void tma_reduce_add_3d(const void* tensor_map, const void* src, int x, int y, int z) {
  asm volatile("cp.reduce.async.bulk.tensor.3d.global.shared::cta.add.tile.bulk_group [%0, {%2, %3, %4}], [%1];\n"
               ::"l"(tensor_map), "r"(static_cast<uint32_t>(__cvta_generic_to_shared(src))), "r"(x), "r"(y), "r"(z)
               : "memory");
}
// Tensor bulk store: the box of `tensor_map` at coordinates (x, y, z) (innermost first) from shared memory at `src`
// (laid out as the map's box, swizzle included), in this thread's current bulk group. Same fencing as
// bulk_reduce_add_f32; boxes past the map's extent are not written.
__device__ __forceinline__ void tma_store_3d(const void* tensor_map, const void* src, int x, int y, int z) {
  asm volatile("cp.async.bulk.tensor.3d.global.shared::cta.tile.bulk_group [%0, {%2, %3, %4}], [%1];\n"
               ::"l"(tensor_map), "r"(static_cast<uint32_t>(__cvta_generic_to_shared(src))), "r"(x), "r"(y), "r"(z)
               : "memory");
}
__device__ __forceinline__ void bulk_commit() { asm volatile("cp.async.bulk.commit_group;\n" ::: "memory"); }
// Until at most N of this thread's bulk groups are pending: reading their shared sources (kRead), or done.
template <int N, bool kRead>
__device__ __forceinline__ void bulk_wait() {
  if constexpr (kRead) asm volatile("cp.async.bulk.wait_group.read %0;\n" ::"n"(N) : "memory");
  else asm volatile("cp.async.bulk.wait_group %0;\n" ::"n"(N) : "memory");
}

// Shared-memory writes of the generic proxy (st.shared, cp.async) made visible to the async proxy
// (wgmma operand reads). Each writing thread fences after its copies landed, then the CTA synchronises.
__device__ __forceinline__ void fence_proxy_async_smem() {
  asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
}

// K-major operand tile with the 128-byte swizzle: R rows (the N or M dimension) x K 16-bit elements,
// stored as K / 64 column panels of R x 64 elements (128 bytes per row, panels R * 128 bytes apart),
// each panel made of 8-row x 128-byte atoms (1024 bytes apart) whose 16-byte chunk c of row r sits at
// chunk c ^ (r % 8). The tile must start 1024-byte aligned (the hardware swizzles address bits).
template <int R, int K>
struct KMajorSw128 {
  static_assert(R % 8 == 0 && K % 64 == 0, "KMajorSw128: R multiple of 8, K multiple of 64");
  static constexpr int kChunks = K / 8;  // 16-byte chunks per row
  static constexpr int kPanelElems = R * 64;
  // Element offset of 16-byte chunk `chunk` (0 .. K / 8 - 1) of row `row`.
  __device__ __forceinline__ static int offset(int row, int chunk) {
    return (chunk / 8) * kPanelElems + row * 64 + (((chunk % 8) ^ (row % 8)) * 8);
  }
  // In bytes. Within a panel (x < 8, chunk % 8 ^ x), bytes(row, chunk ^ x) = bytes(row, chunk) ^ (x << 4);
  // the next panel is kPanelElems * 2 bytes on: one XOR and an immediate per k-step from a lane's base.
  __device__ __forceinline__ static uint32_t bytes(int row, int chunk) { return uint32_t(offset(row, chunk)) * 2u; }
  // Descriptor of the R x 16 slice of k-step ks (elements 16 ks .. 16 ks + 15) of the tile at `base`:
  // start address advanced within the panel by 32 bytes per k-step (the swizzle applies to the final
  // address), stride between 8-row atoms 1024 bytes, leading offset unused (1), layout 128B swizzle.
  // Bytes from the tile's start to k-step ks's 16 columns: 64-column panels, 32 bytes per k-step in one.
  __device__ __forceinline__ static constexpr uint32_t kstep_bytes(int ks) {
    return uint32_t((ks / 4) * kPanelElems * 2 + (ks % 4) * 32);
  }
  // The descriptor is the tile's base descriptor plus the k-step's byte offset / 16 in the start-address
  // field: shared addresses are below 2^18, so the 14-bit field never carries. The base part is the same
  // for every k-step (computed once), the offset a constant: one 64-bit add per wgmma.
  __device__ __forceinline__ static constexpr uint64_t desc(uint32_t base_smem_addr, int ks) {
    uint64_t d = 0;
    d |= uint64_t((base_smem_addr & 0x3FFFF) >> 4);  // start address, bits 0-13
    d |= uint64_t(1) << 16;                          // leading byte offset (unused with a swizzle)
    d |= uint64_t(1024 >> 4) << 32;                  // stride byte offset, bits 32-45
    d |= uint64_t(1) << 62;                          // layout type: 128-byte swizzle
    return d + (kstep_bytes(ks) >> 4);
  }
  // The descriptors of desc / desc_mn rebuilt from the tile's address at every call, for the general sm_90a
  // backward (64-bit bases precomputed per operand cost it a 72-byte spill, s19): the low word is (address >> 4)
  // plus constants (the start address and the k-step's offset in 16-byte units, the leading byte offset), one
  // 32-bit add per k-step on a value the unrolled k-steps share, the high word a constant. Equal to desc /
  // desc_mn for a 16-byte aligned shared address below 2^18 (every shared address on sm_90: no mask, no carry
  // out of the 14-bit start field). The masked form cost four integer instructions per wgmma (s37 ncu).
  __device__ __forceinline__ static constexpr uint64_t desc_rebuilt(uint32_t base_smem_addr, int ks) {
    const uint32_t lo = (base_smem_addr >> 4) + ((1u << 16) + (kstep_bytes(ks) >> 4));
    return (uint64_t((1024 >> 4) | (1u << 30)) << 32) | lo;
  }
  __device__ __forceinline__ static constexpr uint64_t desc_mn_rebuilt(uint32_t base_smem_addr, int ks) {
    const uint32_t lo = (base_smem_addr >> 4) + ((uint32_t((kPanelElems * 2) >> 4) << 16) + uint32_t(ks * 16 * 128 >> 4));
    return (uint64_t((1024 >> 4) | (1u << 30)) << 32) | lo;
  }
  // The same tile read as an MN-major B operand (its rows run along the MMA's K, its K columns are the
  // N dimension, e.g. V for P V): descriptor of rows 16 ks .. 16 ks + 15 (two 8-row atoms, 1024 bytes
  // apart: the stride byte offset) over all columns (64-column panels R * 128 bytes apart: the leading
  // byte offset). The canonical MN-major 128B-swizzle layout ((8 x 16 B, panels), (8 rows, atoms)).
  __device__ __forceinline__ static constexpr uint64_t desc_mn(uint32_t base_smem_addr, int ks) {
    uint64_t d = 0;
    d |= uint64_t((base_smem_addr & 0x3FFFF) >> 4);
    d |= uint64_t((kPanelElems * 2) >> 4) << 16;  // leading byte offset: next 64 columns
    d |= uint64_t(1024 >> 4) << 32;               // stride byte offset: next 8 rows
    d |= uint64_t(1) << 62;
    return d + uint64_t(ks * 16 * 128 >> 4);      // as desc: the k-step's rows added to the start address
  }
};

// The rebuilt descriptors equal desc / desc_mn (which the other kernels use) at every shared address a k-step's
// slice can start at (below 2^18, 128-byte steps here), checked at compile time for the tile shapes in use.
namespace detail {
template <typename Tile, int kKSteps>
constexpr bool rebuilt_descs_agree() {
  for (uint32_t a = 0; a + Tile::kstep_bytes(kKSteps - 1) + 16 * 128 * kKSteps < (1u << 18); a += 128) {
    for (int ks = 0; ks < kKSteps; ++ks) {
      if (Tile::desc_rebuilt(a, ks) != Tile::desc(a, ks) || Tile::desc_mn_rebuilt(a, ks) != Tile::desc_mn(a, ks))
        return false;
    }
  }
  return true;
}
static_assert(rebuilt_descs_agree<KMajorSw128<64, 128>, 8>() && rebuilt_descs_agree<KMajorSw128<128, 128>, 8>() &&
                  rebuilt_descs_agree<KMajorSw128<64, 64>, 4>() && rebuilt_descs_agree<KMajorSw128<128, 64>, 4>(),
              "KMajorSw128: desc_rebuilt / desc_mn_rebuilt differ from desc / desc_mn");
}  // namespace detail

// D (64 x N, fp32) (+)= A (64 x 16, registers) * B (16 x N, shared): wgmma m64nNk16 with A from
// registers. accumulate = false overwrites D (no zeroing needed). N / 2 accumulators per thread. B is
// K-major (kTransB = false, descriptor from KMajorSw128::desc) or MN-major (kTransB = true: N
// contiguous, descriptor from KMajorSw128::desc_mn of a tile whose rows run along K). N = 128 (index
// top-k, the sparse passes' Q K^T, P V at D = 128) and N = 64 (P V at D = 64).
template <typename T, int N, bool kTransB = false>
struct WgmmaRS;

#define MSA_WGMMA_ACC_16 \
  "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), \
  "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15])
#define MSA_WGMMA_ACC_32 MSA_WGMMA_ACC_16, \
  "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), \
  "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])
#define MSA_WGMMA_ACC_64 MSA_WGMMA_ACC_32, \
  "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), \
  "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), \
  "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), \
  "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])
#define MSA_WGMMA_ARGS \
  "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b), "r"(int(accumulate))

#define MSA_WGMMA_D_16 "%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15"
#define MSA_WGMMA_D_32 MSA_WGMMA_D_16 ",%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,%27,%28,%29,%30,%31"
#define MSA_WGMMA_D_64 MSA_WGMMA_D_32 \
  ",%32,%33,%34,%35,%36,%37,%38,%39,%40,%41,%42,%43,%44,%45,%46,%47,%48,%49,%50,%51,%52,%53,%54,%55,%56,%57,%58," \
  "%59,%60,%61,%62,%63"
// One specialisation: N, the transpose-B flag, the accumulator operands (list and constraints), then the
// operand numbers of A's four registers, the descriptor and the accumulate flag (they follow the N / 2
// accumulators).
#define MSA_WGMMA_RS(TYPE, PTXTYPE, N, TRANS, D_LIST, D_OPS, A_REGS, DESC, ACC) \
  template <> \
  struct WgmmaRS<TYPE, N, TRANS != 0> { \
    __device__ __forceinline__ static void run(float (&d)[N / 2], const uint32_t (&a)[4], uint64_t desc_b, \
                                               bool accumulate) { \
      asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, " ACC ", 0;\n" \
                   "wgmma.mma_async.sync.aligned.m64n" #N "k16.f32." PTXTYPE "." PTXTYPE " " \
                   "{" D_LIST "}, {" A_REGS "}, " DESC ", p, 1, 1, " #TRANS ";\n}\n" \
                   : D_OPS : MSA_WGMMA_ARGS); \
    } \
  };
#define MSA_WGMMA_RS_ALL(TYPE, PTXTYPE, TRANS) \
  MSA_WGMMA_RS(TYPE, PTXTYPE, 64, TRANS, MSA_WGMMA_D_32, MSA_WGMMA_ACC_32, "%32,%33,%34,%35", "%36", "%37") \
  MSA_WGMMA_RS(TYPE, PTXTYPE, 128, TRANS, MSA_WGMMA_D_64, MSA_WGMMA_ACC_64, "%64,%65,%66,%67", "%68", "%69")
MSA_WGMMA_RS_ALL(__nv_bfloat16, "bf16", 0)
MSA_WGMMA_RS_ALL(__nv_bfloat16, "bf16", 1)
MSA_WGMMA_RS_ALL(__half, "f16", 0)
MSA_WGMMA_RS_ALL(__half, "f16", 1)
#undef MSA_WGMMA_RS_ALL
#undef MSA_WGMMA_RS

// D (64 x 128, f16) (+)= A (64 x 32 e4m3, registers) * B (32 x 128 e4m3, shared, K-major): wgmma m64n128k32 on
// FP8 (the index top-k's FP8 scores). A k-step spans 32 one-byte elements, the bytes of a 16-bit k-step: A's
// fragment is what ldmatrix_x4 gives for 16 rows x 32 bytes (register i: rows g / g + 8, bytes 4 t .. 4 t + 3
// and 16 + 4 t ..), and B's descriptor is KMajorSw128<R, K / 2>::desc of the bytes seen as 16-bit elements.
// FP8 operands take no transpose flags (K-major only). f16 accumulators: 32 registers, register i two adjacent
// columns of one row (an fp32 accumulator's c[2 i], c[2 i + 1]); the caller keeps every partial sum within f16's
// range (the fp32 form, m64n128k32.f32.e4m3.e4m3, took the FP8 top-k's scores until s66).
struct WgmmaRSE4m3N128F16 {
  __device__ __forceinline__ static void run(uint32_t (&d)[32], const uint32_t (&a)[4], uint64_t desc_b, bool accumulate) {
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %37, 0;\n"
                 "wgmma.mma_async.sync.aligned.m64n128k32.f16.e4m3.e4m3 "
                 "{" MSA_WGMMA_D_32 "}, {%32,%33,%34,%35}, %36, p, 1, 1;\n}\n"
                 : "+r"(d[0]), "+r"(d[1]), "+r"(d[2]), "+r"(d[3]), "+r"(d[4]), "+r"(d[5]), "+r"(d[6]), "+r"(d[7]),
                   "+r"(d[8]), "+r"(d[9]), "+r"(d[10]), "+r"(d[11]), "+r"(d[12]), "+r"(d[13]), "+r"(d[14]),
                   "+r"(d[15]), "+r"(d[16]), "+r"(d[17]), "+r"(d[18]), "+r"(d[19]), "+r"(d[20]), "+r"(d[21]),
                   "+r"(d[22]), "+r"(d[23]), "+r"(d[24]), "+r"(d[25]), "+r"(d[26]), "+r"(d[27]), "+r"(d[28]),
                   "+r"(d[29]), "+r"(d[30]), "+r"(d[31])
                 : MSA_WGMMA_ARGS);
  }
};
#undef MSA_WGMMA_ARGS

// acc (64 x N) (+)= A (64 x 16 kSteps) * B, A from registers: every A fragment is loaded (load_a(frag, kk))
// before the first wgmma, then one commit and one wait, so the loads overlap and nothing waits between
// groups of k-steps (4 kSteps registers for the fragments). Returns once the wgmmas are done.
template <typename T, int N, int kSteps, bool kTransB = false, typename LoadA, typename BDesc>
__device__ __forceinline__ void wgmma_rs_ksteps(float (&acc)[N / 2], LoadA load_a, BDesc b_desc,
                                                bool accumulate_first) {
  uint32_t a[kSteps][4];
#pragma unroll
  for (int kk = 0; kk < kSteps; ++kk) load_a(a[kk], kk);
  wgmma_fence();
#pragma unroll
  for (int kk = 0; kk < kSteps; ++kk)
    WgmmaRS<T, N, kTransB>::run(acc, a[kk], b_desc(kk), accumulate_first || kk > 0);
  wgmma_commit();
  wgmma_wait<0>();
  fence_regs(acc);  // no use of acc moves above the wait
}

// acc (64 x N) (+)= A (64 x 64: four k-steps) * B, A from registers: load_a(frag, kk) fills this warp's
// A fragment of k-step kk (e.g. by ldmatrix), b_desc(kk) gives B's descriptor. accumulate_first =
// false overwrites acc at the first k-step. Returns once the wgmmas are done (the fragments and acc
// are ordinary registers again).
template <typename T, int N, bool kTransB = false, typename LoadA, typename BDesc>
__device__ __forceinline__ void wgmma_rs_k64(float (&acc)[N / 2], LoadA load_a, BDesc b_desc, bool accumulate_first) {
  wgmma_rs_ksteps<T, N, 4, kTransB>(acc, load_a, b_desc, accumulate_first);
}

// D (64 x N, fp32) (+)= A (64 x 16, shared) * B (16 x N, shared): wgmma m64nNk16 with both operands in
// shared memory. K-major operands take KMajorSw128::desc; kTransA / kTransB read A / B MN-major
// (KMajorSw128::desc_mn of a tile whose rows run along K: A = dsi^T of a [unit][key] tile, B = Q_idx).
template <typename T, int N, bool kTransA = false, bool kTransB = false>
struct WgmmaSS;

// One specialisation per N and pair of transpose flags: the accumulator operands (list and constraints),
// then the operand numbers of the two descriptors and the accumulate flag (they follow the N / 2 accumulators).
#define MSA_WGMMA_SS(TYPE, PTXTYPE, N, TA, TB, D_LIST, D_OPS, DESC_A, DESC_B, ACC) \
  template <> \
  struct WgmmaSS<TYPE, N, TA != 0, TB != 0> { \
    __device__ __forceinline__ static void run(float (&d)[N / 2], uint64_t desc_a, uint64_t desc_b, bool accumulate) { \
      asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, " ACC ", 0;\n" \
                   "wgmma.mma_async.sync.aligned.m64n" #N "k16.f32." PTXTYPE "." PTXTYPE " " \
                   "{" D_LIST "}, " DESC_A ", " DESC_B ", p, 1, 1, " #TA ", " #TB ";\n}\n" \
                   : D_OPS \
                   : "l"(desc_a), "l"(desc_b), "r"(int(accumulate))); \
    } \
  };
// (0, 0), N = 32: the sparse backward's S = Q K^T and dP = dO V^T over 32 keys; N = 64: the dense KL pass's
// S^T = K Q^T (A = 64 keys of K, B = 64 queries of Q); N = 128: the general stats pass's S = Q K^T. (1, 1), N = 128:
// index dk's dK_idx = dsi^T Q_idx
// (sm90/index_dk/mainloop.cuh); N = 64: the warp-specialized backward's dQ = dS K (A = dS^T tiles, B = K) and the
// dense KL's dQ_idx = dS K_idx. (0, 1), N = Di: the dense KL's dK_idx = dS^T Q_idx (A = dS^T, B = Q_idx).
#define MSA_WGMMA_SS_ALL(TYPE, PTXTYPE) \
  MSA_WGMMA_SS(TYPE, PTXTYPE, 32, 0, 0, MSA_WGMMA_D_16, MSA_WGMMA_ACC_16, "%16", "%17", "%18") \
  MSA_WGMMA_SS(TYPE, PTXTYPE, 64, 0, 0, MSA_WGMMA_D_32, MSA_WGMMA_ACC_32, "%32", "%33", "%34") \
  MSA_WGMMA_SS(TYPE, PTXTYPE, 64, 0, 1, MSA_WGMMA_D_32, MSA_WGMMA_ACC_32, "%32", "%33", "%34") \
  MSA_WGMMA_SS(TYPE, PTXTYPE, 64, 1, 1, MSA_WGMMA_D_32, MSA_WGMMA_ACC_32, "%32", "%33", "%34") \
  MSA_WGMMA_SS(TYPE, PTXTYPE, 128, 0, 0, MSA_WGMMA_D_64, MSA_WGMMA_ACC_64, "%64", "%65", "%66") \
  MSA_WGMMA_SS(TYPE, PTXTYPE, 128, 0, 1, MSA_WGMMA_D_64, MSA_WGMMA_ACC_64, "%64", "%65", "%66") \
  MSA_WGMMA_SS(TYPE, PTXTYPE, 128, 1, 1, MSA_WGMMA_D_64, MSA_WGMMA_ACC_64, "%64", "%65", "%66")
MSA_WGMMA_SS_ALL(__nv_bfloat16, "bf16")
MSA_WGMMA_SS_ALL(__half, "f16")
#undef MSA_WGMMA_SS_ALL
#undef MSA_WGMMA_SS
#undef MSA_WGMMA_D_64
#undef MSA_WGMMA_ACC_64
#undef MSA_WGMMA_D_32
#undef MSA_WGMMA_D_16
#undef MSA_WGMMA_ACC_32
#undef MSA_WGMMA_ACC_16

// acc (64 x 64) (+)= A (64 x 16 kSteps, shared) * B (shared), both by descriptor: every k-step in one
// commit group, then the wait. Returns once the wgmmas are done.
template <typename T, int kSteps, typename ADesc, typename BDesc>
__device__ __forceinline__ void wgmma_ss64_ksteps(float (&acc)[32], ADesc a_desc, BDesc b_desc, bool accumulate_first) {
  wgmma_fence();
#pragma unroll
  for (int kk = 0; kk < kSteps; ++kk) WgmmaSS<T, 64>::run(acc, a_desc(kk), b_desc(kk), accumulate_first || kk > 0);
  wgmma_commit();
  wgmma_wait<0>();
  fence_regs(acc);
}

}  // namespace msa::sm90
