"""The warp-specialized sm_90a passes (csrc/sm90/sparse_fwd/: Gu = 4 heads per unit, J = 1, with the index
branch) against the general sm_90a passes (MSA_FWD_WS=0): the output pass alone (the default) and with the
warp-specialized stats pass (MSA_FWD_WS_STATS=1, off by default: no faster than the general one).
The main logits and P V are the same wgmma products per row, reduced in the same order, so with the general
stats pass out and lse must be bitwise equal. The warp-specialized stats pass sums a row's exponentials against
the row max while the general one sums full tiles against each lane's own reference (quad_row_ref_sum), and the
index logits run on mma.sync there instead of wgmma (another fp32 summation order) merged in 32-key parts
instead of 64: with it lse and lse_idx match to fp32 rounding, out (P and the partials rounded to the dtype) is
held to the float64 reference as the default path's is, and the KL and its index gradients match to rounding.
The reference checks of the default path (test_sparse_fwd_gpu, test_gradients, test_long_seq_gpu) run this
kernel too wherever the layout has Gu = 4."""
import math

import pytest
import torch

from attention_check import assert_close_style, reference_forward
from helpers import cuda_kernel_names, make_packed, poison_allocator, sm90_kernels_run

pytestmark = pytest.mark.gpu
ops = torch.ops.msa


def _run(monkeypatch, ws, args, stats=True):
    monkeypatch.delenv("MSA_PORTABLE_KERNELS", raising=False)
    monkeypatch.delenv("MSA_FWD_FIXED_GU", raising=False)
    if ws:
        monkeypatch.delenv("MSA_FWD_WS", raising=False)
    else:
        monkeypatch.setenv("MSA_FWD_WS", "0")
    if stats:  # the warp-specialized stats pass scores the index branch on every selected block (with the top-k's
        monkeypatch.setenv("MSA_FWD_WS_STATS", "1")  # stats, MSA_SEL_MAX_BLOCKS > 0, the general one runs)
        monkeypatch.setenv("MSA_SEL_MAX_BLOCKS", "0")
    else:
        monkeypatch.delenv("MSA_FWD_WS_STATS", raising=False)
        monkeypatch.delenv("MSA_SEL_MAX_BLOCKS", raising=False)
    poison_allocator()
    return ops.msa_fwd(*args)


@pytest.fixture(autouse=True)
def _hopper(monkeypatch):
    monkeypatch.delenv("MSA_PORTABLE_KERNELS", raising=False)
    if not sm90_kernels_run():
        pytest.skip("the warp-specialized pass is an sm_90a kernel")


# (Hq, Hkv, Hi, Hki), D, Di, block_size, dtype: every one has G = Hq / Hi = 4 and J = 1; each of the four
# (dtype, D) instantiations runs, and block_size 64 with both D.
CASES = [((16, 2, 4, 1), 128, 128, 128, torch.bfloat16),
         ((16, 2, 4, 2), 64, 64, 64, torch.float16),
         ((8, 1, 2, 1), 128, 64, 128, torch.float16),
         ((8, 2, 2, 1), 64, 128, 128, torch.bfloat16),
         ((16, 2, 4, 1), 128, 128, 64, torch.bfloat16)]
LENGTHS = [2100, 700, 1, 300, 129]  # 1 token, under a block, items of many 16-unit tiles and a partial last one


def _kernels(fn):
    return " ".join(cuda_kernel_names(fn))


def _check(monkeypatch, args, index_grad):
    general = _run(monkeypatch, False, args, stats=False)
    ws_out = _run(monkeypatch, True, args, stats=False)
    ws = _run(monkeypatch, True, args)
    for name, i in (("out", 0), ("indices", 2), ("lse", 3), ("lse_idx", 4)):
        a = general[i]
        assert name == "indices" or torch.isfinite(a.float()).all(), f"{name}: non-finite values"
        assert torch.equal(a, ws_out[i]), f"{name} differs between the warp-specialized output pass and the general one"
        if name in ("lse", "lse_idx"):
            torch.testing.assert_close(ws[i], a, rtol=1e-5, atol=1e-5, msg=name)
            assert torch.equal(torch.isinf(ws[i]), torch.isinf(a)), f"{name}: other rows without keys"
        elif name == "out":  # lse to fp32 rounding, P and the partials rounded to the dtype: as exact as the default
            q, k, v, qi, ki, cu, _, _, bs, scale, iscale = args[:11]
            exact, (lowp_out, _) = reference_forward(q, k, v, qi, ki, general[2], cu, bs, scale, iscale)
            assert_close_style("out (warp-specialized stats pass)", ws[i], exact[0], lowp_out, a.dtype)
        else:
            assert torch.equal(a, ws[i]), f"{name} differs between the warp-specialized passes and the general ones"
    for res in (ws_out, ws):
        torch.testing.assert_close(res[1], general[1], rtol=1e-4, atol=1e-6, msg="kl")
        torch.testing.assert_close(res[7], general[7], rtol=1e-4, atol=1e-6, msg="kl_rows")
    if index_grad:
        for name, i in (("kl_dq_idx", 5), ("kl_dk_idx", 6)):
            a = general[i]
            scale = a.abs().max().item()
            assert scale > 0, f"{name}: all zero"
            for res in (ws_out, ws):
                b = res[i]
                assert torch.isfinite(b).all(), f"{name}: non-finite values"
                torch.testing.assert_close(b, a, rtol=2e-2, atol=2e-3 * scale, msg=name)
                assert (b - a).abs().mean().item() < 1e-3 * scale, f"{name}: mean difference too large"


