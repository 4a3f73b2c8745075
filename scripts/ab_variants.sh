#!/usr/bin/env bash
# Several patches A/B'd in one GPU call, each against the same A (the tree as it is), one at a time:
#   scripts/ab_variants.sh LOGDIR PATCH [PATCH ...] [-- bench args, e.g. --n 8192 32768]
# A: build + the tests in MSA_AB_A_TESTS (default tests/test_errors.py) + benchmark. Then per patch: apply,
# rebuild (incremental), the tests in MSA_AB_B_TESTS (default tests -m gpu), benchmark, revert. A patch that
# does not apply is reported and skipped. Logs land in LOGDIR/a, LOGDIR/<patch name>, packed as LOGDIR.tgz
# (only a few files come back from a device call). scripts/ab_patch.sh is the one-patch form.
set -uo pipefail
LOG=${1:?usage: scripts/ab_variants.sh LOGDIR PATCH [PATCH ...] [-- bench args]}
shift
patches=()
while [ $# -gt 0 ] && [ "$1" != "--" ]; do patches+=("$1"); shift; done
[ $# -gt 0 ] && shift  # the --
[ ${#patches[@]} -gt 0 ] || { echo "no patch given"; exit 2; }
here=$(cd "$(dirname "$0")" && pwd)
base=$(cat .msa_commit 2>/dev/null || echo unknown)
MSA_PYTEST_ARGS="${MSA_AB_A_TESTS:-tests/test_errors.py}" bash "$here/gpu_check.sh" "$LOG/a" "$@" > /dev/null 2>&1
echo "a: $(tr '\n' ' ' < "$LOG/a/summary.txt")"
rc=0
for pf in "${patches[@]}"; do
  name=$(basename "$pf" .patch)
  if ! patch -p1 --dry-run --forward < "$pf" > "$LOG/patch-$name.txt" 2>&1; then
    echo "$name: does not apply"; cat "$LOG/patch-$name.txt"
    rc=2
    continue
  fi
  patch -p1 --forward --no-backup-if-mismatch < "$pf" > /dev/null 2>&1
  MSA_COMMIT="$base-$name" MSA_PYTEST_ARGS="${MSA_AB_B_TESTS:-tests -m gpu}" \
    bash "$here/gpu_check.sh" "$LOG/$name" "$@" > /dev/null 2>&1 || rc=1
  echo "$name: $(tr '\n' ' ' < "$LOG/$name/summary.txt" 2> /dev/null)"
  patch -p1 -R --no-backup-if-mismatch < "$pf" > /dev/null 2>&1
done
for d in "$LOG"/*/; do
  side=$(basename "$d")
  [ -f "$d/bench.txt" ] && { echo "$side:"; grep -E "^\| [0-9]" "$d/bench.txt"; }
  rm -f "$d/build.log" "$d/bench_progress.log"
  [ -f "$d/tests.log" ] && gzip -f "$d/tests.log"
done
tar czf "$LOG.tgz" -C "$(dirname "$LOG")" "$(basename "$LOG")" && rm -rf "$LOG"
exit $rc
