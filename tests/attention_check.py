"""Oracles for the CUDA attention kernels (STYLE rule 7).

The exact reference runs on the GPU in float64 (its factories follow the default device). The
same-precision baseline is the same reference with its accumulation dtype forced to the input dtype
(bf16/fp16 matmuls and softmax), which is what a plain PyTorch implementation in that precision does.
A kernel passes when its error against the exact reference is at most twice the baseline's plus atol.
"""
from contextlib import contextmanager
from functools import partial

import torch

from msa import reference as ref

ATOL = {torch.bfloat16: 2e-3, torch.float16: 5e-4}


@contextmanager
def on_device(device):
    with torch.device(device):
        yield


@contextmanager
def low_precision():
    """Make the reference accumulate in the input dtype (bf16/fp16)."""
    saved = ref.acc_dtype
    ref.acc_dtype = lambda dtype: dtype
    try:
        yield
    finally:
        ref.acc_dtype = saved


def run_ref(fn, *args, dtype=torch.float64):
    """fn(*args) with tensor args cast to `dtype` (int tensors kept), on their device."""
    cast = [a.to(dtype) if isinstance(a, torch.Tensor) and a.is_floating_point() else a for a in args]
    device = next(a.device for a in args if isinstance(a, torch.Tensor))
    with on_device(device):
        return fn(*cast)


def max_err(a, b):
    return (a.double() - b.double()).abs().max().item() if a.numel() else 0.0


def assert_close_style(name, got, exact, lowp, dtype, unit=1.0, rows=128):
    """err(got) <= 2 * err(same-precision torch) + atol, with both errors against the exact result;
    atol scales with max(largest exact magnitude, unit): `unit` is the quantity's natural size (1 for
    outputs and main gradients, d_kl / rows for the KL's gradients). The rule holds over the whole tensor
    and over each group of `rows` rows of its first dimension (tokens or keys) on its own: the largest
    values (e.g. dk / dv of the first key blocks, which every query attends to) must not set the bound
    for the rest (a backward that lost the last key blocks' dk / dv would pass the whole-tensor rule)."""
    assert torch.isfinite(got).all(), f"{name}: non-finite values (unwritten output?)"

    def check(where, g, e, lp):
        err, base = max_err(g, e), max_err(lp, e)
        scale = max(e.abs().max().item() if e.numel() else 0.0, unit)
        bound = 2 * base + ATOL[dtype] * scale
        assert err <= bound, f"{name}{where}: max error {err:.3g} > 2 * {base:.3g} + {ATOL[dtype]:g} * {scale:.3g}"
        return err, base

    result = check("", got, exact, lowp)
    if got.dim() > 0 and got.shape[0] > rows:
        for r0 in range(0, got.shape[0], rows):
            r1 = r0 + rows
            check(f" rows [{r0}, {min(r1, got.shape[0])})", got[r0:r1], exact[r0:r1], lowp[r0:r1])
    return result


def assert_lse_close(name, got, exact, rtol=1e-4):
    """lse is fp32 from exactly represented inputs: only accumulation-order error is allowed.
    -inf (empty rows) must match exactly."""
    exact = exact.to(got.dtype)
    inf = torch.isinf(exact)
    assert torch.equal(torch.isinf(got), inf), f"{name}: -inf rows differ"
    err = (got[~inf].double() - exact[~inf].double()).abs()
    bound = rtol * (1 + exact[~inf].double().abs())
    assert (err <= bound).all(), f"{name}: max error {err.max().item():.3g}"


def reference_forward(q, k, v, qi, ki, idx, cu, bs, scale, iscale, cu_k=None):
    """Exact (out, lse, kl, lse_idx, kl_rows) and the same-precision out and lse over selection `idx` (None: the
    dense causal set of warmup). cu_k: the keys' layout (queries a suffix of the keys), None: cu's."""
    sparse_fwd = partial(ref.sparse_fwd, cu_seqlens_k=cu_k)
    index_kl_rows = partial(ref.index_kl_rows, cu_seqlens_k=cu_k)
    exact_out, exact_lse = run_ref(sparse_fwd, q, k, v, idx, cu, bs, scale)
    exact_rows, exact_lse_idx = run_ref(index_kl_rows, q, k, exact_lse, qi, ki, idx, cu, bs, scale, iscale)
    exact_kl = exact_rows.sum() / exact_rows.numel()
    with low_precision():
        lowp_out, lowp_lse = run_ref(sparse_fwd, q, k, v, idx, cu, bs, scale, dtype=q.dtype)
    return (exact_out, exact_lse, exact_kl, exact_lse_idx, exact_rows), (lowp_out, lowp_lse)


