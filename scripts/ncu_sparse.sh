#!/usr/bin/env bash
# ncu summary (speed of light, warp stalls) of one launch of each sparse kernel at N (default 32768):
#   scripts/ncu_sparse.sh OUTDIR [N]
OUT=${1:?usage: scripts/ncu_sparse.sh OUTDIR [N]}
N=${2:-32768}
mkdir -p "$OUT"
for k in "sparse_fwd_kernel" "sparse_bwd_kernel"; do
  ncu --clock-control none -k "regex:$k" -c 2 --section SpeedOfLight --section WarpStateStats --section Occupancy \
      --section MemoryWorkloadAnalysis python3 scripts/profile_msa.py "$N" > "$OUT/ncu_$k.txt" 2>&1
  grep -E "sparse_|Duration|Throughput|Stall|Warp Cycles|Achieved Occupancy|Theoretical Occupancy|Block Limit|L2 Hit|Mem Busy|Issued" \
      "$OUT/ncu_$k.txt" | head -80
done
