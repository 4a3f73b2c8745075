"""Per-kernel CUDA times of one msa_attention forward + backward (bench configuration), from
torch.profiler: python scripts/profile_msa.py [N ...]. Prints one table per N, kernels by total time.
MSA_PROFILE_DETERMINISTIC=1 profiles deterministic=True instead, MSA_PROFILE_WARMUP=1 warmup=True,
MSA_PROFILE_WARMUP=both the default step and then warmup=True (one A/B call that changes both paths).
MSA_PROFILE_DENSE=1 adds, per N, msa.bench's dense SDPA step (the ratios' denominator): which backend's kernels it
launches and their GPU time.
MSA_PROFILE_FP8=1 profiles the FP8 selection (index_dtype=torch.float8_e4m3fn: the copies and the FP8 top-k), so that
the ncu scripts reach the FP8 top-k: scripts/ncu_hotspots.sh by its mangled name ('index_topk_sm90.*Lb1EEEv', kFp8
the last template argument), scripts/ncu_summary.sh as 'index_topk_sm90' (the step's only top-k then).
MSA_PROFILE_ROWS=K prints K kernel rows (default 18); every table ends with the step's kernel launches and
GPU time, and the host time to enqueue one step (the GPU idle beforehand, no sync inside).
MSA_PROFILE_HOST=1 adds a table of the host side (CPU activity: ops and CUDA API calls by self CPU time)."""
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the in-place build
from msa import bench  # noqa: E402


def main():
    ns = [int(a) for a in sys.argv[1:]] or [32768]
    det = os.environ.get("MSA_PROFILE_DETERMINISTIC") == "1"
    fp8 = os.environ.get("MSA_PROFILE_FP8") == "1"
    warm_env = os.environ.get("MSA_PROFILE_WARMUP", "0")
    if fp8 and (det or warm_env != "0"):
        sys.exit("MSA_PROFILE_FP8=1 profiles the default step: not with MSA_PROFILE_DETERMINISTIC or MSA_PROFILE_WARMUP")
    for warm in {"1": [True], "both": [False, True]}.get(warm_env, [False]):
        for n in ns:
            profile_one(n, det, warm, fp8)
    if os.environ.get("MSA_PROFILE_DENSE") == "1":
        for n in ns:
            profile_one(n, False, False, dense=True)


def profile_one(n, det, warm, fp8=False, dense=False):
    if dense:
        step = bench.dense_fwd_bwd
    elif warm:
        step = bench.msa_fwd_bwd_warmup
    elif fp8:
        step = bench.msa_fwd_bwd_fp8
    else:
        step = lambda *x: bench.msa_fwd_bwd(*x, deterministic=det)  # noqa: E731
    x = bench.make_inputs(n, torch.device("cuda"), torch.bfloat16, seed=0)
    for _ in range(2):
        step(*x)
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        step(*x)
        torch.cuda.synchronize()
    what = "dense SDPA fwd+bwd (msa.bench's)" if dense else "msa fwd+bwd"
    print(f"## N = {n}: {what}{', deterministic' if det else ''}{', warmup' if warm else ''}"
          f"{', fp8 index' if fp8 else ''}, one call")
    rows = int(os.environ.get("MSA_PROFILE_ROWS", "18"))
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=rows, max_name_column_width=70))
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    gpu_us = sum(e.device_time for e in kernels)
    enqueue = []
    for _ in range(5):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        step(*x)
        enqueue.append((time.perf_counter() - t0) * 1e3)
        torch.cuda.synchronize()
    if os.environ.get("MSA_PROFILE_HOST") == "1":
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as host:
            step(*x)
            torch.cuda.synchronize()
        print(host.key_averages().table(sort_by="self_cpu_time_total", row_limit=rows, max_name_column_width=70))
    print(f"kernels and memsets: {len(kernels)}, GPU time {gpu_us / 1e3:.3f} ms; host enqueue of one step "
          f"(median of 5): {sorted(enqueue)[2]:.3f} ms")


if __name__ == "__main__":
    main()
