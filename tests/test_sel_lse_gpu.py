"""The sparse path's lse_idx from the Hopper top-k (csrc/sm90/index_topk, kSel): the top list carries each kept
block's sum of exponentials, the stats pass scores the index branch on each row's own block only, and the stats
combine adds the two; msa_fwd takes it where no sequence has more than MSA_SEL_MAX_BLOCKS key blocks (default
128). Against the float64 reference over the kernel's own selection, against the stats pass scoring every
selected block (MSA_SEL_MAX_BLOCKS=0: the same selection, main branch bitwise, the index terms to rounding),
bitwise between 2- and 4-warpgroup CTAs and run to run; that the kSel kernel is what ran, and the bound."""
import math

from functools import partial

import pytest
import torch

from attention_check import assert_close_style, assert_forward_close, low_precision, reference_forward, run_ref
from msa import reference as ref
from helpers import cuda_kernel_names, launched_kernel, make_packed, poison_allocator, sm90_kernels_run, suffix_packed

pytestmark = pytest.mark.gpu
ops = torch.ops.msa

NAMES = ("out", "kl", "indices", "lse", "lse_idx", "kl_dq_idx", "kl_dk_idx", "kl_rows")


@pytest.fixture(autouse=True)
def _hopper(monkeypatch):
    monkeypatch.delenv("MSA_PORTABLE_KERNELS", raising=False)
    for var in ("MSA_SEL_MAX_BLOCKS", "MSA_FWD_WS_STATS", "MSA_TOPK_WG"):
        monkeypatch.delenv(var, raising=False)
    if not sm90_kernels_run():
        pytest.skip("the selection's lse_idx comes from the sm_90a top-k kernel")


# (lengths or (len_q, len_k) per sequence, (Hq, Hkv, Hi, Hki), Di, block_size, topk, dtype, index scale factor):
# sequences of 1 token, under a block and of many blocks; block_size 64 (two blocks per 128-key sub-tile); a
# topk of 2 (one kept block) and 32 (more slots than blocks: padding); Hi / Hki of 1, 2, 4 and 16; a negative
# index scale (the kernel flips Q) and a large one (logits of tens); queries a suffix of the keys; two kv heads
# per index group (J = 2: the stats pass's index work on its first kv head only), topk 1 (no kept block: the
# top-k's stats are empty) with Di 64 at block_size 128.
CASES = [
    ([2100, 700, 1, 300, 129], (16, 2, 4, 1), 128, 128, 16, torch.bfloat16, 1.0),
    ([1500, 257], (8, 2, 8, 4), 64, 64, 4, torch.float16, -1.5),
    ([3000, 64], (4, 4, 4, 4), 128, 128, 32, torch.bfloat16, 3.0),
    ([1000, 513], (16, 16, 16, 1), 128, 64, 2, torch.bfloat16, 1.0),
    (([300, 5, 1], [2348, 900, 129]), (16, 2, 4, 1), 128, 128, 16, torch.bfloat16, 1.0),
    ([1800, 300], (16, 8, 4, 1), 64, 128, 1, torch.bfloat16, 1.0),
    ([2500, 700], (16, 8, 4, 2), 128, 64, 8, torch.float16, 1.0),
]


def _inputs(case):
    lengths, heads, di, bs, topk, dtype, f = CASES[case]
    if isinstance(lengths, tuple):
        x = suffix_packed(*lengths, heads, 128, di, dtype=dtype, device="cuda", seed=case + 11)
        q, k, v, qi, ki, cu, mx, cu_k, mx_k = (x["q"], x["k"], x["v"], x["qi"], x["ki"], x["cu_q"], x["mx_q"],
                                               x["cu_k"], x["mx_k"])
    else:
        q, k, v, qi, ki, cu, mx = make_packed(lengths, heads, 128, di, dtype=dtype, device="cuda", seed=case + 11)
        cu_k = mx_k = None
    args = (q, k, v, qi, ki, cu, mx, topk, bs, 1 / math.sqrt(128), f / math.sqrt(di), False, True, True, False,
            cu_k, mx_k)
    return args, cu_k


def _run(monkeypatch, args, sel=None, wg=None, deterministic=False):
    """sel: MSA_SEL_MAX_BLOCKS (None: the default; 0: off)."""
    if sel is None:
        monkeypatch.delenv("MSA_SEL_MAX_BLOCKS", raising=False)
    else:
        monkeypatch.setenv("MSA_SEL_MAX_BLOCKS", str(sel))
    if wg is None:
        monkeypatch.delenv("MSA_TOPK_WG", raising=False)
    else:
        monkeypatch.setenv("MSA_TOPK_WG", str(wg))
    args = list(args)
    args[14] = deterministic
    poison_allocator()  # a row or slot left unwritten reads as garbage
    return ops.msa_fwd(*args)


def _kernels(fn):
    return [n for n in cuda_kernel_names(fn) if "index_topk_sm90_kernel" in n]


def _modes(name):
    """(kLse, kSel, kFp8) of an index_topk_sm90_kernel<T, D, WG, kLse, kSel, kFp8> launch name."""
    _, args = launched_kernel(name)
    assert len(args) == 6, name  # the kernel's template changed: update this parser with it
    return tuple(a == "true" for a in args[3:])


def _sel_kernel_ran(names):
    return bool(names) and all(_modes(n) == (False, True, False) for n in names)


def _plain_kernel_ran(names):
    return bool(names) and all(_modes(n) == (False, False, False) for n in names)