def assert_forward_close(out, kl, lse, lse_idx, exact, lowp_out, kl_rows=None):
    """out by the STYLE rule, lse and lse_idx to fp32 accumulation error, kl to 1e-3 relative; kl_rows (msa_fwd's
    output 7, (Hi, T)), where given, row by row (a few wrong rows move the mean kl too little): a row's KL moves with
    its heads' lse, which holds to ~1e-4 (1 + |lse|) ~ 1e-3 here, so 3e-3 (1 + |row|) (measured on the H100, s50:
    up to 2.6e-3 in the layouts with Hkv > Hi or 3 heads per group, on both kernel paths)."""
    exact_out, exact_lse, exact_kl, exact_lse_idx, exact_rows = exact
    assert_close_style("out", out, exact_out, lowp_out, out.dtype)
    assert_lse_close("lse", lse, exact_lse)
    assert_lse_close("lse_idx", lse_idx, exact_lse_idx)
    assert kl.dtype == torch.float32 and kl.dim() == 0
    assert abs(kl.item() - exact_kl.item()) <= 1e-3 * abs(exact_kl.item()) + 1e-5, (kl.item(), exact_kl.item())
    if kl_rows is not None:
        assert kl_rows.shape == exact_rows.shape, (kl_rows.shape, exact_rows.shape)
        err = (kl_rows.double() - exact_rows).abs()
        ratio = err / (1 + exact_rows.abs())
        assert (ratio <= 3e-3).all(), f"kl_rows: {int((ratio > 3e-3).sum())} rows off, max err / (1 + |row|) " \
                                      f"{ratio.max().item():.3g}"


def assert_grads_close(grads, dout, dkl, q, k, v, qi, ki, idx, cu, bs, scale, iscale, cu_k=None):
    """The five gradients (dq, dk, dv, dq_idx, dk_idx) for (dout, dkl) against the exact reference, by
    the STYLE rule; the KL's gradients on the scale d_kl / rows. cu_k as in reference_forward."""
    dtype = q.dtype
    sparse_fwd, sparse_bwd = partial(ref.sparse_fwd, cu_seqlens_k=cu_k), partial(ref.sparse_bwd, cu_seqlens_k=cu_k)
    index_kl, index_kl_bwd = partial(ref.index_kl, cu_seqlens_k=cu_k), partial(ref.index_kl_bwd, cu_seqlens_k=cu_k)
    _, lse = run_ref(sparse_fwd, q, k, v, idx, cu, bs, scale)
    exact = run_ref(sparse_bwd, dout, q, k, v, lse, idx, cu, bs, scale)
    _, lse_idx = run_ref(index_kl, q, k, lse, qi, ki, idx, cu, bs, scale, iscale)
    exact += run_ref(index_kl_bwd, dkl, q, k, lse, qi, ki, lse_idx, idx, cu, bs, scale, iscale)
    with low_precision():
        _, lse_l = run_ref(sparse_fwd, q, k, v, idx, cu, bs, scale, dtype=dtype)
        lowp = run_ref(sparse_bwd, dout, q, k, v, lse_l, idx, cu, bs, scale, dtype=dtype)
        _, lse_idx_l = run_ref(index_kl, q, k, lse_l, qi, ki, idx, cu, bs, scale, iscale, dtype=dtype)
        lowp += run_ref(index_kl_bwd, dkl, q, k, lse_l, qi, ki, lse_idx_l, idx, cu, bs, scale, iscale,
                        dtype=dtype)
    kl_unit = abs(dkl.item()) / (q.shape[0] * qi.shape[1])  # d_kl / rows
    for name, got, e, lp in zip(("dq", "dk", "dv", "dq_idx", "dk_idx"), grads, exact, lowp):
        assert got.dtype == dtype and got.shape == e.shape
        assert_close_style(name, got, e, lp, dtype, unit=kl_unit if name.endswith("_idx") else 1.0)
