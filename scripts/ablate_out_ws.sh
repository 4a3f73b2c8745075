#!/usr/bin/env bash
# What each piece of the warp-specialized output pass (csrc/sm90/sparse_fwd/out_pass_ws.cuh, the kernel the
# bench runs: Gu = 4, J = 1) costs, by removing it: scripts/ablate.sh (timings only, the edited builds compute
# wrong results). One GPU call, ~1 min per variant at one N (ABLATE_N, default 32768 here).
#   scripts/ablate_out_ws.sh OUTDIR
# Variants (each single one's sed changes exactly one line, checked with grep -c and a compile; the combined ones
# join those edits):
#   no_idx_logits  the index logits S_idx (mma.sync under the S wgmma; the S_idx tile keeps stale values)
#   no_exp         the exponentials of P (P = the raw logits)
#   no_head_sum    the reduce-scatter of P over the unit's 4 heads (shuffles)
#   no_pv          the P V wgmmas (O is whatever the registers hold; staged and stored as before)
#   no_out_store   the output partials' TMA stores (O still staged in shared memory; since s54's 726c527)
#   no_q_gather    the producer's global reads of the tiles' Q rows (cp.async with source size 0: the stage's Q
#                  is zero-filled, its shared-memory writes and the full mbarrier stay; is the gather the bound?)
#   no_kl_terms    the KL terms and the dsi tile (log2 / exp2 per unit and key)
#   no_dk_wgmma    the dK warpgroup's two wgmmas per tile (index dk folded into the pass, s52; its barriers stay)
#   no_dk_reds     only the dK warpgroup's reds into dki_accum at the item's end
#   no_dq          dq_idx: its mma.sync and the reds
#   no_dq_reds     only dq_idx's reds
#   no_index_branch  no_idx_logits, no_kl_terms and no_dq together (the index branch's share of the pass)
# (With the index gradient the pass runs two consumers beside the dK warpgroup, three without it: s52.)
F=csrc/sm90/sparse_fwd/out_pass_ws.cuh
# The edits that combined variants reuse.
idx_logits='s/^      for (int ks = 0; ks < kDi \/ 16; ++ks) {$/      for (int ks = 0; ks < 0; ++ks) {/'
kl_terms='s/^    for (int n = 0; n < kKeys \/ 8; n += kGu) {$/    for (int n = 0; n < 0; n += kGu) {/'
dq='s/^      if (wq \* 32 < p.di) {$/      if (false) {/'
export ABLATE_N=${ABLATE_N:-32768}
export ABLATE_GREP=${ABLATE_GREP:-out_pass_ws_kernel|sparse_fwd_kernel}
exec "$(dirname "$0")/ablate.sh" "${1:?usage: scripts/ablate_out_ws.sh OUTDIR}" \
  "no_idx_logits|$F|$idx_logits" \
  "no_exp|$F|s/^    if (full_tile) exp_tile(std::false_type{}); else exp_tile(std::true_type{});/    (void)full_tile;/" \
  "no_head_sum|$F|s/^    for (int b = 1; b < kGu; b <<= 1) {\$/    for (int b = 1; b < 1; b <<= 1) {/" \
  "no_pv|$F|s/^        WgmmaRS<T, 64, true>::run/        if (false) WgmmaRS<T, 64, true>::run/" \
  "no_out_store|$F|s/^      tma_store_3d(/      if (false) tma_store_3d(/" \
  "no_q_gather|$F|s/^    cp_async_16(sQ + SwizzledTile<D>::offset(row, c), qh + int64_t(ok ? tok\[u\] : 0) \* p.q_stride_t, ok);/    cp_async_16(sQ + SwizzledTile<D>::offset(row, c), qh, false);/" \
  "no_kl_terms|$F|$kl_terms" \
  "no_dk_wgmma|$F|s/^      if (h == 0 || two) WgmmaRS<T, kKeys, true>::run(acc\[h\], a\[h\], b, t > 0);/      if (false) WgmmaRS<T, kKeys, true>::run(acc[h], a[h], b, t > 0);/" \
  "no_dk_reds|$F|s/^            sm80::atomic_add4(p.dki_accum + /            if (false) sm80::atomic_add4(p.dki_accum + /" \
  "no_dq|$F|$dq" \
  "no_index_branch|$F|$idx_logits;$kl_terms;$dq" \
  "no_dq_reds|$F|s/^            for (int n = 0; n < 4; ++n) sm80::atomic_add4(dst + n \* 8, x\[n\]);/            for (int n = 0; n < 4; ++n) if (false) sm80::atomic_add4(dst + n * 8, x[n]);/"
