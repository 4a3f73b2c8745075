#!/usr/bin/env bash
# What each piece of the sm_90a output pass costs today, by removing it (scripts/ablate.sh: timings only,
# the edited builds compute wrong results). One GPU call, ~1 min per variant (ABLATE_N=32768 for 32K only).
#   scripts/ablate_out_pass.sh OUTDIR
# Variants (each sed was checked to change exactly one line and to compile). They aim at the kernel the
# bench runs, the one compiled for Gu = 4 heads per unit (G = 4, J = 1):
#   no_pv_out      P V and the output partials' stores (pv_out returns at once)
#   no_out_store   only the output partials' 16-byte stores (O staged in shared memory, then global)
#   no_kl_terms    the KL terms and the dsi tile (the reduce-scatter of P over the unit's heads stays)
#   no_dsi_dq      the tile's dsi copy to global memory and dq_idx (mma.sync + atomics)
#   no_dq_atomics  only dq_idx's atomics (the non-deterministic ones the bench runs)
#   no_idx_logits  the index logits (both passes: they share the code)
F=csrc/smxx/sparse_fwd/sparse_fwd_body.cuh
exec "$(dirname "$0")/ablate.sh" "${1:?usage: scripts/ablate_out_pass.sh OUTDIR}" \
  "no_pv_out|$F|s/^        if (!p.write_out) return;  \/\/ CTA-uniform/        return;  \/\/ CTA-uniform/" \
  "no_out_store|$F|s/^              if (u < nu)\$/              if (false)/" \
  "no_kl_terms|$F|s/^              if ((n \& (Gu - 1)) == 0) {\$/              if (false) {/" \
  "no_dsi_dq|$F|s/^      if (p.dsi_part != nullptr) {\$/      if (false) {/" \
  "no_dq_atomics|$F|s/^              else atomic_add4(p.dqi_accum + o + n \* 8, x);/              else if (false) atomic_add4(p.dqi_accum + o + n * 8, x);/" \
  "no_idx_logits|$F|s/if (index_tile(ub) \&\& j == 0) {  \/\/ CTA-uniform/if (false) {  \/\/ CTA-uniform/"
