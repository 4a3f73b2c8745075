"""Queries that are a suffix of the keys on the CUDA kernels (docs/semantics.md, docs/plan_suffix_queries.md):
select_blocks, the forward (out, lse, kl) and all five gradients against the float64 reference on the GPU
with the kernels' own selection, the square CUDA call on the keys' layout restricted to the query rows as a
second oracle, bitwise repeatable deterministic gradients, and the tuning knobs on one case. Warmup too:
flash for the dense main branch and lse_idx, the KL by the dense KL kernel or the sparse kernels' dense
mode, against the reference over the full causal set."""
import math

import pytest
import torch

import msa
from attention_check import ATOL, assert_forward_close, assert_grads_close, reference_forward
from helpers import cuda_kernel_names, poison_allocator, sm90_kernels_run, suffix_packed
from topk_check import assert_valid_topk, block_scores

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("kernel_choice")]  # Hopper (wgmma) and portable
ops = torch.ops.msa

HEADS = [(16, 2, 4, 1), (8, 4, 2, 1), (4, 4, 4, 1)]
CASES = [  # (len_q per sequence, len_k per sequence, block size, topk): shifts len_k - len_q
    ([1], [300], 64, 3),                       # decode: one query, shift 299
    ([0, 5, 40], [70, 5, 400], 128, 16),       # len_q 0 (keys only), len_q = len_k, shift 360
    ([63, 100], [126, 229], 64, 1),            # shifts 63 and 129
    ([64, 65, 7], [128, 130, 72], 128, 3),     # shifts 64, 65, 65
    ([200, 1, 129], [201, 1000, 258], 64, 16),  # shifts 1, 999, 129
    ([300], [2348], 128, 16),                  # shift 2048: many blocks before the first query
    ([1, 3], [20000, 9000], 64, 16),           # decode over many key blocks: more keys than entries (the work
                                               # list's bound min(num_keys, entries) sizes the forward's grid)
]


def _case(case, dtype, heads=None):
    lq, lk, bs, topk = CASES[case]
    heads = heads or HEADS[case % len(HEADS)]
    x = suffix_packed(lq, lk, heads, 128, 128 if case % 2 else 64, dtype=dtype, device="cuda", seed=case)
    return x, bs, topk


def _scales(x):
    return 1 / math.sqrt(x["q"].shape[-1]), 1 / math.sqrt(x["qi"].shape[-1])


def _key(x):
    return dict(cu_seqlens_k=x["cu_k"], max_seqlen_k=x["mx_k"])


def _select(x, bs, topk):
    return msa.select_blocks(x["qi"], x["ki"], topk=topk, block_size=bs, cu_seqlens=x["cu_q"], max_seqlen=x["mx_q"],
                             **_key(x))


def _square_indices(x, bs, topk, idx):
    """The square call's selection on the keys' layout, its query rows replaced by `idx`."""
    full = msa.select_blocks(x["qi_full"], x["ki"], topk=topk, block_size=bs, cu_seqlens=x["cu_k"],
                             max_seqlen=x["mx_k"])
    mixed = full.clone()
    mixed[:, x["rows"]] = idx
    return full, mixed


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("case", range(len(CASES)))
def test_select_blocks_suffix(case, dtype):
    """A valid top-k of the block scores at the queries' positions, equal to the square call's rows except
    where the selection boundary is a tie."""
    x, bs, topk = _case(case, dtype)
    _, iscale = _scales(x)
    idx = _select(x, bs, topk)
    assert idx.shape == (x["qi"].shape[1], x["q"].shape[0], topk)
    full, mixed = _square_indices(x, bs, topk, idx)
    # Every row of the keys' layout checked; the query rows are the suffix call's.
    assert_valid_topk(mixed, x["qi_full"], x["ki"], x["cu_k"], topk, bs, iscale)
    differ = (full[:, x["rows"]] != idx).any(-1)
    cu = x["cu_k"].tolist()
    for h, t in differ.nonzero().tolist():  # only a tie at the selection boundary may choose otherwise
        row = int(x["rows"][t])
        s = max(i for i in range(len(cu) - 1) if cu[i] <= row < cu[i + 1])
        m = block_scores(x["qi_full"], x["ki"], cu[s], cu[s + 1], bs, iscale)[h, row - cu[s]]
        got, want = (m[sel[sel >= 0].long()].sort().values for sel in (idx[h, t], full[h, row]))
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def _forward(x, bs, topk, warmup=False):
    """ops.msa_fwd with the key layout: (out, kl, indices, lse, lse_idx, ...)."""
    scale, iscale = _scales(x)
    return ops.msa_fwd(x["q"], x["k"], x["v"], x["qi"], x["ki"], x["cu_q"], x["mx_q"], topk, bs, scale, iscale, warmup,
                       True, False, False, x["cu_k"], x["mx_k"])


