"""How much of the bench's msa fwd+bwd time is host time the GPU waits for: python scripts/host_lead.py [N ...].
Times one msa_attention forward + backward (bench configuration) as msa.bench does (CUDA events around
the call, synchronised per repetition), then again with the GPU kept busy by a sleep kernel queued before
the start event, so the host's work before the first launch overlaps the sleep. The difference is the
host lead the bench counts; the CPU time of the call (to its return) is printed too. MSA_PROFILE_WARMUP=1 times
warmup=True instead (dense main branch, KL over the full causal set); MSA_PROFILE_DENSE=1 times the bench's dense cuDNN
fwd+bwd (the reference the bench divides by: whether it shows the same gap)."""
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the in-place build
from msa import bench  # noqa: E402


STEP = bench.msa_fwd_bwd_warmup if os.environ.get("MSA_PROFILE_WARMUP") == "1" else bench.msa_fwd_bwd
if os.environ.get("MSA_PROFILE_DENSE") == "1":
    STEP = bench.dense_fwd_bwd
LABELS = {bench.msa_fwd_bwd_warmup: " (warmup)", bench.dense_fwd_bwd: " (dense cuDNN)"}


def timed(x, sleep_cycles, reps=9):
    times, cpu = [], []
    for _ in range(reps):
        torch.cuda.synchronize()
        if sleep_cycles:
            torch.cuda._sleep(sleep_cycles)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        t0 = time.perf_counter()
        STEP(*x)
        cpu.append((time.perf_counter() - t0) * 1e3)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times), statistics.median(cpu)


def main():
    for n in [int(a) for a in sys.argv[1:]] or [32768]:
        x = bench.make_inputs(n, torch.device("cuda"), torch.bfloat16, seed=0)
        for _ in range(2):
            STEP(*x)
        plain, cpu = timed(x, 0)
        busy, _ = timed(x, 200_000_000)  # ~0.1 s at 1.98 GHz: the whole call is queued behind it
        print(f"N = {n}{LABELS.get(STEP, '')}: bench-style {plain:.3f} ms, GPU kept busy {busy:.3f} ms, host lead {plain - busy:.3f} ms; "
              f"CPU time of the call {cpu:.3f} ms")


if __name__ == "__main__":
    main()
