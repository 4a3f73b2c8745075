"""Can the warmup's lse_idx (the index branch's logsumexp, SPEC 5) come cheaper from cuDNN with a narrow V?
Times aten's cuDNN forward on the bench configuration's index branch (Hi = 4 query heads, one key head,
Di = 128) with V of 128 columns (what msa_fwd passes today: k_idx) against V = the first d_v columns of
k_idx, and checks that the lse is the same. python scripts/probe_lse_idx.py [N ...]"""
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the in-place build
from msa import bench  # noqa: E402

A = torch.ops.aten


def main():
    print("torch", torch.__version__, "cudnn", torch.backends.cudnn.version())
    timer = bench.Timer(torch.device("cuda"), 20)
    for n in [int(a) for a in sys.argv[1:]] or [8192, 32768]:
        g = torch.Generator(device="cuda").manual_seed(0)
        qi = torch.randn(1, 4, n, 128, device="cuda", dtype=torch.bfloat16, generator=g)
        ki = torch.randn(1, 1, n, 128, device="cuda", dtype=torch.bfloat16, generator=g)
        sc = 128 ** -0.5

        def fwd(v):
            return A._scaled_dot_product_cudnn_attention(qi, ki, v, None, True, 0.0, True, False, scale=sc)

        ref = fwd(ki)[1].float()
        base = timer(lambda: fwd(ki), [()])
        print(f"N={n}: d_v = 128 (k_idx): {base:.3f} ms")
        for dv in (64, 32, 16, 8):
            for name, v in (("slice", ki[..., :dv]), ("contiguous", ki[..., :dv].contiguous())):
                try:
                    lse = fwd(v)[1].float()
                    err = (lse.reshape(ref.shape) - ref).abs().max().item()
                    ms = timer(lambda: fwd(v), [()])
                    print(f"  d_v = {dv:3d} ({name}): {ms:.3f} ms, lse max |diff| {err:.2e}")
                except RuntimeError as e:
                    print(f"  d_v = {dv:3d} ({name}): cuDNN refused: {str(e).splitlines()[0][:150]}")


if __name__ == "__main__":
    main()
