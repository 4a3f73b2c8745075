"""emu.py's stand-in on _check_sparse_backward's configurations (packed [700, 64, 1], random indices with -1 and
repeats, the wide-unit layouts, bs 64 / 128), with the s45 oracles."""
import math, sys
import os
HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "../../../../tests")); sys.path.insert(0, HERE)
import torch
from emu import check_emulated
from helpers import HEADS, make_packed

configs = [(h, 64, 64, 4) for h in HEADS] + [(h, D, bs, 3) for D, bs in [(64, 128), (128, 128), (128, 64)]
                                             for h in [(16, 2, 2, 1), (12, 1, 1, 1), (24, 1, 1, 1)]]
for heads, D, bs, topk in configs:
    lengths = [700, 64, 1]
    q, k, v, _, _, cu, mx = make_packed(lengths, heads, D, 64, dtype=torch.bfloat16, device="cpu", seed=sum(heads) + D)
    g = torch.Generator().manual_seed(D + bs)
    idx = torch.cat([torch.randint(-1, -(-n // bs) + 1, (heads[2], n, topk), generator=g) for n in lengths], 1)
    idx = idx.to(torch.int32)
    check_emulated(q, k, v, idx, cu, bs, 1 / math.sqrt(D), torch.randn_like)
    print(heads, D, bs, "pass", flush=True)
