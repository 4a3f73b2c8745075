// Thin wrappers over the sm80 warp-level tensor-core path: cp.async, ldmatrix, mma.sync m16n8k16.
// Fragment layouts (PTX ISA, m16n8k16 with 16-bit inputs), g = lane / 4, t = lane % 4:
//   A 16x16 row-major: a0 (g, 2t..2t+1), a1 (g+8, 2t..), a2 (g, 2t+8..), a3 (g+8, 2t+8..)
//   B 16x8 (K x N, "col"): b0 (k 2t..2t+1, n g), b1 (k 2t+8.., n g)
//   C 16x8 fp32: c0,c1 (g, 2t..2t+1), c2,c3 (g+8, 2t..2t+1)
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>

namespace msa::sm80 {

// log2(e) and ln(2) in float: exp(x) = exp2(x log2 e), ln(x) = log2(x) ln 2 (ex2 / lg2.approx).
constexpr float kLog2e = 1.4426950408889634f;
constexpr float kLn2 = 0.6931471805599453f;

__device__ __forceinline__ uint32_t smem_addr(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// 16-byte global -> shared copy; src_bytes = 0 writes zeros (out-of-range rows). The cp.async and ldmatrix helpers
// declare memory, so the compiler keeps this thread's other shared-memory accesses on their side (s61).
__device__ __forceinline__ void cp_async_16(void* smem, const void* gmem, bool valid) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(smem_addr(smem)), "l"(gmem),
               "r"(valid ? 16 : 0) : "memory");
}
// 4-byte global -> shared copy (per-row scalars such as lse); valid = false writes zero.
__device__ __forceinline__ void cp_async_4(void* smem, const void* gmem, bool valid) {
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(smem_addr(smem)), "l"(gmem),
               "r"(valid ? 4 : 0) : "memory");
}

// Two fp32 adds to consecutive global addresses (one vector atomic on sm90).
__device__ __forceinline__ void atomic_add2(float* dst, float a, float b) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  atomicAdd(reinterpret_cast<float2*>(dst), make_float2(a, b));
#else
  atomicAdd(dst, a);
  atomicAdd(dst + 1, b);
#endif
}

// dst[0..3] += v (16-byte aligned): one 16-byte vector atomic on sm_90+, two 8-byte ones before.
__device__ __forceinline__ void atomic_add4(float* dst, float4 v) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  atomicAdd(reinterpret_cast<float4*>(dst), v);
#else
  atomic_add2(dst, v.x, v.y);
  atomic_add2(dst + 2, v.z, v.w);
#endif
}

// An m16n8 C fragment regrouped over the lane pair (tq, tq ^ 1) for 16-byte stores or atomics: even tq
// returns row g's columns 2 tq .. 2 tq + 3, odd tq row g + 8's columns 2 (tq - 1) .. 2 tq + 1. Every
// lane of the warp must call it.
__device__ __forceinline__ float4 quad_rows4(const float (&c)[4], int tq) {
  const bool odd = (tq & 1) != 0;
  const float r0 = __shfl_xor_sync(0xffffffffu, odd ? c[0] : c[2], 1);
  const float r1 = __shfl_xor_sync(0xffffffffu, odd ? c[1] : c[3], 1);
  return odd ? make_float4(r0, r1, c[2], c[3]) : make_float4(c[0], c[1], r0, r1);
}

__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }
// The memory clobber keeps the compiler from moving this thread's reads of the copied data above the wait.
template <int N>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
}

// ldmatrix from a shared-memory address the caller computed (e.g. a lane's swizzled base once, then one
// XOR per k-step: see SwizzledTile::bytes), and the transposing load that gives B fragments (k pairs along
// rows) from a row-major [k][n] tile.
__device__ __forceinline__ void ldmatrix_x4_at(uint32_t (&r)[4], uint32_t addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr) : "memory");
}
__device__ __forceinline__ void ldmatrix_x4_trans_at(uint32_t (&r)[4], uint32_t addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr) : "memory");
}
// Two 8 x 8 matrices (rows from the addresses of lanes 0-7 and 8-15).
__device__ __forceinline__ void ldmatrix_x2(uint32_t (&r)[2], const void* smem) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x2.shared.b16 {%0,%1}, [%2];\n"
               : "=r"(r[0]), "=r"(r[1])
               : "r"(smem_addr(smem)) : "memory");
}
// The same loads from a pointer into shared memory.
__device__ __forceinline__ void ldmatrix_x4(uint32_t (&r)[4], const void* smem) { ldmatrix_x4_at(r, smem_addr(smem)); }
__device__ __forceinline__ void ldmatrix_x4_trans(uint32_t (&r)[4], const void* smem) {
  ldmatrix_x4_trans_at(r, smem_addr(smem));
}

