"""MSA_DENSE_KL_CHUNK (query tiles per CTA of the warmup path's dense KL kernel), or another variable the launcher
reads at each call (--var, e.g. MSA_DENSE_KL_WS), against the default, interleaved in one process so that clock and
thermal drift between processes does not decide: python scripts/dense_kl_chunks.py [--rounds R] [--var NAME] N
[N ...] [-- VALUE ...]. Each round times the warmup fwd+bwd (bench configuration, msa.bench.Timer) once per setting,
in a rotated order; prints the median over rounds per setting ("default" = the variable unset: for the chunk the
launcher's own choice, max(4, query tiles / 32)). The variables are read at each call (csrc/api/dense_kl.cpp)."""
import os
import statistics
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the in-place build
from msa import bench  # noqa: E402


def pop_option(args, flag, default):
    """The value after `flag` in args (both taken out of args), else default."""
    if flag not in args:
        return default
    i = args.index(flag)
    value = args[i + 1]
    del args[i:i + 2]
    return value


def main():
    args = sys.argv[1:]
    rounds = int(pop_option(args, "--rounds", 5))
    var = pop_option(args, "--var", "MSA_DENSE_KL_CHUNK")
    chunks = ["default", "8", "16", "32", "64"]
    if "--" in args:
        i = args.index("--")
        chunks = ["default"] + args[i + 1:]
        args = args[:i]
    timer = bench.Timer(torch.device("cuda"), reps=5)
    for n in [int(a) for a in args] or [32768]:
        sets = [bench.make_inputs(n, torch.device("cuda"), torch.bfloat16, seed=s) for s in range(2)]
        times = {c: [] for c in chunks}
        for r in range(rounds):
            for c in chunks[r % len(chunks):] + chunks[:r % len(chunks)]:
                if c == "default":
                    os.environ.pop(var, None)
                else:
                    os.environ[var] = c
                times[c].append(timer(bench.msa_fwd_bwd_warmup, sets))
        os.environ.pop(var, None)
        base = statistics.median(times["default"])
        print(f"N={n} warmup fwd+bwd ({var}), median of {rounds} rounds: " + ", ".join(
            f"{c}: {statistics.median(t):.3f} ms ({statistics.median(t) / base - 1:+.1%})" for c, t in times.items()),
            flush=True)
        del sets
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
