"""Queries that are a suffix of the keys (issue 18 item 1, docs/semantics.md) on the CPU path: each
sequence's len_q queries are its last len_q of len_k positions, causal aligned bottom-right.

Checked against the independent brute force (tests/brute.py), against the square call whose last rows
are the suffix (out, lse, indices, dk / dv / dk_idx of those rows' loss), by finite differences, and for
its errors. On CUDA (tests/test_suffix_queries_gpu.py for the kernels), warmup included: its results against
this CPU path (GPU test below)."""

import numpy as np
import pytest
import torch
from torch.autograd import gradcheck

import brute
import msa
from helpers import assert_rounded_once, make_inputs, suffix_packed as _suffix_packed

ops = torch.ops.msa


def _np(x):
    return x.detach().double().numpy()


CASES = [  # (len_q per sequence, len_k per sequence, heads, block size, topk)
    ([1], [300], (8, 2, 4, 1), 64, 3),
    ([1, 40, 129, 0, 7], [1, 200, 129, 50, 300], (16, 2, 4, 2), 64, 2),
    ([64, 65, 3], [128, 400, 3], (4, 4, 4, 1), 128, 16),
    ([100], [333], (8, 4, 2, 1), 64, 1),
]


@pytest.mark.parametrize("case", range(len(CASES)))
@pytest.mark.parametrize("warmup", [False, True])
def test_suffix_matches_brute_force(case, warmup):
    lq, lk, heads, bs, topk = CASES[case]
    x = _suffix_packed(lq, lk, heads, 64, 128, seed=case)
    out, kl, idx = msa.msa_attention_varlen(x["q"], x["k"], x["v"], x["qi"], x["ki"], x["cu_q"], x["mx_q"],
                                            cu_seqlens_k=x["cu_k"], max_seqlen_k=x["mx_k"], topk=topk,
                                            block_size=bs, warmup=warmup, return_indices=True)
    assert out.shape == x["q"].shape and idx.shape == (heads[2], sum(lq), topk)
    want = brute.msa(_np(x["q"]), _np(x["k"]), _np(x["v"]), _np(x["qi"]), _np(x["ki"]), x["cu_q"].tolist(), topk,
                     bs, 64 ** -0.5, 128 ** -0.5, warmup, cu_k=x["cu_k"].tolist())
    np.testing.assert_array_equal(idx.numpy(), want["indices"])
    np.testing.assert_allclose(_np(out), want["out"], rtol=1e-9, atol=1e-11)
    assert abs(kl.item() - want["kl"]) <= 1e-9 * max(1.0, abs(want["kl"]))


@pytest.mark.parametrize("warmup", [False, True])
def test_suffix_equals_the_square_call_on_its_rows(warmup):
    """The square call over all key positions, restricted to the query rows: the same out, lse, indices and
    kl rows (so the same kl); and the gradients of a loss on out's rows: the same dq (of the rows), dk, dv
    (the KL's gradients: test_suffix_gradcheck)."""
    lq, lk, heads = [1, 70, 0, 129], [200, 70, 30, 300], (8, 2, 4, 1)
    x = _suffix_packed(lq, lk, heads, 64, 64, seed=4)
    args = dict(topk=2, block_size=64, softmax_scale=0.125, index_scale=0.125)
    leaves = [t.detach().requires_grad_() for t in (x["q"], x["k"], x["v"], x["qi"], x["ki"])]
    sq = [t.detach().requires_grad_() for t in (x["q_full"], x["k"], x["v"], x["qi_full"], x["ki"])]
    r = ops.msa_fwd(*leaves, x["cu_q"], x["mx_q"], args["topk"], 64, 0.125, 0.125, warmup, True, True, False,
                    x["cu_k"], x["mx_k"])
    f = ops.msa_fwd(*sq, x["cu_k"], x["mx_k"], args["topk"], 64, 0.125, 0.125, warmup, True, True, False)
    rows = x["rows"]
    torch.testing.assert_close(r[0], f[0][rows], rtol=0, atol=1e-12)      # out
    torch.testing.assert_close(r[2], f[2][:, rows], rtol=0, atol=0)        # indices
    torch.testing.assert_close(r[3], f[3][:, rows], rtol=0, atol=1e-12)    # lse
    torch.testing.assert_close(r[4], f[4][:, rows], rtol=0, atol=1e-12)    # lse_idx
    torch.testing.assert_close(r[7], f[7][:, rows], rtol=0, atol=1e-12)    # kl rows
    g = torch.randn_like(r[0])
    (r[0] * g).sum().backward()
    gf = torch.zeros_like(f[0])
    gf[rows] = g
    (f[0] * gf).sum().backward()
    torch.testing.assert_close(leaves[0].grad, sq[0].grad[rows], rtol=0, atol=1e-11)
    torch.testing.assert_close(leaves[1].grad, sq[1].grad, rtol=0, atol=1e-11)
    torch.testing.assert_close(leaves[2].grad, sq[2].grad, rtol=0, atol=1e-11)
    assert torch.count_nonzero(sq[0].grad[torch.ones(len(sq[0]), dtype=torch.bool).index_fill_(0, rows, False)]) == 0
    kl = msa.msa_attention_varlen(*leaves, x["cu_q"], x["mx_q"], cu_seqlens_k=x["cu_k"], max_seqlen_k=x["mx_k"],
                                  warmup=warmup, **args)[1]
    assert abs(kl.item() - f[7][:, rows].mean().item()) < 1e-12