def _grads(x, bs, topk, seed, deterministic=False, warmup=False):
    """msa_attention_varlen's out, selection and five gradients for random dout and d_kl."""
    leaves = [x[n].detach().requires_grad_(True) for n in ("q", "k", "v", "qi", "ki")]
    poison_allocator()
    out, kl, idx = msa.msa_attention_varlen(*leaves, x["cu_q"], x["mx_q"], topk=topk, block_size=bs,
                                            return_indices=True, deterministic=deterministic, warmup=warmup,
                                            **_key(x))
    g = torch.Generator(device="cpu").manual_seed(seed)
    dout = torch.randn(out.shape, generator=g).to(out)
    dkl = torch.tensor(0.5 + seed % 3, device=out.device)
    grads = torch.autograd.grad((out, kl), leaves, (dout, dkl))
    return out, idx, grads, dout, dkl


def _check_against_reference(x, bs, topk, seed, warmup=False):
    """warmup: the reference over the full causal set (the selection is only returned)."""
    scale, iscale = _scales(x)
    poison_allocator()
    out, kl, idx, lse, lse_idx = _forward(x, bs, topk, warmup)[:5]
    assert out.shape == x["q"].shape and lse.shape == (x["q"].shape[1], x["q"].shape[0])
    attend = None if warmup else idx
    exact, (lowp_out, _) = reference_forward(x["q"], x["k"], x["v"], x["qi"], x["ki"], attend, x["cu_q"], bs, scale,
                                             iscale, cu_k=x["cu_k"])
    assert_forward_close(out, kl, lse, lse_idx, exact, lowp_out)
    _, idx2, grads, dout, dkl = _grads(x, bs, topk, seed, warmup=warmup)
    assert torch.equal(idx, idx2)
    assert grads[1].shape == x["k"].shape and grads[4].shape == x["ki"].shape  # every key row
    assert_grads_close(grads, dout, dkl, x["q"], x["k"], x["v"], x["qi"], x["ki"], attend, x["cu_q"], bs, scale,
                       iscale, cu_k=x["cu_k"])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("case", range(len(CASES)))
def test_msa_suffix_against_reference(case, dtype):
    x, bs, topk = _case(case, dtype)
    _check_against_reference(x, bs, topk, seed=case)


@pytest.mark.parametrize("heads", HEADS)
def test_msa_suffix_head_classes(heads):
    x, bs, topk = _case(4, torch.bfloat16, heads)
    _check_against_reference(x, bs, topk, seed=sum(heads))


@pytest.mark.parametrize("warmup", [False, True])
def test_batched_suffix(warmup):
    """Batched: k, v, k_idx with N_k > N_q rows, the queries the last N_q positions of each batch entry."""
    x = suffix_packed([100, 100], [333, 333], (8, 2, 4, 1), 128, 128, dtype=torch.bfloat16, device="cuda", seed=5)
    q, qi = (x[n].view(2, 100, *x[n].shape[1:]) for n in ("q", "qi"))
    k, v, ki = (x[n].view(2, 333, *x[n].shape[1:]) for n in ("k", "v", "ki"))
    out, kl = msa.msa_attention(q, k, v, qi, ki, topk=4, block_size=64, warmup=warmup)
    out2, kl2 = msa.msa_attention_varlen(x["q"], x["k"], x["v"], x["qi"], x["ki"], x["cu_q"], 100, topk=4,
                                         block_size=64, warmup=warmup, **_key(x))
    torch.testing.assert_close(out.flatten(0, 1), out2, rtol=0, atol=0)
    torch.testing.assert_close(kl, kl2, rtol=0, atol=0)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("case", [0, 2, 4, 5, 6])
