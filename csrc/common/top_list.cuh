// The per-row streaming top list of the index top-k kernels (sm80 and sm90), and its output.
#pragma once
#include <cstdint>
#include <type_traits>

#include "common/mma_sm80.h"
#include "params.h"

namespace msa {

constexpr float kPosInf = __builtin_huge_valf();
constexpr float kNegInf = -__builtin_huge_valf();

// Streaming top list of one row: a binary heap in shared memory whose root is the worst kept entry
// (lowest score, then highest block), so the root's score is the row's threshold and an insertion is
// one sift-down (depth <= 5). Only the threshold lives in registers. Blocks are offered in ascending
// order, so a new block enters only when it beats the root strictly (ties keep the lower block).
// Rows are kSlots = 32 words apart, so slot j of every row would sit in bank j: the lanes of a warp, each
// on its own row at the same heap position, would meet in one bank (a 16- to 32-way conflict on every
// access). Slot j of row r is therefore stored at position j ^ (r % 32) of the row: one bank per row of
// 32 consecutive rows.
// kSum: each slot also carries a float that travels with its entry (the sm90 kernel's per-block sum of
// exponentials, for the selection's index logsumexp: SPEC 4's lse_idx without rescoring the kept blocks).
template <bool kSum>
struct TopHeap {
  static constexpr int kSlots = 32;  // shared-memory slots per row (>= topk - 1)
  static_assert(kSlots == 32, "the bank swizzle permutes the 32 slots of a row");
  float* score;  // the row's slots (kSlots words, swizzled)
  int* block;
  float* sum;  // kSum only
  int size;  // topk - 1
  int swz;   // row % 32
  __device__ __forceinline__ TopHeap(float* scores, int* blocks, int row, int topk, float* sums = nullptr)
      : score(scores + row * kSlots),
        block(blocks + row * kSlots),
        sum(kSum ? sums + row * kSlots : nullptr),
        size(topk - 1),
        swz(row & (kSlots - 1)) {}
  __device__ __forceinline__ float& sc(int j) const { return score[j ^ swz]; }
  __device__ __forceinline__ int& bl(int j) const { return block[j ^ swz]; }
  __device__ __forceinline__ float& su(int j) const { return sum[j ^ swz]; }
  __device__ __forceinline__ static bool worse(float sa, int ba, float sb, int bb) {
    return sa < sb || (sa == sb && ba > bb);
  }
  __device__ __forceinline__ void init() {
    for (int j = 0; j < size; ++j) {
      sc(j) = kNegInf;
      bl(j) = -1;
    }
  }
  // Replaces the root by (s, b), restores the heap and returns the new threshold. One thread per row.
  // A fixed-depth loop (size <= 31: 5 levels) with only forward branches: no loop back-edge inside the
  // sm90 kernel's wgmma pipeline (ptxas serialises the wgmmas around one).
  // kSum: x is the new entry's carried float.
  __device__ __forceinline__ float replace_root(float s, int b, float x = 0.f) {
    static_assert(kSlots <= 32, "5 heap levels hold at most 31 entries");
    int i = 0;
#pragma unroll
    for (int level = 0; level < 5; ++level) {
      const int l = 2 * i + 1, r = l + 1;
      int w = i;
      float ws = s;
      int wb = b;
      if (l < size && worse(sc(l), bl(l), ws, wb)) { w = l; ws = sc(l); wb = bl(l); }
      if (r < size && worse(sc(r), bl(r), ws, wb)) { w = r; ws = sc(r); wb = bl(r); }
      if (w == i) break;
      sc(i) = ws;
      bl(i) = wb;
      if constexpr (kSum) su(i) = su(w);
      i = w;
    }
    sc(i) = s;
    bl(i) = b;
    if constexpr (kSum) su(i) = x;
    return sc(0);
  }
  // kSum, before write_sorted: the kept entries' combined (max, sum) in the log2 domain, (m, l) with
  // l = sum over kept j of su(j) 2^(sc(j) log2e - m), m = max of sc(j) log2e; (-inf, 0) when nothing is kept.
  // A NaN carried sum makes l NaN.
  __device__ __forceinline__ float2 kept_max_sum() const {
    float m = kNegInf;
    for (int j = 0; j < size; ++j)
      if (bl(j) >= 0) m = fmaxf(m, sc(j) * sm80::kLog2e);
    float l = 0.f;
    if (m != kNegInf) {
      for (int j = 0; j < size; ++j)
        if (bl(j) >= 0) l += su(j) * exp2f(fmaf(sc(j), sm80::kLog2e, -m));
    }
    return make_float2(m, l);
  }
  // The row's output (SPEC 2): the kept blocks ascending, then the local block, then -1 padding.
  // Sorts the heap's block array in place. One thread per row.
  __device__ __forceinline__ void write_sorted(int32_t* out, int topk, int local_block) {
    int cnt = 0;
    for (int j = 0; j < size; ++j) {
      const int x = bl(j);
      if (x >= 0) bl(cnt++) = x;
    }
    for (int j = 1; j < cnt; ++j) {  // at most 31 entries
      const int x = bl(j);
      int m = j - 1;
      while (m >= 0 && bl(m) > x) {
        bl(m + 1) = bl(m);
        --m;
      }
      bl(m + 1) = x;
    }
    for (int j = 0; j < cnt; ++j) out[j] = bl(j);
    out[cnt] = local_block;
    for (int j = cnt + 1; j < topk; ++j) out[j] = -1;
  }
};
using SmemTopHeap = TopHeap<false>;

// The same list in registers (the sm90 plain top-k, topk - 1 <= 16): a row's entries on the two lanes of its quad that
// hold the row (tq and tq ^ 2), 8 slots each (slot 8 half + i), each entry one key that orders as TopHeap::worse does
// (a larger key is a better entry), so the row's worst is a min and an exchange of the lanes' worsts one shuffle. A
// kept block's key is its score's order-preserving bits above kMask - block (the kernel's block keys: f16 maxima into
// 32-bit keys, FP8; fp32 scores into 64-bit ones, 16-bit): a higher score, then a lower block, is a larger key. The
// empty slots hold their slot number (0 .. 15, below every block's key, whose score bits are never 0), the slots at or
// past topk - 1 kPad (above every block's key, never the worst). Keys are unique but for kPad (blocks are distinct),
// so the row's worst is on exactly one of its lanes. An insertion is the holder replacing its worst, a min tree over
// its 8 and the exchange: no shared memory on the path, no dependent loads. The same entries as TopHeap's (same take
// condition, same worst, same ties).
template <typename Key>
struct RegKeyList {
  static_assert(std::is_same_v<Key, uint32_t> || std::is_same_v<Key, uint64_t>, "32- or 64-bit keys");
  static constexpr int kPerLane = 8;
  static constexpr int kBlockBits = 4 * int(sizeof(Key));  // the low half: kMask - block
  static constexpr Key kMask = (Key(1) << kBlockBits) - 1;
  // 64-bit: kPad's low half (0xffff) is no block's (those are >= 2^31) and no empty slot's, so that replace can
  // compare the low halves alone (unique but for kPad, which is never a holder's worst).
  static constexpr Key kPad = sizeof(Key) == 4 ? Key(0xffffffffu) : Key(0xffffffff0000ffffull);
  Key k[kPerLane];
  Key w;      // this lane's worst (smallest) key
  bool hold;  // this lane holds the row's worst
  __device__ __forceinline__ static Key block_key(uint32_t score_bits, int b) {
    return Key(score_bits) << kBlockBits | (kMask - Key(uint32_t(b)));
  }
  __device__ __forceinline__ void init(int size, int half) {
#pragma unroll
    for (int i = 0; i < kPerLane; ++i) {
      const int j = kPerLane * half + i;
      k[i] = j < size ? Key(j) : kPad;
    }
    find_worst();
  }
  __device__ __forceinline__ void find_worst() {
    Key t[kPerLane / 2];
#pragma unroll
    for (int i = 0; i < kPerLane / 2; ++i) t[i] = min(k[2 * i], k[2 * i + 1]);
    w = min(min(t[0], t[1]), min(t[2], t[3]));
  }
  // Every lane of the warp calls it (a shuffle): the row's threshold key on both of the row's lanes.
  __device__ __forceinline__ Key exchange() {
    const Key o = __shfl_xor_sync(0xffffffffu, w, 2);
    hold = w < o;
    return min(w, o);
  }
  // The holder's worst replaced by key kn.
  __device__ __forceinline__ void replace(Key kn) {
#pragma unroll
    for (int i = 0; i < kPerLane; ++i) k[i] = uint32_t(k[i]) == uint32_t(w) ? kn : k[i];
    find_worst();
  }
  // The kept blocks into the row's TopHeap slots 0 .. topk - 2, -1 where empty (write_sorted reads only blocks).
  __device__ __forceinline__ void store(const TopHeap<false>& heap, int half) const {
#pragma unroll
    for (int i = 0; i < kPerLane; ++i) {
      const int j = kPerLane * half + i;
      if (j < heap.size) heap.bl(j) = k[i] >= Key(2 * kPerLane) ? int(uint32_t(kMask - (k[i] & kMask))) : -1;
    }
  }
};

}  // namespace msa
