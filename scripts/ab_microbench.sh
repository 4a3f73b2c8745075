#!/usr/bin/env bash
# Interleaved A/B of one kernel through its C++ microbenchmark (benchmarks/cpp), for differences below the ~4%
# that whole-kernel figures drift between device calls (scripts/ab_variants.sh profiles each side once):
#   scripts/ab_microbench.sh LOGDIR EXE "EXE ARGS" VARIANT [VARIANT ...]
#   e.g. scripts/ab_microbench.sh $OUT/abm msa_bench_dense_kl "--n 8192 32768 --only kl" x.patch y1.patch,y2.patch
# Several executables from the same builds: EXE comma-separated and ARGS one '|'-separated field each, or one field
#   for all (e.g. msa_bench_dense_kl,msa_bench_index_topk "--n 32768 --only kl|--n 32768"); each round runs them all.
# Builds the microbenchmarks (scripts/gpu_microbench.sh with MSA_MICROBENCH_BUILD_ONLY=1, one build directory per
# side under build/ab-micro) for the tree as it is (side a) and for each VARIANT (a patch, or comma-separated
# patches applied in order, reverted after its build), keeps each side's EXE, then runs the sides in turn for
# MSA_AB_ROUNDS rounds (default 5; the order rotates every round, so no side always runs first). Writes
# LOGDIR/rounds.csv (round,side,kernel,shape,ms,tflops,gbps: each round's ms is the executable's own median of
# --reps calls) and LOGDIR/ab.txt (per kernel row and shape: each side's median over the rounds, its change
# against a, the rounds' min-max), prints ab.txt, and packs LOGDIR as LOGDIR.tgz. Tests are not run here:
# scripts/ab_variants.sh runs them with a variant.
set -uo pipefail
LOG=${1:?usage: scripts/ab_microbench.sh LOGDIR EXE "EXE ARGS" VARIANT [VARIANT ...]}
EXE=${2:?usage: scripts/ab_microbench.sh LOGDIR EXE "EXE ARGS" VARIANT [VARIANT ...]}
ARGS=${3-}
shift 3 || exit 2
[ $# -gt 0 ] || { echo "no variant given"; exit 2; }
here=$(cd "$(dirname "$0")" && pwd)
# shellcheck source=scripts/ab_lib.sh
. "$here/ab_lib.sh"
mkdir -p "$LOG/bin"
LOG=$(cd "$LOG" && pwd)
ROUNDS=${MSA_AB_ROUNDS:-5}
IFS=, read -r -a exes <<< "$EXE"
IFS='|' read -r -a exe_args <<< "$ARGS"
[ ${#exe_args[@]} -le 1 ] || [ ${#exe_args[@]} -eq ${#exes[@]} ] || { echo "ARGS: one '|' field per executable"; exit 2; }
sides=()
build_side() {  # build_side NAME: the tree as it is now; its executables kept in LOG/bin/NAME/
  local name=$1
  MSA_MICROBENCH_BUILD="build/ab-micro/$name" MSA_MICROBENCH_BUILD_ONLY=1 \
    bash "$here/gpu_microbench.sh" "$LOG/$name" > "$LOG/$name.out" 2>&1
  local rc=$?
  echo "$name: $(tr '\n' ' ' < "$LOG/$name/summary.txt" 2> /dev/null)"
  [ $rc -ne 0 ] && { tail -n 20 "$LOG/$name/build.log"; return 1; }
  rm -f "$LOG/$name/build.log"
  mkdir -p "$LOG/bin/$name"
  local e
  for e in "${exes[@]}"; do cp "build/ab-micro/$name/bin/$e" "$LOG/bin/$name/" || return 1; done
  sides+=("$name")
}
build_side a
for v in "$@"; do
  name=$(ab_name "$v")
  ab_apply "$v" "$LOG/patch-$name.txt" && build_side "$name"
  ab_revert
done

echo "round,side,kernel,shape,ms,tflops,gbps" > "$LOG/rounds.csv"
n=${#sides[@]}
rc=0
for ((r = 0; r < ROUNDS; r++)); do
  for ((j = 0; j < n; j++)); do
    s=${sides[(r + j) % n]}
    for ((x = 0; x < ${#exes[@]}; x++)); do
      a=${exe_args[x]-${exe_args[0]-}}
      # shellcheck disable=SC2086  # the executable's options, split as given
      "$LOG/bin/$s/${exes[x]}" $a --no-header 2>> "$LOG/run.log" | sed "s/^/$r,$s,/" >> "$LOG/rounds.csv" || rc=1  # pipefail: the exe's status
    done
  done
done
${PYTHON:-python3} - "$LOG/rounds.csv" "${sides[@]}" > "$LOG/ab.txt" <<'PY'
import csv, statistics, sys
path, sides = sys.argv[1], sys.argv[2:]
rows = {}
for r in csv.DictReader(open(path)):
    rows.setdefault((r["kernel"], r["shape"]), {}).setdefault(r["side"], []).append(float(r["ms"]))
for (kernel, shape), by_side in rows.items():
    print(f"{kernel} {shape}")
    base = statistics.median(by_side["a"]) if "a" in by_side else None
    for s in sides:
        ms = by_side.get(s)
        if not ms:
            continue
        med = statistics.median(ms)
        change = f"{100 * (med / base - 1):+.1f}%" if base else ""
        print(f"  {s:40s} {med:9.4f} ms {change:>7s}  (rounds {min(ms):.4f}-{max(ms):.4f}, n={len(ms)})")
PY
cat "$LOG/ab.txt"
tar czf "$LOG.tgz" --exclude=bin -C "$(dirname "$LOG")" "$(basename "$LOG")" && rm -rf "$LOG"  # not the executables
exit $rc
