#!/usr/bin/env bash
# s48 call 4: land c1deefc (backward tests + bench at 8K / 32K / 128K + profile), then the stats pass's SS Q K^T
# (patches/stats_ss_q.patch) built on top: its forward tests and profile. Run from the repo root: OUT=dir bash call4.sh
L=benchmarks/results/logs/20261205-issue17-s48
MSA_PYTEST_TIMEOUT=240 MSA_PYTEST_ARGS="tests/test_bwd_ws_gpu.py tests/test_sparse_bwd_gpu.py tests/test_deterministic_gpu.py tests/test_long_seq_gpu.py tests/test_errors.py -m gpu" \
  bash scripts/gpu_check.sh $OUT/g --n 8192 32768 131072 > $OUT/check.log 2>&1
cp $OUT/g/*.md $OUT/ 2>/dev/null
python3 scripts/profile_msa.py 8192 32768 > $OUT/g/profile.txt 2>&1
grep -E "GPU time|sparse_bwd_ws|sparse_fwd_kernel" $OUT/g/profile.txt | cut -c1-60,170-
patch -p1 -s < $L/patches/stats_ss_q.patch
MSA_SKIP_BENCH=1 MSA_PYTEST_TIMEOUT=150 MSA_PYTEST_ARGS="tests/test_sparse_fwd_gpu.py tests/test_fwd_fixed_gu_gpu.py tests/test_long_seq_gpu.py -m gpu" \
  bash scripts/gpu_check.sh $OUT/s > /dev/null 2>&1
python3 scripts/profile_msa.py 8192 32768 > $OUT/s/profile.txt 2>&1
grep -E "GPU time|sparse_fwd_kernel" $OUT/s/profile.txt | cut -c1-60,170-
cat $OUT/s/summary.txt
patch -p1 -R -s < $L/patches/stats_ss_q.patch
for d in g s; do gzip -f $OUT/$d/tests.log $OUT/$d/build.log 2>/dev/null; done
tar czf $OUT/logs.tgz -C $OUT g s check.log; rm -rf $OUT/g $OUT/s
cat $OUT/check.log | tail -4