@pytest.mark.parametrize("warmup,topk", [(False, 1), (False, 2), (True, 2)])
def test_suffix_gradcheck(warmup, topk):
    """All five gradients by finite differences: out -> q, k, v; kl -> q_idx, k_idx (dk, dv, dk_idx over
    every key row, those of positions no query sees included: zero). The kl's gradients are small (a mean over
    rows), so its check has atol 1e-7 (the default 1e-5 passes them halved)."""
    x = _suffix_packed([1, 30, 0], [140, 70, 20], (8, 2, 4, 1), 64, 64, seed=6)
    base = [x["q"], x["k"], x["v"], x["qi"], x["ki"]]

    def f(*t):
        return msa.msa_attention_varlen(*t, x["cu_q"], x["mx_q"], cu_seqlens_k=x["cu_k"], max_seqlen_k=x["mx_k"],
                                        topk=topk, block_size=64, warmup=warmup)
    q, k, v, qi, ki = (t.detach().requires_grad_() for t in base)
    assert gradcheck(lambda q, k, v: f(q, k, v, qi.detach(), ki.detach())[0], (q, k, v), fast_mode=True)
    assert gradcheck(lambda qi, ki: f(q.detach(), k.detach(), v.detach(), qi, ki)[1], (qi, ki), fast_mode=True,
                     atol=1e-7, rtol=1e-5)


