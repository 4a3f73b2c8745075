"""One small case of every compiled kernel, for `compute-sanitizer --tool memcheck|racecheck`."""
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the in-place build
import msa  # noqa: E402

torch.manual_seed(0)
# The index top-k alone on a longer sequence (many sub-tiles: every pipeline stage reused several times),
# with the default kernel (Hopper on an sm_90 GPU) and the portable one.
for portable in ["0", "1"]:
    os.environ["MSA_PORTABLE_KERNELS"] = portable
    for bs in [64, 128]:
        cu = torch.tensor([0, 4000, 4100], dtype=torch.int32, device="cuda")
        qi = torch.randn(4100, 4, 128, dtype=torch.bfloat16, device="cuda")
        ki = torch.randn(4100, 1, 128, dtype=torch.bfloat16, device="cuda")
        msa.select_blocks(qi, ki, topk=16, block_size=bs, cu_seqlens=cu, max_seqlen=4000)
os.environ["MSA_PORTABLE_KERNELS"] = "0"
for dtype, di, bs, topk, lengths in [(torch.bfloat16, 128, 128, 16, [700, 129, 1]), (torch.float16, 64, 64, 3, [300])]:
    T = sum(lengths)
    cu = torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist(), dtype=torch.int32, device="cuda")
    qi = torch.randn(T, 4, di, dtype=dtype, device="cuda")
    ki = torch.randn(T, 1, di, dtype=dtype, device="cuda")
    idx = msa.select_blocks(qi, ki, topk=topk, block_size=bs, cu_seqlens=cu, max_seqlen=max(lengths))
    offsets, rows, block_offsets = torch.ops.msa.reverse_index(idx, cu, max(lengths), bs)
    for heads in [(8, 2, 4, 1), (8, 4, 2, 1)]:  # Hi >= Hkv and Hi < Hkv (two kv heads per group)
        q = torch.randn(T, heads[0], 128, dtype=dtype, device="cuda")
        k, v = (torch.randn(T, heads[1], 128, dtype=dtype, device="cuda") for _ in range(2))
        qi2, ki2 = qi[:, :heads[2]].contiguous(), ki
        out, kl, idx2, lse, lse_idx, g_q, g_k, _ = torch.ops.msa.msa_fwd(q, k, v, qi2, ki2, cu, max(lengths), topk, bs,
                                                                       0.088, 0.088, False, False, True)
        torch.ops.msa.msa_bwd(torch.randn_like(out), torch.tensor(1.0, device="cuda"), q, k, v, out, lse, qi2, ki2,
                              lse_idx, idx2, g_q, g_k, cu, max(lengths), bs, 0.088, 0.088, False)
        # Warmup: the dense-mode KL pass and its index gradient (the main branch is torch's flash kernel).
        out, kl, idx3, lse, lse_idx, g_q, g_k, _ = torch.ops.msa.msa_fwd(q, k, v, qi2, ki2, cu, max(lengths), topk, bs,
                                                                       0.088, 0.088, True, False, True)
        # The main branch alone (no index branch in the kernels).
        out, lse = torch.ops.msa.sparse_fwd(q, k, v, idx2, cu, max(lengths), bs, 0.088)
        torch.ops.msa.sparse_bwd(torch.randn_like(out), q, k, v, out, lse, idx2, cu, max(lengths), bs, 0.088)
        os.environ["MSA_BWD_UNITS_PER_ITEM"] = "5"  # every key split over several backward CTAs
        torch.ops.msa.sparse_bwd(torch.randn_like(out), q, k, v, out, lse, idx2, cu, max(lengths), bs, 0.088)
        del os.environ["MSA_BWD_UNITS_PER_ITEM"]
        # Deterministic mode: exact hi / lo sums, per-item partials and their in-order reductions.
        out, kl, idx2, lse, lse_idx, g_q, g_k, _ = torch.ops.msa.msa_fwd(q, k, v, qi2, ki2, cu, max(lengths), topk,
                                                                          bs, 0.088, 0.088, False, False, True, True)
        torch.ops.msa.msa_bwd(torch.randn_like(out), torch.tensor(1.0, device="cuda"), q, k, v, out, lse, qi2, ki2,
                              lse_idx, idx2, g_q, g_k, cu, max(lengths), bs, 0.088, 0.088, False, True)
        torch.ops.msa.msa_fwd(q, k, v, qi2, ki2, cu, max(lengths), topk, bs, 0.088, 0.088, True, False, True, True)
        # Non-finite inputs: NaN / Inf in one token of every input.
        bad = [x.clone() for x in (q, k, v, qi2, ki2)]
        for x, val in zip(bad, (float("nan"), float("inf"), float("nan"), float("-inf"), float("nan"))):
            x[min(5, T - 1)] = val
        out, kl, idx4, lse, lse_idx, g_q, g_k, _ = torch.ops.msa.msa_fwd(*bad, cu, max(lengths), topk, bs, 0.088,
                                                                          0.088, False, False, True)
        torch.ops.msa.msa_bwd(torch.randn_like(out), torch.tensor(1.0, device="cuda"), *bad[:3], out, lse, *bad[3:],
                              lse_idx, idx4, g_q, g_k, cu, max(lengths), bs, 0.088, 0.088, False)
    torch.cuda.synchronize()
# Queries that are a suffix of the keys, few of them over many key blocks (more keys than entries: the work
# list, its launch order and the grid are bounded by the entries), fwd + bwd, deterministic too.
cu_q = torch.tensor([0, 1, 4], dtype=torch.int32, device="cuda")
cu_k = torch.tensor([0, 20000, 29000], dtype=torch.int32, device="cuda")
q, qi = torch.randn(4, 8, 128, device="cuda", dtype=torch.bfloat16), torch.randn(4, 4, 128, device="cuda", dtype=torch.bfloat16)
k, v = (torch.randn(29000, 2, 128, device="cuda", dtype=torch.bfloat16) for _ in range(2))
ki = torch.randn(29000, 1, 128, device="cuda", dtype=torch.bfloat16)
for det in (False, True):
    out, kl, idx, lse, lse_idx, g_q, g_k, _ = torch.ops.msa.msa_fwd(q, k, v, qi, ki, cu_q, 3, 16, 64, 0.088, 0.088,
                                                                    False, True, True, det, cu_k, 20000)
    torch.ops.msa.msa_bwd(torch.randn_like(out), torch.tensor(1.0, device="cuda"), q, k, v, out, lse, qi, ki, lse_idx,
                          idx, g_q, g_k, cu_q, 3, 64, 0.088, 0.088, False, det, cu_k, 20000)
torch.cuda.synchronize()
print("sanitize case done")