def test_suffix_equals_the_square_call_on_its_rows(case, dtype):
    """The main branch of the square CUDA call on the keys' layout (the same selection on the query rows):
    out and lse on the query rows; dq there, dk and dv everywhere for a dout that is zero on the other rows."""
    x, bs, topk = _case(case, dtype)
    scale, _ = _scales(x)
    idx = _select(x, bs, topk)
    _, mixed = _square_indices(x, bs, topk, idx)
    rows = x["rows"]
    leaves = [x[n].detach().requires_grad_(True) for n in ("q", "k", "v")]
    out, lse = msa.sparse_attention(*leaves, idx, block_size=bs, return_lse=True, cu_seqlens=x["cu_q"],
                                    max_seqlen=x["mx_q"], **_key(x))
    full = [t.detach().requires_grad_(True) for t in (x["q_full"], x["k"], x["v"])]
    out_f, lse_f = msa.sparse_attention(*full, mixed, block_size=bs, return_lse=True, cu_seqlens=x["cu_k"],
                                        max_seqlen=x["mx_k"])
    # Both calls sum in fp32 in another order (other tiles and items): a value may round to its neighbour in the
    # input dtype, hence the relative term of two ulps.
    eps = torch.finfo(dtype).eps
    torch.testing.assert_close(out, out_f[rows], rtol=2 * eps, atol=2 * ATOL[dtype])
    torch.testing.assert_close(lse, lse_f[:, rows], rtol=1e-5, atol=1e-5)
    g = torch.Generator(device="cpu").manual_seed(case)
    dout = torch.randn(out.shape, generator=g).to(out)
    dout_f = torch.zeros_like(out_f)
    dout_f[rows] = dout
    dq, dk, dv = torch.autograd.grad(out, leaves, dout)
    dq_f, dk_f, dv_f = torch.autograd.grad(out_f, full, dout_f)
    for name, a, b in (("dq", dq, dq_f[rows]), ("dk", dk, dk_f), ("dv", dv, dv_f)):
        atol = 2 * ATOL[dtype] * max(1.0, b.abs().max().item())
        torch.testing.assert_close(a, b, rtol=2 * eps, atol=atol, msg=lambda m, n=name: f"{n}: {m}")


@pytest.mark.parametrize("case", [1, 4])
def test_suffix_deterministic_bitwise(case):
    x, bs, topk = _case(case, torch.bfloat16)
    first = _grads(x, bs, topk, seed=case, deterministic=True)
    second = _grads(x, bs, topk, seed=case, deterministic=True)
    assert torch.equal(first[0], second[0]) and torch.equal(first[1], second[1])
    for name, a, b in zip(("dq", "dk", "dv", "dq_idx", "dk_idx"), first[2], second[2]):
        assert torch.equal(a, b), f"{name} differs run to run"
    scale, iscale = _scales(x)
    assert_grads_close(first[2], first[3], first[4], x["q"], x["k"], x["v"], x["qi"], x["ki"], first[1], x["cu_q"],
                       bs, scale, iscale, cu_k=x["cu_k"])


# Each knob: one or more (variable, value) pairs. The warp-specialized stats pass never runs where the selection's
# lse_idx comes from the top-k (idx_own_only: at most MSA_SEL_MAX_BLOCKS key blocks, here 16), so its knob turns
# that off too.
KNOBS = [(("MSA_BWD_WS", "0"),), (("MSA_FWD_WS", "0"),), (("MSA_FWD_WS_STATS", "1"), ("MSA_SEL_MAX_BLOCKS", "0")),
         (("MSA_SMALL_SMEM", "1"),), (("MSA_FWD_ROWS", "64"),), (("MSA_ITEM_ORDER", "0"),),
         (("MSA_FWD_FIXED_GU", "0"),), (("MSA_PARTIAL_BUDGET", "1048576"),), (("MSA_FWD_UNITS_PER_ITEM", "37"),),
         (("MSA_BWD_UNITS_PER_ITEM", "5"),)]


