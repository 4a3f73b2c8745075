"""Warmup's dense main branch on cuDNN called by msa_fwd itself (dense_cudnn, csrc/api/dense_attention.cpp): the
route each call takes (no msa::_dense_fwd on the host where it applies), its results against those of the Python
kernel's route (the same cuDNN forward: bitwise) and against the float64 reference, and the calls where the op must
ignore the flag (layouts, deterministic mode, negative scales) or the caller must not pass it (torch.backends, the
environment, a failed shape)."""
import math

import pytest
import torch

import msa
from msa import _ops
from attention_check import assert_forward_close, reference_forward
from helpers import assert_same_forward, make_inputs, make_packed, poison_allocator, suffix_packed

pytestmark = [pytest.mark.gpu, pytest.mark.filterwarnings("error::RuntimeWarning")]
ops = torch.ops.msa
needs_cudnn = pytest.mark.skipif(not torch.backends.cudnn.is_available(), reason="cuDNN not available")


def _host_ops(fn):
    """The dispatcher ops fn() called on the host (torch.profiler's CPU events), by name."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        fn()
    torch.cuda.synchronize()
    return {e.name for e in prof.events()}


def _fwd(args, dense_cudnn, *, det=False, key_layout=(None, None)):
    """msa_fwd in warmup with index gradients."""
    q, k, v, qi, ki, cu, mx, scale, iscale = args
    return ops.msa_fwd(q, k, v, qi, ki, cu, mx, 16, 128, scale, iscale, True, False, True, det, *key_layout,
                       dense_cudnn=dense_cudnn)


def _batched(B, N, heads, D, Di, dtype, seed):
    q, k, v, qi, ki = (t.reshape(B * N, *t.shape[2:]) for t in make_inputs(B, N, heads, D, Di, dtype=dtype,
                                                                           device="cuda", seed=seed))
    return q, k, v, qi, ki, None, N, 1 / math.sqrt(D), 1 / math.sqrt(Di)


@needs_cudnn
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape", [(2, 700, (8, 2, 4, 1), 64, 128), (1, 2048, (16, 2, 4, 2), 128, 64),
                                   (3, 129, (4, 4, 4, 1), 128, 128)])
def test_direct_route_same_results(shape, dtype):
    """B sequences of N tokens (B > 1: cuDNN's lse (B, H, N) is reordered into (H, T) by a copy): the op's own cuDNN
    call takes no msa::_dense_fwd and gives the Python route's results bitwise, into poisoned memory, and the
    reference's."""
    B, N, heads, D, Di = shape
    args = _batched(B, N, heads, D, Di, dtype, seed=B * N)
    poison_allocator()
    direct = _fwd(args, True)
    assert "msa::_dense_fwd" not in _host_ops(lambda: _fwd(args, True))
    assert "msa::_dense_fwd" in _host_ops(lambda: _fwd(args, False))
    assert_same_forward(direct, _fwd(args, False), "the route to cuDNN", written=True)
    q, k, v, qi, ki, _, mx, scale, iscale = args
    cu = torch.arange(0, q.shape[0] + 1, N, dtype=torch.int32, device="cuda")
    exact, (lowp_out, _) = reference_forward(q, k, v, qi, ki, None, cu, 128, scale, iscale)
    out, kl, _, lse, lse_idx, _, _, kl_rows = direct
    assert_forward_close(out, kl, lse, lse_idx, exact, lowp_out, kl_rows)


@needs_cudnn
def test_direct_route_one_packed_sequence():
    """cu_seqlens of one sequence (the packed layout the bench and long-context training use)."""
    q, k, v, qi, ki, cu, mx = make_packed([3000], (8, 2, 4, 1), 128, 128, dtype=torch.bfloat16, device="cuda",
                                          seed=11)
    args = (q, k, v, qi, ki, cu, mx, 128 ** -0.5, 128 ** -0.5)
    assert "msa::_dense_fwd" not in _host_ops(lambda: _fwd(args, True))
    assert_same_forward(_fwd(args, True), _fwd(args, False), "the route to cuDNN")


@pytest.mark.parametrize("case", ["varlen", "deterministic", "negative_scale", "suffix"])
def test_flag_ignored_where_it_does_not_apply(case):
    """dense_cudnn=True where the C++ call does not apply (packed sequences of unequal lengths, deterministic mode, a
    negative scale, queries that are a suffix of one sequence's keys): msa::_dense_fwd chooses, and the results are
    those without the flag."""
    det, key_layout = case == "deterministic", (None, None)
    if case == "varlen":
        q, k, v, qi, ki, cu, mx = make_packed([900, 1, 129, 0, 1500], (8, 2, 4, 1), 128, 64, dtype=torch.bfloat16,
                                              device="cuda", seed=4)
        args = (q, k, v, qi, ki, cu, mx, 128 ** -0.5, 64 ** -0.5)
    elif case == "suffix":
        x = suffix_packed([700], [1500], (8, 2, 4, 1), 64, 64, dtype=torch.bfloat16, device="cuda", seed=6)
        args = (x["q"], x["k"], x["v"], x["qi"], x["ki"], x["cu_q"], x["mx_q"], 0.125, 0.125)
        key_layout = (x["cu_k"], x["mx_k"])
    else:
        args = _batched(2, 600, (8, 2, 4, 1), 64, 64, torch.bfloat16, seed=5)
    if case == "negative_scale":
        args = (*args[:7], -0.125, -0.1)
    assert "msa::_dense_fwd" in _host_ops(lambda: _fwd(args, True, det=det, key_layout=key_layout))
    assert_same_forward(_fwd(args, True, det=det, key_layout=key_layout), _fwd(args, False, det=det, key_layout=key_layout),
                        "dense_cudnn where it does not apply")


def _public_call(**kw):
    x = make_inputs(2, 500, (8, 2, 4, 1), 64, 64, dtype=torch.bfloat16, device="cuda", seed=8, requires_grad=True)
    return lambda: msa.msa_attention(*x, warmup=True, **kw)


@needs_cudnn
def test_public_api_takes_direct_route(monkeypatch):
    """msa_attention(warmup=True) passes dense_cudnn where cuDNN is the choice, and not where it is not: cuDNN SDPA
    disabled in torch.backends, MSA_DENSE_BACKEND=flash, deterministic=True, MSA_DENSE_DIRECT=0, or an aten schema
    other than the one the C++ call is written for."""
    assert "msa::_dense_fwd" not in _host_ops(_public_call())
    assert "msa::_dense_fwd" in _host_ops(_public_call(deterministic=True))
    was = torch.backends.cuda.cudnn_sdp_enabled()
    torch.backends.cuda.enable_cudnn_sdp(False)
    try:
        assert "msa::_dense_fwd" in _host_ops(_public_call())
    finally:
        torch.backends.cuda.enable_cudnn_sdp(was)
    monkeypatch.setenv("MSA_DENSE_BACKEND", "flash")
    assert "msa::_dense_fwd" in _host_ops(_public_call())
    monkeypatch.delenv("MSA_DENSE_BACKEND")
    monkeypatch.setenv("MSA_DENSE_DIRECT", "0")
    assert "msa::_dense_fwd" in _host_ops(_public_call())
    monkeypatch.delenv("MSA_DENSE_DIRECT")
    monkeypatch.setattr(_ops, "_cudnn_schema_ok", False)
    assert "msa::_dense_fwd" in _host_ops(_public_call())


@needs_cudnn
def test_failed_shape_keeps_python_route(monkeypatch):
    """A shape whose cuDNN call failed before (msa/_ops.py _CUDNN_FAILED: flash from then on) is not sent to cuDNN
    again by the op."""
    x = make_inputs(2, 500, (8, 2, 4, 1), 64, 64, dtype=torch.bfloat16, device="cuda", seed=8)
    flat = [t.reshape(1000, *t.shape[2:]) for t in x]
    monkeypatch.setattr(_ops, "_CUDNN_FAILED", {_ops._shape_key(flat[0], flat[1], 500)})
    assert not _ops.dense_cudnn(flat[0], flat[1], None, 500, (), 0.125, False)
    assert _ops.dense_cudnn(flat[0], flat[1], None, 250, (), 0.125, False)  # another length: not failed
