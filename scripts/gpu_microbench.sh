#!/usr/bin/env bash
# The C++ microbenchmarks (benchmarks/cpp) on a CUDA machine with no network:
#   scripts/gpu_microbench.sh LOGDIR [common bench args...]
# Configures and builds the msa_benchmarks target with CMake (no setup.py, no torch linked: torch's headers
# only satisfy the top-level configure), with all cores, MSA_CUDA_ARCHS from the environment (default 90a),
# into build/microbench (MSA_MICROBENCH_BUILD overrides); then runs every executable at N = 8192, 32768,
# 131072 (MSA_MICROBENCH_NS="..." overrides) and writes LOGDIR/microbench.csv (one header line,
# `kernel,shape,ms,tflops,gbps`), LOGDIR/microbench.log (the executables' stderr), LOGDIR/build.log,
# LOGDIR/ptxas.txt and LOGDIR/result.md (the stored form, scripts/microbench_md.py). The args go to every
# executable, so only the common options fit there (e.g. --reps 10, --portable, --dtype fp16; see any
# executable's --help). CUTLASS: MSA_CUTLASS_DIR, else the carried .whl/nvidia_cutlass-*.whl installed into
# /tmp/msa-site (as scripts/gpu_check.sh does), else an installed nvidia-cutlass. MSA_MICROBENCH_BUILD_ONLY=1:
# build only (scripts/ab_microbench.sh runs the executables itself).
set -uo pipefail
LOG=${1:?usage: scripts/gpu_microbench.sh LOGDIR [common bench args...]}
shift
mkdir -p "$LOG"
LOG=$(cd "$LOG" && pwd)
PY=${PYTHON:-python3}
ARCHS=${MSA_CUDA_ARCHS:-90a}
BUILD=${MSA_MICROBENCH_BUILD:-build/microbench}
NS=${MSA_MICROBENCH_NS:-"8192 32768 131072"}
JOBS=${MAX_JOBS:-$(nproc)}
summary() { echo "$*" | tee -a "$LOG/summary.txt"; }

