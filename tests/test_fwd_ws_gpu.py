"""The warp-specialized sm_90a output pass (csrc/sm90/sparse_fwd/out_pass_ws.cuh: Gu = 4 heads per unit,
J = 1, with the index branch) against the general sm_90a pass (MSA_FWD_WS=0). P and P V are the same
wgmma products per row, so out (and lse, from the shared stats pass) must be bitwise equal; the index
logits run on mma.sync there instead of wgmma (another fp32 summation order), so the KL and its index
gradients match to rounding. The reference checks of the default path (test_sparse_fwd_gpu,
test_gradients, test_long_seq_gpu) run this kernel too wherever the layout has Gu = 4."""
import math

import pytest
import torch

from helpers import make_packed, poison_allocator

pytestmark = pytest.mark.gpu
ops = torch.ops.msa


def _run(monkeypatch, ws, args):
    monkeypatch.delenv("MSA_PORTABLE_KERNELS", raising=False)
    monkeypatch.delenv("MSA_FWD_FIXED_GU", raising=False)
    if ws:
        monkeypatch.delenv("MSA_FWD_WS", raising=False)
    else:
        monkeypatch.setenv("MSA_FWD_WS", "0")
    poison_allocator()
    return ops.msa_fwd(*args)


@pytest.fixture(autouse=True)
def _hopper(monkeypatch):
    monkeypatch.delenv("MSA_PORTABLE_KERNELS", raising=False)
    if int(ops.device_config(torch.empty(0, device="cuda"))[1]) != 1:  # this build runs the sm_90a kernels here
        pytest.skip("the warp-specialized pass is an sm_90a kernel")


# (Hq, Hkv, Hi, Hki), D, Di, block_size, dtype: every one has G = Hq / Hi = 4 and J = 1.
CASES = [((16, 2, 4, 1), 128, 128, 128, torch.bfloat16),
         ((16, 2, 4, 2), 64, 64, 64, torch.float16),
         ((8, 1, 2, 1), 128, 64, 128, torch.bfloat16),
         ((8, 2, 2, 1), 64, 128, 128, torch.float16)]


@pytest.mark.parametrize("deterministic", [False, True])
@pytest.mark.parametrize("index_grad", [True, False])
@pytest.mark.parametrize("case", CASES)
def test_ws_matches_general(monkeypatch, case, index_grad, deterministic):
    heads, D, Di, bs, dtype = case
    # Sequences of 1 token, under a block, and long enough for items of many 16-unit tiles (and a
    # partial last one).
    q, k, v, qi, ki, cu, mx = make_packed([2100, 700, 1, 300, 129], heads, D, Di, dtype=dtype, device="cuda",
                                          seed=D + Di + bs)
    args = (q, k, v, qi, ki, cu, mx, 6, bs, 1 / math.sqrt(D), 1 / math.sqrt(Di), False, True, index_grad,
            deterministic)
    general = _run(monkeypatch, False, args)
    ws = _run(monkeypatch, True, args)
    for name, a, b in zip(("out", "indices", "lse", "lse_idx"), (general[0], *general[2:5]), (ws[0], *ws[2:5])):
        assert torch.isfinite(a.float()).all() or name == "indices", f"{name}: non-finite values"
        assert torch.equal(a, b), f"{name} differs between the warp-specialized and the general pass"
    torch.testing.assert_close(ws[1], general[1], rtol=1e-4, atol=1e-6, msg="kl")
    torch.testing.assert_close(ws[7], general[7], rtol=1e-4, atol=1e-6, msg="kl_rows")
    if index_grad:
        for name, a, b in zip(("kl_dq_idx", "kl_dk_idx"), general[5:7], ws[5:7]):
            assert torch.isfinite(b).all(), f"{name}: non-finite values"
            scale = a.abs().max().item()
            assert scale > 0, f"{name}: all zero"
            torch.testing.assert_close(b, a, rtol=2e-2, atol=2e-3 * scale, msg=name)
            assert (b - a).abs().mean().item() < 1e-3 * scale, f"{name}: mean difference too large"
