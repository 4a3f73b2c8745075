#!/usr/bin/env bash
# Where one kernel spends its issue slots: ncu's per-SASS-instruction stall samples and executed
# instruction counts, summarised by scripts/ncu_hotspots.py (top instructions, opcode mix).
#   scripts/ncu_hotspots.sh OUTDIR KERNEL_REGEX [N]   (regex on the mangled name, e.g. 'sparse_fwd_kernel.*Lb1E')
# Everything also comes packed as OUTDIR.tgz: a device call returns only a few files (s30 lost one kernel's source
# counters that way), so fetch the .tgz when several kernels are profiled in one call.
OUT=${1:?usage: scripts/ncu_hotspots.sh OUTDIR KERNEL_REGEX [N]}
K=${2:?kernel regex}
N=${3:-32768}
mkdir -p "$OUT"
ncu --clock-control none --kernel-name-base mangled -k "regex:$K" -c 1 \
    --section SpeedOfLight --section WarpStateStats --section Occupancy --section InstructionStats \
    python3 scripts/profile_msa.py "$N" > "$OUT/details.txt" 2>&1
grep -E "Duration|Throughput|Warp Cycles|Occupancy|Stall|Issued|Executed Ipc" "$OUT/details.txt" | head -40
ncu --clock-control none --kernel-name-base mangled -k "regex:$K" -c 1 --section SourceCounters \
    --page source --print-source sass --csv python3 scripts/profile_msa.py "$N" > "$OUT/source.csv" 2>&1
# Into the file first: a reader that closes stdout early (| head) must not cut the summary short.
python3 "$(dirname "$0")/ncu_hotspots.py" "$OUT/source.csv" > "$OUT/hotspots.txt"
cat "$OUT/hotspots.txt"
gzip -f "$OUT/source.csv"
tar czf "${OUT%/}.tgz" -C "$(dirname "${OUT%/}")" "$(basename "${OUT%/}")"
