"""The CUDA sparse forward and KL (msa_fwd, sparse_fwd) against the float64 reference on the GPU."""
import math

import pytest
import torch

import msa
from attention_check import (assert_close_style, assert_forward_close, assert_lse_close, low_precision,
                             reference_forward, run_ref)
from helpers import HEADS, VARLEN_LENGTHS, VARLEN_SHAPES, make_inputs, make_packed, poison_allocator
from msa import reference as ref
from topk_check import assert_valid_topk

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("kernel_choice")]  # Hopper stats pass and portable
ops = torch.ops.msa


def _fwd_case(q, k, v, qi, ki, cu, mx, topk, bs):
    scale, iscale = 1 / math.sqrt(q.shape[-1]), 1 / math.sqrt(qi.shape[-1])
    poison_allocator()
    res = ops.msa_fwd(q, k, v, qi, ki, cu, mx, topk, bs, scale, iscale, False, True, False)
    out, kl, idx, lse, lse_idx, kl_rows = *res[:5], res[7]
    # The oracle attends to the kernel's own selection, checked here against SPEC 2 too: msa_fwd selects with
    # the kSel top-k (the kept blocks' sums) where it applies, which msa.select_blocks (test_index_topk_gpu)
    # does not run.
    assert_valid_topk(idx, qi, ki, cu, topk, bs, iscale)
    exact, (lowp_out, _) = reference_forward(q, k, v, qi, ki, idx, cu, bs, scale, iscale)
    assert_forward_close(out, kl, lse, lse_idx, exact, lowp_out, kl_rows)
    again = ops.msa_fwd(q, k, v, qi, ki, cu, mx, topk, bs, scale, iscale, False, True, False)[:5]
    for name, a, b in zip(("out", "kl", "indices", "lse", "lse_idx"), (out, kl, idx, lse, lse_idx), again):
        assert torch.equal(a, b), f"{name} differs between two runs"


CASES = [  # (B, N, D, Di, block_size, topk): every class of the foundation list, rotated over HEADS
    (2, 1, 64, 64, 128, 16), (2, 100, 128, 64, 64, 3), (1, 128, 64, 128, 128, 1), (2, 129, 128, 128, 64, 16),
    (1, 300, 64, 64, 64, 32), (2, 700, 128, 128, 128, 3), (2, 2048, 128, 128, 128, 16),
    (1, 2048, 64, 64, 64, 16), (1, 8192, 128, 128, 128, 16),
    # topk = 32 with more blocks visible than slots: every slot of the per-slot stats and combines in use
    (1, 4500, 128, 128, 128, 32), (1, 2500, 64, 64, 64, 32),
]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("case", range(len(CASES)))
def test_msa_fwd_batched(case, dtype):
    B, N, D, Di, bs, topk = CASES[case]
    heads = HEADS[case % len(HEADS)]
    q, k, v, qi, ki = make_inputs(B, N, heads, D, Di, dtype=dtype, device="cuda", seed=case)
    flat = [x.reshape(B * N, *x.shape[2:]) for x in (q, k, v, qi, ki)]
    cu = torch.arange(0, (B + 1) * N, N, dtype=torch.int32, device="cuda")
    _fwd_case(*flat, cu, N, topk, bs)


@pytest.mark.parametrize("heads", HEADS + [(16, 2, 4, 1), (12, 4, 4, 1), (8, 8, 2, 1)])
def test_msa_fwd_varlen(heads):
    q, k, v, qi, ki, cu, mx = make_packed(VARLEN_LENGTHS, heads, 128, 64, dtype=torch.bfloat16,
                                          device="cuda", seed=sum(heads))
    _fwd_case(q, k, v, qi, ki, cu, mx, 5, 128)


@pytest.mark.parametrize("heads", [(16, 2, 4, 1), (8, 2, 4, 1)])  # warp-specialized kernels, general ones
@pytest.mark.parametrize("D, Di, bs, dtype", VARLEN_SHAPES)
def test_msa_fwd_varlen_shapes(heads, D, Di, bs, dtype):
    x = make_packed(VARLEN_LENGTHS, heads, D, Di, dtype=dtype, device="cuda", seed=D + Di + bs)
    _fwd_case(*x, 5, bs)


def test_msa_attention_api_matches_op():
    q, k, v, qi, ki = make_inputs(2, 600, (8, 2, 4, 1), 64, 64, dtype=torch.bfloat16, device="cuda", seed=3)
    out, kl, idx = msa.msa_attention(q, k, v, qi, ki, topk=4, block_size=64, return_indices=True)
    flat = [x.reshape(1200, *x.shape[2:]) for x in (q, k, v, qi, ki)]
    cu = torch.tensor([0, 600, 1200], dtype=torch.int32, device="cuda")
    o2, kl2, idx2 = ops.msa_fwd(*flat, cu, 600, 4, 64, 0.125, 0.125, False, True, False)[:3]
    assert torch.equal(out.reshape(1200, 8, 64), o2) and torch.equal(kl, kl2)
    assert torch.equal(idx, idx2.view(4, 2, 600, 4).permute(1, 0, 2, 3))


