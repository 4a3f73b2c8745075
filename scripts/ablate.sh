#!/usr/bin/env bash
# Timing-only ablations in one GPU call: what a piece of a kernel costs, measured by removing it.
#   scripts/ablate.sh OUTDIR 'NAME|FILE|SED' ['NAME|FILE|SED' ...]
# Builds the tree as it is (e0) and, per argument, the tree with `sed -i SED FILE` applied (the other
# edits undone), and runs scripts/profile_msa.py for each (N from ABLATE_N, default "32768 131072").
# The edited builds compute wrong results on purpose: never test or store them as anything but
# timings. ABLATE_GREP: the kernels to show (a grep -E alternation; default the sparse ones); the
# environment reaches scripts/profile_msa.py (MSA_PROFILE_WARMUP=1 profiles the warmup step); ABLATE_CMD runs
# one more command per build (below); ABLATE_ONLY (a regex of names, e.g. 'no_dq_reds|no_grad') runs only those
# variants after e0. Example (the general backward's non-deterministic dq atomics, portable and Hopper):
#   scripts/ablate.sh $OUT/abl 'no_dq_atomics|csrc/smxx/sparse_bwd/sparse_bwd_body.cuh|s/^            else atomic_add4(p.dq_accum + o + n \* 8, x);/            else if (false) atomic_add4(p.dq_accum + o + n * 8, x);/'
set -uo pipefail
OUT=${1:?usage: scripts/ablate.sh OUTDIR 'NAME|FILE|SED' ...}
shift
mkdir -p "$OUT"
if compgen -G ".whl/*.whl" > /dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/msa-site .whl/*.whl 2> /dev/null
  export PYTHONPATH=/tmp/msa-site${PYTHONPATH:+:$PYTHONPATH}
fi
run() {
  # e0: the sources against a warm machine's last build (s28: a stale mix of a patched build's objects broke e0).
  # A variant's sed (and the restore after it) gives its file a new mtime, so ninja rebuilds only what it touches.
  [ "$1" = e0 ] && bash "$(dirname "$0")/sync_build.sh"
  MAX_JOBS=${MAX_JOBS:-$(nproc)} MSA_CUDA_ARCHS=${MSA_CUDA_ARCHS:-90a} python3 setup.py build_ext --inplace \
    > "$OUT/build_$1.log" 2>&1 || { echo "build $1 failed"; tail -n 5 "$OUT/build_$1.log"; return 1; }
  [ "$1" = e0 ] && bash "$(dirname "$0")/sync_build.sh" done
  python3 scripts/profile_msa.py ${ABLATE_N:-32768 131072} > "$OUT/prof_$1.txt" 2>&1
  echo "== $1"
  grep -E "^## N|${ABLATE_GREP:-sparse_fwd_kernel|sparse_bwd_kernel|index_topk}|Self CUDA time total" "$OUT/prof_$1.txt" \
    | cut -c1-60,150-180
  rm -f "$OUT/build_$1.log"
  # ABLATE_CMD: one more command per build, given the variant's log folder (e.g. an ncu source-counter run:
  # ABLATE_CMD='scripts/ncu_hotspots.sh' with its kernel regex and N in ABLATE_CMD_ARGS).
  if [ -n "${ABLATE_CMD:-}" ]; then $ABLATE_CMD "$OUT/cmd_$1" ${ABLATE_CMD_ARGS:-} > "$OUT/cmd_$1.txt" 2>&1; fi
}
run e0
for spec in "$@"; do
  IFS='|' read -r name file expr <<< "$spec"
  [[ -n "${ABLATE_ONLY:-}" && ! "$name" =~ ^(${ABLATE_ONLY})$ ]] && continue  # ABLATE_ONLY: names to run (regex)
  cp "$file" "$OUT/.orig"
  sed -i "$expr" "$file"
  if cmp -s "$file" "$OUT/.orig"; then echo "== $name: the sed changed nothing in $file"; continue; fi
  run "$name"
  cp "$OUT/.orig" "$file"
done
rm -f "$OUT/.orig"