// Two fp32 values as one packed 16-bit pair (the A-fragment / store format).
template <typename T>
__device__ __forceinline__ uint32_t pack2(float lo, float hi);
template <>
__device__ __forceinline__ uint32_t pack2<__nv_bfloat16>(float lo, float hi) {
  __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
  return *reinterpret_cast<uint32_t*>(&v);
}
template <>
__device__ __forceinline__ uint32_t pack2<__half>(float lo, float hi) {
  __half2 v = __floats2half2_rn(lo, hi);
  return *reinterpret_cast<uint32_t*>(&v);
}

// The A operand fragment (m16n8k16 / wgmma RS layout) of 16 accumulator columns: acc8 points at two
// consecutive C n-tiles (8 columns each: rows g, g + 8 of columns 2 tq, + 1), packed to the input dtype;
// e.g. P for P V from the logits' accumulator (n-tiles 2 kk, 2 kk + 1 are k-step kk).
template <typename T>
__device__ __forceinline__ void a_frag(const float* acc8, uint32_t (&a)[4]) {
  a[0] = pack2<T>(acc8[0], acc8[1]);
  a[1] = pack2<T>(acc8[2], acc8[3]);
  a[2] = pack2<T>(acc8[4], acc8[5]);
  a[3] = pack2<T>(acc8[6], acc8[7]);
}
template <typename T>
__device__ __forceinline__ float2 unpack2(uint32_t v);
template <>
__device__ __forceinline__ float2 unpack2<__nv_bfloat16>(uint32_t v) {
  return __bfloat1622float2(*reinterpret_cast<__nv_bfloat162*>(&v));
}
template <>
__device__ __forceinline__ float2 unpack2<__half>(uint32_t v) {
  return __half22float2(*reinterpret_cast<__half2*>(&v));
}

template <typename T>
struct MmaOp;

template <>
struct MmaOp<__nv_bfloat16> {
  __device__ __forceinline__ static void run(float (&c)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  }
};

template <>
struct MmaOp<__half> {
  __device__ __forceinline__ static void run(float (&c)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  }
};

// Shared tile of R rows x D 16-bit elements, row-major, 16-byte chunks XOR-swizzled by (row % 8) so
// that ldmatrix's eight row addresses of one column fall in distinct banks.
// The same swizzle for a width known only at run time (a multiple of 64 elements).
__device__ __forceinline__ int swizzled_offset(int row, int chunk, int width) {
  return row * width + ((chunk ^ (row & 7)) * 8);
}

template <int D>
struct SwizzledTile {
  static constexpr int kChunks = D / 8;  // 16-byte chunks per row
  __device__ __forceinline__ static int offset(int row, int chunk) {  // in elements
    return row * D + ((chunk ^ (row & 7)) * 8);
  }
  // In bytes. For x < kChunks, bytes(row, chunk ^ x) = bytes(row, chunk) ^ (x << 4) (a row's 2 D bytes
  // are a multiple of the 16 kChunks bytes the XOR touches): a lane computes its base once and each
  // k-step's address is one XOR, also of an absolute address when the tile starts 2 D-byte aligned.
  __device__ __forceinline__ static uint32_t bytes(int row, int chunk) { return uint32_t(offset(row, chunk)) * 2u; }
};

// One warp's acc (16 rows x 8 N8 columns) += A B over kKeys keys (128, or 64): A = rows a_row0 ..
// a_row0 + 15 of a [row][key] tile (SwizzledTile<kKeys>: P, dS, dsi), B = the keys' rows of a
// [key][column] tile (BTile, e.g. V, K or K_idx) from 16-byte chunk b_chunk0 on, read transposed by ldmatrix.
template <typename T, typename BTile, int kKeys = 128, int N8>
__device__ __forceinline__ void mma_rows_keys(float (&acc)[N8][4], const T* a, int a_row0, const T* b, int b_chunk0,
                                              int lane) {
  static_assert(N8 % 2 == 0, "mma_rows_keys: columns in pairs of n8 tiles");
  static_assert(kKeys % 16 == 0 && kKeys >= 64, "mma_rows_keys: whole 16-key steps of a swizzled tile");
#pragma unroll
  for (int kk = 0; kk < kKeys / 16; ++kk) {  // 16 keys per step
    uint32_t fa[4];
    ldmatrix_x4(fa, a + SwizzledTile<kKeys>::offset(a_row0 + lane % 16, kk * 2 + lane / 16));
#pragma unroll
    for (int dp = 0; dp < N8 / 2; ++dp) {
      uint32_t fb[4];
      ldmatrix_x4_trans(fb,
                        b + BTile::offset(kk * 16 + (lane % 8) + ((lane / 8) % 2) * 8, b_chunk0 + dp * 2 + lane / 16));
      MmaOp<T>::run(acc[2 * dp], fa, fb[0], fb[1]);
      MmaOp<T>::run(acc[2 * dp + 1], fa, fb[2], fb[3]);
    }
  }
}

