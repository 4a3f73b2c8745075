#!/usr/bin/env bash
# A/B of a kernel change in one GPU call: the tree as it is (A) against the tree with PATCH applied (B).
#   scripts/ab_patch.sh LOGDIR PATCH[,PATCH2,...] [bench args, e.g. --n 32768 131072 --reps 5]
# Several comma-separated patches are applied in order (B = all of them; device time is scarce).
# A: build + the tests in MSA_AB_A_TESTS (default tests/test_errors.py) + benchmark. B: patch, rebuild
# (incremental), the tests in MSA_AB_B_TESTS (default: the GPU tests), benchmark; the patch is reverted at the end. MSA_AB_PROFILE=N adds a
# per-kernel profile (scripts/profile_msa.py N) of each side, as LOGDIR/{a,b}/profile.txt. Logs of
# LOGDIR/a and LOGDIR/b (scripts/gpu_check.sh each) come back packed as LOGDIR.tgz.
set -uo pipefail
LOG=${1:?usage: scripts/ab_patch.sh LOGDIR PATCH [bench args...]}
PATCH=${2:?usage: scripts/ab_patch.sh LOGDIR PATCH [bench args...]}
shift 2
here=$(cd "$(dirname "$0")" && pwd)
# MSA_AB_A_ARGS: bench args for A alone (e.g. fewer N than B's final run); default: the same as B's.
if [ -n "${MSA_AB_A_ARGS:-}" ]; then a_args=($MSA_AB_A_ARGS); else a_args=("$@"); fi
MSA_PYTEST_ARGS="${MSA_AB_A_TESTS:-tests/test_errors.py}" bash "$here/gpu_check.sh" "$LOG/a" "${a_args[@]}" > /dev/null 2>&1
profile() { [ -n "${MSA_AB_PROFILE:-}" ] && ${PYTHON:-python3} "$here/profile_msa.py" $MSA_AB_PROFILE > "$1/profile.txt" 2>&1; }
profile "$LOG/a"
echo "A: $(tr '\n' ' ' < "$LOG/a/summary.txt")"
IFS=, read -r -a patches <<< "$PATCH"
applied=()
revert() { for ((i = ${#applied[@]} - 1; i >= 0; i--)); do patch -p1 -R --no-backup-if-mismatch < "${applied[i]}" > /dev/null 2>&1; done; }
tag=""
for pf in "${patches[@]}"; do
  if ! patch -p1 --forward --no-backup-if-mismatch < "$pf" >> "$LOG/patch.txt" 2>&1; then
    echo "patch $pf does not apply"; cat "$LOG/patch.txt"; revert; exit 2
  fi
  applied+=("$pf")
  tag="$tag-$(basename "$pf" .patch)"
done
base=$(cat .msa_commit 2>/dev/null || echo unknown)
MSA_COMMIT="$base$tag" MSA_PYTEST_ARGS="${MSA_AB_B_TESTS:-tests -m gpu}" \
  bash "$here/gpu_check.sh" "$LOG/b" "$@" > /dev/null 2>&1
rc=$?
profile "$LOG/b"
echo "B: $(tr '\n' ' ' < "$LOG/b/summary.txt")"
revert
for side in a b; do echo "$side:"; grep -E "^\| [0-9]" "$LOG/$side/bench.txt"; done
# Only a few files come back from a device call: keep the tables and summaries, pack the rest.
for side in a b; do rm -f "$LOG/$side/build.log" "$LOG/$side/bench_progress.log"; gzip -f "$LOG/$side/tests.log"; done
tar czf "$LOG.tgz" -C "$(dirname "$LOG")" "$(basename "$LOG")" && rm -rf "$LOG"
exit $rc
