"""Median fwd+bwd ms of msa_attention(warmup=True) against dense cuDNN (bench configuration):
python scripts/time_warmup.py N [N ...]. For A/B runs of the warmup path's knobs (environment)."""
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the in-place build
from msa import bench  # noqa: E402


def main():
    timer = bench.Timer(torch.device("cuda"), reps=10)
    knobs = {k: v for k, v in os.environ.items() if k.startswith("MSA_")}
    for n in [int(a) for a in sys.argv[1:]] or [32768]:
        sets = [bench.make_inputs(n, torch.device("cuda"), torch.bfloat16, seed=s) for s in range(2)]
        w = timer(bench.msa_fwd_bwd_warmup, sets)
        d = timer(bench.dense_fwd_bwd, sets)
        print(f"N={n} warmup fwd+bwd {w:.3f} ms, dense {d:.3f} ms, ratio {w / d:.2f}  {knobs}", flush=True)
        del sets
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
