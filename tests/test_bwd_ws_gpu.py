"""The warp-specialized sm_90a backward (csrc/sm90/sparse_bwd/sparse_bwd_ws.cuh; the default on Hopper in
both modes) against the general sm_90a one (MSA_BWD_WS=0): dq, dk and dv of sparse_attention for the same
indices and dout. The two kernels compute the transposed logits (K Q^T) and sum dQ in another order (D = 128:
each consumer's 64 columns over all 128 keys; D = 64: the two consumers' partials over their 64 keys), another
fp32 summation order, so the gradients match to rounding, not bitwise. The warp-specialized kernel gathers Q and
dO as TMA boxes where a unit has 4 or 8 heads (MSA_BWD_WS_TMA=1: also 1 or 2; =0: 16-byte cp.async copies): all
three settings are compared."""
import re

import pytest
import torch

import msa
from helpers import cuda_kernel_names, make_packed, poison_allocator, sm90_kernels_run

pytestmark = pytest.mark.gpu


@pytest.fixture(autouse=True)
def _hopper(monkeypatch):
    monkeypatch.delenv("MSA_PORTABLE_KERNELS", raising=False)
    if not sm90_kernels_run():
        pytest.skip("the warp-specialized backward is an sm_90a kernel")


def _grads(monkeypatch, ws, q, k, v, idx, cu, mx, bs, dout, deterministic=False):
    monkeypatch.setenv("MSA_BWD_WS", "1" if ws else "0")
    leaves = [x.detach().requires_grad_(True) for x in (q, k, v)]
    poison_allocator()
    out = msa.sparse_attention(*leaves, idx, block_size=bs, cu_seqlens=cu, max_seqlen=mx, deterministic=deterministic)
    return torch.autograd.grad(out, leaves, dout)


