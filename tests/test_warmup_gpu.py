"""Warmup mode on CUDA (SPEC 5): dense main attention (PyTorch flash) and our dense KL pass, against the
float64 reference: out, lse, kl, lse_idx and all five gradients."""
import math

import pytest
import torch

import msa
from attention_check import assert_forward_close, assert_grads_close, reference_forward
from helpers import HEADS, make_inputs, make_packed, poison_allocator

pytestmark = pytest.mark.gpu
ops = torch.ops.msa


def _check(q, k, v, qi, ki, cu, mx, topk, bs, seed):
    scale, iscale = 1 / math.sqrt(q.shape[-1]), 1 / math.sqrt(qi.shape[-1])
    poison_allocator()
    out, kl, idx, lse, lse_idx, g_q, g_k, _ = ops.msa_fwd(q, k, v, qi, ki, cu, mx, topk, bs, scale, iscale, True,
                                                           False, True)
    assert idx.shape == (qi.shape[1], q.shape[0], 0)
    exact, (lowp_out, _) = reference_forward(q, k, v, qi, ki, None, cu, bs, scale, iscale)
    assert_forward_close(out, kl, lse, lse_idx, exact, lowp_out)
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
    assert_grads_close(grads, dout, dkl, q, k, v, qi, ki, None, cu, bs, scale, iscale)


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
