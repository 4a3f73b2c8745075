// The sparse forward's setup as csrc/api/sparse_fwd.cpp does it (reverse index per query chunk, params of
// both passes, the combines and index_dk), shared by the forward, combine and backward benchmarks.
//
// Differences from the op, for timing: every chunk keeps its own reverse index and its own slice of the
// per-entry partials (the op reuses one chunk-sized workspace), so any kernel can be replayed over all
// chunks with valid inputs (the stats, lse and dsi of that chunk) and no chunk's inputs alias another's in
// the L2 cache. Chunk sizes, work lists, grids and launch order are the op's.
#pragma once
#include <string>
#include <vector>

#include "bench_common.h"
#include "common/workspace.h"

namespace msa::bench {

// One reverse index with its own outputs and workspace (ReverseIndexSizes s): the params have the
// whole token range and no indices yet (p.indices is set per input set).
struct RevIndex {
  Buf offsets, rows, block_offsets, keys, rows_in, temp, item_offsets, items, order;
  ReverseIndexParams p{};
  RevIndex(const ReverseIndexSizes& s, const Problem& pb);
};

enum class FwdMode {
  kSparse,   // msa::sparse_fwd: the main branch only (no q_idx / k_idx in the passes)
  kMsa,      // msa::msa_fwd without index gradients: + index stats, KL terms
  kMsaGrad,  // msa::msa_fwd with index_grad (training): + dsi, dq_idx (output pass) and index_dk
};
const char* mode_name(FwdMode m);

struct FwdConfig {
  FwdMode mode = FwdMode::kMsaGrad;
  int units_per_item = kFwdUnitsPerItem;  // MSA_FWD_UNITS_PER_ITEM
  int64_t budget = 0;                     // MSA_PARTIAL_BUDGET; 0: the op's (fwd_partial_budget)
  // The budget this run chunks by: the op's default for the problem unless --budget-mib set one.
  int64_t budget_for(int64_t tokens, int hq, int d) const {
    return budget > 0 ? budget : fwd_partial_budget(tokens, hq, d, mode == FwdMode::kMsaGrad);
  }
  bool item_order = true;                 // MSA_ITEM_ORDER=0 turns it off
  bool fixed_gu = true;                   // MSA_FWD_FIXED_GU=0 turns it off
  bool out_ws = true;                     // MSA_FWD_WS=0 turns it off
  bool rows64 = false;                    // MSA_FWD_ROWS=64
  // msa modes on the Hopper top-k: sequences of at most this many key blocks take the kept blocks' index (max, sum)
  // from the selection and the stats pass scores each row's own block only (the op's sel_stats_applies).
  int sel_max_blocks = 128;               // MSA_SEL_MAX_BLOCKS; 0: never
};
// --mode, --units-per-item, --budget-mib, --no-item-order, --sel-max-blocks; with `passes` also --no-fixed-gu,
// --no-ws, --fwd-rows.
std::vector<Knob> fwd_knobs(FwdConfig& cfg, bool passes = true);

struct FwdChunk {
  int64_t begin = 0, tokens = 0;
  Buf offsets, rows, block_offsets, item_offsets, items, order;  // this chunk's reverse index
  ReverseIndexParams rp{};
};

struct FwdSet {
  Buf q, k, v, qi, ki;  // random normal; qi / ki also make the selection in kSparse mode
  Buf indices;          // (Hi, T, topk) from the index top-k kernel
  Buf sel_stats;        // (Hi, T) float2: the kept blocks' index (max, sum) from the top-k (FwdBench::sel)
  int64_t attended = 0; // sum over (t, r) of |T(t, r)| (SPEC 8), without the factor G
  std::vector<FwdChunk> chunks;
  // Per-entry partials of every chunk (chunk c at entry Hi * begin * topk).
  Buf stats, idx_stats, kl_part, out_part, dsi_part;  // dsi_part: FwdBench::dsi only
  Buf out, lse, lse_idx, kl_rows, dqi, dki;
};

class FwdBench {
 public:
  // n_sets input sets: random inputs, the selection, every chunk's reverse index, one full forward.
  // sink: slot 0 of every row becomes block 0 before the reverse indices are built.
  FwdBench(const Problem& pb, const FwdConfig& cfg, int n_sets, uint64_t seed, cudaStream_t s, bool sink = false);

  const Problem& pb;
  const FwdConfig cfg;
  const cudaStream_t stream;
  bool index = false, grad = false;
  // sel: the selection's kept blocks' stats feed the stats pass and combine (the op at <= sel_max_blocks key blocks).
  // dsi: the output pass writes dsi partials and index_dk reads them; false where the warp-specialized output pass
  // computes dk_idx itself (sm90::out_ws_fuses_index_dk), as in the op.
  bool sel = false, dsi = false;
  int64_t chunk = 0;  // tokens per chunk
  ReverseIndexSizes ri;
  Buf keys, rows_in, temp;  // the reverse index builds' workspace (one, as in the op)
  std::vector<FwdSet> sets;

  int num_chunks() const { return int(sets[0].chunks.size()); }
  SparseFwdParams fwd_params(int set, int c) const;
  SparseCombineParams combine_params(int set, int c) const;
  IndexDkParams dk_params(int set, int c) const;

  // One launch each for chunk c of a set (errors exit).
  void reverse_index(int set, int c) const;
  void zero_stats(int set, int c) const;  // the op's memsets: slots that select nothing keep (0, 0)
  void stats_pass(int set, int c) const;
  void out_pass(int set, int c) const;
  void combine_stats(int set, int c) const;
  void combine_out(int set, int c) const;
  void combine_kl(int set, int c) const;
  void index_dk(int set, int c) const;  // no launch unless dsi
  // The op's per-chunk sequence: reverse index, memsets, stats pass, stats combine, output pass, output
  // and KL combines, index_dk (where dsi); over all chunks.
  void forward(int set) const;
  // Zero the index-gradient accumulators (the op allocates them zeroed).
  void zero_grads(int set) const;

  std::string shape() const;            // pb.shape + mode
  double attended() const;              // sum over (t, r) |T(t, r)|, mean over the sets
  double attended_flops() const;        // 4 D G sum|T|: the attended fwd FLOPs of SPEC 8 (mean over the sets)
};

// Bytes of q, k, v (+ q_idx, k_idx with the index branch) of one input set: what rotating_sets counts.
double fwd_input_bytes(const Problem& pb, bool index);

}  // namespace msa::bench
