"""Argument checks: the pieces the public API (msa/interface.py) and msa.metrics share with the ops' CPU and fake
kernels (msa/_ops.py), and the kernels' own checks for direct `torch.ops.msa.*` calls.

The public API checks everything first; the kernels' checks mirror the structural rules the CUDA host code
enforces (csrc/api: check_qkv_cuda, check_group_heads, the indices / lse / d_kl checks), so that an op called
directly refuses on the CPU what it refuses on CUDA, with a message naming the argument, instead of a broadcast
into a wrong answer. The CPU path keeps its extras: fp32 / fp64 inputs and any head dim or block size (gradcheck
runs at tiny shapes). cu_seqlens and max_seqlen are checked by msa._ops._seqs.
"""
from __future__ import annotations

import numbers

import torch

from . import reference as ref

MAX_TOPK = 32


def _fail(name, expected, got, exc=ValueError):
    raise exc(f"{name}: expected {expected}, got {got}")


def is_int(x):
    """An int or another integral number (a NumPy integer), not a bool."""
    return isinstance(x, numbers.Integral) and not isinstance(x, bool)


def check_heads(hq, hkv, hi, hki, hi_name="q_idx"):
    """SPEC 1's head rules: Hkv divides Hq; given Hi, Hi divides Hq, Hki (given) divides Hi, and one of Hi, Hkv
    divides the other."""
    if hkv < 1 or hq % hkv:
        _fail("k", f"a kv head count dividing Hq={hq}", hkv)
    if hi is None:
        return
    if hi < 1 or hq % hi:
        _fail(hi_name, f"an index head count dividing Hq={hq}", hi)
    if hki is not None and (hki < 1 or hi % hki):
        _fail("k_idx", f"an index-key head count dividing Hi={hi}", hki)
    if hi % hkv and hkv % hi:
        _fail(hi_name, f"Hi and Hkv={hkv} such that one divides the other", f"Hi={hi}")


def _shape(x):
    return f"shape {tuple(x.shape)}"


def one_device(*tensors):
    """Every tensor argument on one device (a fake kernel runs for a mix with a meta tensor, so it checks too)."""
    xs = [x for x in tensors if isinstance(x, torch.Tensor)]
    for x in xs[1:]:
        if x.device != xs[0].device:
            _fail("tensors", f"one device ({xs[0].device})", f"{x.device} among them")


def qkv(q, k, v):
    """q (T, Hq, D), k and v (T_k, Hkv, D) of q's floating dtype, Hkv dividing Hq."""
    for name, x in (("q", q), ("k", k), ("v", v)):
        if x.dim() != 3:
            _fail(name, "a (T, H, D) tensor", _shape(x))
        if not x.is_floating_point() or x.dtype != q.dtype:
            _fail(name, f"dtype {q.dtype} (that of q; floating point)", x.dtype)
    if v.shape != k.shape:
        _fail("v", f"the shape of k {tuple(k.shape)}", _shape(v))
    if k.shape[2] != q.shape[2]:
        _fail("k", f"head dim D = {q.shape[2]} (that of q)", k.shape[2])
    if q.shape[1] < 1:
        _fail("q", "at least one head", _shape(q))
    check_heads(q.shape[1], k.shape[1], None, None)


def index_qk(q_idx, k_idx, T, Tk):
    """q_idx (T, Hi, Di), k_idx (T_k, Hki, Di) of one floating dtype, Hki dividing Hi."""
    for name, x, rows in (("q_idx", q_idx, T), ("k_idx", k_idx, Tk)):
        if x.dim() != 3 or x.shape[0] != rows:
            _fail(name, f"a ({rows}, H, Di) tensor", _shape(x))
        if not x.is_floating_point() or x.dtype != q_idx.dtype:
            _fail(name, f"dtype {q_idx.dtype} (that of q_idx; floating point)", x.dtype)
    if k_idx.shape[2] != q_idx.shape[2]:
        _fail("k_idx", f"head dim Di = {q_idx.shape[2]} (that of q_idx)", k_idx.shape[2])
    if k_idx.shape[1] < 1 or q_idx.shape[1] < 1 or q_idx.shape[1] % k_idx.shape[1]:
        _fail("k_idx", f"a head count dividing Hi = {q_idx.shape[1]}", k_idx.shape[1])


# The selection's FP8 inputs (index_dtype, SPEC 2): e4m3 copies of q_idx / k_idx.
FP8_DTYPES = (torch.float8_e4m3fn,)


def sel_inputs(q_idx, k_idx, sel_q_idx, sel_k_idx):
    """msa_fwd's selection inputs: (sel_q_idx, sel_k_idx), both of their index tensor's shape and device, of one
    dtype, float8_e4m3fn or that of q_idx; or neither (None: the selection scores q_idx, k_idx)."""
    if (sel_q_idx is None) != (sel_k_idx is None):
        _fail("sel_q_idx, sel_k_idx", "both or neither", "one of them")
    if sel_q_idx is None:
        return None
    for name, x, like in (("sel_q_idx", sel_q_idx, q_idx), ("sel_k_idx", sel_k_idx, k_idx)):
        if x.shape != like.shape or x.device != like.device:
            _fail(name, f"shape {tuple(like.shape)} on {like.device}", f"{_shape(x)} on {x.device}")
        if x.dtype not in FP8_DTYPES + (like.dtype,) or x.dtype != sel_q_idx.dtype:
            _fail(name, f"dtype float8_e4m3fn or {like.dtype}, one for both", x.dtype)
    return sel_q_idx, sel_k_idx


def topk(k):
    if not 1 <= k <= MAX_TOPK:
        _fail("topk", f"1..{MAX_TOPK}", k)


def block_size(bs):
    if bs < 1:
        _fail("block_size", "a positive int", bs)


def indices(idx, T=None, hq=None, hkv=None, name="indices"):
    """int32 (Hi, T, topk) with 1 <= topk <= 32 (T: any where None) and, given (Hq, Hkv), Hi an index-group count
    of them."""
    if (idx.dtype != torch.int32 or idx.dim() != 3 or (T is not None and idx.shape[1] != T)
            or not 1 <= idx.shape[2] <= MAX_TOPK):
        _fail(name, f"int32 (Hi, {'T' if T is None else T}, 1..{MAX_TOPK})", f"{idx.dtype} {_shape(idx)}")
    if hq is not None:
        check_heads(hq, hkv, idx.shape[0], None, name)


def like(name, x, want):
    """x of want's shape and dtype (dout and out beside q)."""
    if x.shape != want.shape or x.dtype != want.dtype:
        _fail(name, f"{want.dtype} {tuple(want.shape)}", f"{x.dtype} {_shape(x)}")


def lse(name, x, heads, T, dtype):
    """An lse (heads, T) in the accumulation dtype of the inputs."""
    acc = ref.acc_dtype(dtype)
    if x.dtype != acc or tuple(x.shape) != (heads, T):
        _fail(name, f"{acc} ({heads}, {T})", f"{x.dtype} {_shape(x)}")


def d_kl(x):
    if x.numel() != 1 or not x.is_floating_point():
        _fail("d_kl", "one floating-point value", f"{x.dtype} {_shape(x)}")
