"""The sm_90a stats and output passes compiled for Gu = 4 heads per unit (the bench configuration:
G = 4, J = 1, with the index branch) against the general ones (MSA_FWD_FIXED_GU=0): the same
operations per entry in another order, so out, lse, lse_idx and the KL must be bitwise equal. Without
the index branch (sparse_attention) the Gu = 4 kernels run too (G = 4, J = 1) and must match as well."""
import math

import pytest
import torch

from helpers import make_packed, poison_allocator

pytestmark = pytest.mark.gpu
ops = torch.ops.msa


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
    q, k, v, qi, ki, cu, mx = make_packed([1500, 700, 1, 300], heads, D, Di, dtype=dtype, device="cuda",
                                          seed=D + Di + warmup)
    args = (q, k, v, qi, ki, cu, mx, 6, bs, 1 / math.sqrt(D), 1 / math.sqrt(Di), warmup, True, True)
    general = _run(monkeypatch, False, args)
    fixed = _run(monkeypatch, True, args)
    for name, a, b in zip(("out", "kl", "indices", "lse", "lse_idx"), general[:5], fixed[:5]):
        assert torch.equal(a, b), f"{name} differs between the Gu = 4 and the general kernels"
    for name, a, b in zip(("kl_dq_idx", "kl_dk_idx"), general[5:], fixed[5:]):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-9, msg=f"{name} differs between the two kernels")


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
        assert torch.isfinite(a).all(), f"{name}: poison left in the general kernel's result"
        assert torch.equal(a, b), f"{name} differs between the Gu = 4 and the general kernels"
