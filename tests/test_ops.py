"""torch.library integration: opcheck on every op, torch.compile(fullgraph=True) of the public API."""
import pytest
import torch

import msa
from helpers import make_packed

ops = torch.ops.msa


def _packed(dtype=torch.float32, requires_grad=True, lengths=(70, 30)):
    q, k, v, qi, ki, cu, mx = make_packed(list(lengths), (8, 2, 4, 1), 64, 64, dtype=dtype, seed=1,
                                          requires_grad=requires_grad)
    return q, k, v, qi, ki, cu, mx


@pytest.mark.parametrize("warmup,ret,grad", [(False, False, True), (False, False, False), (True, False, True),
                                              (True, True, False)])
def test_opcheck_msa_fwd(warmup, ret, grad):
    q, k, v, qi, ki, cu, mx = _packed()
    torch.library.opcheck(ops.msa_fwd, (q, k, v, qi, ki, cu, mx, 2, 64, 0.125, 0.125, warmup, ret, grad))


@pytest.mark.parametrize("grad", [False, True])
def test_opcheck_msa_bwd(grad):
    q, k, v, qi, ki, cu, mx = _packed(requires_grad=False)
    out, kl, idx, lse, lse_idx, g_q, g_k, _ = ops.msa_fwd(q, k, v, qi, ki, cu, mx, 2, 64, 0.125, 0.125, False, False,
                                                        grad)
    dout = torch.randn_like(out)
    dkl = torch.tensor(1.5)
    for d_out, d_kl in ((dout, dkl), (None, dkl), (dout, None)):
        torch.library.opcheck(ops.msa_bwd, (d_out, d_kl, q, k, v, out, lse, qi, ki, lse_idx, idx, g_q, g_k, cu, mx,
                                            64, 0.125, 0.125, False))


@pytest.mark.parametrize("warmup", [False, True])
def test_forward_index_grad_matches_backward(warmup):
    """kl_dq_idx / kl_dk_idx of the forward equal the backward's recomputation for d_kl = 1 (softmax and index
    scales differ, so an argument swapped on either side shows), and a finite difference of kl."""
    # 300 tokens: 5 blocks of 64, of which topk = 2 selects fewer than are visible (warmup differs from sparse)
    q, k, v, qi, ki, cu, mx = _packed(dtype=torch.float64, requires_grad=False, lengths=(300, 130))
    out, kl, idx, lse, lse_idx, g_q, g_k, _ = ops.msa_fwd(q, k, v, qi, ki, cu, mx, 2, 64, 0.125, 0.09, warmup, False,
                                                        True)
    none = torch.empty(0, dtype=torch.float64)
    *_, dq_idx, dk_idx = ops.msa_bwd(None, torch.tensor(1.0, dtype=torch.float64), q, k, v, out, lse, qi, ki,
                                     lse_idx, idx, none, none, cu, mx, 64, 0.125, 0.09, warmup)
    torch.testing.assert_close(g_q, dq_idx)
    torch.testing.assert_close(g_k, dk_idx)
    # Both sides above run the same reference code: the values themselves against a central difference of kl
    # along one random direction of (q_idx, k_idx) (float64; the step leaves the selection as it is).
    g = torch.Generator().manual_seed(5)
    eq, ek = (torch.randn(x.shape, generator=g, dtype=torch.float64) for x in (qi, ki))
    h = 1e-6

    def kl_at(sign):
        return ops.msa_fwd(q, k, v, qi + sign * h * eq, ki + sign * h * ek, cu, mx, 2, 64, 0.125, 0.09, warmup, False,
                           False)[1].item()
    fd = (kl_at(1) - kl_at(-1)) / (2 * h)
    want = (g_q * eq).sum().item() + (g_k * ek).sum().item()
    assert abs(fd - want) <= 1e-5 * abs(want) + 1e-9, (fd, want)


def test_opcheck_select_sparse_reverse():
    q, k, v, qi, ki, cu, mx = _packed()
    idx = ops.select_blocks(qi.detach(), ki.detach(), cu, mx, 2, 64, 0.125)
    torch.library.opcheck(ops.select_blocks, (qi, ki, cu, mx, 2, 64, 0.125))
    torch.library.opcheck(ops.sparse_fwd, (q, k, v, idx, cu, mx, 64, 0.125))
    out, lse = ops.sparse_fwd(q.detach(), k.detach(), v.detach(), idx, cu, mx, 64, 0.125)
    torch.library.opcheck(ops.sparse_bwd, (torch.randn_like(out), q.detach(), k.detach(), v.detach(), out, lse, idx,
                                           cu, mx, 64, 0.125))
    torch.library.opcheck(ops.reverse_index, (idx, cu, mx, 64))


@pytest.mark.parametrize("warmup,index_dtype", [(False, None), (True, None), (False, torch.float8_e4m3fn)])
def test_compile_fullgraph_msa_attention(warmup, index_dtype):
    torch._dynamo.reset()
    from helpers import make_inputs
    q, k, v, qi, ki = make_inputs(2, 100, (8, 2, 4, 1), 64, 64, dtype=torch.bfloat16, seed=2, requires_grad=True)

    def step(q, k, v, qi, ki):
        out, kl = msa.msa_attention(q, k, v, qi, ki, topk=2, block_size=64, warmup=warmup, index_dtype=index_dtype)
        return out.float().square().mean() + kl

    compiled = torch.compile(step, fullgraph=True, backend="aot_eager")
    loss_c = compiled(q, k, v, qi, ki)
    grads_c = torch.autograd.grad(loss_c, (q, k, v, qi, ki))
    loss_e = step(q, k, v, qi, ki)
    grads_e = torch.autograd.grad(loss_e, (q, k, v, qi, ki))
    torch.testing.assert_close(loss_c, loss_e)
    for a, b in zip(grads_c, grads_e):
        torch.testing.assert_close(a, b)


def test_compile_fullgraph_inductor():
    torch._dynamo.reset()
    from helpers import make_inputs
    q, k, v, qi, ki = make_inputs(1, 70, (4, 4, 4, 1), 64, 64, dtype=torch.float32, seed=3)
    f = torch.compile(lambda *a: msa.msa_attention(*a, topk=1, block_size=64), fullgraph=True)
    out, kl = f(q, k, v, qi, ki)
    want, want_kl = msa.msa_attention(q, k, v, qi, ki, topk=1, block_size=64)
    torch.testing.assert_close(out, want)
    torch.testing.assert_close(kl, want_kl)
