"""The CUDA backward (msa_bwd, sparse_bwd): all five gradients against the float64 reference on the GPU."""
import math

import pytest
import torch

import msa
from attention_check import assert_close_style, assert_grads_close, assert_lse_close, low_precision, run_ref
from helpers import (HEADS, VARLEN_LENGTHS, VARLEN_SHAPES, assert_same_forward, cuda_kernel_names, make_inputs,
                     make_packed, poison_allocator, sm90_kernels_run)
from msa import reference as ref

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("kernel_choice")]  # Hopper (wgmma) and portable
ops = torch.ops.msa


def _grads(q, k, v, qi, ki, cu, mx, topk, bs, seed):
    """msa_attention_varlen's five gradients for random dout and d_kl, with its selection and lse."""
    leaves = [x.detach().requires_grad_(True) for x in (q, k, v, qi, ki)]
    poison_allocator()
    out, kl, idx = msa.msa_attention_varlen(*leaves, cu, mx, topk=topk, block_size=bs, return_indices=True)
    g = torch.Generator(device="cpu").manual_seed(seed)
    dout = torch.randn(out.shape, generator=g).to(out)
    dkl = torch.tensor(0.5 + seed % 3, device=q.device)
    grads = torch.autograd.grad((out, kl), leaves, (dout, dkl))
    return grads, dout, dkl, idx


def _check_grads(q, k, v, qi, ki, cu, mx, topk, bs, seed):
    scale, iscale = 1 / math.sqrt(q.shape[-1]), 1 / math.sqrt(qi.shape[-1])
    grads, dout, dkl, idx = _grads(q, k, v, qi, ki, cu, mx, topk, bs, seed)
    assert_grads_close(grads, dout, dkl, q, k, v, qi, ki, idx, cu, bs, scale, iscale)


CASES = [  # (B, N, D, Di, block_size, topk)
    (2, 1, 64, 64, 128, 16), (2, 100, 128, 64, 64, 3), (1, 129, 128, 128, 64, 16), (1, 300, 64, 64, 64, 32),
    (2, 700, 128, 128, 128, 3), (2, 2048, 128, 128, 128, 16), (1, 8192, 128, 128, 128, 16),
    # topk = 32 with more blocks visible than slots
    (1, 4500, 128, 128, 128, 32), (1, 2500, 64, 64, 64, 32),
]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("case", range(len(CASES)))
def test_msa_bwd_batched(case, dtype):
    B, N, D, Di, bs, topk = CASES[case]
    heads = HEADS[case % len(HEADS)]
    x = make_inputs(B, N, heads, D, Di, dtype=dtype, device="cuda", seed=case)
    flat = [t.reshape(B * N, *t.shape[2:]) for t in x]
    cu = torch.arange(0, (B + 1) * N, N, dtype=torch.int32, device="cuda")
    _check_grads(*flat, cu, N, topk, bs, seed=case)


@pytest.mark.parametrize("heads", HEADS + [(16, 2, 4, 1), (12, 4, 4, 1), (8, 8, 2, 1)])
def test_msa_bwd_varlen(heads):
    q, k, v, qi, ki, cu, mx = make_packed(VARLEN_LENGTHS, heads, 128, 64, dtype=torch.bfloat16,
                                          device="cuda", seed=sum(heads))
    _check_grads(q, k, v, qi, ki, cu, mx, 5, 128, seed=sum(heads))


@pytest.mark.parametrize("heads", [(16, 2, 4, 1), (8, 2, 4, 1)])  # warp-specialized kernels, general ones
@pytest.mark.parametrize("D, Di, bs, dtype", VARLEN_SHAPES)
def test_msa_bwd_varlen_shapes(heads, D, Di, bs, dtype):
    x = make_packed(VARLEN_LENGTHS, heads, D, Di, dtype=dtype, device="cuda", seed=D + Di + bs)
    _check_grads(*x, 5, bs, seed=D + Di + bs)