@pytest.mark.parametrize("knob", KNOBS, ids=[",".join(f"{n}={v}" for n, v in k) for k in KNOBS])
def test_suffix_knobs(knob, monkeypatch, kernel_choice):
    """Every work split and kernel variant on one case with 4 query heads per index head (the Hopper
    warp-specialized passes apply) and several sequences."""
    for name, value in knob:
        monkeypatch.setenv(name, value)
    x = suffix_packed([200, 1, 129, 0], [201, 1000, 258, 64], (16, 4, 4, 1), 128, 128, dtype=torch.bfloat16,
                      device="cuda", seed=11)
    if dict(knob).get("MSA_FWD_WS_STATS") == "1" and kernel_choice == "default" and sm90_kernels_run():
        ran = cuda_kernel_names(lambda: _forward(x, 64, 16))
        assert any("stats_pass_ws_kernel" in n for n in ran), ran
    _check_against_reference(x, 64, 16, seed=11)


def test_suffix_value_errors_on_cuda():
    """Bad key-side values raise SPEC 7's ValueError naming cu_seqlens_k / max_seqlen_k before any launch."""
    x = suffix_packed([5, 9], [20, 30], (8, 2, 4, 1), 128, 128, dtype=torch.bfloat16, device="cuda")
    t = (x["q"], x["k"], x["v"], x["qi"], x["ki"])
    dev = x["q"].device

    def call(cu_k, mx_k):
        return msa.msa_attention_varlen(*t, x["cu_q"], x["mx_q"], cu_seqlens_k=torch.tensor(cu_k, dtype=torch.int32,
                                                                                               device=dev),
                                        max_seqlen_k=mx_k)
    for cu_k, mx_k, match in (([0, 4, 50], 46, "cu_seqlens_k: expected len_k >= len_q"),
                              ([0, 50], 50, "cu_seqlens_k: expected 2 sequences"),
                              ([0, 20, 40], 30, "cu_seqlens_k"),
                              ([0, 20, 50], 20, "max_seqlen_k: expected >= the longest")):
        with pytest.raises(ValueError, match=match):
            call(cu_k, mx_k)
    with pytest.raises(ValueError, match="cu_seqlens_k: expected len_k >= len_q"):
        msa.select_blocks(x["qi"], x["ki"], cu_seqlens=x["cu_q"], max_seqlen=x["mx_q"],
                          cu_seqlens_k=torch.tensor([0, 4, 50], dtype=torch.int32, device=dev), max_seqlen_k=46)


# Warmup (SPEC 5) with a key layout. The dense KL kernel walks 64-row query tiles against 128-key tiles:
# shifts 1, 63, 64, 65, 127 and 129 put the diagonal at every kind of offset within both; len_q 1 (decode),
# len_q 0 (keys only) and len_q = len_k beside them.
WARMUP_CASES = [  # (len_q per sequence, len_k per sequence, block size)
    ([1], [700], 64),                   # decode: shift 699
    ([300, 5, 0], [301, 5, 64], 128),   # shift 1, len_q = len_k, keys only
    ([130, 64], [193, 128], 64),        # shifts 63, 64
    ([65, 200], [130, 327], 128),       # shifts 65, 127
    ([257, 1], [386, 1], 128),          # shift 129, a sequence of one token
    ([500], [2548], 128),               # shift 2048: 16 key tiles before the first query
    ([1, 0, 1], [300, 64, 129], 64),    # decode with an empty query sequence (flash's max_seqlen_q = 1 path)
]
# G = 4 (the dense KL kernel's pipelined heads), G = 2 (its general kernel), Hkv > Hi (the dense mode always).
WARMUP_HEADS = [(16, 2, 4, 1), (8, 2, 4, 1), (8, 4, 2, 1)]


