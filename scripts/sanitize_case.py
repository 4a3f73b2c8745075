"""Small cases that launch every kernel msa compiles and the variants listed in scripts/kernel_coverage.py, for
compute-sanitizer:

    compute-sanitizer --tool memcheck|racecheck|synccheck python3 scripts/sanitize_case.py
    python3 scripts/sanitize_case.py --kernels FILE   # no sanitizer: the kernels launched, one name per line

scripts/kernel_coverage.py checks such a list against csrc/ (every __global__, the variants in its VARIANTS), and
tests/test_sanitize_case.py runs both on an sm_90 GPU. The configurations below set the op's environment knobs
(read at every call) that pick the other kernel paths: the portable kernels, the general sm_90a passes, the 99 KB
configuration, several query chunks. Each runs a few hundred tokens, so a sanitizer pass takes minutes. The MSA_*
knobs of the calling shell are cleared first: configuration 0 is the default kernels.
"""
import argparse
import os
import sys
import time
from unittest import mock

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the in-place build
import msa  # noqa: E402

OPS = torch.ops.msa
SCALE = 0.088
DEVICE = "cuda"  # --device cpu: the same calls on the CPU path (tests/test_sanitize_case.py checks the script so)
# (Hq, Hkv, Hi): G = Hq / Hi heads per index group; the backward's unit holds Gu = G / J heads (J = Hkv / Hi kv heads
# per group where Hkv > Hi, else 1).
G2 = (8, 2, 4)   # G = 2, Gu = 2: the general sm_90a output pass, the cp.async backward gather
J2 = (8, 4, 2)   # Hi < Hkv (J = 2): two kv heads per group, Gu = 2, the portable-layout dense KL in warmup
G4 = (16, 2, 4)  # the bench's layout: G = Gu = 4: the warp-specialized output pass, the TMA backward gather
G8 = (16, 2, 2)  # G = Gu = 8: the TMA gather's other box, the general output pass
# (dtype, D, Di, block_size, topk, sequence lengths)
BF16 = (torch.bfloat16, 128, 128, 128, 16, [700, 129, 1])
FP16 = (torch.float16, 64, 64, 64, 3, [300])
# (environment, shapes, head layouts, full): the default kernels on every shape and layout, then each knob on one.
CONFIGS = [
    ({}, [BF16, FP16], [G2, J2, G4, G8], True),
    ({"MSA_PORTABLE_KERNELS": "1"}, [BF16, FP16], [G4, J2], False),
    ({"MSA_PORTABLE_KERNELS": "1", "MSA_SMALL_SMEM": "1"}, [BF16], [G4], False),
    ({"MSA_PORTABLE_KERNELS": "1", "MSA_FWD_ROWS": "64"}, [BF16], [G4], False),
    ({"MSA_FWD_WS": "0"}, [BF16], [G4], False),  # the general pass at Gu = 4, index dk on its own
    ({"MSA_FWD_WS_STATS": "1", "MSA_SEL_MAX_BLOCKS": "0"}, [BF16], [G4], False),  # + the top-k without kSel
    ({"MSA_BWD_WS": "0"}, [BF16], [G4, G2], False),  # the general sm_90a backward, with and without its dQ map
    ({"MSA_BWD_WS_TMA": "1"}, [BF16], [G2], False),  # the TMA gather at Gu = 2
    ({"MSA_PARTIAL_BUDGET": str(16 << 20)}, [BF16], [G4], False),  # several query chunks of the forward
]


def randn(*shape, dtype):
    return torch.randn(*shape, dtype=dtype, device=DEVICE)


def fwd(x, cu, L, topk, bs, warmup=False, grad=True, det=False):
    return OPS.msa_fwd(*x, cu, L, topk, bs, SCALE, SCALE, warmup, False, grad, det)


def bwd(x, res, cu, L, bs, warmup=False, det=False):
    out, kl, idx, lse, lse_idx, g_q, g_k, _ = res
    q, k, v, qi, ki = x
    return OPS.msa_bwd(torch.randn_like(out), torch.tensor(1.0, device=DEVICE), q, k, v, out, lse, qi, ki, lse_idx, idx,
                       g_q, g_k, cu, L, bs, SCALE, SCALE, warmup, det)


