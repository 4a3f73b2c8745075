"""Dense cuDNN SDPA fwd+bwd in the bench configuration's shapes (B=1, Hq=16, Hkv=2, D=128, causal, GQA, bf16),
repeated for a given number of seconds of load, for scripts/clock_probe.sh's clock samples (is the ratios' denominator
under the power cap too?). torch only, so that it runs without the msa build (`import msa` needs msa._C), hence not
msa.bench's dense_fwd_bwd itself: this one pins the cuDNN backend (sdpa_kernel) and takes contiguous (B, H, N, D)
inputs and a random dO, where the bench calls SDPA's default choice on transposed (B, N, H, D) views with dO = 1.
Prints one CSV row per N,
`dense_cudnn_fwdbwd,N=...,median ms,TFLOP/s (msa.bench's 3.5 * 2N^2*D*Hq),reps`.
    python3 scripts/dense_load.py SECONDS N [N ...]"""
import statistics
import sys

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel


def fwd_bwd(q, k, v, do):
    out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    torch.autograd.grad(out, (q, k, v), do)


def main():
    seconds = float(sys.argv[1])
    for n in [int(a) for a in sys.argv[2:]]:
        g = torch.Generator(device="cuda").manual_seed(n)
        mk = lambda h: torch.randn(1, h, n, 128, device="cuda", dtype=torch.bfloat16, generator=g).requires_grad_()
        q, k, v = mk(16), mk(2), mk(2)
        do = torch.randn_like(q)
        times = []
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            for _ in range(2):
                fwd_bwd(q, k, v, do)
            while sum(times) < seconds * 1e3:
                a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                a.record()
                fwd_bwd(q, k, v, do)
                b.record()
                b.synchronize()
                times.append(a.elapsed_time(b))
        ms = statistics.median(times)
        print(f"dense_cudnn_fwdbwd,N={n},{ms:.3f},{3.5 * 2 * n * n * 128 * 16 / ms / 1e9:.1f},{len(times)}", flush=True)


if __name__ == "__main__":
    main()
