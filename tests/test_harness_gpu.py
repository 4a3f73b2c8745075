"""msa inside the training harnesses, on CUDA: torch.compile (fullgraph, dynamic shapes, inductor's CUDA
graphs), torch.cuda.graph capture of a whole training step, autocast, activation checkpointing, the
layouts training code hands over (fused QKV slices, (B, H, N, D) transposes), NaN / Inf inputs.

Every case runs on both kernel paths (the Hopper kernels and the portable ones), except the
torch.compile ones: what compile traces does not depend on the kernel, and CUDA graph capture of both
paths is covered by the torch.cuda.graph test."""
import math

import pytest
import torch
from torch.utils.checkpoint import checkpoint

import msa
from helpers import make_inputs, make_packed

pytestmark = [pytest.mark.gpu]
both_paths = pytest.mark.usefixtures("kernel_choice")  # the Hopper kernels and the portable ones

HEADS = (8, 2, 4, 1)
TOPK, BS = 3, 64


def _leaves(xs):
    return [x.detach().clone().requires_grad_(True) for x in xs]


def _upstream(out, seed):
    g = torch.Generator(device="cpu").manual_seed(seed)
    return torch.randn(out.shape, generator=g).to(out), torch.tensor(0.5 + seed % 3, device=out.device)


def _grads(fn, xs, seed):
    """fn's outputs ((out, kl), or out alone) and the gradients for random dout (and d_kl) w.r.t. xs."""
    leaves = _leaves(xs)
    res = fn(*leaves)
    outs = list(res[:2]) if isinstance(res, tuple) else [res]
    dout, dkl = _upstream(outs[0], seed)
    return (*outs, *torch.autograd.grad(outs, leaves, (dout, dkl)[:len(outs)]))


def _close(got, want, names):
    for name, a, b in zip(names, got, want):
        assert a.dtype == b.dtype and a.shape == b.shape, name
        torch.testing.assert_close(a, b, msg=lambda m: f"{name}: {m}")


NAMES = ("out", "kl", "dq", "dk", "dv", "dq_idx", "dk_idx")


# ----------------------------------------------------------------------------------------------
# torch.compile on CUDA
# ----------------------------------------------------------------------------------------------
def _batched(N, seed):
    return make_inputs(2, N, HEADS, 64, 64, dtype=torch.bfloat16, device="cuda", seed=seed)


def _varlen(lengths, seed):
    return make_packed(lengths, HEADS, 64, 64, dtype=torch.bfloat16, device="cuda", seed=seed)


def _msa_attention(*x):
    return msa.msa_attention(*x, topk=TOPK, block_size=BS)


def _msa_attention_varlen(q, k, v, qi, ki, cu, mx):
    return msa.msa_attention_varlen(q, k, v, qi, ki, cu, mx, topk=TOPK, block_size=BS)


def _api_case(api, i):
    """(fn, differentiable inputs, other inputs) of one public function at the i-th of two sizes."""
    N = (300, 517)[i]
    if api == "msa_attention_varlen":
        q, k, v, qi, ki, cu, mx = _varlen(([300, 77], [517, 1, 200])[i], seed=i)
        return _msa_attention_varlen, [q, k, v, qi, ki], [cu, mx]
    q, k, v, qi, ki = _batched(N, seed=N)
    if api == "msa_attention":
        return _msa_attention, [q, k, v, qi, ki], []
    if api == "sparse_attention":
        def fn(q, k, v, idx):
            return msa.sparse_attention(q, k, v, idx, block_size=BS)
        return fn, [q, k, v], [msa.select_blocks(qi, ki, topk=TOPK, block_size=BS)]

    def select(qi, ki):
        return msa.select_blocks(qi, ki, topk=TOPK, block_size=BS)
    return select, [], [qi, ki]