@pytest.mark.parametrize("deterministic", [True, False])
def test_backward_parts_skip(deterministic):
    """Only out's gradient, only kl's gradient: the other inputs get none, and the given ones equal those of the
    whole loss (kl gives q, k, v no gradient and out gives q_idx, k_idx none): bitwise in deterministic mode, within
    one bf16 rounding of the fp32 sums otherwise (their atomics add in another order per run)."""
    q, k, v, qi, ki = [t.requires_grad_(True) for t in
                       make_inputs(1, 500, (8, 2, 4, 1), 64, 64, dtype=torch.bfloat16, device="cuda", seed=9)]
    w = torch.randn(1, 500, 8, 64, device="cuda")
    x = (q, k, v, qi, ki)

    def grads(use_out, use_kl):
        out, kl = msa.msa_attention(*x, topk=3, block_size=64, deterministic=deterministic)
        terms = ([(out.float() * w).sum()] if use_out else []) + ([kl] if use_kl else [])
        return torch.autograd.grad(sum(terms), x, allow_unused=True)

    full = grads(True, True)
    g_out, g_kl = grads(True, False), grads(False, True)
    assert g_out[3] is None and g_out[4] is None and all(g is None for g in g_kl[:3])
    for name, got, want in zip(("dq", "dk", "dv", "dq_idx", "dk_idx"), g_out[:3] + g_kl[3:], full):
        assert got.abs().sum() > 0, name
        if deterministic:
            assert torch.equal(got, want), f"{name}: differs from the whole loss's"
        else:
            torch.testing.assert_close(got, want, rtol=2 ** -7, atol=1e-6 * want.abs().max().item(), msg=name)
    with torch.no_grad():  # no index gradient is computed without autograd
        assert torch.ops.msa.msa_fwd(q.reshape(500, 8, 64), k.reshape(500, 2, 64), v.reshape(500, 2, 64),
                                     qi.reshape(500, 4, 64), ki.reshape(500, 1, 64),
                                     torch.tensor([0, 500], dtype=torch.int32, device="cuda"), 500, 3, 64, 0.125,
                                     0.125, False, False, False)[5].numel() == 0