@pytest.mark.parametrize("kl_pass", ["dense_kl", "dense_mode"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("case", range(len(WARMUP_CASES)))
def test_warmup_suffix_against_reference(case, dtype, kl_pass, backends, monkeypatch):
    """Flash (bottom-right causal) for the main branch and lse_idx; the KL by the dense KL kernel (Hopper,
    Hkv <= Hi) or by the sparse kernels in dense mode (MSA_DENSE_KL=0, the portable kernels, Hkv > Hi)."""
    if kl_pass == "dense_mode":
        monkeypatch.setenv("MSA_DENSE_KL", "0")
    lq, lk, bs = WARMUP_CASES[case]
    x = suffix_packed(lq, lk, WARMUP_HEADS[case % len(WARMUP_HEADS)], 128, 64 if case % 2 else 128, dtype=dtype,
                      device="cuda", seed=case + 50)
    _check_against_reference(x, bs, 16, seed=case, warmup=True)
    assert set(backends) == {"flash"}, backends


def test_warmup_suffix_deterministic_bitwise(backends):
    """deterministic=True: flash's deterministic backward and the dense-mode KL pass, bitwise run to run."""
    x = suffix_packed([200, 1, 129], [201, 1000, 258], (8, 2, 4, 1), 128, 128, dtype=torch.bfloat16, device="cuda",
                      seed=13)
    first = _grads(x, 128, 16, seed=13, deterministic=True, warmup=True)
    second = _grads(x, 128, 16, seed=13, deterministic=True, warmup=True)
    assert torch.equal(first[0], second[0])
    for name, a, b in zip(("dq", "dk", "dv", "dq_idx", "dk_idx"), first[2], second[2]):
        assert torch.equal(a, b), f"{name} differs run to run"
    scale, iscale = _scales(x)
    assert_grads_close(first[2], first[3], first[4], x["q"], x["k"], x["v"], x["qi"], x["ki"], None, x["cu_q"], 128,
                       scale, iscale, cu_k=x["cu_k"])
    assert set(backends) == {"flash"}, backends


@pytest.mark.parametrize("kl_pass", ["dense_kl", "dense_mode"])
def test_warmup_suffix_equals_the_square_call_on_its_rows(kl_pass, monkeypatch):
    """The square warmup call on the keys' layout, on the query rows: out, lse, lse_idx, the KL rows and
    dq_idx (scaled by its rows: T_k Hi there, T_q Hi here), with shifts the float64 reference would be slow
    on."""
    if kl_pass == "dense_mode":
        monkeypatch.setenv("MSA_DENSE_KL", "0")
    x = suffix_packed([300, 1, 129, 0], [4396, 2000, 258, 64], (16, 2, 4, 1), 128, 128, dtype=torch.bfloat16,
                      device="cuda", seed=12)
    scale, iscale = _scales(x)
    rows = x["rows"]
    r = ops.msa_fwd(x["q"], x["k"], x["v"], x["qi"], x["ki"], x["cu_q"], x["mx_q"], 16, 128, scale, iscale, True,
                    False, True, False, x["cu_k"], x["mx_k"])
    f = ops.msa_fwd(x["q_full"], x["k"], x["v"], x["qi_full"], x["ki"], x["cu_k"], x["mx_k"], 16, 128, scale, iscale,
                    True, False, True, False)
    # two calls, two summation orders: two ulps of relative slack besides the absolute one
    torch.testing.assert_close(r[0], f[0][rows], rtol=2 * torch.finfo(torch.bfloat16).eps,
                               atol=2 * ATOL[torch.bfloat16])
    for name, i in (("lse", 3), ("lse_idx", 4), ("kl_rows", 7)):
        torch.testing.assert_close(r[i], f[i][:, rows], rtol=1e-4, atol=1e-5, msg=lambda m, n=name: f"{n}: {m}")
    want = f[5][rows] * (x["k"].shape[0] / x["q"].shape[0])
    torch.testing.assert_close(r[5], want, rtol=0, atol=2e-3 * want.abs().max().item())