@pytest.mark.parametrize("api", ["msa_attention", "msa_attention_varlen", "sparse_attention", "select_blocks"])
def test_compile_fullgraph_dynamic(api):
    """fullgraph inductor compile with dynamic shapes: equal to eager at two sequence lengths, and the
    second (a new N or T, new cu_seqlens and max_seqlen) runs without recompiling."""
    torch._dynamo.reset()
    compiled = None
    for i in range(2):
        fn, diff, rest = _api_case(api, i)
        if compiled is None:
            compiled = torch.compile(fn, fullgraph=True, dynamic=True)
        else:
            torch.compiler.set_stance("fail_on_recompile")
        try:
            if not diff:
                assert torch.equal(compiled(*rest), fn(*rest))
                continue
            eager = _grads(lambda *a: fn(*a, *rest), diff, seed=i)
            comp = _grads(lambda *a: compiled(*a, *rest), diff, seed=i)
            names = NAMES if len(eager) == 7 else ("out", "dq", "dk", "dv")
            _close(comp, eager, names)
        finally:
            torch.compiler.set_stance("default")


@pytest.mark.parametrize("layout", ["batched", "varlen"])
def test_compile_reduce_overhead(layout):
    """mode="reduce-overhead" (inductor's CUDA graphs) around the forward, the backward run by autograd:
    calls on new values, recorded once and replayed, equal eager. A varlen cu_seqlens is marked static
    and checked before the first call (docs/semantics.md)."""
    torch._dynamo.reset()
    fn, _, extra = _api_case("msa_attention" if layout == "batched" else "msa_attention_varlen", 0)
    if extra:
        torch._dynamo.mark_static_address(extra[0])
        msa.validate_cu_seqlens(extra[0], extra[1], 377)
    compiled = torch.compile(fn, mode="reduce-overhead", fullgraph=True)
    for i in range(4):  # record, then replays, on fresh values each time
        xs = _batched(300, seed=10 + i) if layout == "batched" else _varlen([300, 77], seed=10 + i)[:5]
        want = _grads(lambda *a: fn(*a, *extra), xs, seed=i)
        torch.compiler.cudagraph_mark_step_begin()
        got = [g.clone() for g in _grads(lambda *a: compiled(*a, *extra), xs, seed=i)]
        _close(got, want, NAMES)


@both_paths
# ----------------------------------------------------------------------------------------------
# torch.cuda.graph: a whole training step captured and replayed on new values
# ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("layout", ["batched", "varlen"])
def test_cuda_graph_training_step(layout):
    """Forward, both losses and backward captured once; each replay on new input values gives the
    eager step's loss and gradients (nothing in the step syncs with the host: the capture would fail)."""
    if layout == "batched":
        sets = [_batched(300, seed=s) for s in range(3)]
        fn, extra = _msa_attention, []
    else:
        sets = []
        for s in range(3):
            q, k, v, qi, ki, cu, mx = _varlen([300, 1, 76], seed=s)
            sets.append([q, k, v, qi, ki])
        fn, extra = _msa_attention_varlen, [cu, mx]
        msa.validate_cu_seqlens(cu, mx, 377)  # SPEC 7's host check, before the capture
    static = _leaves(sets[0])
    g = torch.Generator(device="cpu").manual_seed(7)
    w = torch.randn(static[0].shape, generator=g).to("cuda")

    def step():
        out, kl = fn(*static, *extra)
        loss = (out.float() * w).sum() + 0.3 * kl
        loss.backward()
        return loss

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):  # warm up outside the capture (allocator, lazy init)
            for x in static:
                x.grad = None
            step()
    torch.cuda.current_stream().wait_stream(side)
    for x in static:
        x.grad = None
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_loss = step()
    for x in sets[1:]:
        with torch.no_grad():
            for s, new in zip(static, x):
                s.copy_(new)
        graph.replay()
        eager = _leaves(x)
        out, kl = fn(*eager, *extra)
        loss = (out.float() * w).sum() + 0.3 * kl
        loss.backward()
        torch.testing.assert_close(static_loss, loss, rtol=1e-5, atol=1e-5)
        for name, s, e in zip(NAMES[2:], static, eager):
            torch.testing.assert_close(s.grad, e.grad, msg=lambda m: f"{name}: {m}")


