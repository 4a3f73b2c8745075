#!/usr/bin/env bash
# Does a kernel slow down under sustained load (power or thermal clock drop)? Runs one command (typically a C++
# microbenchmark executable built by scripts/gpu_microbench.sh into build/microbench) while nvidia-smi samples the SM
# clock, power, temperature and the active clock-event reasons every 100 ms; prints the command's output (its CSV
# rows) and the samples' summary (scripts/clock_probe_summary.py) per run. Give each run about the same seconds of load (e.g. 32K with
# --reps 400 against 128K with --reps 20 for the dense KL) so that a drop at one N alone is not the heat of the other.
#   scripts/clock_probe.sh LOGDIR NAME EXECUTABLE [ARGS...]   (several probes: call it once per run, distinct NAMEs)
# e.g. scripts/clock_probe.sh OUT/clk kl32 msa_bench_dense_kl --n 32768 --reps 400 --no-header
# EXECUTABLE is looked up in build/microbench/bin first, else run as given (e.g. python3 some_script.py).
set -uo pipefail
LOG=${1:?usage: scripts/clock_probe.sh LOGDIR NAME EXECUTABLE [ARGS...]}
NAME=${2:?run name}
EXE=${3:?executable (build/microbench/bin or any command)}
shift 3
mkdir -p "$LOG"
BIN=${MSA_MICROBENCH_BUILD:-build/microbench}/bin
# clocks_event_reasons (drivers >= 535) was clocks_throttle_reasons before.
reasons=clocks_event_reasons.active
nvidia-smi --query-gpu=$reasons --format=csv > /dev/null 2>&1 || reasons=clocks_throttle_reasons.active
nvidia-smi --query-gpu=timestamp,clocks.sm,power.draw,temperature.gpu,$reasons --format=csv,noheader,nounits -lms 100 > "$LOG/$NAME.smi.csv" 2>&1 &
smi=$!
sleep 0.5
[ -x "$BIN/$EXE" ] && EXE="$BIN/$EXE"
"$EXE" "$@" > "$LOG/$NAME.csv" 2> "$LOG/$NAME.log"
rc=$?
sleep 0.3
kill $smi 2> /dev/null
wait $smi 2> /dev/null
echo "## $NAME: $EXE $* (rc=$rc)"
cat "$LOG/$NAME.csv"
python3 "$(dirname "$0")/clock_probe_summary.py" "$LOG/$NAME.smi.csv"
exit $rc