@pytest.mark.parametrize("warmup", [False, True])
def test_batched_suffix_equals_varlen(warmup):
    """msa_attention with N_k > N_q (every batch row the same lengths) is the packed call."""
    B, Nq, Nk, heads = 3, 50, 190, (8, 2, 4, 1)
    q, k, v, qi, ki = make_inputs(B, Nk, heads, 64, 64, seed=8)
    qs, qis = q[:, -Nq:], qi[:, -Nq:]
    out, kl, idx = msa.msa_attention(qs, k, v, qis, ki, topk=2, block_size=64, warmup=warmup, return_indices=True)
    assert out.shape == qs.shape and idx.shape == (B, 4, Nq, 2)
    cu_q = torch.arange(0, B * Nq + 1, Nq, dtype=torch.int32)
    cu_k = torch.arange(0, B * Nk + 1, Nk, dtype=torch.int32)
    flat = [t.reshape(-1, *t.shape[2:]) for t in (qs, k, v, qis, ki)]
    o2, kl2, idx2 = msa.msa_attention_varlen(*flat, cu_q, Nq, cu_seqlens_k=cu_k, max_seqlen_k=Nk, topk=2,
                                             block_size=64, warmup=warmup, return_indices=True)
    torch.testing.assert_close(out.reshape(-1, *out.shape[2:]), o2, rtol=0, atol=0)
    torch.testing.assert_close(idx.permute(1, 0, 2, 3).reshape(4, B * Nq, 2), idx2, rtol=0, atol=0)
    assert kl.item() == kl2.item()
    # the square call's last rows
    o3, kl3, idx3 = msa.msa_attention(q, k, v, qi, ki, topk=2, block_size=64, warmup=warmup, return_indices=True)
    torch.testing.assert_close(out, o3[:, -Nq:], rtol=0, atol=1e-12)
    torch.testing.assert_close(idx, idx3[:, :, -Nq:], rtol=0, atol=0)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_suffix_low_precision_close_to_brute_force(dtype):
    """Half / fp32 inputs: a valid top-k of the fp64 block scores, out and kl close to the fp64 brute force of
    the same rounded inputs with that selection."""
    lq, lk, heads, bs, topk = CASES[1]
    x = _suffix_packed(lq, lk, heads, 64, 128, dtype=dtype, seed=9)
    out, kl, idx = msa.msa_attention_varlen(x["q"], x["k"], x["v"], x["qi"], x["ki"], x["cu_q"], x["mx_q"],
                                            cu_seqlens_k=x["cu_k"], max_seqlen_k=x["mx_k"], topk=topk, block_size=bs,
                                            return_indices=True)
    cu_q, cu_k = x["cu_q"].tolist(), x["cu_k"].tolist()
    scores = brute.block_scores(_np(x["qi"]), _np(x["ki"]), cu_q, bs, 128 ** -0.5, cu_k)
    brute.check_valid_topk(idx.numpy(), scores, topk, rel_tol=1e-5)
    want = brute.msa(_np(x["q"]), _np(x["k"]), _np(x["v"]), _np(x["qi"]), _np(x["ki"]), cu_q, topk, bs, 64 ** -0.5,
                     128 ** -0.5, False, indices=idx.numpy(), cu_k=cu_k)
    if dtype == torch.float32:
        np.testing.assert_allclose(_np(out), want["out"], rtol=1e-5, atol=1e-5)
    else:
        assert_rounded_once("out", _np(out), want["out"], dtype)
    assert abs(kl.item() - want["kl"]) <= 1e-4 * max(1.0, abs(want["kl"]))


def test_select_blocks_and_sparse_attention_take_suffix_queries():
    """The two branches alone: select_blocks on the suffix is the square call's rows; sparse_attention with
    those indices is msa's out, batched and packed."""
    B, Nq, Nk, heads = 2, 33, 260, (8, 2, 4, 1)
    q, k, v, qi, ki = make_inputs(B, Nk, heads, 64, 64, seed=10)
    idx = msa.select_blocks(qi[:, -Nq:], ki, topk=3, block_size=64)
    torch.testing.assert_close(idx, msa.select_blocks(qi, ki, topk=3, block_size=64)[:, :, -Nq:], rtol=0, atol=0)
    out = msa.sparse_attention(q[:, -Nq:], k, v, idx, block_size=64)
    want = msa.msa_attention(q[:, -Nq:], k, v, qi[:, -Nq:], ki, topk=3, block_size=64)[0]
    torch.testing.assert_close(out, want, rtol=0, atol=0)
    cu_q = torch.arange(0, B * Nq + 1, Nq, dtype=torch.int32)
    cu_k = torch.arange(0, B * Nk + 1, Nk, dtype=torch.int32)
    flat = lambda t: t.reshape(-1, *t.shape[2:])  # noqa: E731
    idx_p = msa.select_blocks(flat(qi[:, -Nq:]), flat(ki), topk=3, block_size=64, cu_seqlens=cu_q, max_seqlen=Nq,
                              cu_seqlens_k=cu_k, max_seqlen_k=Nk)
    torch.testing.assert_close(idx_p, idx.permute(1, 0, 2, 3).reshape(4, -1, 3), rtol=0, atol=0)
    out_p, lse_p = msa.sparse_attention(flat(q[:, -Nq:]), flat(k), flat(v), idx_p, block_size=64, return_lse=True,
                                        cu_seqlens=cu_q, max_seqlen=Nq, cu_seqlens_k=cu_k, max_seqlen_k=Nk)
    torch.testing.assert_close(out_p, flat(out), rtol=0, atol=0)
    assert lse_p.shape == (8, B * Nq)