@both_paths
@pytest.mark.parametrize("N", [347, 349])  # shapes no other test uses: first seen inside the capture
def test_capture_of_a_new_batched_shape(N):
    """The batched layout's sequence offsets are kept per shape after their first eager call; a shape first seen
    inside a CUDA graph capture builds its own inside the graph (its kernel has not run yet, so it must not be
    kept): the replay and a later eager call of the same shape both give the eager answer."""
    with torch.no_grad():
        _msa_attention(*_batched(200, seed=1))  # lazy initialisation outside the capture, another shape
        x = _batched(N, seed=2)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out, kl = _msa_attention(*x)
        graph.replay()
        torch.cuda.synchronize()
        ref_out, ref_kl = _msa_attention(*x)  # eager, after the capture: builds and keeps the offsets
        again_out, again_kl = _msa_attention(*x)  # eager, from the kept offsets
    torch.testing.assert_close(out, ref_out, rtol=0, atol=0)
    torch.testing.assert_close(kl, ref_kl, rtol=0, atol=0)
    torch.testing.assert_close(again_out, ref_out, rtol=0, atol=0)
    torch.testing.assert_close(again_kl, ref_kl, rtol=0, atol=0)
    assert torch.isfinite(ref_out).all() and torch.isfinite(ref_kl)


@both_paths
def test_capture_of_unchecked_cu_seqlens_raises():
    """A cu_seqlens never checked before the capture cannot be read during it: a clear error."""
    q, k, v, qi, ki, cu, mx = _varlen([100, 50], seed=3)
    fresh = cu.clone()
    graph = torch.cuda.CUDAGraph()
    with pytest.raises(RuntimeError, match="msa.validate_cu_seqlens"):
        with torch.cuda.graph(graph):
            msa.msa_attention_varlen(q, k, v, qi, ki, fresh, mx, topk=TOPK, block_size=BS)
    torch.cuda.synchronize()
    msa.msa_attention_varlen(q, k, v, qi, ki, fresh, mx, topk=TOPK, block_size=BS)  # eager is fine after


@both_paths
# ----------------------------------------------------------------------------------------------
# Autocast, checkpointing, layouts
# ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_autocast_casts_fp32_inputs(dtype):
    """Under torch.autocast fp32 inputs run as the autocast dtype, like torch's attention; gradients
    reach the fp32 leaves. Outside autocast fp32 on CUDA is a TypeError (test_errors)."""
    xs = make_inputs(2, 300, HEADS, 64, 64, dtype=torch.float32, device="cuda", seed=4)
    with torch.autocast("cuda", dtype=dtype):
        got = _grads(_msa_attention, xs, seed=4)
    want = _grads(_msa_attention, [x.to(dtype) for x in xs], seed=4)
    assert got[0].dtype == dtype and got[2].dtype == torch.float32
    _close(got[:2], want[:2], NAMES[:2])
    _close([g.to(dtype) for g in got[2:]], want[2:], NAMES[2:])
    with pytest.raises(TypeError, match=r"^q: expected dtype in .* on cuda, got torch\.float32$"):
        _msa_attention(*xs)


@both_paths
def test_activation_checkpointing():
    """Non-reentrant checkpointing recomputes the forward in the backward: the recomputed selection and
    the gradients are those of a run without checkpointing."""
    xs = _batched(400, seed=5)

    def block(q, k, v, qi, ki):
        return msa.msa_attention(q, k, v, qi, ki, topk=TOPK, block_size=BS, return_indices=True)

    def ckpt(*a):
        return checkpoint(block, *a, use_reentrant=False)

    want = _grads(block, xs, seed=5)
    got = _grads(ckpt, xs, seed=5)
    _close(got, want, NAMES)
    assert torch.equal(ckpt(*xs)[2], block(*xs)[2])


