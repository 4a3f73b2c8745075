"""Gradients of the CPU path by finite differences in float64 (SPEC 4 autograd rules)."""
import pytest
import torch
from torch.autograd import gradcheck

import msa
from helpers import make_inputs, make_packed

ops = torch.ops.msa


@pytest.mark.parametrize("warmup", [False, True])
@pytest.mark.parametrize("heads", [(8, 2, 4, 1), (8, 4, 2, 1)])
def test_out_gradcheck(warmup, heads):
    """d out / d (q, k, v) through msa_attention (selection fixed: q_idx, k_idx are constants)."""
    q, k, v, qi, ki = make_inputs(2, 150, heads, 64, 64, seed=1)
    for x in (q, k, v):
        x.requires_grad_(True)
    f = lambda q, k, v: msa.msa_attention(q, k, v, qi, ki, topk=2, block_size=64, warmup=warmup)[0]  # noqa: E731
    assert gradcheck(f, (q, k, v), fast_mode=True, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("warmup", [False, True])
@pytest.mark.parametrize("heads", [(8, 2, 4, 1), (16, 2, 4, 2)])
def test_kl_gradcheck(warmup, heads):
    """d kl / d (q_idx, k_idx); q, k, v are constants (the teacher is detached, so their kl
    gradient is zero by definition and is checked separately)."""
    q, k, v, qi, ki = make_inputs(2, 150, heads, 64, 64, seed=2)
    qi.requires_grad_(True)
    ki.requires_grad_(True)
    f = lambda qi, ki: msa.msa_attention(q, k, v, qi, ki, topk=2, block_size=64, warmup=warmup)[1]  # noqa: E731
    assert gradcheck(f, (qi, ki), fast_mode=True, atol=1e-7, rtol=1e-5)


def test_varlen_gradcheck():
    """out -> q, k, v and kl -> q_idx, k_idx on packed sequences. The kl's gradients are ~1e-4 (a mean over
    T * Hi rows), so its check takes test_kl_gradcheck's atol: the default 1e-5 passes them halved."""
    q, k, v, qi, ki, cu, mx = make_packed([130, 7, 70], (8, 2, 4, 1), 64, 64, seed=3)
    for x in (q, k, v, qi, ki):
        x.requires_grad_(True)

    def f(q, k, v, qi, ki):
        out, kl = msa.msa_attention_varlen(q, k, v, qi, ki, cu, mx, topk=1, block_size=64)
        return out, kl
    assert gradcheck(lambda q, k, v: f(q, k, v, qi, ki)[0], (q, k, v), fast_mode=True)
    assert gradcheck(lambda qi, ki: f(q, k, v, qi, ki)[1], (qi, ki), fast_mode=True, atol=1e-7, rtol=1e-5)


def test_sparse_attention_gradcheck():
    q, k, v, qi, ki = make_inputs(1, 200, (4, 4, 2, 1), 64, 64, seed=4)
    idx = msa.select_blocks(qi, ki, topk=2, block_size=64)
    for x in (q, k, v):
        x.requires_grad_(True)
    assert gradcheck(lambda q, k, v: msa.sparse_attention(q, k, v, idx, block_size=64), (q, k, v), fast_mode=True)


@pytest.mark.parametrize("warmup,index_grad", [(False, False), (True, False), (False, True), (True, True)])
def test_full_gradcheck_tiny(warmup, index_grad):
    """Every Jacobian entry (slow mode) on a tiny problem, through the op and its registered autograd:
    4-token blocks, head dims 8 (the op itself takes any size; the public API restricts them)."""
    g = torch.Generator().manual_seed(5)
    T, Hq, Hkv, Hi, Hki, D = 14, 4, 2, 2, 1, 8
    mk = lambda h: torch.randn(T, h, D, generator=g, dtype=torch.float64, requires_grad=True)  # noqa: E731
    q, k, v, qi, ki = mk(Hq), mk(Hkv), mk(Hkv), mk(Hi), mk(Hki)
    cu = torch.tensor([0, 9, 14], dtype=torch.int32)

    def f(q, k, v, qi, ki):
        out, kl = ops.msa_fwd(q, k, v, qi, ki, cu, 9, 2, 4, 0.3, 0.4, warmup, False, index_grad)[:2]
        return out, kl
    assert gradcheck(lambda q, k, v: f(q, k, v, qi.detach(), ki.detach())[0], (q, k, v))
    assert gradcheck(lambda qi, ki: f(q.detach(), k.detach(), v.detach(), qi, ki)[1], (qi, ki))


def test_autograd_routing():
    """out gives no gradient to q_idx/k_idx; kl gives none to q/k/v (teacher detached)."""
    q, k, v, qi, ki = make_inputs(1, 130, (8, 2, 4, 1), 64, 64, seed=6, requires_grad=True)
    out, kl = msa.msa_attention(q, k, v, qi, ki, topk=1, block_size=64)
    g = torch.autograd.grad(out.sum(), (q, k, v, qi, ki), allow_unused=True)
    assert all(x is not None and x.abs().sum() > 0 for x in g[:3]) and g[3] is None and g[4] is None
    out, kl = msa.msa_attention(q, k, v, qi, ki, topk=1, block_size=64)
    g = torch.autograd.grad(kl, (q, k, v, qi, ki), allow_unused=True)
    assert all(x is None for x in g[:3]) and all(x is not None and x.abs().sum() > 0 for x in g[3:])


@pytest.mark.parametrize("warmup,needs", [(False, "all"), (True, "all"), (False, "main"), (False, "index")])
def test_eager_function_matches_the_registered_autograd(warmup, needs):
    """msa_attention in eager mode runs msa_fwd under msa._ops.MsaFunction (no Python autograd kernel on the host's
    path); its outputs and the gradients of the inputs that need them (all five, only q / k / v, only the index
    inputs) equal those of the op through its registered autograd, and autocast keeps the registered path."""
    x = list(make_inputs(2, 150, (8, 2, 4, 1), 64, 64, seed=11))
    grad_of = {"all": range(5), "main": range(3), "index": range(3, 5)}[needs]
    for i in grad_of:
        x[i].requires_grad_(True)
    q, k, v, qi, ki = x
    wrt = [x[i] for i in grad_of]
    out, kl = msa.msa_attention(q, k, v, qi, ki, topk=2, block_size=64, warmup=warmup)
    fn = (kl if needs != "main" else out).grad_fn
    if needs == "main":
        fn = fn.next_functions[0][0]  # out is a view of the op's output
    assert type(fn).__name__ == "MsaFunctionBackward"
    dout = torch.randn_like(out)
    loss = lambda o, s: (o * dout).sum() * (needs != "index") + 0.7 * s * (needs != "main")  # noqa: E731
    want = torch.autograd.grad(loss(out, kl), wrt)
    flat = [t.reshape(300, *t.shape[2:]) for t in x]
    out2, kl2 = ops.msa_fwd(*flat, None, 150, 2, 64, 64 ** -0.5, 64 ** -0.5, warmup, False, needs != "main", False)[:2]
    got = torch.autograd.grad(loss(out2.view_as(out), kl2), wrt)
    assert torch.equal(out2.view_as(out), out) and torch.equal(kl2, kl)
    for a, b in zip(want, got):
        assert torch.equal(a, b)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out3, kl3 = msa.msa_attention(q, k, v, qi, ki, topk=2, block_size=64, warmup=warmup)
    fn3 = (kl3 if needs != "main" else out3).grad_fn
    names = {type(fn3).__name__} | {type(f).__name__ for f, _ in fn3.next_functions if f is not None}
    assert any(n.startswith("GeneratedBackwardFor_msa_msa_fwd") for n in names), names


@pytest.mark.filterwarnings("ignore::torch.jit.TracerWarning", "ignore:.*torch.jit.trace. is deprecated")
def test_jit_trace_records_the_op():
    """torch.jit.trace of msa_attention on inputs that need gradients records msa::msa_fwd (the registered path), not
    the eager MsaFunction, so the traced module can be saved."""
    q, k, v, qi, ki = make_inputs(1, 130, (8, 2, 4, 1), 64, 64, seed=12, requires_grad=True)
    traced = torch.jit.trace(lambda *x: msa.msa_attention(*x, topk=2, block_size=64), (q, k, v, qi, ki),
                             check_trace=False)
    assert "msa::msa_fwd" in str(traced.graph) and "PythonOp" not in str(traced.graph)


def test_kl_gradient_is_pidx_minus_p():
    """SPEC 4 directly: with k_idx = I-like keys, d kl / d S_idx = (Pidx - P) / rows; checked through
    the chain rule on q_idx for a one-sequence, one-head case against explicit probabilities."""
    T, D = 6, 64
    g = torch.Generator().manual_seed(8)
    q = torch.randn(1, T, 1, D, generator=g, dtype=torch.float64)
    k = torch.randn(1, T, 1, D, generator=g, dtype=torch.float64)
    v = torch.randn(1, T, 1, D, generator=g, dtype=torch.float64)
    qi = torch.randn(1, T, 1, D, generator=g, dtype=torch.float64, requires_grad=True)
    ki = torch.randn(1, T, 1, D, generator=g, dtype=torch.float64)
    _, kl = msa.msa_attention(q, k, v, qi, ki, topk=1, block_size=64, softmax_scale=0.2, index_scale=0.3)
    (dqi,) = torch.autograd.grad(kl, qi)
    want = torch.zeros(T, D, dtype=torch.float64)
    for i in range(T):
        P = torch.softmax(0.2 * k[0, :i + 1, 0] @ q[0, i, 0], 0)
        Pidx = torch.softmax(0.3 * ki[0, :i + 1, 0] @ qi[0, i, 0].detach(), 0)
        want[i] = 0.3 * ((Pidx - P) / T) @ ki[0, :i + 1, 0]
    torch.testing.assert_close(dqi[0, :, 0], want, rtol=1e-10, atol=1e-14)