def _random_indices(Hi, lengths, topk, bs, seed):
    """Hand-made selections: random blocks (some past the token's own), repeats and -1 gaps."""
    g = torch.Generator().manual_seed(seed)
    rows = []
    for n in lengths:
        nb = -(-n // bs)
        rnd = torch.randint(-1, nb + 1, (Hi, n, topk), generator=g)
        rnd[..., 1] = rnd[..., 0]  # a repeat
        rows.append(rnd)
    return torch.cat(rows, dim=1).to(torch.int32).cuda()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("heads", HEADS)
def test_sparse_attention_hand_made_indices(heads, dtype):
    lengths = [700, 64, 1]
    q, k, v, qi, _, cu, mx = make_packed(lengths, heads, 64, 64, dtype=dtype, device="cuda", seed=7)
    idx = _random_indices(heads[2], lengths, 4, 64, seed=sum(heads))
    poison_allocator()
    out, lse = msa.sparse_attention(q, k, v, idx, block_size=64, return_lse=True, cu_seqlens=cu, max_seqlen=mx)
    exact_out, exact_lse = run_ref(ref.sparse_fwd, q, k, v, idx, cu, 64, 0.125)
    with low_precision():
        lowp_out, _ = run_ref(ref.sparse_fwd, q, k, v, idx, cu, 64, 0.125, dtype=dtype)
    assert_close_style("out", out, exact_out, lowp_out, dtype)
    assert_lse_close("lse", lse, exact_lse)
    assert torch.isinf(lse).any(), "the case should contain rows that attend to nothing"
    assert (out[torch.isinf(lse).T] == 0).all()


@pytest.mark.parametrize("fixed_gu", ["default", "0"])
def test_kl_with_subnormal_group_mean(monkeypatch, fixed_gu):
    """A key whose group-averaged probability pm is a subnormal float: one head's P just above the exp2
    underflow (e^-83 / t for tokens t ~ 20-75), the group's other heads 0. lg2.approx.ftz reads a
    subnormal as 0, so pm * log2(pm) must not be taken there (it made the KL -inf)."""
    if fixed_gu == "0":
        monkeypatch.setenv("MSA_FWD_FIXED_GU", "0")
    else:
        monkeypatch.delenv("MSA_FWD_FIXED_GU", raising=False)
    T, D, bs = 256, 64, 128
    g = torch.Generator(device="cpu").manual_seed(11)
    q = torch.zeros(T, 4, D)  # Hq = 4, Hkv = Hi = Hki = 1: G = 4, J = 1 (the bench's head layout)
    q[:, 0, 0] = 664.0  # head 0: logit -83 against key 0 (scale 1/8), 0 against the others
    q[:, 1:, 0] = 1600.0  # heads 1-3: logit -200 against key 0, so P = 0 there
    k = torch.zeros(T, 1, D)
    k[0, 0, 0] = -1.0
    v = torch.randn(T, 1, D, generator=g)
    qi = torch.randn(T, 1, D, generator=g) * 0.5
    ki = torch.randn(T, 1, D, generator=g) * 0.5
    q, k, v, qi, ki = (x.to(device="cuda", dtype=torch.bfloat16) for x in (q, k, v, qi, ki))
    cu = torch.tensor([0, T], dtype=torch.int32, device="cuda")
    scale, iscale = 1 / math.sqrt(D), 1 / math.sqrt(D)
    # The case is there: token t >= 1 sees key 0 and t keys of logit 0, so head 0's P of key 0 is
    # 2^(-83 log2 e - log2 t) in fp32 (0 below 2^-126, as exp2.approx.ftz gives), and pm = P / 4.
    t = torch.arange(1, T, dtype=torch.float64)
    p0 = torch.exp2((-83.0 * math.log2(math.e) - torch.log2(t)).float())
    pm = torch.where(p0 < 2.0 ** -126, torch.zeros_like(p0), p0) / 4
    assert ((pm > 0) & (pm < 2.0 ** -126)).sum() > 10
    poison_allocator()
    out, kl, idx, lse, lse_idx = ops.msa_fwd(q, k, v, qi, ki, cu, T, 2, bs, scale, iscale, False, True, False)[:5]
    assert torch.isfinite(kl), f"kl = {kl.item()}"
    exact, (lowp_out, _) = reference_forward(q, k, v, qi, ki, idx, cu, bs, scale, iscale)
    assert_forward_close(out, kl, lse, lse_idx, exact, lowp_out)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_stats_pass_wide_logit_spread(dtype):
    """Rows whose logits inside one block spread over far more than 128 in the log2 domain (keys with a
    large first component of either sign against queries with a large one): the stats pass's full tiles
    sum each lane's exponentials against the lane's first entry (quad_row_ref_sum), which overflows fp32
    here, and a lane whose sum passes 2^64 redoes it against its own max. lse, out and kl against the
    float64 reference."""
    B, N, heads, D, Di = 1, 2048, (16, 2, 4, 1), 128, 128
    q, k, v, qi, ki = make_inputs(B, N, heads, D, Di, dtype=torch.float64, seed=29)
    g = torch.Generator(device="cpu").manual_seed(29)
    big = torch.rand(N, generator=g) < 0.25  # a quarter of the keys: first component +-60 (fp16-safe)
    sign = torch.where(torch.rand(N, generator=g) < 0.5, -1.0, 1.0).double()
    k[0, big, :, 0] = (60.0 * sign[big])[:, None]
    q[..., 0] = 12.0  # logit part 12 * 60 / sqrt(128) = +-63.6 (+-92 in log2): spreads of ~180 inside a lane
    flat = [x.reshape(B * N, *x.shape[2:]).to(device="cuda", dtype=dtype) for x in (q, k, v, qi, ki)]
    cu = torch.tensor([0, N], dtype=torch.int32, device="cuda")
    _fwd_case(*flat, cu, N, 16, 128)


def test_stats_pass_overflowed_logits():
    """Finite bf16 inputs whose dot products overflow fp32 to -inf on some keys (2^70 * -2^70): those keys
    weigh 0, as in the float64 reference. The keys at positions 2 and 3 mod 8 are the columns of one lane
    of each quad, so on full tiles that lane's entries are all -inf (quad_row_ref_sum leaves it out of the
    merge instead of taking -inf - -inf). Every token still sees one finite key, the first of its own block
    (position 0 mod 8): a row whose every logit overflows has no fp32 answer (the float64 softmax of equal
    -2^140 logits is uniform), so it is out of range, not tested."""
    B, N, heads, D, Di = 1, 1024, (16, 2, 4, 1), 128, 128
    q, k, v, qi, ki = make_inputs(B, N, heads, D, Di, dtype=torch.float64, seed=31)
    q[..., 0] = 2.0 ** 70
    k[..., 0] = 0.0
    k[0, (torch.arange(N) % 8) // 2 == 1, :, 0] = -(2.0 ** 70)
    flat = [x.reshape(B * N, *x.shape[2:]).to(device="cuda", dtype=torch.bfloat16) for x in (q, k, v, qi, ki)]
    cu = torch.tensor([0, N], dtype=torch.int32, device="cuda")
    _fwd_case(*flat, cu, N, 16, 128)


@pytest.mark.parametrize("index_grad", [False, True])
def test_fwd_results_do_not_depend_on_query_chunks(monkeypatch, index_grad):
    """The forward's query chunks (MSA_PARTIAL_BUDGET bounds the tokens whose partials share one workspace): the
    default (one chunk here) against a 1 MiB budget (many small chunks, so chunk boundaries and item splits are
    everywhere). The selection is made before the chunks: bitwise equal. The rest match to rounding, not
    bitwise: a chunk changes which units share a work item and a 16-unit tile, and the stats pass sums a slot's
    exponentials against the lane's first logit on a tile whose rows all see the whole block (quad_row_ref_sum)
    but against the row max on any other tile (quad_row_max_sum), so a row's lse can move by an fp32 ulp with its
    tile's company, and out by a rounding of the dtype (s52: why a bitwise comparison of two kernel paths needs the
    same chunks). dq_idx / dk_idx: fp32 atomics, compared to rounding too."""
    q, k, v, qi, ki, cu, mx = make_packed([2100, 700, 1, 300, 129], (16, 2, 4, 1), 128, 128, dtype=torch.bfloat16,
                                          device="cuda", seed=52)
    args = (q, k, v, qi, ki, cu, mx, 6, 128, 1 / math.sqrt(128), 1 / math.sqrt(128), False, True, index_grad, False)
    monkeypatch.delenv("MSA_PARTIAL_BUDGET", raising=False)
    poison_allocator()
    one = ops.msa_fwd(*args)
    monkeypatch.setenv("MSA_PARTIAL_BUDGET", str(1 << 20))
    poison_allocator()
    many = ops.msa_fwd(*args)
    assert torch.equal(one[2], many[2]), "the selection depends on the query chunks"
    checks = [("out", 0, 8e-3, 1e-3), ("lse", 3, 1e-5, 1e-5), ("lse_idx", 4, 1e-5, 1e-5), ("kl_rows", 7, 1e-4, 1e-6)]
    if index_grad:
        checks += [("kl_dq_idx", 5, 1e-4, 1e-6), ("kl_dk_idx", 6, 1e-4, 1e-6)]
    for name, i, rtol, atol in checks:
        a, b = one[i].float(), many[i].float()
        assert torch.isfinite(a).all() and torch.isfinite(b).all(), f"{name}: non-finite values"
        if name in ("kl_dq_idx", "kl_dk_idx"):
            atol = atol + 1e-5 * a.abs().max().item()
        torch.testing.assert_close(b, a, rtol=rtol, atol=atol, msg=f"{name} depends on the query chunks")
