"""Where the GPU sits idle during one msa_attention forward + backward (bench configuration):
python scripts/trace_gaps.py [N ...]. From a torch.profiler trace (CPU and CUDA activity): the wall
time of the call, the summed kernel time, and the largest gaps between consecutive kernels with the
CPU-side ops that ran during each gap (what the GPU was waiting for). MSA_PROFILE_WARMUP=1: warmup=True.
MSA_TRACE_TIMELINE=1 also prints every GPU activity in order (start after the first, duration, idle before it)."""
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the in-place build
from msa import bench  # noqa: E402

LABEL = "msa_fwd_bwd"  # the record_function around the step


def main():
    ns = [int(a) for a in sys.argv[1:]] or [32768]
    acts = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    step = bench.msa_fwd_bwd_warmup if os.environ.get("MSA_PROFILE_WARMUP") == "1" else bench.msa_fwd_bwd
    for n in ns:
        x = bench.make_inputs(n, torch.device("cuda"), torch.bfloat16, seed=0)
        for _ in range(2):
            step(*x)
        torch.cuda.synchronize()
        with torch.profiler.profile(activities=acts) as prof:
            with torch.profiler.record_function(LABEL):
                step(*x)
            torch.cuda.synchronize()
        events = prof.events()
        # The label's range is recorded on the GPU's timeline too (a user annotation spanning the step): not an
        # activity, and counting it hid every gap it covered.
        gpu = sorted((e.time_range.start, e.time_range.end, e.name) for e in events
                     if e.device_type == torch.autograd.DeviceType.CUDA and e.name != LABEL)
        cpu = [(e.time_range.start, e.time_range.end, e.name) for e in events
               if e.device_type == torch.autograd.DeviceType.CPU]
        busy = sum(b - a for a, b, _ in gpu)
        gaps = []
        end = gpu[0][1]
        for a, b, name in gpu[1:]:
            if a > end:
                gaps.append((a - end, end, a, name))
            end = max(end, b)
        span = end - gpu[0][0]
        print(f"## N = {n}: {len(gpu)} GPU activities over {span / 1e3:.2f} ms, busy {busy / 1e3:.2f} ms, "
              f"idle {sum(g[0] for g in gaps) / 1e3:.2f} ms in {len(gaps)} gaps")
        # Host lead: from the call's start on the CPU to its first GPU activity (the bench's CUDA-event
        # timer counts it: its start event is recorded before the call).
        call = [e for e in events if e.name == LABEL and e.device_type == torch.autograd.DeviceType.CPU]
        if call:
            c0 = call[0].time_range.start
            first_launch = min((s for s, _, nm in cpu if nm.startswith("cuda") and "Launch" in nm and s >= c0),
                               default=None)
            print(f"host lead: {(gpu[0][0] - c0) / 1e3:.3f} ms from the call to the first GPU activity"
                  + (f" (first launch call after {(first_launch - c0) / 1e3:.3f} ms)" if first_launch else "")
                  + f"; CPU time of the call {(call[0].time_range.end - c0) / 1e3:.3f} ms")
            ops = sorted(((e - s, s - c0, nm) for s, e, nm in cpu if c0 <= s < gpu[0][0]), reverse=True)
            print("  longest CPU events (incl. CUDA runtime calls) before the first GPU activity: " +
                  ", ".join(f"{nm} {d / 1e3:.3f} ms @{t / 1e3:.3f}" for d, t, nm in ops[:15]))
        if os.environ.get("MSA_TRACE_TIMELINE") == "1":
            prev_end = gpu[0][0]
            for a, b, name in gpu:
                print(f"  @{(a - gpu[0][0]):9.1f} us {b - a:8.1f} us (idle {max(0, a - prev_end):6.1f}) {name[:90]}")
                prev_end = max(prev_end, b)
        for d, a, b, nxt in sorted(gaps, reverse=True)[:20]:
            during = sorted({nm for s, e, nm in cpu if s < b and e > a and not nm.startswith("cuda")})[:6]
            print(f"  {d:8.1f} us before {nxt[:60]!r}; CPU ops meanwhile: {', '.join(during)}")


if __name__ == "__main__":
    main()