@pytest.mark.parametrize("case", range(len(CASES)))
def test_sel_lse_against_reference_and_full_stats(monkeypatch, case):
    args, cu_k = _inputs(case)
    names = _kernels(lambda: _run(monkeypatch, args))
    assert _sel_kernel_ran(names), f"the kSel top-k did not run: {names}"
    names = _kernels(lambda: _run(monkeypatch, args, sel=0))
    assert _plain_kernel_ran(names), names

    got = _run(monkeypatch, args)
    full = _run(monkeypatch, args, sel=0)
    out, kl, idx, lse, lse_idx = got[:5]
    for name in ("out", "indices", "lse"):  # the main branch and the selection do not change
        i = NAMES.index(name)
        assert torch.equal(got[i], full[i]), f"{name} differs with the selection's lse_idx"
    assert torch.isfinite(lse_idx).all()
    torch.testing.assert_close(lse_idx, full[4], rtol=2e-6, atol=2e-6, msg="lse_idx against every block scored")
    torch.testing.assert_close(kl, full[1], rtol=1e-4, atol=1e-6, msg="kl")
    torch.testing.assert_close(got[7], full[7], rtol=1e-4, atol=1e-5, msg="kl_rows")

    q, k, v, qi, ki, cu, mx, topk, bs, scale, iscale = args[:11]
    exact, lowp = reference_forward(q, k, v, qi, ki, idx, cu, bs, scale, iscale, cu_k)
    assert_forward_close(out, kl, lse, lse_idx, exact, lowp[0])
    # The KL's index gradients (d_kl = 1) by the STYLE rule against the exact ones, for both paths (dsi is rounded
    # to the input dtype, so the two differ by more than lse_idx does: their errors are what must stay small).
    bwd = partial(ref.index_kl_bwd, cu_seqlens_k=cu_k, out_dtype=torch.float64)
    one = torch.ones((), dtype=torch.float64, device="cuda")
    ex = run_ref(bwd, one, q, k, exact[1], qi, ki, exact[3], idx, cu, bs, scale, iscale)
    with low_precision():
        _, lse_l = run_ref(partial(ref.sparse_fwd, cu_seqlens_k=cu_k), q, k, v, idx, cu, bs, scale, dtype=q.dtype)
        _, lse_idx_l = run_ref(partial(ref.index_kl, cu_seqlens_k=cu_k), q, k, lse_l, qi, ki, idx, cu, bs, scale,
                               iscale, dtype=q.dtype)
        lp = run_ref(bwd, one, q, k, lse_l, qi, ki, lse_idx_l, idx, cu, bs, scale, iscale, dtype=q.dtype)
    unit = 1 / (q.shape[0] * qi.shape[1])
    for name, i, e, b in (("kl_dq_idx", 5, ex[0], lp[0]), ("kl_dk_idx", 6, ex[1], lp[1])):
        for res in (got, full):
            assert_close_style(name, res[i], e, b, q.dtype, unit=unit)


@pytest.mark.parametrize("case", [0, 1])
def test_sel_lse_warpgroups_and_runs_bitwise(monkeypatch, case):
    """The kept blocks' sums are per-thread over the same columns in both CTA sizes: bitwise equal; and
    deterministic mode repeats bitwise."""
    args, _ = _inputs(case)
    two = _run(monkeypatch, args, wg=2)
    four = _run(monkeypatch, args, wg=4)
    for i in range(5):
        assert torch.equal(two[i], four[i]), f"{NAMES[i]} differs between 2- and 4-warpgroup top-k CTAs"
    a = _run(monkeypatch, args, deterministic=True)
    b = _run(monkeypatch, args, deterministic=True)
    for name, x, y in zip(NAMES, a, b):
        assert torch.equal(x, y), f"{name}: deterministic runs differ"
    torch.testing.assert_close(a[4], four[4], rtol=0, atol=0, msg="lse_idx: deterministic mode")


def test_sel_lse_bound(monkeypatch):
    """MSA_SEL_MAX_BLOCKS bounds the longest sequence's key blocks: at the bound the kSel top-k runs, one under it
    the plain one, whose results equal those of MSA_SEL_MAX_BLOCKS=0 bitwise."""
    args, _ = _inputs(4)  # keys of 2348 tokens: 19 blocks of 128
    assert _sel_kernel_ran(_kernels(lambda: _run(monkeypatch, args, sel=19)))
    assert _plain_kernel_ran(_kernels(lambda: _run(monkeypatch, args, sel=18)))
    under, off = _run(monkeypatch, args, sel=18), _run(monkeypatch, args, sel=0)
    for name, x, y in zip(NAMES, under, off):
        if name not in ("kl_dq_idx", "kl_dk_idx"):  # fp32 atomics: the order of their adds varies
            assert torch.equal(x, y), f"{name} differs under the bound from the stats pass's own index terms"


def test_sel_lse_chunked_queries_and_small_items(monkeypatch):
    """Query chunks (a small partial budget: sel_stats is indexed by global token, the combines by chunk) and
    work items of 5 units (tiles that mix a block's own tokens with later ones), against the reference."""
    monkeypatch.setenv("MSA_PARTIAL_BUDGET", str(1 << 20))
    monkeypatch.setenv("MSA_FWD_UNITS_PER_ITEM", "5")
    args, cu_k = _inputs(0)
    assert _sel_kernel_ran(_kernels(lambda: _run(monkeypatch, args)))
    got, full = _run(monkeypatch, args), _run(monkeypatch, args, sel=0)
    torch.testing.assert_close(got[4], full[4], rtol=2e-6, atol=2e-6, msg="lse_idx against every block scored")
    q, k, v, qi, ki, cu, mx, topk, bs, scale, iscale = args[:11]
    exact, lowp = reference_forward(q, k, v, qi, ki, got[2], cu, bs, scale, iscale, cu_k)
    assert_forward_close(got[0], got[1], got[3], got[4], exact, lowp[0])
