"""Warmup mode on CUDA (SPEC 5): dense main attention (PyTorch flash) and our dense KL pass, against the
float64 reference: out, lse, kl, lse_idx and all five gradients."""
import math

import pytest
import torch

import msa
from attention_check import assert_close_style, assert_lse_close, low_precision, run_ref
from helpers import HEADS, make_inputs, make_packed, poison_allocator
from msa import reference as ref

pytestmark = pytest.mark.gpu
ops = torch.ops.msa


def _check(q, k, v, qi, ki, cu, mx, topk, bs, seed):
    dtype = q.dtype
    scale, iscale = 1 / math.sqrt(q.shape[-1]), 1 / math.sqrt(qi.shape[-1])
    poison_allocator()
    out, kl, idx, lse, lse_idx, g_q, g_k = ops.msa_fwd(q, k, v, qi, ki, cu, mx, topk, bs, scale, iscale, True, False,
                                                        True)
    assert idx.shape == (qi.shape[1], q.shape[0], 0)
    exact_out, exact_lse = run_ref(ref.sparse_fwd, q, k, v, None, cu, bs, scale)
    exact_kl, exact_lse_idx = run_ref(ref.index_kl, q, k, exact_lse, qi, ki, None, cu, bs, scale, iscale)
    with low_precision():
        lowp_out, lowp_lse = run_ref(ref.sparse_fwd, q, k, v, None, cu, bs, scale, dtype=dtype)
    assert_close_style("out", out, exact_out, lowp_out, dtype)
    assert_lse_close("lse", lse, exact_lse)
    assert_lse_close("lse_idx", lse_idx, exact_lse_idx)
    assert abs(kl.item() - exact_kl.item()) <= 1e-3 * abs(exact_kl.item()) + 1e-5, (kl.item(), exact_kl.item())
    again = ops.msa_fwd(q, k, v, qi, ki, cu, mx, topk, bs, scale, iscale, True, False, True)
    for name, a, b in zip(("out", "kl", "lse", "lse_idx"), (out, kl, lse, lse_idx), (again[0], again[1], again[3],
                                                                                     again[4])):
        assert torch.equal(a, b), f"{name} differs between two runs"
    # Gradients through the public API.
    leaves = [x.detach().requires_grad_(True) for x in (q, k, v, qi, ki)]
    o2, kl2 = msa.msa_attention_varlen(*leaves, cu, mx, topk=topk, block_size=bs, warmup=True)
    g = torch.Generator().manual_seed(seed)
    dout = torch.randn(o2.shape, generator=g).to(o2)
    dkl = torch.tensor(1.5, device=q.device)
    grads = torch.autograd.grad((o2, kl2), leaves, (dout, dkl))
    exact = run_ref(ref.sparse_bwd, dout, q, k, v, exact_lse, None, cu, bs, scale)
    exact += run_ref(ref.index_kl_bwd, dkl, q, k, exact_lse, qi, ki, exact_lse_idx, None, cu, bs, scale, iscale)
    with low_precision():
        lowp = run_ref(ref.sparse_bwd, dout, q, k, v, lowp_lse, None, cu, bs, scale, dtype=dtype)
        _, lowp_lse_idx = run_ref(ref.index_kl, q, k, lowp_lse, qi, ki, None, cu, bs, scale, iscale, dtype=dtype)
        lowp += run_ref(ref.index_kl_bwd, dkl, q, k, lowp_lse, qi, ki, lowp_lse_idx, None, cu, bs, scale, iscale,
                        dtype=dtype)
    kl_unit = dkl.item() / (q.shape[0] * qi.shape[1])
    for name, got, e, lp in zip(("dq", "dk", "dv", "dq_idx", "dk_idx"), grads, exact, lowp):
        assert_close_style(name, got, e, lp, dtype, unit=kl_unit if name.endswith("_idx") else 1.0)


CASES = [(2, 1, 64, 64, 128), (1, 300, 128, 64, 64), (2, 700, 64, 128, 128), (1, 2048, 128, 128, 128)]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("case", range(len(CASES)))
def test_warmup_batched(case, dtype):
    B, N, D, Di, bs = CASES[case]
    heads = HEADS[case % len(HEADS)]
    x = make_inputs(B, N, heads, D, Di, dtype=dtype, device="cuda", seed=case)
    flat = [t.reshape(B * N, *t.shape[2:]) for t in x]
    cu = torch.arange(0, (B + 1) * N, N, dtype=torch.int32, device="cuda")
    _check(*flat, cu, N, 16, bs, seed=case)


@pytest.mark.parametrize("heads", [(8, 2, 4, 1), (8, 4, 2, 1), (12, 4, 4, 1)])
def test_warmup_varlen(heads):
    q, k, v, qi, ki, cu, mx = make_packed([900, 1, 129, 0, 1500], heads, 128, 64, dtype=torch.bfloat16,
                                          device="cuda", seed=sum(heads))
    _check(q, k, v, qi, ki, cu, mx, 16, 128, seed=3)


def test_warmup_return_indices():
    q, k, v, qi, ki = make_inputs(1, 500, (8, 2, 4, 1), 64, 64, dtype=torch.bfloat16, device="cuda", seed=2)
    out, kl, idx = msa.msa_attention(q, k, v, qi, ki, topk=3, block_size=64, warmup=True, return_indices=True)
    assert torch.equal(idx, msa.select_blocks(qi, ki, topk=3, block_size=64))