def test_suffix_errors():
    x = _suffix_packed([5, 9], [20, 30], (8, 2, 4, 1), 64, 64)
    t = (x["q"], x["k"], x["v"], x["qi"], x["ki"])
    call = lambda **kw: msa.msa_attention_varlen(*t, x["cu_q"], x["mx_q"], topk=2, block_size=64, **kw)  # noqa: E731
    with pytest.raises(ValueError, match="cu_seqlens_k: expected len_k >= len_q"):
        bad = torch.tensor([0, 4, 50], dtype=torch.int32)  # 5 queries, 4 keys in sequence 0
        call(cu_seqlens_k=bad, max_seqlen_k=46)
    with pytest.raises(ValueError, match="cu_seqlens_k: expected 2 sequences"):
        call(cu_seqlens_k=torch.tensor([0, 50], dtype=torch.int32), max_seqlen_k=50)
    with pytest.raises(ValueError, match=r"cu_seqlens_k: expected cu_seqlens_k\[-1\] == T_k"):
        call(cu_seqlens_k=torch.tensor([0, 20, 40], dtype=torch.int32), max_seqlen_k=30)
    with pytest.raises(ValueError, match="max_seqlen_k: expected >= the longest"):
        call(cu_seqlens_k=x["cu_k"], max_seqlen_k=20)
    with pytest.raises(TypeError, match="max_seqlen_k: expected an int with cu_seqlens_k"):
        call(cu_seqlens_k=x["cu_k"])
    with pytest.raises(TypeError, match="cu_seqlens_k: expected dtype torch.int32"):
        call(cu_seqlens_k=x["cu_k"].long(), max_seqlen_k=30)
    with pytest.raises(ValueError, match="k: expected T = 14 rows"):
        call()  # keys of another length without their layout
    with pytest.raises(ValueError, match="cu_seqlens_k: expected cu_seqlens_k\\[0\\] == 0"):
        call(cu_seqlens_k=torch.tensor([1, 20, 50], dtype=torch.int32), max_seqlen_k=30)
    with pytest.raises(ValueError, match="cu_seqlens_k: expected non-decreasing"):
        call(cu_seqlens_k=torch.tensor([0, 51, 50], dtype=torch.int32), max_seqlen_k=51)
    with pytest.raises(TypeError, match="max_seqlen_k: expected None without cu_seqlens_k"):
        call(max_seqlen_k=30)
    q, k, v, qi, ki = make_inputs(2, 40, (8, 2, 4, 1), 64, 64)
    with pytest.raises(TypeError, match="max_seqlen_k: expected None in the batched layout"):
        msa.select_blocks(qi, ki, max_seqlen_k=40)
    with pytest.raises(TypeError, match="cu_seqlens_k: expected None in the batched layout"):
        msa.sparse_attention(q, k, v, msa.select_blocks(qi, ki), cu_seqlens_k=x["cu_k"])
    with pytest.raises(ValueError, match="k_idx: expected T = 14 rows \\(those of q_idx"):
        msa.select_blocks(x["qi"], x["ki"], cu_seqlens=x["cu_q"], max_seqlen=x["mx_q"])
    with pytest.raises(ValueError, match=r"k: expected leading dims \(B, N_k\) with B = 2 and N_k >= N_q = 40"):
        msa.msa_attention(q, k[:, :30], v[:, :30], qi, ki[:, :30])
    with pytest.raises(ValueError, match=r"v: expected leading dims \(2, 40\) \(those of k\)"):
        msa.msa_attention(q[:, :10], k, v[:, :30], qi[:, :10], ki)
    with pytest.raises(ValueError, match=r"q_idx: expected leading dims \(2, 10\) \(those of q\)"):
        msa.msa_attention(q[:, :10], k, v, qi, ki)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_suffix_warmup_on_cuda_matches_cpu():
    """Warmup takes suffix queries on CUDA (through the Python layer and the op itself): out and kl close to
    this CPU path on the same bf16 inputs; a cu_seqlens_k equal to cu_seqlens (another tensor) is bitwise the
    square case."""
    q, k, v, qi, ki = make_inputs(1, 300, (8, 2, 4, 1), 128, 128, dtype=torch.bfloat16, device="cuda")

    def close(got, want):  # (out, kl): out to bf16 rounding, the KL to 1e-3 relative
        torch.testing.assert_close(got[0].cpu(), want[0], rtol=2e-2, atol=2e-2)
        assert abs(got[1].item() - want[1].item()) <= 1e-3 * abs(want[1].item()) + 1e-5, (got[1].item(), want[1].item())

    args = (q[:, -100:], k, v, qi[:, -100:], ki)
    close(msa.msa_attention(*args, warmup=True), msa.msa_attention(*(t.cpu() for t in args), warmup=True))
    flat = [t[0] for t in (q, k, v, qi, ki)]
    cu = torch.tensor([0, 300], dtype=torch.int32, device="cuda")
    for warmup in (False, True):
        out, kl = msa.msa_attention_varlen(*flat, cu, 300, cu_seqlens_k=cu.clone(), max_seqlen_k=300, warmup=warmup)
        out2, kl2 = msa.msa_attention_varlen(*flat, cu, 300, warmup=warmup)
        torch.testing.assert_close(out, out2, rtol=0, atol=0)
        torch.testing.assert_close(kl, kl2, rtol=0, atol=0)
    cu_q = torch.tensor([0, 5], dtype=torch.int32, device="cuda")
    call = (flat[0][-5:], flat[1], flat[2], flat[3][-5:], flat[4], cu_q, 5, 16, 128, 0.125, 0.125, True, False, False,
            False, cu, 300)
    got = ops.msa_fwd(*call)
    want = ops.msa_fwd(*(a.cpu() if isinstance(a, torch.Tensor) else a for a in call))
    close(got[:2], want[:2])


