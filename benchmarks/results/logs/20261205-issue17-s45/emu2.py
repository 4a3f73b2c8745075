"""emu.py's stand-in on _check_sparse_backward's configurations (packed [700, 64, 1], random indices with -1 and
repeats, the wide-unit layouts, bs 64 / 128), with the s45 oracles."""
import math, sys
import os
HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "../../../../tests")); sys.path.insert(0, HERE)
import torch
from emu import emu_fwd, emu_bwd
from attention_check import assert_close_style, assert_lse_close, low_precision, run_ref
from helpers import HEADS, make_packed
from msa import reference as ref

configs = [(h, 64, 64, 4) for h in HEADS] + [(h, D, bs, 3) for D, bs in [(64, 128), (128, 128), (128, 64)]
                                             for h in [(16, 2, 2, 1), (12, 1, 1, 1), (24, 1, 1, 1)]]
for heads, D, bs, topk in configs:
    lengths = [700, 64, 1]
    q, k, v, _, _, cu, mx = make_packed(lengths, heads, D, 64, dtype=torch.bfloat16, device="cpu", seed=sum(heads) + D)
    g = torch.Generator().manual_seed(D + bs)
    idx = torch.cat([torch.randint(-1, -(-n // bs) + 1, (heads[2], n, topk), generator=g) for n in lengths], 1)
    idx = idx.to(torch.int32)
    scale, dtype = 1 / math.sqrt(D), q.dtype
    out, lse = emu_fwd(q, k, v, idx, cu, bs, scale)
    exact_out, exact_lse = run_ref(ref.sparse_fwd, q, k, v, idx, cu, bs, scale)
    with low_precision():
        lowp_out, lowp_lse = run_ref(ref.sparse_fwd, q, k, v, idx, cu, bs, scale, dtype=dtype)
    assert_close_style("out", out, exact_out, lowp_out, dtype)
    assert_lse_close("lse", lse, exact_lse)
    dout = torch.randn_like(out)
    grads = emu_bwd(dout, q, k, v, out, lse, idx, cu, bs, scale)
    exact = run_ref(ref.sparse_bwd, dout, q, k, v, exact_lse, idx, cu, bs, scale)
    with low_precision():
        lowp = run_ref(ref.sparse_bwd, dout, q, k, v, lowp_lse, idx, cu, bs, scale, dtype=dtype)
    for name, got, e, lp in zip(("dq", "dk", "dv"), grads, exact, lowp):
        assert_close_style(name, got, e, lp, dtype)
    print(heads, D, bs, "pass", flush=True)