@pytest.mark.parametrize("index_grad,deterministic", [(True, False), (True, True), (False, False)])
@pytest.mark.parametrize("case", CASES)
def test_ws_matches_general(monkeypatch, case, index_grad, deterministic):
    heads, D, Di, bs, dtype = case
    q, k, v, qi, ki, cu, mx = make_packed(LENGTHS, heads, D, Di, dtype=dtype, device="cuda", seed=D + Di + bs)
    args = (q, k, v, qi, ki, cu, mx, 6, bs, 1 / math.sqrt(D), 1 / math.sqrt(Di), False, True, index_grad,
            deterministic)
    _check(monkeypatch, args, index_grad)


@pytest.mark.parametrize("knobs", [{"MSA_PARTIAL_BUDGET": str(1 << 20)}, {"MSA_FWD_UNITS_PER_ITEM": "37"}])
def test_ws_many_chunks_and_odd_items(monkeypatch, knobs):
    """Several query chunks (a 1 MiB partial budget), and items of 37 units (tiles of 16, 16, 5)."""
    for name, value in knobs.items():
        monkeypatch.setenv(name, value)
    heads, D, Di, bs, dtype = CASES[0]
    q, k, v, qi, ki, cu, mx = make_packed(LENGTHS, heads, D, Di, dtype=dtype, device="cuda", seed=3)
    args = (q, k, v, qi, ki, cu, mx, 6, bs, 1 / math.sqrt(D), 1 / math.sqrt(Di), False, True, True, False)
    _check(monkeypatch, args, True)


def test_ws_allocates_no_dsi_partials(monkeypatch):
    """Where the warp-specialized output pass computes dk_idx itself (no index dk launch) the forward holds no dsi
    partials (128 of the dtype per entry, entry = index head x token x selected block): its peak memory is below the
    general pass's by their size (one chunk here: the same chunk either way)."""
    heads, D, Di, bs, dtype = CASES[0]
    lengths, topk = [8192], 6
    q, k, v, qi, ki, cu, mx = make_packed(lengths, heads, D, Di, dtype=dtype, device="cuda", seed=9)
    args = (q, k, v, qi, ki, cu, mx, topk, bs, 1 / math.sqrt(D), 1 / math.sqrt(Di), False, True, True, False)
    peak = {}
    for ws in (False, True, False):  # the general pass twice: its peak does not depend on the allocator's history
        _run(monkeypatch, ws, args, stats=False)  # warm (and poisoned) caches: then measured on a second call
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        res = ops.msa_fwd(*args)
        torch.cuda.synchronize()
        measured = torch.cuda.max_memory_allocated() - base
        assert peak.setdefault(ws, measured) == measured, "the general pass's peak moved between two calls"
        del res
    dsi = heads[2] * sum(lengths) * topk * 128 * q.element_size()
    saved = peak[False] - peak[True]
    assert 0.9 * dsi <= saved <= dsi + (16 << 20), f"saved {saved} bytes, dsi partials {dsi}"


def test_ws_kernels_run(monkeypatch):
    """The layout dispatches to the warp-specialized kernels (and MSA_FWD_WS=0 to the general ones), so the
    comparisons above compare two different kernels."""
    heads, D, Di, bs, dtype = CASES[0]
    q, k, v, qi, ki, cu, mx = make_packed(LENGTHS, heads, D, Di, dtype=dtype, device="cuda", seed=5)
    args = (q, k, v, qi, ki, cu, mx, 6, bs, 1 / math.sqrt(D), 1 / math.sqrt(Di), False, True, True, False)
    names = _kernels(lambda: _run(monkeypatch, True, args))
    assert "out_pass_ws_kernel" in names and "stats_pass_ws_kernel" in names, names
    assert "index_dk_kernel" not in names, names  # index dk folded into the warp-specialized output pass
    names = _kernels(lambda: _run(monkeypatch, True, args, stats=False))  # the default
    assert "out_pass_ws_kernel" in names and "stats_pass_ws_kernel" not in names, names
    names = _kernels(lambda: _run(monkeypatch, False, args))
    assert "_ws_kernel" not in names and "sparse_fwd_kernel" in names and "index_dk_kernel" in names, names