def test_opcheck_with_a_key_layout():
    """torch.library.opcheck (schema, fake, autograd registration) of the ops taking cu_seqlens_k."""
    x = _suffix_packed([3, 40], [70, 90], (8, 2, 4, 1), 64, 64, dtype=torch.float32)
    q, k, v, qi, ki = (t.detach().requires_grad_() for t in (x["q"], x["k"], x["v"], x["qi"], x["ki"]))
    key = (x["cu_k"], x["mx_k"])
    for warmup, grad in ((False, True), (True, False)):
        torch.library.opcheck(ops.msa_fwd, (q, k, v, qi, ki, x["cu_q"], x["mx_q"], 2, 64, 0.125, 0.125, warmup, False,
                                            grad, False, *key))
    idx = ops.select_blocks(qi.detach(), ki.detach(), x["cu_q"], x["mx_q"], 2, 64, 0.125, *key)
    torch.library.opcheck(ops.select_blocks, (qi, ki, x["cu_q"], x["mx_q"], 2, 64, 0.125, *key))
    torch.library.opcheck(ops.sparse_fwd, (q, k, v, idx, x["cu_q"], x["mx_q"], 64, 0.125, False, *key))
    out, kl, idx, lse, lse_idx, g_q, g_k, _ = ops.msa_fwd(q.detach(), k.detach(), v.detach(), qi.detach(), ki.detach(),
                                                        x["cu_q"], x["mx_q"], 2, 64, 0.125, 0.125, False, False, True,
                                                        False, *key)
    assert g_k.shape == ki.shape and lse.shape == (8, 43)
    torch.library.opcheck(ops.msa_bwd, (torch.randn_like(out), torch.tensor(1.5), q.detach(), k.detach(), v.detach(),
                                        out, lse, qi.detach(), ki.detach(), lse_idx, idx, g_q, g_k, x["cu_q"],
                                        x["mx_q"], 64, 0.125, 0.125, False, False, *key))
    torch.library.opcheck(ops.sparse_bwd, (torch.randn_like(out), q.detach(), k.detach(), v.detach(), out, lse[:, :],
                                           idx, x["cu_q"], x["mx_q"], 64, 0.125, False, *key))


def test_compile_fullgraph_suffix():
    B, Nq, Nk = 1, 20, 150
    q, k, v, qi, ki = make_inputs(B, Nk, (8, 2, 4, 1), 64, 64, dtype=torch.float32, seed=12)
    f = torch.compile(lambda *t: msa.msa_attention(*t, topk=2, block_size=64), fullgraph=True, backend="eager")
    out, kl = f(q[:, -Nq:], k, v, qi[:, -Nq:], ki)
    want, kl_want = msa.msa_attention(q[:, -Nq:], k, v, qi[:, -Nq:], ki, topk=2, block_size=64)
    torch.testing.assert_close(out, want, rtol=0, atol=0)
    assert kl.item() == kl_want.item()
