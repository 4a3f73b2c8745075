// The per-row streaming top list of the index top-k kernels (sm80 and sm90), and its output.
#pragma once
#include <cstdint>

#include "params.h"

namespace msa {

constexpr float kPosInf = __builtin_huge_valf();
constexpr float kNegInf = -__builtin_huge_valf();

// Streaming top list of one row: a binary heap in shared memory whose root is the worst kept entry
// (lowest score, then highest block), so the root's score is the row's threshold and an insertion is
// one sift-down (depth <= 5). Only the threshold lives in registers. Blocks are offered in ascending
// order, so a new block enters only when it beats the root strictly (ties keep the lower block).
struct SmemTopHeap {
  static constexpr int kSlots = 32;  // shared-memory slots per row (>= topk - 1)
  float* score;
  int* block;
  int size;  // topk - 1
  __device__ __forceinline__ static bool worse(float sa, int ba, float sb, int bb) {
    return sa < sb || (sa == sb && ba > bb);
  }
  __device__ __forceinline__ void init() {
    for (int j = 0; j < size; ++j) {
      score[j] = kNegInf;
      block[j] = -1;
    }
  }
  // Replaces the root by (s, b), restores the heap and returns the new threshold. One thread per row.
  // A fixed-depth loop (size <= 31: 5 levels) with only forward branches: no loop back-edge inside the
  // sm90 kernel's wgmma pipeline (ptxas serialises the wgmmas around one).
  __device__ __forceinline__ float replace_root(float s, int b) {
    static_assert(kSlots <= 32, "5 heap levels hold at most 31 entries");
    int i = 0;
#pragma unroll
    for (int level = 0; level < 5; ++level) {
      const int l = 2 * i + 1, r = l + 1;
      int w = i;
      float ws = s;
      int wb = b;
      if (l < size && worse(score[l], block[l], ws, wb)) { w = l; ws = score[l]; wb = block[l]; }
      if (r < size && worse(score[r], block[r], ws, wb)) { w = r; ws = score[r]; wb = block[r]; }
      if (w == i) break;
      score[i] = ws;
      block[i] = wb;
      i = w;
    }
    score[i] = s;
    block[i] = b;
    return score[0];
  }
  // The row's output (SPEC 2): the kept blocks ascending, then the local block, then -1 padding.
  // Sorts the heap's block array in place. One thread per row.
  __device__ __forceinline__ void write_sorted(int32_t* out, int topk, int local_block) {
    int* v = block;
    int cnt = 0;
    for (int j = 0; j < size; ++j) {
      const int x = v[j];
      if (x >= 0) v[cnt++] = x;
    }
    for (int j = 1; j < cnt; ++j) {  // at most 31 entries
      const int x = v[j];
      int m = j - 1;
      while (m >= 0 && v[m] > x) {
        v[m + 1] = v[m];
        --m;
      }
      v[m + 1] = x;
    }
    for (int j = 0; j < cnt; ++j) out[j] = v[j];
    out[cnt] = local_block;
    for (int j = cnt + 1; j < topk; ++j) out[j] = -1;
  }
};

}  // namespace msa
