"""Warmup's lse_idx on the Hopper index kernel (csrc/sm90/index_topk, kLse; the portable path and
MSA_INDEX_LSE=dense take the dense forward): against the float64 logsumexp over every causally visible key,
against the dense forward it replaces, bitwise run to run and between 2- and 4-warpgroup CTAs."""
import math
import os

import pytest
import torch

from attention_check import assert_lse_close
from helpers import make_packed, poison_allocator, sm90_kernels_run, suffix_packed

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("kernel_choice")]
ops = torch.ops.msa


def _hopper_kernel():
    return os.environ.get("MSA_PORTABLE_KERNELS") != "1" and sm90_kernels_run()


def _exact(qi, ki, cu_q, cu_k, iscale):
    """(Hi, T) float64: each row's logsumexp of iscale * q_idx . k_idx over keys 0..its position (the query is
    the last position of its keys when a sequence has more keys than queries)."""
    Hi, Hki = qi.shape[1], ki.shape[1]
    q64, k64 = qi.double().cpu(), ki.double().cpu()
    cq, ck = cu_q.tolist(), cu_k.tolist()
    out = torch.full((Hi, qi.shape[0]), math.nan, dtype=torch.float64)
    for s in range(len(cq) - 1):
        n, nk = cq[s + 1] - cq[s], ck[s + 1] - ck[s]
        if n == 0:
            continue
        keys = k64[ck[s]:ck[s + 1]].repeat_interleave(Hi // Hki, dim=1)
        logits = torch.einsum("thd,jhd->htj", q64[cq[s]:cq[s + 1]], keys) * iscale
        pos = torch.arange(n)[:, None] + (nk - n)
        logits = logits.masked_fill(torch.arange(nk)[None, :] > pos, -math.inf)
        out[:, cq[s]:cq[s + 1]] = torch.logsumexp(logits, -1)
    return out


def _lse_idx(q, k, v, qi, ki, cu, mx, iscale, cu_k=None, mx_k=None):
    poison_allocator()  # a row the kernel does not write reads as garbage
    return ops.msa_fwd(q, k, v, qi, ki, cu, mx, 16, 128, q.shape[-1] ** -0.5, iscale, True, False, False, False,
                       cu_k, mx_k)[4]


# (lengths, (Hq, Hkv, Hi, Hki), Di): sub-tile edges (127 / 128 / 129 / 256 keys), one-token sequences, Hr = Hi /
# Hki of 1, 4 and 64, both index head dims (test_lse_idx_warpgroup_count: Hr 3, 8, 16, 64 on both CTA sizes).
CASES = [([1, 127, 128, 129, 300], (8, 2, 4, 1), 128), ([700, 1, 256], (8, 2, 8, 2), 64),
         ([1000, 513], (16, 16, 16, 16), 128), ([333, 64], (64, 1, 64, 1), 64), ([2048], (16, 2, 4, 1), 128)]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("case", range(len(CASES)))
def test_lse_idx_against_exact(case, dtype, monkeypatch, backends):
    lengths, heads, di = CASES[case]
    q, k, v, qi, ki, cu, mx = make_packed(lengths, heads, 64, di, dtype=dtype, device="cuda", seed=case + 3)
    iscale = di ** -0.5 * (-1.5 if case % 2 else 1.0)  # a negative scale: the kernel flips Q's sign
    got = _lse_idx(q, k, v, qi, ki, cu, mx, iscale)
    # which path ran: the dense forward of the main branch, and of the index branch unless the kernel took it
    assert len(backends) == (1 if _hopper_kernel() else 2), backends
    assert got.dtype == torch.float32 and got.shape == (heads[2], q.shape[0])
    assert_lse_close("lse_idx", got.cpu(), _exact(qi, ki, cu, cu, iscale))
    assert torch.equal(got, _lse_idx(q, k, v, qi, ki, cu, mx, iscale)), "lse_idx differs between two runs"
    monkeypatch.setenv("MSA_INDEX_LSE", "dense")  # the dense forward it replaces: the same to fp32 rounding
    assert_lse_close("lse_idx (dense forward)", _lse_idx(q, k, v, qi, ki, cu, mx, iscale).cpu(), got.cpu().double())


@pytest.mark.parametrize("lq,lk", [([200, 1, 129], [201, 1000, 258]), ([0, 300], [50, 4096])])
def test_lse_idx_suffix_queries(lq, lk):
    """Queries that are the last positions of their keys (bottom-right causal): the keys before the first query
    are all visible, the masked sub-tiles are the last query tokens' own."""
    x = suffix_packed(lq, lk, (8, 2, 4, 1), 64, 128, dtype=torch.bfloat16, device="cuda", seed=11)
    iscale = 128 ** -0.5
    got = _lse_idx(x["q"], x["k"], x["v"], x["qi"], x["ki"], x["cu_q"], x["mx_q"], iscale, x["cu_k"], x["mx_k"])
    assert_lse_close("lse_idx", got.cpu(), _exact(x["qi"], x["ki"], x["cu_q"], x["cu_k"], iscale))


@pytest.mark.parametrize("heads", [(8, 2, 8, 1), (16, 2, 16, 1), (64, 1, 64, 1), (12, 4, 12, 4)])
def test_lse_idx_warpgroup_count(heads, monkeypatch, backends):
    """2- and 4-warpgroup CTAs (MSA_TOPK_WG) give bitwise the same lse_idx: each row's columns, sub-tiles and
    merge order do not depend on how rows are tiled. Hi / Hki of 8, 16, 64 (2 tokens per 2-warpgroup CTA) and 3
    (CTAs with padding rows)."""
    if not _hopper_kernel():
        pytest.skip("the warpgroup count is the sm_90a kernel's")
    q, k, v, qi, ki, cu, mx = make_packed([2000, 1, 700], heads, 64, 128, dtype=torch.bfloat16, device="cuda",
                                          seed=5)
    got = {}
    for wg in ("2", "4"):
        monkeypatch.setenv("MSA_TOPK_WG", wg)
        got[wg] = _lse_idx(q, k, v, qi, ki, cu, mx, 128 ** -0.5)
    assert len(backends) == 2, backends  # the main branch's dense forward only: the kernel took lse_idx
    assert torch.equal(got["2"], got["4"])
    assert_lse_close("lse_idx", got["2"].cpu(), _exact(qi, ki, cu, cu, 128 ** -0.5))


def test_lse_idx_more_than_64_heads_per_key_head(backends):
    """Hi / Hki > 64 (the index kernel's CTAs would hold under two tokens): the dense forward, as before."""
    q, k, v, qi, ki, cu, mx = make_packed([300], (128, 1, 128, 1), 64, 64, dtype=torch.bfloat16, device="cuda", seed=2)
    got = _lse_idx(q, k, v, qi, ki, cu, mx, 0.125)
    assert len(backends) == 2, backends
    assert_lse_close("lse_idx", got.cpu(), _exact(qi, ki, cu, cu, 0.125))


def test_lse_idx_large_logits():
    """Logits of several hundred (an index scale of 8 on unit-variance rows): the running max keeps the sums
    finite, as a stable logsumexp does."""
    q, k, v, qi, ki, cu, mx = make_packed([900], (8, 2, 4, 1), 64, 128, dtype=torch.bfloat16, device="cuda", seed=9)
    got = _lse_idx(q, k, v, qi, ki, cu, mx, 8.0)
    assert torch.isfinite(got).all()
    assert_lse_close("lse_idx", got.cpu(), _exact(qi, ki, cu, cu, 8.0))
