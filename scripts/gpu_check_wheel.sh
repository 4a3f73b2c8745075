#!/usr/bin/env bash
# A built wheel, checked on a CUDA machine with no network (issue 16): installs WHEEL into a private
# site folder (no dependencies: the machine's torch is used), then runs from that install, not from the
# source tree: `python -m msa.info`, the GPU tests (MSA_PYTEST_ARGS, default "tests -m gpu", on a copy
# of tests/ outside the repository so `import msa` finds the wheel) and the bench (MSA_SKIP_BENCH=1
# skips it; MSA_BENCH_ARGS adds arguments). MSA_SMALL_SMEM_BENCH="ARGS" also runs the bench with the
# portable kernels in both shared-memory configurations (default and MSA_SMALL_SMEM=1).
#   scripts/gpu_check_wheel.sh WHEEL LOGDIR
set -uo pipefail
WHEEL=${1:?usage: scripts/gpu_check_wheel.sh WHEEL LOGDIR}
LOG=${2:?usage: scripts/gpu_check_wheel.sh WHEEL LOGDIR}
mkdir -p "$LOG"
LOG=$(cd "$LOG" && pwd)
PY=${PYTHON:-python3}
ROOT=$(cd "$(dirname "$0")/.." && pwd)
SITE=$(mktemp -d /tmp/msa-wheel-site.XXXX)
RUN=$(mktemp -d /tmp/msa-wheel-run.XXXX)
export PYTHONUNBUFFERED=1
[ -z "${MSA_COMMIT:-}" ] && [ -f "$ROOT/.msa_commit" ] && export MSA_COMMIT=$(cat "$ROOT/.msa_commit")
$PY -m pip install -q --no-index --no-deps --no-compile --target "$SITE" "$WHEEL" > "$LOG/install.log" 2>&1
rc=$?
echo "install $(basename "$WHEEL"): rc=$rc" | tee -a "$LOG/summary.txt"
[ $rc -ne 0 ] && { tail -n 20 "$LOG/install.log"; exit $rc; }
export PYTHONPATH=$SITE${PYTHONPATH:+:$PYTHONPATH}
cp -r "$ROOT/tests" "$RUN/tests"
cd "$RUN"
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,temperature.gpu --format=csv > "$LOG/gpu.txt" 2>&1
$PY -m msa.info > "$LOG/info.txt" 2>&1
echo "msa.info: rc=$?, msa from $($PY -c 'import msa; print(msa.__file__)')" | tee -a "$LOG/summary.txt"
t0=$(date +%s)
# MSA_TEST_TIMEOUT (s) stops the tests (SIGINT: pytest still prints its summary) to leave time for the bench.
timeout -s INT "${MSA_TEST_TIMEOUT:-0}" $PY -m pytest ${MSA_PYTEST_ARGS:-tests -m gpu} -q -rs --durations=10 \
  -p no:cacheprovider > "$LOG/tests.log" 2>&1
echo "tests: rc=$?, $(( $(date +%s) - t0 )) s, $(tail -n 1 "$LOG/tests.log")" | tee -a "$LOG/summary.txt"
if [ "${MSA_SKIP_BENCH:-0}" != 1 ]; then
  $PY -m msa.bench --save "$LOG" ${MSA_BENCH_ARGS:-} 2> "$LOG/bench_progress.log" | tee "$LOG/bench.txt"
  echo "bench: rc=${PIPESTATUS[0]}" | tee -a "$LOG/summary.txt"
fi
if [ -n "${MSA_SMALL_SMEM_BENCH:-}" ]; then
  for small in 0 1; do
    MSA_PORTABLE_KERNELS=1 MSA_SMALL_SMEM=$small $PY -m msa.bench ${MSA_SMALL_SMEM_BENCH} \
      > "$LOG/bench_portable_small$small.txt" 2> "$LOG/bench_portable_small${small}_progress.log"
    echo "bench portable, MSA_SMALL_SMEM=$small: rc=$?" | tee -a "$LOG/summary.txt"
    cat "$LOG/bench_portable_small$small.txt"
  done
fi
