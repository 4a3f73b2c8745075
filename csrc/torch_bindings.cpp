// Every schema of torch.ops.msa, registered through PyTorch's stable ABI (csrc/api/stable.h says why).
// Implementations register beside their code: the CUDA kernels in csrc/api/*.cpp
// (STABLE_TORCH_LIBRARY_IMPL(msa, CUDA, ...)), the CPU reference, fakes and autograd in msa/_ops.py. Layout is packed (thd): tensors are (T, H, D), sequences given by cu_seqlens (S+1,), or,
// where cu_seqlens is None, T / max_seqlen sequences of max_seqlen tokens each (the batched layout:
// nothing to read back from the device). `deterministic` makes the gradients bitwise reproducible.
// cu_seqlens_k / max_seqlen_k (None: the layout of the queries) split the key-side tensors (k, v, k_idx
// and their gradients) where the queries are a suffix of the keys: sequence s's len_q queries are its
// last len_q of len_k >= len_q positions (docs/semantics.md). Both paths compute that case, warmup
// included.
#include <torch/csrc/stable/library.h>

STABLE_TORCH_LIBRARY(msa, m) {
  // SPEC 2: int32 (Hi, T, topk) selected blocks, ascending, -1 padded. q_idx, k_idx: bf16 / fp16, or both
  // float8_e4m3fn (index_dtype: the FP8 top-k on Hopper at Di = 128, else the same values widened to bf16), whose
  // values must keep |x| <= 16 as msa.fp8_index_copies' do (the FP8 top-k sums in f16; not checked: a value range).
  m.def("select_blocks(Tensor q_idx, Tensor k_idx, Tensor? cu_seqlens, SymInt max_seqlen, int topk, "
        "int block_size, float index_scale, Tensor? cu_seqlens_k=None, SymInt? max_seqlen_k=None) -> Tensor");
  // The CUDA body of msa::fp8_index_copies (msa/_ops.py, index_dtype's e4m3 copies): q_idx (T, Hi, Di) per row,
  // k_idx (T_k, Hki, Di) per (sequence, head), its sequences cu_seqlens_k or runs of seq_len_k rows; contiguous.
  m.def("_fp8_copies_cuda(Tensor q_idx, Tensor k_idx, Tensor? cu_seqlens_k, int seq_len_k) -> (Tensor, Tensor)");
  // SPEC 3: out (T, Hq, D) and lse (Hq, T) over the causally visible tokens of the selected blocks.
  m.def("sparse_fwd(Tensor q, Tensor k, Tensor v, Tensor indices, Tensor? cu_seqlens, SymInt max_seqlen, "
        "int block_size, float softmax_scale, bool deterministic=False, Tensor? cu_seqlens_k=None, SymInt? max_seqlen_k=None) -> (Tensor out, Tensor lse)");
  m.def("sparse_bwd(Tensor dout, Tensor q, Tensor k, Tensor v, Tensor out, Tensor lse, Tensor indices, "
        "Tensor? cu_seqlens, SymInt max_seqlen, int block_size, float softmax_scale, bool deterministic=False, "
        "Tensor? cu_seqlens_k=None, SymInt? max_seqlen_k=None) -> (Tensor dq, Tensor dk, Tensor dv)");
  // SPEC 2-5 in one op: selection, sparse (or warmup dense) attention, exact KL value, index LSE.
  // indices is (Hi, T, topk); in warmup mode it is (Hi, T, 0) unless return_indices. With index_grad
  // the pass that computes kl also yields its gradient for d_kl = 1 (SPEC 4: kl is linear in d_kl):
  // kl_dq_idx (T, Hi, Di) and kl_dk_idx (T_k, Hki, Di) in fp32; without, both are empty (0,). kl_rows
  // (Hi, T) fp32 holds each row's KL term (kl is their mean). sel_q_idx / sel_k_idx: the selection's own inputs
  // (SPEC 2 with index_dtype: float8_e4m3fn copies of q_idx / k_idx with |x| <= 16 as select_blocks takes them,
  // or tensors of their dtype); the KL, lse_idx and the index gradients use q_idx / k_idx.
  m.def("msa_fwd(Tensor q, Tensor k, Tensor v, Tensor q_idx, Tensor k_idx, Tensor? cu_seqlens, "
        "SymInt max_seqlen, int topk, int block_size, float softmax_scale, float index_scale, bool warmup, "
        "bool return_indices, bool index_grad, bool deterministic=False, Tensor? cu_seqlens_k=None, SymInt? max_seqlen_k=None, "
        "Tensor? sel_q_idx=None, Tensor? sel_k_idx=None) -> (Tensor out, Tensor kl, "
        "Tensor indices, Tensor lse, Tensor lse_idx, Tensor kl_dq_idx, Tensor kl_dk_idx, Tensor kl_rows)");
  // SPEC 4 gradients: dout -> dq, dk, dv; dkl -> dq_idx, dk_idx (dkl times the forward's kl_dq_idx /
  // kl_dk_idx when given, else from dkl/rows * (Pidx - P) again). A missing dout or dkl skips that part
  // (its gradients are returned as zeros).
  m.def("msa_bwd(Tensor? dout, Tensor? dkl, Tensor q, Tensor k, Tensor v, Tensor out, Tensor lse, "
        "Tensor q_idx, Tensor k_idx, Tensor lse_idx, Tensor indices, Tensor kl_dq_idx, Tensor kl_dk_idx, "
        "Tensor? cu_seqlens, SymInt max_seqlen, int block_size, float softmax_scale, float index_scale, "
        "bool warmup, bool deterministic=False, Tensor? cu_seqlens_k=None, SymInt? max_seqlen_k=None) -> (Tensor dq, Tensor dk, Tensor dv, Tensor dq_idx, "
        "Tensor dk_idx)");
  // Reverse index: CSR over keys (index head r, global kv block) of the tokens that selected the block,
  // tokens ascending. Keys number Hi * (T // block_size + S) (an upper bound on the blocks, known
  // without reading cu_seqlens); block_offsets[s] is the first global block of sequence s.
  m.def("reverse_index(Tensor indices, Tensor? cu_seqlens, SymInt max_seqlen, int block_size) -> "
        "(Tensor offsets, Tensor rows, Tensor block_offsets)");
  // For tests (CUDA): the backward's reverse index with its work list of items of <= units_per_item tokens
  // (item_offsets (keys + 1), items (max_items, 2) = (key, first row)) and launch order (max_items; empty
  // with MSA_ITEM_ORDER=0), copied out of the build.
  m.def("_work_list(Tensor indices, Tensor? cu_seqlens, SymInt max_seqlen, int block_size, int units_per_item) -> "
        "(Tensor offsets, Tensor rows, Tensor item_offsets, Tensor items, Tensor order)");
  // Checks cu_seqlens (SPEC 7) and, on CUDA, remembers the values read, so later calls on the same
  // tensor version (a CUDA graph capture among them) read nothing back.
  m.def("validate_cu_seqlens(Tensor cu_seqlens, int total_tokens, int max_seqlen) -> ()");
  // What the CUDA build does on the device of `like` (python -m msa.info): an int64 CPU tensor
  // [sm90 kernels in this build, the Hopper path taken, forward output rows per tile (D = 128), the
  // 99 KB configuration taken, opt-in shared memory per block in bytes].
  m.def("device_config(Tensor like) -> Tensor");
  // PyTorch's dense attention (cuDNN or flash) for warmup (SPEC 5), implemented in Python (msa/_ops.py)
  // and called by the CUDA msa_fwd / msa_bwd: for the dense main branch, and (the output unused) for the
  // index branch's lse_idx. aten's attention schemas change between torch releases, and the flash
  // backward's determinism is PyTorch's global flag, which the stable ABI cannot set. uniform: every
  // sequence holds T / (number of sequences) tokens (the batched layout, or one packed sequence), which
  // the cuDNN kernels need; lse is (H, T) in either case. lse_only: the caller reads lse alone (the index
  // branch), and out may hold fewer columns than v (cuDNN runs with a narrow V, the same lse).
  // cu_seqlens_k / max_seqlen_k: the keys' layout where the queries are a suffix of the keys (then
  // flash, causal aligned bottom-right; None: the queries' layout).
  m.def("_dense_fwd(Tensor q, Tensor k, Tensor v, Tensor cu_seqlens, SymInt max_seqlen, float softmax_scale, "
        "bool uniform=False, bool deterministic=False, bool lse_only=False, Tensor? cu_seqlens_k=None, "
        "SymInt? max_seqlen_k=None) -> (Tensor out, Tensor lse)");
  m.def("_dense_bwd(Tensor dout, Tensor q, Tensor k, Tensor v, Tensor out, Tensor lse, Tensor cu_seqlens, "
        "SymInt max_seqlen, float softmax_scale, bool deterministic, bool uniform=False, Tensor? cu_seqlens_k=None, "
        "SymInt? max_seqlen_k=None) -> (Tensor dq, Tensor dk, Tensor dv)");
}
