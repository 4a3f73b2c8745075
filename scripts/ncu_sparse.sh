#!/usr/bin/env bash
# ncu summary (speed of light, warp stalls, memory, pipes) of one launch of each sparse kernel at N
# (default 32768): scripts/ncu_sparse.sh OUTDIR [N]
OUT=${1:?usage: scripts/ncu_sparse.sh OUTDIR [N]}
MSA_NCU_COUNT=${MSA_NCU_COUNT:-2} exec "$(dirname "$0")/ncu_summary.sh" "$OUT" "${2:-32768}" sparse_fwd_kernel sparse_bwd_kernel