def batch(shape, heads):
    """(x, cu, L): random q, k, v, q_idx, k_idx of one varlen batch, its cu_seqlens and longest length."""
    dtype, D, Di, _, _, lengths = shape
    hq, hkv, hi = heads
    T, L = sum(lengths), max(lengths)
    cu = torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist(), dtype=torch.int32, device=DEVICE)
    x = (randn(T, hq, D, dtype=dtype), randn(T, hkv, D, dtype=dtype), randn(T, hkv, D, dtype=dtype),
         randn(T, hi, Di, dtype=dtype), randn(T, 1, Di, dtype=dtype))
    return x, cu, L


def step(shape, heads, full):
    """fwd + bwd of one varlen batch, the forward without the index gradient, both in deterministic mode too; `full`
    adds warmup (deterministic too), the main branch alone, split backward items, non-finite inputs and the batched
    layout."""
    dtype, D, Di, bs, topk, _ = shape
    hq, hkv, hi = heads
    x, cu, L = batch(shape, heads)
    T = x[0].shape[0]
    res = fwd(x, cu, L, topk, bs)
    bwd(x, res, cu, L, bs)
    idx = res[2]
    fwd(x, cu, L, topk, bs, grad=False)
    res = fwd(x, cu, L, topk, bs, det=True)
    bwd(x, res, cu, L, bs, det=True)
    if not full:
        return
    res = fwd(x, cu, L, topk, bs, warmup=True)  # the dense-mode KL pass and its index gradient
    bwd(x, res, cu, L, bs, warmup=True)
    fwd(x, cu, L, topk, bs, warmup=True, det=True)
    q, k, v = x[:3]
    out, lse = OPS.sparse_fwd(q, k, v, idx, cu, L, bs, SCALE)  # the main branch alone
    OPS.sparse_bwd(torch.randn_like(out), q, k, v, out, lse, idx, cu, L, bs, SCALE)
    with mock.patch.dict(os.environ, {"MSA_BWD_UNITS_PER_ITEM": "5"}):  # every key split over several backward CTAs
        OPS.sparse_bwd(torch.randn_like(out), q, k, v, out, lse, idx, cu, L, bs, SCALE)
    bad = [t.clone() for t in x]  # NaN / Inf in one token of every input
    for t, val in zip(bad, (float("nan"), float("inf"), float("nan"), float("-inf"), float("nan"))):
        t[min(5, T - 1)] = val
    bwd(bad, fwd(bad, cu, L, topk, bs), cu, L, bs)
    # The batched layout (cu_seqlens built on the GPU) through the public API and autograd.
    n = 2 * bs + 3
    b = [randn(2, n, h, d, dtype=dtype).requires_grad_() for h, d in ((hq, D), (hkv, D), (hkv, D), (hi, Di), (1, Di))]
    out, kl = msa.msa_attention(*b, topk=min(topk, 2), block_size=bs)
    (out.float().square().mean() + kl).backward()
    out, kl = msa.msa_attention(*b, topk=min(topk, 2), block_size=bs, index_dtype=torch.float8_e4m3fn)
    (out.float().square().mean() + kl).backward()  # msa_fwd given the selection's FP8 inputs


def topk_alone():
    """The index top-k on a longer sequence (every pipeline stage reused several times), portable and Hopper, both
    CTA sizes of the Hopper kernel, with and without index_dtype."""
    for knobs in ({"MSA_PORTABLE_KERNELS": "1"}, {"MSA_TOPK_WG": "2"}, {"MSA_TOPK_WG": "4"}):
        with mock.patch.dict(os.environ, knobs):
            for bs in [64, 128]:
                cu = torch.tensor([0, 4000, 4100], dtype=torch.int32, device=DEVICE)
                qi = randn(4100, 4, 128, dtype=torch.bfloat16)
                ki = randn(4100, 1, 128, dtype=torch.bfloat16)
                msa.select_blocks(qi, ki, topk=16, block_size=bs, cu_seqlens=cu, max_seqlen=4000)
                # The FP8 selection (index_dtype): the e4m3 copies, then the FP8 top-k (the widened copies on the
                # portable path).
                msa.select_blocks(qi, ki, topk=16, block_size=bs, cu_seqlens=cu, max_seqlen=4000,
                                  index_dtype=torch.float8_e4m3fn)


