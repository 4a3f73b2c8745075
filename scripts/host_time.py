"""Host time to enqueue the pieces of one msa step (bench configuration, CUDA): python scripts/host_time.py [N ...].

Each line: the median over 7 calls of the wall time of one call that returns before the GPU is done (the GPU
idle beforehand, a sync after), so it is the host's own cost: Python, checks, the dispatcher, allocations and
launches. Compare a piece with its kernels' GPU time (scripts/profile_msa.py): where the host takes longer, the GPU
waits in a real step. Pieces: the whole step (forward + backward), the forward alone (autograd on, no backward),
the forward with autograd off, the msa_fwd op called directly, select_blocks, the reverse_index op (one
build over all tokens), the sparse_fwd op (the main branch given a selection: its chunks' reverse indices,
passes and combines) and the backward alone (timed from a forward done beforehand, the autograd engine
included)."""
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the in-place build
import msa  # noqa: E402
from msa import bench  # noqa: E402


def host_ms(fn, before=None, reps=7):
    times = []
    for _ in range(reps + 2):
        state = before() if before else None
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn(state)
        times.append((time.perf_counter() - t0) * 1e3)
        torch.cuda.synchronize()
    return statistics.median(times[2:])


def main():
    if not torch.cuda.is_available():
        sys.exit("host_time.py: needs a CUDA device")
    ns = [int(a) for a in sys.argv[1:]] or [8192]
    c = bench.CONFIG
    for n in ns:
        q, k, v, qi, ki = x = bench.make_inputs(n, torch.device("cuda"), torch.bfloat16, seed=0)
        kw = dict(topk=c["topk"], block_size=c["block_size"])
        scale, iscale = c["D"] ** -0.5, c["Di"] ** -0.5
        flat = [t.detach().reshape(n, *t.shape[2:]) for t in x]

        def fwd_only(_):
            return msa.msa_attention(q, k, v, qi, ki, **kw)

        def fwd_nograd(_):
            with torch.no_grad():
                return msa.msa_attention(q, k, v, qi, ki, **kw)

        def op_direct(_):
            return torch.ops.msa.msa_fwd(*flat, None, n, c["topk"], c["block_size"], scale, iscale, False, False,
                                         True, False)

        idx = bench.synthetic_indices(n, q.device, seed=n)
        cu = torch.tensor([0, n], dtype=torch.int32, device=q.device)

        def forward_state():
            out, kl = msa.msa_attention(q, k, v, qi, ki, **kw)
            return out, kl, torch.ones_like(out), torch.ones_like(kl)

        def bwd_only(s):
            torch.autograd.grad(s[:2], x, s[2:])

        rows = [("step (fwd + bwd)", host_ms(lambda _: bench.msa_fwd_bwd(*x))),
                ("forward, autograd on", host_ms(fwd_only)),
                ("forward, no_grad", host_ms(fwd_nograd)),
                ("msa_fwd op, direct", host_ms(op_direct)),
                ("select_blocks", host_ms(lambda _: bench.select_fn(qi, ki))),
                ("reverse_index op", host_ms(lambda _: torch.ops.msa.reverse_index(idx, cu, n, c["block_size"]))),
                ("sparse_fwd op", host_ms(lambda _: bench.sparse_fwd(*flat[:3], idx, cu, n))),
                ("backward (autograd.grad)", host_ms(bwd_only, before=forward_state))]
        print(f"## N = {n}: host ms per call (median of 7)")
        for name, ms in rows:
            print(f"{name:28s} {ms:8.3f}")


if __name__ == "__main__":
    main()