// Accumulator fragments (m16n8 tiles, 4 floats per lane) set to zero.
template <int N>
__device__ __forceinline__ void zero_acc(float (&acc)[N][4]) {
#pragma unroll
  for (int n = 0; n < N; ++n)
#pragma unroll
    for (int e = 0; e < 4; ++e) acc[n][e] = 0.f;
}

// 2^x and log2(x) on the special-function unit, one instruction each (ex2/lg2.approx.ftz: relative
// error ~2^-22; subnormal results flush to zero). exp2f/log2f without fast math add range fix-ups
// (three more instructions per call), a measurable share of the sparse passes' issue slots.
__device__ __forceinline__ float fast_exp2(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}
__device__ __forceinline__ float fast_log2(float x) {
  float y;
  asm("lg2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

// Smallest normal float. The KL terms take pm * log2(pm) only from here on: lg2.approx.ftz reads a
// subnormal pm as 0 (-inf), and pm = (sum of the heads' P) / G is subnormal when the sum is below
// 2^-124 (one head's P a little above the exp2 underflow, the others 0), which made the KL -inf.
// Each term skipped is below 2^-126 * |log2 pm - s2| in size.
constexpr float kMinNormal = 1.17549435e-38f;
// One key's KL term in the log2 domain, pm (log2 pm - s2) with s2 the index logit in log2 units (SPEC 4): 0 for pm
// below kMinNormal (pm = 0 at masked keys and past a block's end, where s2 may be stale shared memory: a select, as
// 0 * NaN is NaN); a NaN pm (a non-finite input) passes, so the row's KL is NaN as in the reference.
__device__ __forceinline__ float kl_term_log2(float pm, float s2) {
  return !(pm < kMinNormal) ? pm * (fast_log2(pm) - s2) : 0.f;
}
// acc plus that term (one FFMA where the term is taken).
__device__ __forceinline__ float kl_term_log2_add(float acc, float pm, float s2) {
  return !(pm < kMinNormal) ? fmaf(pm, fast_log2(pm) - s2, acc) : acc;
}

// x = c * scale for a warp's m16 x (8 N) fragment array whose lane holds columns col0 + 8 n + 2 tq and + 1 of
// rows g (entries 0-1) and g + 8 (entries 2-3); -inf past a row's last visible column (lim0 for row g, lim1
// for g + 8; -1 masks the whole row). The index logits' masking before quad_row_max_sum.
template <int N>
__device__ __forceinline__ void masked_scaled(const float (&c)[N][4], float scale, int col0, int tq, int lim0,
                                              int lim1, float (&x)[N][4]) {
#pragma unroll
  for (int n = 0; n < N; ++n) {
    const int col = col0 + n * 8 + 2 * tq;
    x[n][0] = col <= lim0 ? c[n][0] * scale : -__builtin_huge_valf();
    x[n][1] = col + 1 <= lim0 ? c[n][1] * scale : -__builtin_huge_valf();
    x[n][2] = col <= lim1 ? c[n][2] * scale : -__builtin_huge_valf();
    x[n][3] = col + 1 <= lim1 ? c[n][3] * scale : -__builtin_huge_valf();
  }
}

// Per row of a warp's m16 x (8 N) fragment array (rows g and g + 8 of the lane, entries 0-1 and 2-3):
// m = the row's max of x * scale (-inf when the row is all -inf) and l = sum of exp2(x * scale - m),
// both reduced over the quad of lanes that holds the row; x * scale is in the log2 domain. scale > 0
// (the max is taken on x, then scaled: the same value as the max of the products), and the exponent
// is one FMA per element. R = 1: row g only (m[1], l[1] are left unset).
template <int R = 2, int N>
__device__ __forceinline__ void quad_row_max_sum(const float (&x)[N][4], float (&m)[2], float (&l)[2],
                                                 float scale = 1.f) {
  static_assert(R == 1 || R == 2, "rows per lane");
#pragma unroll
  for (int r = 0; r < R; ++r) {
    float mr = -__builtin_huge_valf();
#pragma unroll
    for (int n = 0; n < N; ++n) mr = fmaxf(mr, fmaxf(x[n][2 * r], x[n][2 * r + 1]));
#pragma unroll
    for (int off = 1; off <= 2; off <<= 1) mr = fmaxf(mr, __shfl_xor_sync(0xffffffffu, mr, off));
    mr *= scale;
    const float b = mr == -__builtin_huge_valf() ? 0.f : mr;
    float lr = 0.f;
#pragma unroll
    for (int n = 0; n < N; ++n) lr += fast_exp2(fmaf(x[n][2 * r], scale, -b)) + fast_exp2(fmaf(x[n][2 * r + 1], scale, -b));
#pragma unroll
    for (int off = 1; off <= 2; off <<= 1) lr += __shfl_xor_sync(0xffffffffu, lr, off);
    m[r] = mr;
    l[r] = lr;
  }
}

// The same (m, l) pair for rows whose every entry is visible (a full tile: no mask), without the row max on
// the critical path: each lane sums exp2(x scale - r) against its own reference r (its first entry of the
// row), then the quad merges the lanes' sums at the largest reference. m is then a reference, not the max:
// m + log2 l is the same logsumexp (two roundings per term instead of one), and every consumer of the pair
// (the stats combine, sel_stats' merge) treats it as "sum relative to m". A lane whose sum passes 2^64 (a
// spread of more than 64 in the log2 domain between its reference and another of its entries; a -inf
// reference, inf or NaN too) redoes its sum against its own max, so the pair stays far from fp32's range
// when the combine adds 32 blocks. Logits that overflowed fp32 to -inf (|q.k| > 3.4e38, finite bf16 inputs
// can) weigh 0 as in quad_row_max_sum: a lane whose every entry is -inf holds (-inf, 0) and its sum is
// left out of the merge (no -inf - -inf); a row of them gives (-inf, 0), "no keys". A NaN entry makes the
// row's sum NaN, as there. Against the max path the rounding differs by a few e-6 in log2 units (two
// roundings per term); beyond |x scale| ~ 2^31 the fma's exponents lose meaning in both. scale > 0. R = 1: row
// g only.
template <int R = 2, int N>
__device__ __forceinline__ void quad_row_ref_sum(const float (&x)[N][4], float (&m)[2], float (&l)[2], float scale) {
  static_assert(R == 1 || R == 2, "rows per lane");
  constexpr float kLimit = 18446744073709551616.f;  // 2^64
#pragma unroll
  for (int r = 0; r < R; ++r) {
    float ref = x[0][2 * r] * scale;
    float s[4] = {0.f, 0.f, 0.f, 0.f};  // four chains: short dependencies
#pragma unroll
    for (int n = 0; n < N; ++n) {
      s[(2 * n) % 4] += fast_exp2(fmaf(x[n][2 * r], scale, -ref));
      s[(2 * n + 1) % 4] += fast_exp2(fmaf(x[n][2 * r + 1], scale, -ref));
    }
    float sum = (s[0] + s[1]) + (s[2] + s[3]);
    if (!(sum <= kLimit)) {  // rare: the lane's own max as its reference (NaN stays NaN)
      float mx = -__builtin_huge_valf();
#pragma unroll
      for (int n = 0; n < N; ++n) mx = fmaxf(mx, fmaxf(x[n][2 * r], x[n][2 * r + 1]));
      ref = mx * scale;
      // Every entry -inf (or NaN): the exponents against 0 instead, as quad_row_max_sum does, so the lane's sum
      // is 0, or NaN when an entry is NaN (fmaxf skips NaN), with -inf as its reference.
      const float base = mx == -__builtin_huge_valf() ? 0.f : ref;
      sum = 0.f;
#pragma unroll
      for (int n = 0; n < N; ++n)
        sum += fast_exp2(fmaf(x[n][2 * r], scale, -base)) + fast_exp2(fmaf(x[n][2 * r + 1], scale, -base));
    }
    float top = ref;
#pragma unroll
    for (int off = 1; off <= 2; off <<= 1) top = fmaxf(top, __shfl_xor_sync(0xffffffffu, top, off));
    if (sum != 0.f) sum *= fast_exp2(ref - top);  // an empty lane adds 0 (a NaN sum stays NaN)
#pragma unroll
    for (int off = 1; off <= 2; off <<= 1) sum += __shfl_xor_sync(0xffffffffu, sum, off);
    m[r] = top;
    l[r] = sum;
  }
}

}  // namespace msa::sm80
