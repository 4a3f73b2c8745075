"""Median fwd+bwd ms of one msa_attention step against dense cuDNN (bench configuration), and the step's
workspace: python scripts/time_step.py [--warmup] N [N ...]. For A/B runs of the MSA_* knobs read from
the environment in one build (e.g. MSA_PARTIAL_BUDGET, MSA_FWD_UNITS_PER_ITEM; the warmup path's
MSA_DENSE_KL_CHUNK): run it once per setting. --warmup times warmup=True (dense main branch, KL over the
full causal set); its workspace is not measured."""
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the in-place build
from msa import bench  # noqa: E402


def main():
    args = sys.argv[1:]
    warm = "--warmup" in args
    ns = [int(a) for a in args if a != "--warmup"] or [32768]
    timer = bench.Timer(torch.device("cuda"), reps=10)
    knobs = {k: v for k, v in os.environ.items() if k.startswith("MSA_")}
    step = bench.msa_fwd_bwd_warmup if warm else bench.msa_fwd_bwd
    name = "warmup" if warm else "msa"
    for n in ns:
        sets = [bench.make_inputs(n, torch.device("cuda"), torch.bfloat16, seed=s) for s in range(2)]
        t = timer(step, sets)
        d = timer(bench.dense_fwd_bwd, sets)
        work = "" if warm else f", workspace {bench.fwd_bwd_memory(sets[0])[1]:.2f} GiB"
        print(f"N={n} {name} fwd+bwd {t:.3f} ms, dense {d:.3f} ms, {name} / dense {t / d:.2f}{work}  {knobs}", flush=True)
        del sets
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
