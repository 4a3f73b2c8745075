"""Warmup mode on CUDA (SPEC 5): dense main attention (PyTorch's cuDNN or flash kernel, msa/_ops.py) and
our dense KL pass, against the float64 reference: out, lse, kl, lse_idx and all five gradients, on each
dense backend, with the backend each layout takes checked."""
import math

import pytest
import torch

import msa
from attention_check import assert_forward_close, assert_grads_close, reference_forward
from helpers import HEADS, make_inputs, make_packed, poison_allocator

# A cuDNN call that raises makes the warmup path warn and take flash: here that is a failure.
pytestmark = [pytest.mark.gpu, pytest.mark.filterwarnings("error::RuntimeWarning")]
ops = torch.ops.msa


def _check(q, k, v, qi, ki, cu, mx, topk, bs, seed, batched=False, scales=None):
    """batched: the op without cu_seqlens (B = T / mx sequences of mx tokens) and the batched public API.
    scales: (softmax_scale, index_scale), default 1/sqrt(D) and 1/sqrt(Di)."""
    scale, iscale = scales or (1 / math.sqrt(q.shape[-1]), 1 / math.sqrt(qi.shape[-1]))
    poison_allocator()
    cu_op = None if batched else cu
    out, kl, idx, lse, lse_idx, g_q, g_k, _ = ops.msa_fwd(q, k, v, qi, ki, cu_op, mx, topk, bs, scale, iscale, True,
                                                           False, True)
    assert idx.shape == (qi.shape[1], q.shape[0], 0)
    exact, (lowp_out, _) = reference_forward(q, k, v, qi, ki, None, cu, bs, scale, iscale)
    assert_forward_close(out, kl, lse, lse_idx, exact, lowp_out)
    again = ops.msa_fwd(q, k, v, qi, ki, cu_op, mx, topk, bs, scale, iscale, True, False, True)
    for name, a, b in zip(("out", "kl", "lse", "lse_idx"), (out, kl, lse, lse_idx), (again[0], again[1], again[3],
                                                                                     again[4])):
        assert torch.equal(a, b), f"{name} differs between two runs"
    # Gradients through the public API.
    leaves = [x.detach().requires_grad_(True) for x in (q, k, v, qi, ki)]
    if batched:
        b = q.shape[0] // mx
        o2, kl2 = msa.msa_attention(*(x.view(b, mx, *x.shape[1:]) for x in leaves), topk=topk, block_size=bs,
                                    softmax_scale=scale, index_scale=iscale, warmup=True)
        o2 = o2.reshape(q.shape)
    else:
        o2, kl2 = msa.msa_attention_varlen(*leaves, cu, mx, topk=topk, block_size=bs, softmax_scale=scale,
                                           index_scale=iscale, warmup=True)
    g = torch.Generator().manual_seed(seed)
    dout = torch.randn(o2.shape, generator=g).to(o2)
    dkl = torch.tensor(1.5, device=q.device)
    grads = torch.autograd.grad((o2, kl2), leaves, (dout, dkl))
    assert_grads_close(grads, dout, dkl, q, k, v, qi, ki, None, cu, bs, scale, iscale)


CASES = [(2, 1, 64, 64, 128), (1, 300, 128, 64, 64), (2, 700, 64, 128, 128), (1, 2048, 128, 128, 128)]


