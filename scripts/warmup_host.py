"""Host time of the warmup forward's pieces, to find the GPU's idle time inside the warmup step (s80):
python scripts/warmup_host.py [N ...]   (default 8192; bench configuration, bf16)

In s75 host_lead.py found the 8K warmup step's GPU idle ~0.15 ms beyond its kernels with the host lead hidden (dense
cuDNN's step: ~0.015), and a host lead 0.08 ms longer than dense's (s80, after the dense KL's changes: ~0.03 and
<= ~0.05 ms idle). msa_fwd launches lse_idx (~80 us of GPU) and then calls msa::_dense_fwd (Python, msa/_ops.py),
whose cuDNN launch the GPU waits for where the host takes longer than lse_idx. This prints the host
microseconds (median of REPS calls, each queued behind a sleep kernel so no call waits on the GPU) of:
  - the bench's dense forward (F.scaled_dot_product_attention, cuDNN) and its fwd+bwd,
  - aten::_scaled_dot_product_cudnn_attention called directly (the op _dense_fwd ends in),
  - torch.ops.msa._dense_fwd (the dispatcher's Python kernel, msa/_ops.py, as msa_fwd reaches it from C++),
  - the warmup forward (msa_attention, warmup=True) and its fwd+bwd.
With MSA_HOST_PHASES=1 in the environment the C++ ops print their phases (stderr) on every call: run it with that set
to see msa_fwd's lse_idx / dense_fwd split and msa_bwd's dense_bwd.
"""
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the in-place build
import msa  # noqa: E402
from msa import bench  # noqa: E402

REPS = int(os.environ.get("MSA_WARMUP_HOST_REPS", "21"))


def host_us(fn, reps=REPS):
    """Median host microseconds of fn() with the GPU busy (a sleep kernel queued first)."""
    for _ in range(2):
        fn()
    cpu = []
    for _ in range(reps):
        torch.cuda.synchronize()
        torch.cuda._sleep(50_000_000)  # ~25 ms: everything fn launches queues behind it
        t0 = time.perf_counter()
        fn()
        cpu.append((time.perf_counter() - t0) * 1e6)
    torch.cuda.synchronize()
    return statistics.median(cpu)


def main():
    # With the phases on (a stderr line per op call), a few calls per piece: the lines are the data.
    phases = os.environ.get("MSA_HOST_PHASES") == "1"
    reps = 3 if phases else REPS
    for n in [int(a) for a in sys.argv[1:]] or [8192]:
        q, k, v, qi, ki = bench.make_inputs(n, torch.device("cuda"), torch.bfloat16, seed=0)
        c = bench.CONFIG
        scale = c["D"] ** -0.5
        qt, kt, vt = (x.detach().view(n, x.shape[2], x.shape[3]) for x in (q, k, v))
        cu = torch.tensor([0, n], dtype=torch.int32, device="cuda")
        bh = [x.detach().transpose(1, 2) for x in (q, k, v)]  # (B, H, N, D) views, as cuDNN's op takes them
        pieces = {
            "dense fwd (F.sdpa, the bench's)": lambda: bench.dense_fwd(*(x.detach() for x in (q, k, v))),
            "dense fwd+bwd (the bench's)": lambda: bench.dense_fwd_bwd(q, k, v),
            "aten cuDNN fwd direct": lambda: torch.ops.aten._scaled_dot_product_cudnn_attention(
                bh[0], bh[1], bh[2], None, True, 0.0, True, False, scale=scale),
            "torch.ops.msa._dense_fwd (dispatcher)": lambda: torch.ops.msa._dense_fwd(qt, kt, vt, cu, n, scale, True,
                                                                                     False),
            "warmup fwd (no grad)": lambda: torch.no_grad()(msa.msa_attention)(
                q, k, v, qi, ki, topk=c["topk"], block_size=c["block_size"], warmup=True),
            "warmup fwd+bwd (the bench's)": lambda: bench.msa_fwd_bwd_warmup(q, k, v, qi, ki),
        }
        print(f"## N = {n}: host us per call (median of {reps}, GPU kept busy)", flush=True)
        for name, fn in pieces.items():
            if phases:
                print(f"-- {name}", file=sys.stderr, flush=True)
            print(f"{name}: {host_us(fn, reps):.1f}", flush=True)


if __name__ == "__main__":
    main()
