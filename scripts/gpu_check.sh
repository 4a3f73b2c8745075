#!/usr/bin/env bash
# How every kernel issue is checked on a CUDA machine with no network:
#   scripts/gpu_check.sh LOGDIR [bench args...]
# Installs carried wheels (.whl/, e.g. nvidia-cutlass), builds the extension with all cores, runs the whole test suite
# (GPU tests included; MSA_PYTEST_ARGS narrows it) and the benchmark (MSA_SKIP_BENCH=1 skips it); logs and the result
# table land in LOGDIR. MSA_SANITIZE=1 adds compute-sanitizer runs (memcheck, racecheck, synccheck) of
# scripts/sanitize_case.py. MSA_DEMO="ARGS" also runs `python -m msa.demo ARGS --out LOGDIR/demo` (the training demo;
# its JSON and plots land there). On a tree copied without .git, run scripts/stamp_commit.sh first (here) and carry
# .msa_commit with the tree so the stored results name the commit.
set -uo pipefail
LOG=${1:?usage: scripts/gpu_check.sh LOGDIR [bench args...]}
shift
mkdir -p "$LOG"
PY=${PYTHON:-python3}
# A copied tree may hold a stale .git: the stamp written here by scripts/stamp_commit.sh names the commit.
[ -z "${MSA_COMMIT:-}" ] && [ -f .msa_commit ] && export MSA_COMMIT=$(cat .msa_commit)
export PYTHONUNBUFFERED=1
if compgen -G ".whl/*.whl" > /dev/null; then
  $PY -m pip install -q --no-index --no-deps --no-compile --target /tmp/msa-site .whl/*.whl || exit 1
  export PYTHONPATH=/tmp/msa-site${PYTHONPATH:+:$PYTHONPATH}
fi
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,temperature.gpu --format=csv > "$LOG/gpu.txt" 2>&1
$PY -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda)" >> "$LOG/gpu.txt"
t0=$(date +%s)
# A warm machine keeps the last build: scripts/sync_build.sh rebuilds everything when the sources differ from it.
bash "$(dirname "$0")/sync_build.sh"
MAX_JOBS=${MAX_JOBS:-$(nproc)} MSA_PTXAS_VERBOSE=1 $PY setup.py build_ext --inplace > "$LOG/build.log" 2>&1
rc=$?
[ $rc -eq 0 ] && bash "$(dirname "$0")/sync_build.sh" done
echo "build: rc=$rc, $(( $(date +%s) - t0 )) s" | tee -a "$LOG/summary.txt"
if [ $rc -ne 0 ]; then tail -n 40 "$LOG/build.log"; exit $rc; fi
# In build order (each entry function, then its stack / spill and register lines), so that
# scripts/ptxas_table.py can read it like build.log (sorted, the lines lost their kernels).
grep -E "spill|registers|Compiling entry" "$LOG/build.log" > "$LOG/ptxas.txt" || true
t0=$(date +%s)
# MSA_PYTEST_ARGS narrows the run (e.g. "tests -m gpu" while iterating on a kernel); default: everything.
# MSA_PYTEST_TIMEOUT=S: the tests killed after S seconds (a kernel that deadlocks then costs S, not the device call).
# MSA_PYTEST_HALF=1|2: only the test files named tests/test_[a-k]* (1) or tests/test_[l-z]* (2), after MSA_PYTEST_ARGS
# (e.g. "-m gpu"): the GPU suite takes ~11 min on an H100 (s65), past one 10-minute device call, and each half fits one.
to=(); [ -n "${MSA_PYTEST_TIMEOUT:-}" ] && to=(timeout -k 10 "$MSA_PYTEST_TIMEOUT")
targs=${MSA_PYTEST_ARGS:-tests}
case "${MSA_PYTEST_HALF:-}" in
  "") ;;
  1) targs="${MSA_PYTEST_ARGS:-} $(ls tests/test_[a-k]*.py | tr '\n' ' ')" ;;
  2) targs="${MSA_PYTEST_ARGS:-} $(ls tests/test_[l-z]*.py | tr '\n' ' ')" ;;
  *) echo "MSA_PYTEST_HALF must be 1 or 2" >&2; exit 2 ;;
esac
# Split as the shell would (quotes kept): a -k expression with spaces stays one argument ("-k 'a or b'"; s68's
# queue line lost its tests to the plain word split).
eval "targv=($targs)"
"${to[@]}" $PY -m pytest "${targv[@]}" -q -rs --durations=10 > "$LOG/tests.log" 2>&1
rc_tests=$?
echo "tests: rc=$rc_tests, $(( $(date +%s) - t0 )) s, $(tail -n 1 "$LOG/tests.log")" | tee -a "$LOG/summary.txt"
rc_bench=0
if [ "${MSA_SKIP_BENCH:-0}" != 1 ]; then  # MSA_SKIP_BENCH=1: tests only (iteration calls)
  $PY -m msa.bench --save "$LOG" "$@" 2> "$LOG/bench_progress.log" | tee "$LOG/bench.txt"
  rc_bench=${PIPESTATUS[0]}
  echo "bench: rc=$rc_bench" | tee -a "$LOG/summary.txt"
fi
rc_demo=0
if [ -n "${MSA_DEMO:-}" ]; then
  t0=$(date +%s)
  $PY -m msa.demo ${MSA_DEMO} --out "$LOG/demo" > "$LOG/demo.log" 2> "$LOG/demo_progress.log"
  rc_demo=$?
  echo "demo: rc=$rc_demo, $(( $(date +%s) - t0 )) s" | tee -a "$LOG/summary.txt"
  tail -n 25 "$LOG/demo.log"
fi
rc_san=0
if [ "${MSA_SANITIZE:-0}" = 1 ]; then
  # racecheck and synccheck look at msa's kernels only: the warmup case's main branch is cuDNN's SDPA, whose sm90
  # fprop kernels racecheck flags (Read at +0x2f0 vs Write, 24-96 hazards each, torch 2.11 / cuDNN of cu130, s21);
  # not ours to fix. MSA_SANITIZE_TOOLS picks the tools (default: the three below; initcheck is another),
  # MSA_SANITIZE_ARGS the case's arguments (e.g. "--configs 0,4": a part of its configurations),
  # MSA_SANITIZE_TIMEOUT=S kills a tool's run after S seconds (rc 124: a hang is a race, s61; racecheck takes ~7 min).
  sto=(); [ -n "${MSA_SANITIZE_TIMEOUT:-}" ] && sto=(timeout -k 10 "$MSA_SANITIZE_TIMEOUT")
  for tool in ${MSA_SANITIZE_TOOLS:-memcheck racecheck synccheck}; do
    t0=$(date +%s)
    filt=(); [ $tool != memcheck ] && filt=(--kernel-name-exclude kns=cudnn)
    "${sto[@]}" compute-sanitizer --tool $tool "${filt[@]}" --error-exitcode 3 $PY scripts/sanitize_case.py \
      ${MSA_SANITIZE_ARGS:-} > "$LOG/sanitize_$tool.log" 2>&1
    rc=$?
    [ $rc -ne 0 ] && rc_san=$rc
    echo "sanitizer $tool: rc=$rc, $(( $(date +%s) - t0 )) s, $(tail -n 1 "$LOG/sanitize_$tool.log")" \
      | tee -a "$LOG/summary.txt"
  done
fi
cat "$LOG/summary.txt"
[ $rc_tests -eq 0 ] && [ $rc_bench -eq 0 ] && [ $rc_demo -eq 0 ] && [ $rc_san -eq 0 ]