if [ -z "${MSA_CUTLASS_DIR:-}" ]; then
  if compgen -G ".whl/nvidia_cutlass-*.whl" > /dev/null; then
    $PY -m pip install -q --no-index --no-deps --no-compile --target /tmp/msa-site .whl/nvidia_cutlass-*.whl || exit 1
  fi
  MSA_CUTLASS_DIR=$(PYTHONPATH=/tmp/msa-site${PYTHONPATH:+:$PYTHONPATH} $PY -c '
import importlib.util, pathlib
spec = importlib.util.find_spec("cutlass_library")
print(pathlib.Path(list(spec.submodule_search_locations)[0]) / "source" / "include" if spec else "")')
fi
if [ ! -f "$MSA_CUTLASS_DIR/cute/tensor.hpp" ] && [ ! -f "$MSA_CUTLASS_DIR/include/cute/tensor.hpp" ]; then
  echo "CUTLASS headers not found (MSA_CUTLASS_DIR='$MSA_CUTLASS_DIR'; carry .whl/nvidia_cutlass-4.2.0.0-*.whl)"
  exit 1
fi
# nvcc as setup.py finds it: the toolkit's own before a wrapper on PATH.
NVCC=${CUDACXX:-}
for c in "${CUDA_HOME:+$CUDA_HOME/bin/nvcc}" /usr/local/cuda/bin/nvcc "$(command -v nvcc)"; do
  [ -z "$NVCC" ] && [ -n "$c" ] && [ -x "$c" ] && NVCC=$c
done
[ -z "$NVCC" ] && { echo "no nvcc found (set CUDACXX or CUDA_HOME)"; exit 1; }
TORCH_PREFIX=$($PY -c 'import torch.utils; print(torch.utils.cmake_prefix_path)') || exit 1
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,temperature.gpu --format=csv > "$LOG/gpu.txt" 2>&1

# A copied tree may carry sources older than a warm machine's objects (ninja would not rebuild them): the
# hash of the sources decides, and a different one starts the build directory afresh.
src_hash=$(find csrc benchmarks/cpp CMakeLists.txt -type f | sort | xargs cat | sha256sum | cut -d' ' -f1)
key="$src_hash $ARCHS $MSA_CUTLASS_DIR $NVCC"
if [ "$(cat "$BUILD/.msa_src_hash" 2>/dev/null)" != "$key" ]; then rm -rf "$BUILD"; fi
t0=$(date +%s)
{
  cmake -S . -B "$BUILD" -G Ninja -DCMAKE_BUILD_TYPE=Release -DMSA_BUILD_BENCHMARKS=ON -DMSA_CUDA_ARCHS="$ARCHS" \
    -DMSA_CUTLASS_DIR="$MSA_CUTLASS_DIR" -DCMAKE_PREFIX_PATH="$TORCH_PREFIX" -DCMAKE_CUDA_COMPILER="$NVCC" \
    -DCUDAToolkit_ROOT="$(dirname "$(dirname "$(readlink -f "$NVCC")")")" -DMSA_PTXAS_VERBOSE=ON &&
  cmake --build "$BUILD" --target msa_benchmarks -j "$JOBS"
} > "$LOG/build.log" 2>&1
rc=$?
[ $rc -eq 0 ] && echo "$key" > "$BUILD/.msa_src_hash"
summary "microbench build: rc=$rc, $(( $(date +%s) - t0 )) s, archs $ARCHS, $JOBS jobs"
if [ $rc -ne 0 ]; then tail -n 40 "$LOG/build.log"; exit $rc; fi
grep -E "spill|registers|Compiling entry" "$LOG/build.log" > "$LOG/ptxas.txt" || true  # build order: scripts/ptxas_table.py reads it
[ "${MSA_MICROBENCH_BUILD_ONLY:-0}" = 1 ] && exit 0

BIN="$BUILD/bin"
CSV="$LOG/microbench.csv"
echo "kernel,shape,ms,tflops,gbps" > "$CSV"
: > "$LOG/microbench.log"
rc_all=0
run() {  # run NAME ARGS...: one executable over every N, its rows appended to the CSV
  local name=$1 t=$(date +%s)
  shift
  local what="$name${*:+ $*}"
  echo "## $what" >> "$LOG/microbench.log"
  "$BIN/$name" --n $NS --no-header "$@" >> "$CSV" 2>> "$LOG/microbench.log"
  local r=$?
  [ $r -ne 0 ] && rc_all=$r
  summary "$what: rc=$r, $(( $(date +%s) - t )) s"
}
t0=$(date +%s)
run msa_bench_index_topk "$@"
run msa_bench_reverse_index "$@"
run msa_bench_sparse_fwd --mode sparse "$@"
run msa_bench_sparse_fwd --mode msa-grad "$@"
run msa_bench_sparse_combine --mode msa-grad "$@"
run msa_bench_sparse_bwd "$@"
run msa_bench_sparse_bwd --sink --only bwd "$@"
run msa_bench_dense_kl "$@"  # sm_90a builds on an sm_90 GPU; elsewhere it prints why and adds no rows
if [ -x "$BIN/msa_atomics_bench" ]; then  # standalone (its own output format): the bench configuration at 32K
  "$BIN/msa_atomics_bench" 32768 > "$LOG/atomics_bench.txt" 2>&1
  summary "msa_atomics_bench 32768: rc=$?"
fi
summary "microbench runs: rc=$rc_all, $(( $(date +%s) - t0 )) s, $(($(wc -l < "$CSV") - 1)) rows in $CSV"
# LOGDIR/result.md: the stored form (benchmarks/results/<date>-<gpu>-<commit>-microbench.md), header and CSV; the
# commit from the carried .msa_commit where MSA_COMMIT is unset (the copied .git is stale), as gpu_check.sh does
[ -z "${MSA_COMMIT:-}" ] && [ -f .msa_commit ] && export MSA_COMMIT=$(cat .msa_commit)
$PY scripts/microbench_md.py "$LOG" "scripts/gpu_microbench.sh LOGDIR${*:+ $*} (N = $NS)" > /dev/null ||
  summary "microbench_md.py failed"
column -s, -t < "$CSV" 2>/dev/null || cat "$CSV"
exit $rc_all