@both_paths
def test_strided_layouts():
    """q, k, v as slices of one fused QKV projection and (B, H, N, D) tensors transposed to (B, N, H, D),
    likewise q_idx / k_idx: the same results as contiguous inputs, gradients into the fused tensors."""
    Hq, Hkv, Hi, Hki = HEADS
    ref = _batched(300, seed=6)
    qkv = torch.cat(ref[:3], dim=2).detach().requires_grad_(True)  # (B, N, Hq + 2 Hkv, D)
    idx = torch.cat(ref[3:], dim=2).detach().requires_grad_(True)  # (B, N, Hi + Hki, Di)
    fused = [*qkv.split([Hq, Hkv, Hkv], dim=2), *idx.split([Hi, Hki], dim=2)]
    assert not fused[0].is_contiguous()
    bhnd = [x.detach().transpose(1, 2).contiguous().requires_grad_(True) for x in ref]  # (B, H, N, D) leaves
    want = _grads(_msa_attention, ref, seed=6)
    for views, leaves in ((fused, (qkv, idx)), ([x.transpose(1, 2) for x in bhnd], bhnd)):
        out, kl = _msa_attention(*views)
        dout, dkl = _upstream(out, seed=6)
        grads = torch.autograd.grad((out, kl), leaves, (dout, dkl))
        if len(grads) == 2:  # the fused tensors: split their gradients back per input
            grads = [*grads[0].split([Hq, Hkv, Hkv], dim=2), *grads[1].split([Hi, Hki], dim=2)]
        else:
            grads = [g.transpose(1, 2) for g in grads]
        _close([out, kl, *grads], want, NAMES)


@both_paths
# ----------------------------------------------------------------------------------------------
# NaN / Inf inputs
# ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("which", ["q", "k", "v", "q_idx", "k_idx"])
@pytest.mark.parametrize("value", [math.nan, math.inf])
def test_nonfinite_inputs(which, value):
    """One token of the second sequence poisoned with NaN or Inf: no fault, hang or out-of-bounds
    access; the first sequence's outputs and gradients, and the poisoned sequence's rows before the
    token's block, are those of the clean run; where SDPA gives NaN (the poisoned query's row) msa does
    too; the selection stays valid. (Rows of the token's block before it can turn NaN too: a masked
    key's P is 0 and 0 * NaN = NaN in P V, as in SDPA's math and flash kernels.)"""
    N, t0 = 400, 250
    xs = _batched(N, seed=8)
    clean = _grads(_msa_attention, xs, seed=8)
    bad = [x.clone() for x in xs]
    pos = ("q", "k", "v", "q_idx", "k_idx").index(which)
    bad[pos][1, t0] = value
    got = _grads(_msa_attention, bad, seed=8)
    torch.cuda.synchronize()
    out, clean_out = got[0], clean[0]
    b0 = t0 // BS * BS
    assert torch.equal(out[0], clean_out[0]) and torch.equal(out[1, :b0], clean_out[1, :b0])
    if which == "q":
        assert torch.isnan(out[1, t0]).all()
    for name, a, b in zip(NAMES[2:], got[2:], clean[2:]):
        torch.testing.assert_close(a[0], b[0], msg=lambda m: f"{name}, clean sequence: {m}")
    idx = msa.select_blocks(bad[3], bad[4], topk=TOPK, block_size=BS)
    local = torch.arange(N, device="cuda") // BS
    assert ((idx == -1) | ((idx >= 0) & (idx <= local[None, None, :, None]))).all()
    assert (idx == local[None, None, :, None]).any(-1).all(), "the local block is always selected"
    again = _grads(_msa_attention, xs, seed=8)  # the device is fine afterwards
    _close(again, clean, NAMES)