@pytest.mark.parametrize("backend", ["auto", "flash"])
@pytest.mark.parametrize("layout", ["batched", "packed"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("case", range(len(CASES)))
def test_warmup_batched(case, dtype, layout, backend, backends, monkeypatch):
    """Equal lengths: cuDNN by default (batched layout, or one packed sequence), flash when asked for
    or when the packed layout holds several sequences (its lengths are not known on the host)."""
    if backend == "flash":
        monkeypatch.setenv("MSA_DENSE_BACKEND", "flash")
    B, N, D, Di, bs = CASES[case]
    heads = HEADS[case % len(HEADS)]
    x = make_inputs(B, N, heads, D, Di, dtype=dtype, device="cuda", seed=case)
    flat = [t.reshape(B * N, *t.shape[2:]) for t in x]
    cu = torch.arange(0, (B + 1) * N, N, dtype=torch.int32, device="cuda")
    _check(*flat, cu, N, 16, bs, seed=case, batched=layout == "batched")
    cudnn = backend == "auto" and (layout == "batched" or B == 1) and N > 1 and torch.backends.cudnn.is_available()
    assert set(backends) == {"cudnn" if cudnn else "flash"}, backends


@pytest.mark.parametrize("index_lse", ["kernel", "dense"])
@pytest.mark.parametrize("backend", ["auto", "flash"])
def test_warmup_negative_scales(backend, index_lse, backends, monkeypatch):
    """Negative softmax and index scales (any finite scale is allowed): cuDNN and flash return an infinite lse
    for a negative scale, so msa::_dense_fwd / _dense_bwd fold the sign into q (exact); lse_idx from the Hopper
    index kernel and from the dense forward."""
    if backend == "flash":
        monkeypatch.setenv("MSA_DENSE_BACKEND", "flash")
    if index_lse == "dense":
        monkeypatch.setenv("MSA_INDEX_LSE", "dense")
    q, k, v, qi, ki, cu, mx = make_packed([300, 300], (8, 2, 4, 1), 64, 128, dtype=torch.bfloat16, device="cuda",
                                          seed=17)
    _check(q, k, v, qi, ki, cu, mx, 16, 64, seed=17, batched=True, scales=(-0.125, -0.1))
    assert set(backends) == {"cudnn" if backend == "auto" and torch.backends.cudnn.is_available() else "flash"}


@pytest.mark.parametrize("heads", [(8, 2, 4, 1), (8, 4, 2, 1), (12, 4, 4, 1)])
def test_warmup_varlen(heads, backends):
    q, k, v, qi, ki, cu, mx = make_packed([900, 1, 129, 0, 1500], heads, 128, 64, dtype=torch.bfloat16,
                                          device="cuda", seed=sum(heads))
    _check(q, k, v, qi, ki, cu, mx, 16, 128, seed=3)
    assert set(backends) == {"flash"}, backends


def test_warmup_deterministic_takes_flash(backends):
    """deterministic=True: flash (cuDNN's backward is not bitwise repeatable), gradients bitwise equal."""
    x = make_inputs(1, 1500, (8, 2, 4, 1), 128, 128, dtype=torch.bfloat16, device="cuda", seed=5)
    runs = []
    for _ in range(2):
        leaves = [t.detach().clone().requires_grad_(True) for t in x]
        out, kl = msa.msa_attention(*leaves, warmup=True, deterministic=True)
        runs.append(torch.autograd.grad((out, kl), leaves, (torch.ones_like(out), torch.ones_like(kl))))
    assert set(backends) == {"flash"}, backends
    for a, b in zip(*runs):
        assert torch.equal(a, b)


def test_warmup_sequence_of_one_token(backends):
    """N = 1, batched: cuDNN takes no one-token sequences, so flash, against the reference."""
    x = make_inputs(3, 1, (4, 2, 2, 1), 64, 64, dtype=torch.bfloat16, device="cuda", seed=9)
    flat = [t.reshape(3, *t.shape[2:]) for t in x]
    cu = torch.arange(0, 4, dtype=torch.int32, device="cuda")
    _check(*flat, cu, 1, 16, 64, seed=9, batched=True)
    assert set(backends) == {"flash"}, backends


def test_warmup_return_indices():
    q, k, v, qi, ki = make_inputs(1, 500, (8, 2, 4, 1), 64, 64, dtype=torch.bfloat16, device="cuda", seed=2)
    out, kl, idx = msa.msa_attention(q, k, v, qi, ki, topk=3, block_size=64, warmup=True, return_indices=True)
    assert torch.equal(idx, msa.select_blocks(qi, ki, topk=3, block_size=64))


@pytest.mark.parametrize("case", range(len(CASES)))
def test_warmup_sparse_kl_pass(case, monkeypatch):
    """MSA_DENSE_KL=0: the KL pass on the sparse kernels in dense mode (what J > 1 layouts, deterministic
    mode and non-Hopper GPUs run), against the reference."""
    monkeypatch.setenv("MSA_DENSE_KL", "0")
    B, N, D, Di, bs = CASES[case]
    x = make_inputs(B, N, HEADS[case % len(HEADS)], D, Di, dtype=torch.bfloat16, device="cuda", seed=case + 40)
    flat = [t.reshape(B * N, *t.shape[2:]) for t in x]
    cu = torch.arange(0, (B + 1) * N, N, dtype=torch.int32, device="cuda")
    _check(*flat, cu, N, 16, bs, seed=case, batched=True)


@pytest.mark.parametrize("N", [8192, 20000])
def test_warmup_long(N):
    """The dense KL pass over many key tiles and query chunks (several CTAs per key tile column)."""
    x = make_inputs(1, N, (16, 2, 4, 1), 128, 128, dtype=torch.bfloat16, device="cuda", seed=N)
    flat = [t.reshape(N, *t.shape[2:]) for t in x]
    cu = torch.tensor([0, N], dtype=torch.int32, device="cuda")
    _check(*flat, cu, N, 16, 128, seed=1, batched=True)


def test_warmup_without_index_grad():
    """index_grad=False (no gradient wanted for q_idx / k_idx, e.g. evaluation): the same out and the same
    KL value, bitwise (the KL sums do not depend on the gradient work), and no index gradients."""
    x = make_inputs(1, 3000, (16, 2, 4, 1), 128, 128, dtype=torch.bfloat16, device="cuda", seed=11)
    flat = [t.reshape(3000, *t.shape[2:]) for t in x]
    args = (None, 3000, 16, 128, 128 ** -0.5, 128 ** -0.5, True, False)
    with_grad = ops.msa_fwd(*flat, *args, True)
    without = ops.msa_fwd(*flat, *args, False)
    assert torch.equal(with_grad[0], without[0]) and torch.equal(with_grad[1], without[1])
    assert without[5].numel() == 0 and without[6].numel() == 0


@pytest.mark.parametrize("warmup", [True, False])
@pytest.mark.parametrize("which", ["q", "k", "q_idx"])
@pytest.mark.parametrize("value", [math.nan, math.inf])
def test_nonfinite_input_gives_nonfinite_kl(value, which, warmup, kernel_choice):
    """One token of the second sequence poisoned: the KL is not finite, as in the reference (the KL kernels
    used to drop a NaN P as if it were 0, and the dense KL kernel's fixed-point sums turned a NaN into a
    number), the first sequence's output is that of the clean run, and the device is fine afterwards.
    Warmup and sparse mode, both kernel paths."""
    x = make_inputs(2, 700, (8, 2, 4, 1), 128, 128, dtype=torch.bfloat16, device="cuda", seed=21)
    clean_out, clean_kl = msa.msa_attention(*x, warmup=warmup)
    assert torch.isfinite(clean_kl).item()
    bad = [t.clone() for t in x]
    bad[("q", "k", "v", "q_idx", "k_idx").index(which)][1, 300] = value
    out, kl = msa.msa_attention(*bad, warmup=warmup)
    assert not torch.isfinite(kl).item(), kl
    assert torch.equal(out[0], clean_out[0])
    again_out, again_kl = msa.msa_attention(*x, warmup=warmup)
    torch.testing.assert_close(again_out, clean_out)
    torch.testing.assert_close(again_kl, clean_kl)


@pytest.mark.parametrize("di", [64, 128])
@pytest.mark.parametrize("deterministic", [False, True])
def test_dense_fwd_lse_only_same_lse(di, deterministic, backends):
    """The index branch's lse_idx comes from msa::_dense_fwd with lse_only=True: cuDNN runs on V's first
    columns (flash, under deterministic=True, on all of V); the lse is bitwise that of the full call."""
    g = torch.Generator(device="cuda").manual_seed(7)
    T, hi = 1536, 4
    qi = torch.randn(T, hi, di, device="cuda", dtype=torch.bfloat16, generator=g)
    ki = torch.randn(T, 1, di, device="cuda", dtype=torch.bfloat16, generator=g)
    cu = torch.tensor([0, 768, T], dtype=torch.int32, device="cuda")
    full_out, full = ops._dense_fwd(qi, ki, ki, cu, 768, di ** -0.5, True, deterministic)
    out, lse = ops._dense_fwd(qi, ki, ki, cu, 768, di ** -0.5, True, deterministic, True)
    assert backends == (["flash"] * 2 if deterministic else ["cudnn"] * 2)
    assert torch.equal(lse, full)
    assert out.shape == (T, hi, di if deterministic else 16)
    assert full_out.shape == (T, hi, di)
