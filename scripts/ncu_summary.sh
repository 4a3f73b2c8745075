#!/usr/bin/env bash
# ncu summary of one launch of each named kernel in an msa fwd+bwd at N: speed of light, warp stalls,
# occupancy, memory (L2 / shared memory) and pipe utilisation (tensor, MUFU, FMA, LSU), the lines that say
# what bounds the kernel:
#   scripts/ncu_summary.sh OUTDIR N KERNEL_REGEX [KERNEL_REGEX ...]
# MSA_PROFILE_WARMUP=1: the warmup step; MSA_NCU_COUNT: launches per kernel (default 1).
OUT=${1:?usage: scripts/ncu_summary.sh OUTDIR N KERNEL_REGEX [...]}
N=${2:?N}
shift 2
mkdir -p "$OUT"
metrics=sm__pipe_tensor_op_gmma_cycles_active.avg.pct_of_peak_sustained_active
metrics+=,sm__inst_executed_pipe_xu.avg.pct_of_peak_sustained_active
metrics+=,sm__pipe_fma_cycles_active.avg.pct_of_peak_sustained_active
metrics+=,sm__inst_executed_pipe_lsu.avg.pct_of_peak_sustained_active
metrics+=,l1tex__data_pipe_lsu_wavefronts_mem_shared.avg.pct_of_peak_sustained_elapsed
metrics+=,l1tex__data_bank_conflicts_pipe_lsu_mem_shared.sum
metrics+=,lts__t_sectors_srcunit_tex_op_red.sum,lts__t_sectors_srcunit_tex_op_read.sum
metrics+=,lts__throughput.avg.pct_of_peak_sustained_elapsed
for k in "$@"; do
  name=$(echo "$k" | tr -c 'A-Za-z0-9_\n' '_')
  ncu --clock-control none -k "regex:$k" -c "${MSA_NCU_COUNT:-1}" --section SpeedOfLight --section WarpStateStats --section Occupancy \
      --section MemoryWorkloadAnalysis --section ComputeWorkloadAnalysis --metrics "$metrics" \
      python3 "$(dirname "$0")/profile_msa.py" "$N" > "$OUT/ncu_$name.txt" 2>&1
  echo "== $k"
  grep -E "Duration|Throughput|Stall|Warp Cycles|Achieved Occupancy|L2 Hit|Mem Busy|Max Bandwidth|Issued|pipe|lts__|l1tex__|Pipe" \
      "$OUT/ncu_$name.txt" | head -60
done
