#!/usr/bin/env bash
# What each piece of the Hopper dense KL kernel (warmup's KL pass) costs, by removing it
# (scripts/ablate.sh: timings only, the edited builds compute wrong results). One GPU call, ~45 s per
# variant at ABLATE_N (default 16384):
#   scripts/ablate_dense_kl.sh OUTDIR
# Variants of the default kernel, the one with the index warpgroup (s76; each sed was checked to change the lines
# named and to compile):
#   no_dq_reds      dQ_idx's 8-byte reds (the GEMMs stay)
#   no_idx_gemms    the index warpgroup's GEMMs and reds (dK_idx, dQ_idx): it waits, adds the KL rows, arrives
#   no_dk_gemm      the index warpgroup's dK_idx GEMMs (dQ_idx's stay)
#   no_terms_mufu   the exp2 of Pidx and the log2 of Pbar in the terms (two lines)
#   no_head_exps    the heads' exp2 on full tiles (the FMA and the sum stay)
#   no_ds_wait      the heads' wait for the index warpgroup before they refill a dS^T buffer (racy: timing only)
#   no_kl_atomics   the KL's fixed-point atomics
#   no_grad         every gradient (dK_idx, dQ_idx, the dS^T tile): the KL value alone
F=csrc/sm90/dense_kl/dense_kl_kernel.cuh
export MSA_PROFILE_WARMUP=1 ABLATE_GREP=dense_kl_kernel ABLATE_N=${ABLATE_N:-16384}
exec "$(dirname "$0")/ablate.sh" "${1:?usage: scripts/ablate_dense_kl.sh OUTDIR}" \
  "no_dq_reds|$F|s/const bool ok0 = row0 + qrow < len_q, ok1 = row0 + qrow + 8 < len_q;/const bool ok0 = false, ok1 = false;/" \
  "no_idx_gemms|$F|s/^        if (grad) {\$/        if (false) {/" \
  "no_dk_gemm|$F|s/^          for (int m = 0; m < 2; ++m) {\$/          for (int m = 0; m < 0; ++m) {/" \
  "no_terms_mufu|$F|s/fast_exp2(s2 - lv\[2 \* j + (e \& 1)\])/(s2 - lv[2 * j + (e \& 1)])/;s/pb\[4 \* j + e\] = kl_term_log2(pm, s2);/pb[4 * j + e] = !(pm < 1.17549435e-38f) ? pm * (pm - s2) : 0.f;/" \
  "no_head_exps|$F|s/pb\[4 \* j + e\] += fast_exp2(fmaf(sc\[4 \* j + e\], p.scale_log2, (e \& 1) ? o.y : o.x));/pb[4 * j + e] += fmaf(sc[4 * j + e], p.scale_log2, (e \& 1) ? o.y : o.x);/" \
  "no_ds_wait|$F|s/if (s >= 2) mbar_wait(ds_empty + b, ((s >> 1) + 1) \& 1);/\/\/ no wait/" \
  "no_kl_atomics|$F|s/if (i < kRows \&\& row0 + i < len_q) {  \/\/ KL in fixed point/if (false) {  \/\/ KL/" \
  "no_grad|$F|s/const bool grad = p.dq_idx != nullptr;/const bool grad = false;/"