def _inputs(lengths, heads, D, bs, dtype, topk, seed):
    q, k, v, _, _, cu, mx = make_packed(lengths, heads, D, 64, dtype=dtype, device="cuda", seed=seed)
    g = torch.Generator().manual_seed(seed)
    parts = []
    for n in lengths:  # random earlier blocks (-1 = unused slots), the own block always in
        nb = -(-n // bs)
        own = (torch.arange(n) // bs)[None, :, None].expand(heads[2], n, 1)
        rand = torch.randint(-1, nb, (heads[2], n, topk - 1), generator=g)
        rand = torch.where(rand <= own, rand, torch.full_like(rand, -1))
        parts.append(torch.cat([own, rand], -1))
    idx = torch.cat(parts, 1).to(torch.int32).cuda().contiguous()
    dout = torch.randn(q.shape, generator=g).to(q)
    return q, k, v, idx, cu, mx, dout


def _check(monkeypatch, args, deterministic=False):
    general = _grads(monkeypatch, False, *args)
    ws = _grads(monkeypatch, True, *args, deterministic=deterministic)
    for name, a, b in zip(("dq", "dk", "dv"), general, ws):
        a, b = a.float(), b.float()
        scale = a.abs().max().item()
        assert scale > 0, f"{name}: all zero"
        assert torch.isfinite(b).all(), f"{name}: non-finite values"
        torch.testing.assert_close(b, a, rtol=2e-2, atol=1e-2 * scale, msg=name)
        assert (b - a).abs().mean().item() < 2e-3 * scale, f"{name}: mean difference too large"
    return ws


# (Hq, Hkv, Hi, Hki), D, block_size, dtype: Gu = 4 (the bench layout), 3 (63-row tiles), 1 with J = 4 (four
# kv heads per item), 2 with J = 2, 1 with G = 1, 8 at both D, 4 at D = 64; each (dtype, D) instantiation, block_size
# 64 with both D.
CASES = [((16, 2, 4, 1), 128, 128, torch.bfloat16),
         ((12, 4, 4, 1), 64, 128, torch.float16),
         ((8, 8, 2, 1), 128, 64, torch.float16),
         ((8, 4, 2, 1), 64, 64, torch.bfloat16),
         ((4, 4, 4, 1), 128, 128, torch.bfloat16),
         ((16, 2, 2, 1), 64, 128, torch.float16),
         ((8, 1, 1, 1), 128, 128, torch.bfloat16),
         ((8, 2, 2, 1), 64, 128, torch.bfloat16)]
LENGTHS = [2100, 700, 1, 300, 129]


def _gu(heads):
    """Heads per unit of the backward's tiles (bwd_item's Gu: G / J)."""
    hq, hkv, hi, _ = heads
    return hq // hi // (hkv // hi if hkv > hi else 1)


def _gather(monkeypatch, gather, heads, run):
    """Sets the gather of Q and dO (tma, MSA_BWD_WS_TMA=1: TMA boxes of a unit's heads where Gu is 1, 2, 4 or 8;
    cp_async, MSA_BWD_WS_TMA=0: 16-byte cp.async copies; auto, unset: TMA where Gu is 4 or 8) and checks that run()
    took it: the kernel's last template argument is kTma (the test's tensors are contiguous, so the TMA descriptors
    encode)."""
    if gather == "auto":
        monkeypatch.delenv("MSA_BWD_WS_TMA", raising=False)
    else:
        monkeypatch.setenv("MSA_BWD_WS_TMA", "1" if gather == "tma" else "0")
    tma_gu = {"tma": (1, 2, 4, 8), "auto": (4, 8), "cp_async": ()}[gather]
    ran = re.findall(r"sparse_bwd_ws_kernel<[^>]*, (true|false)>", " ".join(cuda_kernel_names(run)))
    assert ran == [str(_gu(heads) in tma_gu).lower()], ran


@pytest.mark.parametrize("gather", ["auto", "tma", "cp_async"])
@pytest.mark.parametrize("case", CASES)
def test_ws_matches_general(monkeypatch, case, gather):
    heads, D, bs, dtype = case
    q, k, v, idx, cu, mx, dout = _inputs(LENGTHS, heads, D, bs, dtype, 6, seed=D + bs + heads[0])
    args = (q, k, v, idx, cu, mx, bs, dout)
    _gather(monkeypatch, gather, heads, lambda: _grads(monkeypatch, True, *args))
    _check(monkeypatch, args)


@pytest.mark.parametrize("gather", ["tma", "cp_async"])
@pytest.mark.parametrize("case", [CASES[0], CASES[3]])
def test_ws_deterministic(monkeypatch, case, gather):
    """deterministic=True: the writer's exact hi / lo dQ sums and per-item dK / dV partials; the same
    values as the atomic path to rounding, and bitwise equal from run to run."""
    heads, D, bs, dtype = case
    q, k, v, idx, cu, mx, dout = _inputs(LENGTHS, heads, D, bs, dtype, 6, seed=7)
    args = (q, k, v, idx, cu, mx, bs, dout)
    _gather(monkeypatch, gather, heads, lambda: _grads(monkeypatch, True, *args, deterministic=True))
    first = _check(monkeypatch, args, deterministic=True)
    again = _grads(monkeypatch, True, *args, deterministic=True)
    for name, a, b in zip(("dq", "dk", "dv"), first, again):
        assert torch.equal(a, b), f"{name} differs between two deterministic runs"


@pytest.mark.parametrize("per_item", ["5", "200"])
def test_ws_split_items(monkeypatch, per_item):
    """Hot blocks split over several CTAs (MSA_BWD_UNITS_PER_ITEM): items of 5 units (one partial tile) and
    of 200 (several tiles and a partial last one), every token selecting block 0 too."""
    monkeypatch.setenv("MSA_BWD_UNITS_PER_ITEM", per_item)
    heads, D, bs, dtype = CASES[0]
    q, k, v, idx, cu, mx, dout = _inputs([1500, 300], heads, D, bs, dtype, 4, seed=3)
    idx[:, :, 1] = torch.where(idx[:, :, 0] > 0, 0, -1).to(idx)  # block 0 (not twice in a row: own block 0)
    _check(monkeypatch, (q, k, v, idx, cu, mx, bs, dout))


def test_ws_kernel_runs(monkeypatch):
    """MSA_BWD_WS=1 dispatches to the warp-specialized kernel and MSA_BWD_WS=0 to the general one, so the
    comparisons above compare two different kernels."""
    heads, D, bs, dtype = CASES[0]
    q, k, v, idx, cu, mx, dout = _inputs([700], heads, D, bs, dtype, 4, seed=5)
    args = (q, k, v, idx, cu, mx, bs, dout)

    def names(ws):
        return " ".join(cuda_kernel_names(lambda: _grads(monkeypatch, ws, *args)))

    assert "sparse_bwd_ws_kernel" in names(True)
    general = names(False)
    assert "sparse_bwd_ws_kernel" not in general and "sparse_bwd_kernel" in general, general


def test_default_dispatch(monkeypatch):
    """Without MSA_BWD_WS, the Hopper backward is the warp-specialized kernel in both modes (deterministic: its
    exact hi / lo writer, test_ws_deterministic's subject); MSA_BWD_WS=0 takes the general one in both."""
    heads, D, bs, dtype = CASES[0]
    q, k, v, idx, cu, mx, dout = _inputs([700], heads, D, bs, dtype, 4, seed=5)
    monkeypatch.delenv("MSA_BWD_WS", raising=False)

    def names(deterministic):
        def step():
            leaves = [x.detach().requires_grad_(True) for x in (q, k, v)]
            out = msa.sparse_attention(*leaves, idx, block_size=bs, cu_seqlens=cu, max_seqlen=mx,
                                       deterministic=deterministic)
            return torch.autograd.grad(out, leaves, dout)
        return " ".join(cuda_kernel_names(step))

    assert "sparse_bwd_ws_kernel" in names(False)
    assert "sparse_bwd_ws_kernel" in names(True)
    monkeypatch.setenv("MSA_BWD_WS", "0")
    for deterministic in (False, True):
        general = names(deterministic)
        assert "sparse_bwd_ws_kernel" not in general and "sparse_bwd_kernel" in general, general
