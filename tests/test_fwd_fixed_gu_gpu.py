"""The sm_90a stats and output passes compiled for Gu = 4 heads per unit (the bench configuration:
G = 4, J = 1, with the index branch) against the general ones (MSA_FWD_FIXED_GU=0): the same
operations per entry in another order, so out, lse, lse_idx and the KL must be bitwise equal. Without
the index branch (sparse_attention) the Gu = 4 kernels run too (G = 4, J = 1) and must match as well.
Warmup runs its KL on the sparse passes' dense mode here (MSA_DENSE_KL=0): the dense KL kernel, warmup's
default on Hopper, has no Gu = 4 variant. Each comparison also checks from the kernel names that the two
runs took different kernels (kGu = 4 is a template argument of the passes)."""
import math

import pytest
import torch

from helpers import (assert_same_forward, assert_written, cuda_kernel_names, make_packed, poison_allocator,
                     sm90_kernels_run)

pytestmark = pytest.mark.gpu
ops = torch.ops.msa


@pytest.fixture(autouse=True)
def _hopper(monkeypatch):
    monkeypatch.delenv("MSA_PORTABLE_KERNELS", raising=False)  # as _run does: the check sees the path it runs
    if not sm90_kernels_run():
        pytest.skip("the Gu = 4 passes are sm_90a kernels")


def _fwd_kernels(fn):
    return sorted({n for n in cuda_kernel_names(fn) if "sparse_fwd_kernel" in n})


def _run(monkeypatch, fixed, args, op=ops.msa_fwd):
    monkeypatch.delenv("MSA_PORTABLE_KERNELS", raising=False)
    monkeypatch.setenv("MSA_FWD_WS", "0")  # the Gu = 4 instantiations of the general passes, not the
    monkeypatch.setenv("MSA_FWD_WS_STATS", "0")  # warp-specialized ones (tests/test_fwd_ws_gpu.py)
    if fixed:
        monkeypatch.delenv("MSA_FWD_FIXED_GU", raising=False)
    else:
        monkeypatch.setenv("MSA_FWD_FIXED_GU", "0")
    poison_allocator()
    return op(*args)


@pytest.mark.parametrize("warmup", [False, True])
@pytest.mark.parametrize("case", [((16, 2, 4, 1), 128, 128, 128, torch.bfloat16),
                                  ((16, 2, 4, 2), 64, 64, 64, torch.float16),
                                  ((8, 1, 2, 1), 128, 64, 128, torch.bfloat16)])
def test_fixed_gu_matches_general(monkeypatch, case, warmup):
    heads, D, Di, bs, dtype = case
    if warmup:
        monkeypatch.setenv("MSA_DENSE_KL", "0")
    q, k, v, qi, ki, cu, mx = make_packed([1500, 700, 1, 300], heads, D, Di, dtype=dtype, device="cuda",
                                          seed=D + Di + warmup)
    args = (q, k, v, qi, ki, cu, mx, 6, bs, 1 / math.sqrt(D), 1 / math.sqrt(Di), warmup, True, True)
    general = _run(monkeypatch, False, args)
    fixed = _run(monkeypatch, True, args)
    assert_same_forward(general, fixed, "the kernels (Gu = 4 against the general ones)", written=True)
    names = [_fwd_kernels(lambda: _run(monkeypatch, f, args)) for f in (False, True)]
    assert names[0] and names[1] and names[0] != names[1], names


@pytest.mark.parametrize("case", [((16, 2, 4, 1), 128, 128, torch.bfloat16), ((8, 2, 2, 2), 64, 64, torch.float16)])
def test_fixed_gu_without_index_matches_general(monkeypatch, case):
    heads, D, bs, dtype = case
    q, k, v, qi, ki, cu, mx = make_packed([1500, 700, 1, 300], heads, D, 64, dtype=dtype, device="cuda", seed=D + 7)
    args = (q, k, v, qi, ki, cu, mx, 6, bs, 1 / math.sqrt(D), 1 / 8, False, True, False)
    idx = _run(monkeypatch, False, args)[2]
    sargs = (q, k, v, idx, cu, mx, bs, 1 / math.sqrt(D))
    general = _run(monkeypatch, False, sargs, ops.sparse_fwd)
    fixed = _run(monkeypatch, True, sargs, ops.sparse_fwd)
    for name, a, b in zip(("out", "lse"), general, fixed):
        assert_written(name, a)
        assert torch.equal(a, b), f"{name} differs between the Gu = 4 and the general kernels"
    names = [_fwd_kernels(lambda: _run(monkeypatch, f, sargs, ops.sparse_fwd)) for f in (False, True)]
    assert names[0] and names[1] and names[0] != names[1], names
