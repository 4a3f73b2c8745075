"""Oracles for the CUDA attention kernels (STYLE rule 7).

The exact reference runs on the GPU in float64 (its factories follow the default device). The
same-precision baseline is the same reference with its accumulation dtype forced to the input dtype
(bf16/fp16 matmuls and softmax), which is what a plain PyTorch implementation in that precision does.
A kernel passes when its error against the exact reference is at most twice the baseline's plus atol.
"""
from contextlib import contextmanager

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


def assert_close_style(name, got, exact, lowp, dtype, unit=1.0):
    """err(got) <= 2 * err(same-precision torch) + atol, with both errors against the exact result;
    atol scales with max(largest exact magnitude, unit): `unit` is the quantity's natural size (1 for
    outputs and main gradients, d_kl / rows for the KL's gradients)."""
    assert torch.isfinite(got).all(), f"{name}: non-finite values (unwritten output?)"
    err, base = max_err(got, exact), max_err(lowp, exact)
    scale = max(exact.abs().max().item() if exact.numel() else 0.0, unit)
    bound = 2 * base + ATOL[dtype] * scale
    assert err <= bound, f"{name}: max error {err:.3g} > 2 * {base:.3g} + {ATOL[dtype]:g} * {scale:.3g}"
    return err, base


def assert_lse_close(name, got, exact, rtol=1e-4):
    """lse is fp32 from exactly represented inputs: only accumulation-order error is allowed.
    -inf (empty rows) must match exactly."""
    exact = exact.to(got.dtype)
    inf = torch.isinf(exact)
    assert torch.equal(torch.isinf(got), inf), f"{name}: -inf rows differ"
    err = (got[~inf].double() - exact[~inf].double()).abs()
    bound = rtol * (1 + exact[~inf].double().abs())
    assert (err <= bound).all(), f"{name}: max error {err.max().item():.3g}"
