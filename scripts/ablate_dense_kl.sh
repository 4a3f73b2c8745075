#!/usr/bin/env bash
# What each piece of the Hopper dense KL kernel (warmup's KL pass) costs, by removing it
# (scripts/ablate.sh: timings only, the edited builds compute wrong results). One GPU call, ~45 s per
# variant at ABLATE_N (default 16384):
#   scripts/ablate_dense_kl.sh OUTDIR
# Variants (each sed was checked to change the lines named and to compile):
#   no_dq_reds      dQ_idx's 8-byte reds (the GEMM stays)
#   no_dq           the whole dQ_idx block: ldmatrix of dS, the GEMM, the reds
#   no_dk_gemm      the dK_idx GEMM (its wait and the KL shuffles under it stay)
#   no_terms_mufu   the exp2 of Pidx and the log2 of Pbar in the terms (two lines)
#   no_head_exps    the heads' exp2 on full tiles (the FMA and the sum stay)
#   no_cta_barrier  the one CTA barrier per step (racy: timing only)
#   no_kl_atomics   the KL's fixed-point atomics
#   no_grad         every gradient (dK_idx, dQ_idx, the dS^T tile): the KL value alone
F=csrc/sm90/dense_kl/dense_kl_kernel.cuh
export MSA_PROFILE_WARMUP=1 ABLATE_GREP=dense_kl_kernel ABLATE_N=${ABLATE_N:-16384}
exec "$(dirname "$0")/ablate.sh" "${1:?usage: scripts/ablate_dense_kl.sh OUTDIR}" \
  "no_dq_reds|$F|s/const bool ok0 = row0 + qrow < len_q, ok1 = row0 + qrow + 8 < len_q;/const bool ok0 = false, ok1 = false;/" \
  "no_dq|$F|s/^    if (grad) {\$/    if (false) {/" \
  "no_dk_gemm|$F|s/kk < 4; ++kk) WgmmaRS<T, Di, true>::run(dk,/kk < 0; ++kk) WgmmaRS<T, Di, true>::run(dk,/" \
  "no_terms_mufu|$F|s/fast_exp2(s2 - lv\[2 \* j + (e \& 1)\])/(s2 - lv[2 * j + (e \& 1)])/;s/pb\[4 \* j + e\] = kl_term_log2(pm, s2);/pb[4 * j + e] = !(pm < 1.17549435e-38f) ? pm * (pm - s2) : 0.f;/" \
  "no_head_exps|$F|s/pb\[4 \* j + e\] += fast_exp2(fmaf(sc\[4 \* j + e\], p.scale_log2, lv\[2 \* j + (e \& 1)\]));/pb[4 * j + e] += fmaf(sc[4 * j + e], p.scale_log2, lv[2 * j + (e \& 1)]);/" \
  "no_cta_barrier|$F|s/^    __syncthreads();  \/\/ sDs and sKl complete/    \/\/ no barrier/" \
  "no_kl_atomics|$F|s/if (tid < kRows \&\& row0 + tid < len_q) {  \/\/ KL in fixed point/if (false) {  \/\/ KL/" \
  "no_grad|$F|s/const bool grad = p.dq_idx != nullptr;/const bool grad = false;/"