def suffix_queries():
    """Queries that are a suffix of the keys, few of them over many key blocks (more keys than entries: the work
    list, its launch order and the grid are bounded by the entries), fwd + bwd, deterministic too."""
    cu_q = torch.tensor([0, 1, 4], dtype=torch.int32, device=DEVICE)
    cu_k = torch.tensor([0, 20000, 29000], dtype=torch.int32, device=DEVICE)
    q, qi = randn(4, 8, 128, dtype=torch.bfloat16), randn(4, 4, 128, dtype=torch.bfloat16)
    k, v = (randn(29000, 2, 128, dtype=torch.bfloat16) for _ in range(2))
    ki = randn(29000, 1, 128, dtype=torch.bfloat16)
    for det in (False, True):
        out, kl, idx, lse, lse_idx, g_q, g_k, _ = OPS.msa_fwd(q, k, v, qi, ki, cu_q, 3, 16, 64, SCALE, SCALE, False,
                                                              True, True, det, cu_k, 20000)
        OPS.msa_bwd(torch.randn_like(out), torch.tensor(1.0, device=DEVICE), q, k, v, out, lse, qi, ki, lse_idx, idx,
                    g_q, g_k, cu_q, 3, 64, SCALE, SCALE, False, det, cu_k, 20000)


def dense_kl_two_warpgroups():
    """Warmup's dense KL kernel without its index warpgroup (MSA_DENSE_KL_WS=0, the A/B knob), G = 4 and G = 2, with
    and without the index gradient (the default kernel runs in the full configuration's warmup steps)."""
    with mock.patch.dict(os.environ, {"MSA_DENSE_KL_WS": "0"}):
        for shape, heads in ((BF16, G4), (FP16, G2)):
            bs, topk = shape[3], shape[4]
            x, cu, L = batch(shape, heads)
            fwd(x, cu, L, topk, bs, warmup=True)
            fwd(x, cu, L, topk, bs, warmup=True, grad=False)


def sync():
    if DEVICE == "cuda":
        torch.cuda.synchronize()


T0 = time.monotonic()


def progress(what):
    """A line on stderr before each part, with the seconds since the start: a sanitizer run cut by its timeout
    (gpu_check.sh's MSA_SANITIZE_TIMEOUT) then shows which part it was in and how long the parts before took."""
    print(f"[{time.monotonic() - T0:7.1f} s] {what}", file=sys.stderr, flush=True)


def run(configs):
    """The configurations numbered in `configs` (0: the default kernels, with the top-k alone and the suffix
    queries)."""
    torch.manual_seed(0)
    if 0 in configs:
        progress("top-k alone")
        topk_alone()
    for i in configs:
        knobs, shapes, layouts, full = CONFIGS[i]
        with mock.patch.dict(os.environ, knobs):
            for shape in shapes:
                for heads in layouts:
                    dtype = str(shape[0]).replace("torch.", "")
                    progress(f"config {i}{' ' + str(knobs) if knobs else ''} {dtype} D={shape[1]} heads={heads}")
                    step(shape, heads, full)
                    sync()
    if 0 in configs:
        progress("suffix queries")
        suffix_queries()
        progress("dense KL without its index warpgroup")
        dense_kl_two_warpgroups()
    sync()
    progress("all parts ran")


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--kernels", help="write the names of the kernels launched here (torch.profiler), one per line")
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"],
                    help="cpu: the same calls on the CPU path (configuration 0 only: the knobs choose CUDA kernels)")
    ap.add_argument("--configs", help=f"comma-separated numbers of CONFIGS (0-{len(CONFIGS) - 1}; default all)")
    args = ap.parse_args()
    if args.kernels is not None and args.device != "cuda":
        ap.error("--kernels lists CUDA kernels: it needs --device cuda")
    global DEVICE
    DEVICE = args.device
    try:
        configs = [int(c) for c in args.configs.split(",")] if args.configs else list(range(len(CONFIGS)))
    except ValueError:
        ap.error(f"--configs: expected comma-separated numbers, got {args.configs!r}")
    if not all(0 <= c < len(CONFIGS) for c in configs):
        ap.error(f"--configs: expected numbers in 0-{len(CONFIGS) - 1}, got {args.configs!r}")
    if DEVICE == "cpu":
        configs = [c for c in configs if c == 0]
        if not configs:
            ap.error("--device cpu runs configuration 0 only")
    cleared = sorted(k for k in os.environ if k.startswith("MSA_"))
    for k in cleared:
        del os.environ[k]
    if cleared:
        print("cleared:", " ".join(cleared), file=sys.stderr)
    if args.kernels is None:
        run(configs)
    else:
        from torch.profiler import ProfilerActivity, profile
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            run(configs)
        names = sorted({e.name for e in prof.events()})  # CUDA activities only: kernels, memsets
        with open(args.kernels, "w") as f:
            f.write("".join(n + "\n" for n in names))
    print("sanitize case done")


if __name__ == "__main__":
    main()
