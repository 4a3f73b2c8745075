#!/usr/bin/env bash
# A/B of one kernel change in one GPU call: the tree as it is (A) against the tree with PATCH applied:
#   scripts/ab_patch.sh LOGDIR PATCH[,PATCH2,...] [bench args, e.g. --n 32768 131072 --reps 5]
# Several comma-separated patches are applied in order (one variant: all of them). The one-variant form of
# scripts/ab_variants.sh (see there: MSA_AB_A_TESTS, MSA_AB_B_TESTS, MSA_AB_A_ARGS, MSA_AB_PROFILE); logs in
# LOGDIR/a and LOGDIR/<patch names>, packed as LOGDIR.tgz.
LOG=${1:?usage: scripts/ab_patch.sh LOGDIR PATCH [bench args...]}
PATCH=${2:?usage: scripts/ab_patch.sh LOGDIR PATCH [bench args...]}
shift 2
exec "$(cd "$(dirname "$0")" && pwd)/ab_variants.sh" "$LOG" "$PATCH" -- "$@"
