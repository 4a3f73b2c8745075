#!/usr/bin/env bash
# A/B of kernel changes in one GPU call: the tree as it is (A) against each variant, one at a time:
#   scripts/ab_variants.sh LOGDIR VARIANT|@FILE [VARIANT|@FILE ...] [-- bench args, e.g. --n 8192 32768]
# A VARIANT is a patch, or several comma-separated ones applied in order (PATCH1,PATCH2), optionally followed by
# :TESTS, that variant's pytest arguments in place of MSA_AB_B_TESTS ("x.patch:tests/test_warmup_gpu.py -m gpu").
# A: build + the tests in MSA_AB_A_TESTS (default tests/test_errors.py) + benchmark (args: MSA_AB_A_ARGS if
# set, e.g. fewer N than the variants' final run, else the bench args). Then per variant: apply, rebuild, the
# tests in MSA_AB_B_TESTS (default tests -m gpu), benchmark, revert. A variant whose patches do not apply is
# reported and skipped. MSA_AB_PROFILE=N adds a per-kernel profile (scripts/profile_msa.py N) of each side
# (profile.txt; MSA_AB_GREP=REGEX prints the matching kernels' times); MSA_AB_EXTRA=CMD runs CMD after it
# (extra.txt). Logs (scripts/gpu_check.sh each) land in LOGDIR/a and LOGDIR/<variant name> and come back
# packed as LOGDIR.tgz (only a few files return from a device call). scripts/ab_patch.sh: one variant.
# MSA_AB_BUDGET_S=S: a variant is skipped (and said so) when the seconds since the start plus the longest side so
# far would pass S, so that a device call's limit never cuts the packing of what did run.
set -uo pipefail
LOG=${1:?usage: scripts/ab_variants.sh LOGDIR VARIANT [VARIANT ...] [-- bench args]}
shift
variants=()
# @FILE: the variants listed in FILE, one per line (blank lines and lines starting with # skipped), so that a queue
# written in one session runs as written in the next.
while [ $# -gt 0 ] && [ "$1" != "--" ]; do
  if [[ "$1" == @* ]]; then
    [ -f "${1#@}" ] || { echo "no variant file ${1#@}"; exit 2; }
    while IFS= read -r line || [ -n "$line" ]; do
      [[ -z "${line// /}" || "$line" == \#* ]] || variants+=("$line")
    done < "${1#@}"
  else
    variants+=("$1")
  fi
  shift
done
[ $# -gt 0 ] && shift  # the --
[ ${#variants[@]} -gt 0 ] || { echo "no patch given"; exit 2; }
here=$(cd "$(dirname "$0")" && pwd)
# shellcheck source=scripts/ab_lib.sh
. "$here/ab_lib.sh"
base=$(cat .msa_commit 2>/dev/null || echo unknown)
profile() {
  # MSA_AB_TIMEOUT=S: each side's profile killed after S seconds (with MSA_PYTEST_TIMEOUT for its tests: a variant
  # whose kernel deadlocks costs those seconds, and the next variant still runs).
  local to=(); [ -n "${MSA_AB_TIMEOUT:-}" ] && to=(timeout -k 10 "$MSA_AB_TIMEOUT")
  [ -n "${MSA_AB_PROFILE:-}" ] && "${to[@]}" ${PYTHON:-python3} "$here/profile_msa.py" $MSA_AB_PROFILE > "$1/profile.txt" 2>&1
  # MSA_AB_GREP=REGEX (kernel names): those rows' GPU time printed as each side's profile ends (the figures reach
  # stdout even when a device call is cut before LOGDIR.tgz is packed).
  [ -n "${MSA_AB_PROFILE:-}" ] && [ -n "${MSA_AB_GREP:-}" ] &&
    awk -v side="$(basename "$1")" -v re="$MSA_AB_GREP" '/^## N/ {n = $4; sub(/:/, "", n)} $0 ~ re && NF > 10 {
      print "  " side " N=" n ": " substr($0, 1, 60) " " $(NF - 2)}' "$1/profile.txt"
  # MSA_AB_EXTRA: one more command per side (e.g. "MSA_HOST_PHASES=1 python3 scripts/host_time.py 8192"), its
  # stdout and stderr in extra.txt; it finds the side's log folder in $MSA_AB_SIDE (e.g. for scripts/ncu_hotspots.sh
  # "$MSA_AB_SIDE/hs" ...: its files come back in LOGDIR.tgz).
  [ -n "${MSA_AB_EXTRA:-}" ] && MSA_AB_SIDE="$1" bash -c "$MSA_AB_EXTRA" > "$1/extra.txt" 2>&1
  return 0
}
summary() { echo "$1: $(tr '\n' ' ' < "$LOG/$1/summary.txt" 2> /dev/null)"; }

if [ -n "${MSA_AB_A_ARGS:-}" ]; then a_args=($MSA_AB_A_ARGS); else a_args=("$@"); fi
start=$(date +%s)
MSA_PYTEST_ARGS="${MSA_AB_A_TESTS:-tests/test_errors.py}" bash "$here/gpu_check.sh" "$LOG/a" "${a_args[@]}" > /dev/null 2>&1
profile "$LOG/a"
summary a
longest=$(( $(date +%s) - start ))  # the longest side so far (s): a variant's estimate
rc=0
for v in "${variants[@]}"; do
  v_tests="${MSA_AB_B_TESTS:-tests -m gpu}"
  if [[ "$v" == *:* ]]; then v_tests="${v#*:}"; v="${v%%:*}"; fi
  name=$(ab_name "$v")
  elapsed=$(( $(date +%s) - start ))
  if [ -n "${MSA_AB_BUDGET_S:-}" ] && [ $(( elapsed + longest )) -gt "$MSA_AB_BUDGET_S" ]; then
    echo "$name: skipped (budget: ${elapsed} s gone, the longest side took ${longest} s, MSA_AB_BUDGET_S=$MSA_AB_BUDGET_S)"
    [ $rc -eq 0 ] && rc=3
    continue
  fi
  t_side=$(date +%s)
  if ab_apply "$v" "$LOG/patch-$name.txt"; then
    MSA_COMMIT="$base-$name" MSA_PYTEST_ARGS="$v_tests" \
      bash "$here/gpu_check.sh" "$LOG/$name" "$@" > /dev/null 2>&1 || rc=1
    profile "$LOG/$name"
    summary "$name"
  else
    rc=2
  fi
  ab_revert
  d=$(( $(date +%s) - t_side )); [ $d -gt $longest ] && longest=$d
done
for d in "$LOG"/*/; do
  side=$(basename "$d")
  [ -f "$d/bench.txt" ] && { echo "$side:"; grep -E "^\| [0-9]" "$d/bench.txt"; }
  rm -f "$d/build.log" "$d/bench_progress.log"
  [ -f "$d/tests.log" ] && gzip -f "$d/tests.log"
done
tar czf "$LOG.tgz" -C "$(dirname "$LOG")" "$(basename "$LOG")" && rm -rf "$LOG"
exit $rc
