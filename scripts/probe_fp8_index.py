"""The FP8 selection against the bf16 one on the bench configuration's index branch (CUDA): per N, the top-k's
time (median of CUDA-event timed calls, msa.bench.Timer; the FP8 figure with and without msa.fp8_index_copies'
quantization), the copies' own time, and the recall of the FP8 selection (the fraction of the bf16 selection's kept
blocks it keeps too) on the bench's random inputs.

    python scripts/probe_fp8_index.py [N ...]      (default 8192 32768 131072)
"""
import sys

import torch

import msa
from msa.bench import CONFIG, Timer, selection_recall as recall


def main(ns):
    c = CONFIG
    fp8 = torch.float8_e4m3fn
    timer = Timer(torch.device("cuda"), reps=20, warmup=1)

    def _time(fn):  # median ms of CUDA-event timed calls (msa.bench's timer)
        return timer(fn, [()])

    print(f"# {torch.cuda.get_device_name()}; heads Hi {c['Hi']} Hki {c['Hki']}, Di {c['Di']}, topk {c['topk']}, "
          f"block {c['block_size']}")
    print("N,bf16_ms,fp8_ms,fp8_with_copies_ms,copies_ms,recall")
    for n in ns:
        g = torch.Generator(device="cuda").manual_seed(n)
        qi = torch.randn(1, n, c["Hi"], c["Di"], device="cuda", dtype=torch.bfloat16, generator=g)
        ki = torch.randn(1, n, c["Hki"], c["Di"], device="cuda", dtype=torch.bfloat16, generator=g)
        kw = dict(topk=c["topk"], block_size=c["block_size"])
        q8, k8 = msa.fp8_index_copies(qi, ki)
        flat = [x.reshape(n, *x.shape[2:]) for x in (qi, ki, q8, k8)]
        scale = 1 / c["Di"] ** 0.5
        sel = torch.ops.msa.select_blocks
        t16 = _time(lambda: sel(flat[0], flat[1], None, n, kw["topk"], kw["block_size"], scale))
        t8 = _time(lambda: sel(flat[2], flat[3], None, n, kw["topk"], kw["block_size"], scale))
        t8q = _time(lambda: msa.select_blocks(qi, ki, index_dtype=fp8, **kw))
        tq = _time(lambda: msa.fp8_index_copies(qi, ki))
        r = recall(msa.select_blocks(qi, ki, index_dtype=fp8, **kw), msa.select_blocks(qi, ki, **kw))
        print(f"{n},{t16:.4f},{t8:.4f},{t8q:.4f},{tq:.4f},{r:.4f}", flush=True)


if __name__ == "__main__":
    main([int(a) for a in sys.argv[1:]] or [8192, 32768, 131072])