@pytest.mark.parametrize("heads", HEADS)
def test_sparse_attention_backward(heads):
    lengths = [700, 64, 1]
    q, k, v, _, _, cu, mx = make_packed(lengths, heads, 64, 64, dtype=torch.bfloat16, device="cuda", seed=4)
    g = torch.Generator().manual_seed(1)
    idx = torch.cat([torch.randint(-1, -(-n // 64) + 1, (heads[2], n, 4), generator=g) for n in lengths], 1)
    _check_sparse_backward(q, k, v, idx.to(torch.int32).cuda(), cu, mx, 64)


@pytest.mark.parametrize("D, bs", [(64, 128), (128, 128), (128, 64)])
@pytest.mark.parametrize("heads", [(16, 2, 2, 1), (12, 1, 1, 1), (16, 1, 1, 1), (24, 1, 1, 1), (32, 1, 1, 1)])
def test_backward_wide_units(heads, D, bs):
    """Units of 8, 12, 16, 24 and 32 heads (Gu): the Hopper kernel adds dQ by tensor reductions of 4 rows of one unit
    (a unit's rows may span warps or, past 64 / Gu units, leave padding rows in the tile); with 64-key blocks the
    second warpgroup has no row phase but still adds its dQ columns."""
    lengths = [700, 64, 1]
    q, k, v, _, _, cu, mx = make_packed(lengths, heads, D, 64, dtype=torch.bfloat16, device="cuda",
                                        seed=sum(heads) + D + bs)
    g = torch.Generator().manual_seed(D + bs)
    idx = torch.cat([torch.randint(-1, -(-n // bs) + 1, (heads[2], n, 3), generator=g) for n in lengths], 1)
    _check_sparse_backward(q, k, v, idx.to(torch.int32).cuda(), cu, mx, bs)


@pytest.mark.parametrize("heads, boxes", [((16, 2, 4, 1), True), ((16, 1, 1, 1), True), ((4, 4, 4, 1), False),
                                          ((8, 8, 2, 1), False)])
def test_backward_dq_path(heads, boxes, kernel_choice, monkeypatch):
    """Which dQ path the general backward's launcher takes (MSA_BWD_WS=0: on Hopper the warp-specialized kernel
    is the default), read from the profiler's kernel names (the value tests cannot tell the paths apart: both
    are exact): on the Hopper kernels, tensor reductions of 4-row boxes (sparse_bwd_kernel<sm90::BwdMma, T, D,
    false, true>) where units have a multiple of 4 heads (Gu = Hq / Hi / J: 4, 16), per-row bulk reductions
    (<..., false, false>) otherwise (1, 1); the portable kernels have only the latter."""
    monkeypatch.setenv("MSA_BWD_WS", "0")
    hopper = kernel_choice == "default" and sm90_kernels_run()
    q, k, v, qi, ki, cu, mx = make_packed([700, 129], heads, 128, 64, dtype=torch.bfloat16, device="cuda", seed=3)
    leaves = [x.detach().requires_grad_(True) for x in (q, k, v, qi, ki)]
    out, kl = msa.msa_attention_varlen(*leaves, cu, mx)
    ran = cuda_kernel_names(lambda: torch.autograd.grad((out, kl), leaves, (torch.ones_like(out), torch.ones_like(kl))))
    names = {n for n in ran if "sparse_bwd_kernel" in n}
    assert len(names) == 1, names
    name = names.pop()
    assert ("sm90::BwdMma" in name) == hopper, name
    assert name.split(">(")[0].endswith("false, true" if boxes and hopper else "false, false"), name


def _check_sparse_backward(q, k, v, idx, cu, mx, bs):
    """sparse_attention's out and lse, then dq, dk, dv for a random dout, against the float64 reference. The
    oracle's gradients are built from the reference's own lse (not the kernel's: a wrong lse, e.g. one never
    written, would otherwise scale P alike on both sides and cancel)."""
    scale, dtype = 1 / math.sqrt(q.shape[-1]), q.dtype
    leaves = [x.detach().requires_grad_(True) for x in (q, k, v)]
    poison_allocator()
    out, lse = msa.sparse_attention(*leaves, idx, block_size=bs, return_lse=True, cu_seqlens=cu, max_seqlen=mx)
    exact_out, exact_lse = run_ref(ref.sparse_fwd, q, k, v, idx, cu, bs, scale)
    with low_precision():
        lowp_out, lowp_lse = run_ref(ref.sparse_fwd, q, k, v, idx, cu, bs, scale, dtype=dtype)
    assert_close_style("out", out, exact_out, lowp_out, dtype)
    assert_lse_close("lse", lse, exact_lse)
    dout = torch.randn_like(out)
    grads = torch.autograd.grad(out, leaves, dout)
    exact = run_ref(ref.sparse_bwd, dout, q, k, v, exact_lse, idx, cu, bs, scale)
    with low_precision():
        lowp = run_ref(ref.sparse_bwd, dout, q, k, v, lowp_lse, idx, cu, bs, scale, dtype=dtype)
    for name, got, e, lp in zip(("dq", "dk", "dv"), grads, exact, lowp):
        assert_close_style(name, got, e, lp, dtype)


@pytest.mark.parametrize("per_item", [None, "7", "64"])
def test_hot_block_split(monkeypatch, per_item):
    """Every token selects block 0 (an attention sink) and its own block: the backward splits that key
    over many CTAs (small MSA_BWD_UNITS_PER_ITEM forces it; the default splits past 1024 tokens at this size, the
    1500-token sequence's sink included, and past 2048 above 2^20 selection entries), and the split CTAs' dK/dV must
    add up to the reference."""
    lengths, bs = [1500, 300, 1], 64
    q, k, v, _, _, cu, mx = make_packed(lengths, (8, 2, 4, 1), 64, 64, dtype=torch.bfloat16, device="cuda", seed=21)
    parts = []
    for n in lengths:
        local = torch.arange(n) // bs
        sink = torch.zeros(n, dtype=torch.long)
        own = torch.where(local > 0, local, torch.full_like(local, -1))
        parts.append(torch.stack([sink, own], -1)[None].expand(4, n, 2))
    idx = torch.cat(parts, 1).to(torch.int32).cuda().contiguous()
    if per_item is not None:
        monkeypatch.setenv("MSA_BWD_UNITS_PER_ITEM", per_item)
    _check_sparse_backward(q, k, v, idx, cu, mx, bs)


@pytest.mark.parametrize("mode", ["sparse", "warmup", "warmup_dense_kl"])
def test_many_query_chunks(monkeypatch, mode, kernel_choice):
    """A small partial budget splits the queries into many chunks (as N = 128K does with the default):
    results must not depend on the chunking. Warmup's KL on the sparse passes' dense mode (MSA_DENSE_KL=0)
    chunks the same way; the dense KL kernel (warmup's default on Hopper) ignores the budget and splits its
    query tiles by MSA_DENSE_KL_CHUNK instead."""
    warmup = mode != "sparse"
    dense_kl = mode == "warmup_dense_kl"
    if dense_kl and (kernel_choice != "default" or not sm90_kernels_run()):
        pytest.skip("the dense KL kernel is a Hopper kernel")
    if mode == "warmup":
        monkeypatch.setenv("MSA_DENSE_KL", "0")
    q, k, v, qi, ki, cu, mx = make_packed([1500, 700], (8, 2, 4, 1), 64, 64, dtype=torch.bfloat16, device="cuda",
                                          seed=11)
    args = (q, k, v, qi, ki, cu, mx, 4, 64, 0.125, 0.125, warmup, False, True)
    whole = ops.msa_fwd(*args)
    if dense_kl:
        ran = cuda_kernel_names(lambda: ops.msa_fwd(*args))
        assert any("dense_kl_kernel" in n for n in ran), ran
        monkeypatch.setenv("MSA_DENSE_KL_CHUNK", "1")  # one 64-row query tile per CTA
    else:
        monkeypatch.setenv("MSA_PARTIAL_BUDGET", str(300 * 1024))  # a few hundred tokens per chunk
    assert_same_forward(whole, ops.msa_fwd(*args), "the chunking")


@pytest.mark.parametrize("chunk", [None, "1", "3"])
def test_dense_kl_grid_order(monkeypatch, chunk):
    """The dense KL kernel's default chunk-major grid (chunks aligned to query-tile ranges, each CTA's walk
    rotated by its key tile) against its tile-major one (MSA_DENSE_KL_ORDER=tile): the same KL (fixed point) and
    index gradients up to the atomics' rounding, at the default chunk (4 query tiles: 6 chunks of the longer
    sequence, walks starting mid-chunk) and at 1 and 3 (diagonal chunks cut short)."""
    if not sm90_kernels_run():
        pytest.skip("the dense KL kernel is a Hopper kernel")
    q, k, v, qi, ki, cu, mx = make_packed([1500, 700], (8, 2, 4, 1), 64, 64, dtype=torch.bfloat16, device="cuda",
                                          seed=14)
    args = (q, k, v, qi, ki, cu, mx, 4, 64, 0.125, 0.125, True, False, True)
    if chunk is not None:
        monkeypatch.setenv("MSA_DENSE_KL_CHUNK", chunk)
    ran = cuda_kernel_names(lambda: ops.msa_fwd(*args))
    assert any("dense_kl_kernel" in n for n in ran), ran
    chunk_major = ops.msa_fwd(*args)
    monkeypatch.setenv("MSA_DENSE_KL_ORDER", "tile")
    assert_same_forward(chunk_major, ops.msa_fwd(*args), "the dense KL's grid order")


@pytest.mark.parametrize("heads,d,di,dtype,grad", [
    ((16, 2, 4, 1), 128, 128, torch.bfloat16, True),   # G = 4 (the pipelined heads), the bench's head dims
    ((16, 2, 4, 1), 128, 128, torch.bfloat16, False),  # no index gradient: the index warpgroup adds the KL rows only
    ((16, 2, 4, 1), 64, 128, torch.float16, True),
    ((8, 2, 4, 1), 64, 64, torch.float16, True),       # G = 2 (one head at a time)
    ((8, 2, 4, 1), 128, 64, torch.bfloat16, True),
])
@pytest.mark.parametrize("chunk", [None, "1"])
def test_dense_kl_index_warpgroup(monkeypatch, heads, d, di, dtype, grad, chunk):
    """The dense KL kernel with its index warpgroup (the default: dK_idx, dQ_idx and the KL rows on a third
    warpgroup, no CTA barrier per step) against the two-warpgroup kernel (MSA_DENSE_KL_WS=0): the same KL (both add
    the same per-warp fixed-point partials) and index gradients up to the atomics' rounding. Walks of 16 steps
    (default chunk: the heads run ahead through the lse ring and both dS^T buffers, and change kv head half way)
    and of 4 (chunk 1); the longer sequence ends mid-tile."""
    if not sm90_kernels_run():
        pytest.skip("the dense KL kernel is a Hopper kernel")
    q, k, v, qi, ki, cu, mx = make_packed([1500, 700], heads, d, di, dtype=dtype, device="cuda", seed=15)
    args = (q, k, v, qi, ki, cu, mx, 4, 64, d ** -0.5, di ** -0.5, True, False, grad)
    if chunk is not None:
        monkeypatch.setenv("MSA_DENSE_KL_CHUNK", chunk)
    def ran_ws(flag):  # the kernel's last template argument, kWs, in the demangled or the mangled name
        names = [n for n in cuda_kernel_names(lambda: ops.msa_fwd(*args)) if "dense_kl_kernel" in n]
        want = ("true>", "Lb1E") if flag else ("false>", "Lb0E")
        return len(names) == 1 and any(w in names[0] for w in want), names

    ok, names = ran_ws(True)
    assert ok, names
    with_ws = ops.msa_fwd(*args)
    monkeypatch.setenv("MSA_DENSE_KL_WS", "0")
    ok, names = ran_ws(False)
    assert ok, names
    assert_same_forward(with_ws, ops.msa_fwd(*args), "the index warpgroup", written=True)


@pytest.mark.parametrize("per_item", ["7", "128"])
def test_forward_item_size(monkeypatch, per_item):
    """The forward's work items (one kv block and up to MSA_FWD_UNITS_PER_ITEM of its units per CTA;
    default 512): out, lse and the KL are per-entry results combined in slot order, so they must not
    depend on the item size at all; the index gradients (fp32 atomics) up to rounding."""
    q, k, v, qi, ki, cu, mx = make_packed([1500, 700], (8, 2, 4, 1), 64, 64, dtype=torch.bfloat16, device="cuda",
                                          seed=12)
    args = (q, k, v, qi, ki, cu, mx, 4, 64, 0.125, 0.125, False, True, True)
    ref_run = torch.ops.msa.msa_fwd(*args)
    monkeypatch.setenv("MSA_FWD_UNITS_PER_ITEM", per_item)
    run = torch.ops.msa.msa_fwd(*args)
    assert_same_forward(ref_run, run, "the item size")


@pytest.mark.parametrize("per_item", ["7", None])
def test_item_launch_order(monkeypatch, per_item):
    """The work items run largest first (a permutation of the key-ordered list; MSA_ITEM_ORDER=0 turns
    it off): the forward's per-entry results must be bitwise the same in either order, the index
    gradients equal up to the atomics' rounding, and the backward must match the reference in both."""
    if per_item is not None:
        monkeypatch.setenv("MSA_FWD_UNITS_PER_ITEM", per_item)
        monkeypatch.setenv("MSA_BWD_UNITS_PER_ITEM", per_item)
    q, k, v, qi, ki, cu, mx = make_packed([1500, 700], (8, 2, 4, 1), 64, 64, dtype=torch.bfloat16, device="cuda",
                                          seed=13)
    args = (q, k, v, qi, ki, cu, mx, 4, 64, 0.125, 0.125, False, True, True)
    ordered = torch.ops.msa.msa_fwd(*args)
    _check_sparse_backward(q, k, v, ordered[2], cu, mx, 64)
    monkeypatch.setenv("MSA_ITEM_ORDER", "0")
    in_key_order = torch.ops.msa.msa_fwd(*args)
    assert_same_forward(ordered, in_key_order, "the launch order")
    _check_sparse_backward(q, k, v, ordered[2], cu, mx, 64)
