"""index_dtype=torch.float8_e4m3fn on CUDA (issue 17 item 7): the selection scores the e4m3 copies of q_idx / k_idx
(msa.fp8_index_copies) on the Hopper FP8 top-k at Di = 128, elsewhere on those values widened to bf16. Checked
against SPEC 2 on the copies (fp32 block scores), the CPU reference given the same index_dtype, the op on the copies
themselves, and msa_attention's outputs and gradients against the exact reference over the selection it made.
The long sequences (128K, 1M) are in tests/test_long_seq_gpu.py."""
import math

import pytest
import torch

import msa
from msa.bench import selection_recall
from attention_check import assert_forward_close, assert_grads_close, reference_forward
from helpers import (cuda_kernel_names, fp8_rel_tol, launched_kernel, make_inputs, make_packed, poison_allocator,
                     sm90_kernels_run)
from topk_check import assert_valid_topk

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("kernel_choice")]

FP8 = torch.float8_e4m3fn
# The FP8 selection keeps > 95% of the bf16 one's blocks on random normal inputs (CPU reference, 8K, bench heads:
# 96.9%); a wrong operand layout or scale would keep about topk / blocks of them.
RECALL_MIN = 0.95


def packed(x):
    """(B, N, H, D) -> (B * N, H, D), detached."""
    return x.detach().reshape(-1, *x.shape[2:])


def _check(qi, ki, cu, mx, topk, bs, scale=None):
    scale = 1 / math.sqrt(qi.shape[-1]) if scale is None else scale
    kw = dict(topk=topk, block_size=bs, index_scale=scale, max_seqlen=mx)
    poison_allocator()
    got = msa.select_blocks(qi, ki, cu_seqlens=cu, index_dtype=FP8, **kw)
    assert got.shape == (qi.shape[1], qi.shape[0], topk) and got.dtype == torch.int32
    q8, k8 = msa.fp8_index_copies(qi, ki)
    assert q8.dtype == k8.dtype == FP8
    assert_valid_topk(got, q8, k8, cu, topk, bs, scale, rel_tol=fp8_rel_tol(qi.shape[-1]))
    assert torch.equal(got, msa.select_blocks(qi, ki, cu_seqlens=cu, index_dtype=FP8, **kw)), "differs between runs"
    # The op on the copies themselves, and the CPU reference given the same index_dtype (up to near-ties).
    assert torch.equal(got, torch.ops.msa.select_blocks(q8, k8, cu, mx, topk, bs, scale))
    want = msa.select_blocks(qi.cpu(), ki.cpu(), cu_seqlens=cu.cpu(), index_dtype=FP8, **kw)
    rows_differ = (got.cpu() != want).any(-1).float().mean().item()
    # The FP8 kernel's near-ties (f16 sums): 0.11% of rows at block 128 (H100); a row of 64-key blocks has twice the
    # candidates near its threshold (0.63% on the warpgroup case below, H100, s68).
    bound = 1e-3 if fp8_rel_tol(qi.shape[-1]) < 1e-4 else 5e-3 * 128 / bs
    assert rows_differ < bound, f"{rows_differ:.2%} rows differ from the reference"
    return got


@pytest.mark.parametrize("Di", [128, 64])
@pytest.mark.parametrize("N,heads,bs,topk", [(1, (8, 2, 4, 1), 128, 16), (700, (8, 2, 4, 2), 64, 3),
                                             (1500, (16, 2, 4, 1), 128, 4), (2048, (8, 8, 8, 1), 64, 8),
                                             (3000, (16, 2, 16, 16), 128, 16), (4000, (8, 2, 4, 1), 128, 20),
                                             (600, (8, 2, 4, 1), 64, 17), (1000, (8, 2, 4, 1), 128, 1)])
def test_select_blocks_fp8_shapes(Di, N, heads, bs, topk):
    """topk below the blocks of a row (but N = 1): the selection ranks; Hi / Hki = 2 with Hki = 2 among them; list
    sizes 19 (past what fits in registers in s67's patches/topk_fp8_reg_list.patch), 16 (the most that does) and 0
    (topk 1: the own block only); at block 64 a last sequence of 600 keys (600 mod 256 in [65, 128]: s67's
    patches/topk_fp8_n256.patch skips the last 256-key sub-tile's second TMA box there)."""
    _, _, _, qi, ki = make_inputs(2, N, heads, 64, Di, dtype=torch.bfloat16, device="cuda", seed=N + Di)
    cu = torch.arange(0, 3 * N, N, dtype=torch.int32, device="cuda")
    _check(packed(qi), packed(ki), cu, N, topk, bs)


@pytest.mark.parametrize("bs", [64, 128])
def test_select_blocks_fp8_warpgroup_count(monkeypatch, bs):
    """The FP8 top-k's 2- and 4-warpgroup CTAs (MSA_TOPK_WG; short sequences take 2 by default, 128K and 1M take 4 at
    block 128 in test_long_seq_gpu) at both block sizes: each valid on the copies, and the two equal bit for bit (a
    row's scores do not depend on how rows are tiled)."""
    if not sm90_kernels_run():
        pytest.skip("the warpgroup count is the sm_90a kernel's")
    _, _, _, qi, ki, cu, mx = make_packed([3000, 1, 700], (8, 2, 4, 1), 64, 128, dtype=torch.bfloat16, device="cuda",
                                          seed=41 + bs)
    got = {}
    for wg in ("2", "4"):
        monkeypatch.setenv("MSA_TOPK_WG", wg)
        got[wg] = _check(qi, ki, cu, mx, 16, bs)
    assert torch.equal(got["2"], got["4"])


@pytest.mark.parametrize("scale", [-0.125, 0.0])
def test_select_blocks_fp8_varlen_negative_and_zero_scale(scale):
    """Packed sequences (one empty, one of one token); a negative scale flips every e4m3 byte's sign in the kernel,
    a zero one ties every block (the lowest win)."""
    _, _, _, qi, ki, cu, mx = make_packed([2000, 0, 1, 517], (8, 2, 4, 1), 64, 128, dtype=torch.float16,
                                          device="cuda", seed=17)
    _check(qi, ki, cu, mx, 16, 64, scale=scale)


def _spec2_lists(bscore, n, bs, topk):
    """(n, topk) SPEC 2 lists of one head whose block j scores bscore[j] (ties to the lower block)."""
    want = torch.full((n, topk), -1, dtype=torch.int32)
    for local in range(n // bs):
        order = sorted(range(local), key=lambda b: (-bscore[b], b))
        kept = sorted(order[:topk - 1]) + [local]
        want[local * bs:(local + 1) * bs, :len(kept)] = torch.tensor(kept, dtype=torch.int32)
    return want


def _tie_inputs(n, bs, dtype):
    """(n, 4, 128) q_idx / (n, 1, 128) k_idx of `dtype` whose block scores tie exactly: heads 0, 1 of q all -16, heads
    2, 3 all +16; every key of block j is -16 (j % 8 == 3), +16 (j % 8 == 5), +0 (j even) or -0 (other odd j), so a
    block scores +-32768 or a zero whose sign differs with the block (products -0 and +0)."""
    q = torch.full((n, 4, 128), 16.0)
    q[:, :2] = -16.0
    j = torch.arange(n) // bs
    key = torch.where(j % 2 == 0, 0.0, -0.0)
    key = torch.where(j % 8 == 3, -16.0, torch.where(j % 8 == 5, 16.0, key))
    k = key[:, None, None].expand(n, 1, 128).contiguous()
    return q.to(dtype), k.to(dtype)


@pytest.mark.parametrize("dtype", [FP8, torch.bfloat16], ids=["fp8", "bf16"])
@pytest.mark.parametrize("bs", [64, 128])
@pytest.mark.parametrize("scale", [0.125, 0.0])
def test_select_blocks_exact_ties(dtype, bs, scale):
    """Exact ties, among them zeros of both signs (fp32 compares -0 equal to +0): every row must keep SPEC 2's
    blocks, ties to the lower block, exactly, on the e4m3 inputs (the Hopper FP8 top-k) and the same values in bf16
    (the 16-bit one). A list that ranks its scores by their bits must rank -0 with +0, or it keeps a later block
    where the tensor cores' sum of -0 products is -0 (the inputs' -0 bytes are checked here, the sums' sign is the
    hardware's). Scale 0 ties every block: the lowest win."""
    n, topk = 2048, 8
    qi, ki = _tie_inputs(n, bs, dtype)
    neg_zero = 0x80 if dtype == FP8 else 0x8000
    bits = ki.view(torch.uint8 if dtype == FP8 else torch.int16).to(torch.int32) & (0xFF if dtype == FP8 else 0xFFFF)
    assert (bits[(torch.arange(n) // bs) % 8 == 1] == neg_zero).all(), "the -0 keys are -0"
    cu = torch.tensor([0, n], dtype=torch.int32)
    got = torch.ops.msa.select_blocks(qi.cuda(), ki.cuda(), cu.cuda(), n, topk, bs, scale).cpu()
    blocks = torch.arange(n // bs)
    bscore = torch.where(blocks % 8 == 3, 1.0, torch.where(blocks % 8 == 5, -1.0, 0.0)).tolist()
    signs = [(1.0 if h < 2 else -1.0) * (scale != 0) for h in range(4)]  # heads 0, 1: q < 0, so block 3 scores +
    want = torch.stack([_spec2_lists([sign * x for x in bscore], n, bs, topk) for sign in signs])
    assert torch.equal(got, want), f"{(got != want).any(-1).sum().item()} rows differ"


@pytest.mark.parametrize("dtype", [FP8, torch.bfloat16], ids=["fp8", "bf16"])
@pytest.mark.parametrize("bs", [64, 128])
@pytest.mark.parametrize("scale", [1.0, 2.0 ** -125, 2.0 ** -126, 2.0 ** 112, 2.0 ** 113, 2.0 ** -149])
def test_select_blocks_scale_range_edges(dtype, bs, scale):
    """Index scales at the edges of the Hopper FP8 top-k's packed-key lists (abs scale 0 or in [2^-125, 2^112]; the
    shared heaps outside): the selection must rank scale * score in fp32 either way. Block j's scores are all
    +-(j % 8 + 1) / 32 (heads 0, 1 positive, 2, 3 negative; exact in e4m3 and in f16 sums), so at 2^-125 .. 2^113
    the products stay distinct (denormal at the low end) and rank as at scale 1, ties between blocks j and j + 8 to
    the lower; at 2^-149 every product rounds to (-)0 and every block ties: the lowest blocks win, where a list
    ranking the unscaled scores would keep the highest."""
    n, topk = 2048, 8
    q = torch.full((n, 4, 128), 0.125)
    q[:, 2:] = -0.125
    m = (torch.arange(n) // bs) % 8 + 1
    k = (m.float() * 2.0 ** -9)[:, None, None].expand(n, 1, 128).contiguous()  # e4m3 subnormals and 2^-6
    qi, ki = q.to(dtype), k.to(dtype)
    assert torch.equal(ki.float(), k) and torch.equal(qi.float(), q), "exact in the input dtype"
    cu = torch.tensor([0, n], dtype=torch.int32)
    got = torch.ops.msa.select_blocks(qi.cuda(), ki.cuda(), cu.cuda(), n, topk, bs, scale).cpu()
    blocks = torch.arange(n // bs)
    dots = ((blocks % 8 + 1).float() * 2.0 ** -5).tolist()  # 128 * 0.125 * m 2^-9
    for h in range(4):
        sign = 1.0 if h < 2 else -1.0
        prod = [torch.tensor(sign * d, dtype=torch.float32).mul(torch.tensor(scale, dtype=torch.float32)).item()
                for d in dots]
        assert (len(set(prod)) == 1) == (scale == 2.0 ** -149), "the fp32 products tie only at 2^-149"
        want = _spec2_lists(prod, n, bs, topk)
        assert torch.equal(got[h], want), f"head {h}: {(got[h] != want).any(-1).sum().item()} rows differ"


def test_select_blocks_fp8_strided_and_scaled_inputs():
    """Last-dim contiguous views give the same selection; so do inputs scaled by powers of two (the copies'
    power-of-two scales make the rounding independent of them), which also moves k's per-head scale."""
    _, _, _, qi, ki = make_inputs(1, 1500, (8, 2, 4, 1), 64, 128, dtype=torch.bfloat16, device="cuda", seed=4)
    base = msa.select_blocks(qi, ki, topk=8, block_size=128, index_dtype=FP8)
    qs = torch.empty(1, 1500, 4, 256, dtype=qi.dtype, device="cuda")[..., :128]
    qs.copy_(qi)
    assert torch.equal(msa.select_blocks(qs, ki, topk=8, block_size=128, index_dtype=FP8), base)
    assert torch.equal(msa.select_blocks(qi * 8, ki / 4, topk=8, block_size=128, index_dtype=FP8), base)


def test_select_blocks_fp8_full_magnitude():
    """Every value of the copies at the scale rule's bound (+-16: inputs of one power-of-two magnitude, random
    signs), so every score is 256 (agreements - disagreements), up to 128 x 256 = 32768, where the Hopper kernel's f16
    sums are still exact (multiples of 256 within 2^15): the selection must rank as the fp32 reference does, ties
    aside (rel_tol 0). Copies scaled to e4m3's 448 would overflow those sums (inf ties) and fail here."""
    g = torch.Generator(device="cuda").manual_seed(23)
    n, heads, Di = 1500, (8, 2, 4, 1), 128

    def signs(*shape):
        return (torch.randint(0, 2, shape, generator=g, device="cuda") * 2 - 1).to(torch.bfloat16)

    qi, ki = 2 * signs(1, n, heads[2], Di), 0.5 * signs(1, n, heads[3], Di)
    q8, k8 = msa.fp8_index_copies(packed(qi), packed(ki))
    assert q8.float().abs().eq(16).all() and k8.float().abs().eq(16).all()
    cu = torch.tensor([0, n], dtype=torch.int32, device="cuda")
    got = msa.select_blocks(packed(qi), packed(ki), cu_seqlens=cu, max_seqlen=n, topk=8, block_size=128,
                            index_scale=0.125, index_dtype=FP8)
    assert_valid_topk(got, q8, k8, cu, 8, 128, 0.125, rel_tol=0.0)


def test_select_blocks_fp8_recall():
    """The FP8 selection against the bf16 one on the bench's random inputs (normal q_idx, k_idx: near-uniform block
    scores, the hard case): most kept blocks agree. A looser selection would show here first."""
    _, _, _, qi, ki = make_inputs(1, 8192, (16, 2, 4, 1), 64, 128, dtype=torch.bfloat16, device="cuda", seed=5)
    a = msa.select_blocks(qi, ki, topk=16, block_size=128)
    b = msa.select_blocks(qi, ki, topk=16, block_size=128, index_dtype=FP8)
    recall = selection_recall(b, a)
    assert recall > RECALL_MIN, f"recall {recall:.3f}"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("Di", [128, 64])
def test_msa_attention_fp8_index(dtype, Di):
    """The whole op with index_dtype: its selection is select_blocks' FP8 one, and out, lse, the KL and all five
    gradients are exact over it (the KL and the index gradients in the inputs' dtype, not FP8)."""
    B, N, heads, D, bs = 2, 1000, (8, 2, 4, 1), 64, 64
    scale, iscale = 1 / math.sqrt(D), 1 / math.sqrt(Di)
    q, k, v, qi, ki = make_inputs(B, N, heads, D, Di, dtype=dtype, device="cuda", seed=Di, requires_grad=True)
    poison_allocator()
    out, kl, idx = msa.msa_attention(q, k, v, qi, ki, topk=4, block_size=bs, return_indices=True, index_dtype=FP8)
    assert torch.equal(idx, msa.select_blocks(qi, ki, topk=4, block_size=bs, index_dtype=FP8))
    dout = torch.randn_like(out)
    dkl = torch.tensor(1.0, device="cuda")
    grads = torch.autograd.grad((out, kl), (q, k, v, qi, ki), (dout, dkl))
    cu = torch.arange(0, (B + 1) * N, N, dtype=torch.int32, device="cuda")
    flat = [packed(x) for x in (q, k, v, qi, ki)]
    pidx = idx.permute(1, 0, 2, 3).reshape(heads[2], B * N, -1)
    exact, (lowp_out, _) = reference_forward(*flat, pidx, cu, bs, scale, iscale)
    lse, lse_idx = _lse_of(flat, pidx, cu, N, bs, scale, iscale)
    assert_forward_close(packed(out), kl, lse, lse_idx, exact, lowp_out)
    assert_grads_close([packed(g) for g in grads], packed(dout), dkl, *flat, pidx, cu, bs, scale, iscale)


def _lse_of(flat, pidx, cu, N, bs, scale, iscale):
    """lse and lse_idx of the op itself (msa_fwd's outputs 4 and 5) given the FP8 copies."""
    sel = msa.fp8_index_copies(flat[3], flat[4])
    r = torch.ops.msa.msa_fwd(*flat, None, N, pidx.shape[-1], bs, scale, iscale, False, True, False, False,
                              None, None, *sel)
    assert torch.equal(r[2], pidx)
    return r[3], r[4]


def test_fp8_kernel_taken_on_hopper():
    """At Di = 128 on an sm_90 GPU with this build's Hopper kernels, select_blocks with index_dtype launches the
    FP8 top-k (the e4m3 wgmma variant of index_topk_sm90_kernel), not the bf16 one."""
    if not sm90_kernels_run():
        pytest.skip("the Hopper kernels do not run here")
    _, _, _, qi, ki = make_inputs(1, 4096, (8, 2, 4, 1), 64, 128, dtype=torch.bfloat16, device="cuda", seed=1)
    names = cuda_kernel_names(lambda: msa.select_blocks(qi, ki, index_dtype=FP8))
    want = ("index_topk_sm90_kernel", ["__nv_bfloat16", "64", "false", "false", "true"])  # T, D, kLse, kSel, kFp8
    assert any((k, a[:2] + a[3:]) == want for k, a in map(launched_kernel, names)), names


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("Di", [128, 64])
def test_fp8_copies_kernel_matches_the_formula(dtype, Di):
    """The fused CUDA copies (msa::_fp8_copies_cuda, through msa.fp8_index_copies) give the PyTorch formula's bytes:
    strided rows, a zero row, tiny and large values (subnormal e4m3 results, a scale below one), two key heads; k per
    batch element (batched), per sequence (packed, an empty one among them) and as one sequence."""
    from msa._ops import fp8_copies_torch
    _, _, _, qi, ki = make_inputs(2, 333, (8, 2, 4, 2), 64, Di, dtype=dtype, device="cuda", seed=Di)
    qs = torch.empty(2, 333, 4, 2 * Di, dtype=dtype, device="cuda")[..., :Di]
    qs.copy_(qi)
    qs[0, 3, 1] = 0
    qs[1, 7, 2] *= 1e-3
    ki[1] *= 600 if dtype == torch.bfloat16 else 60
    flat_q, flat_k = qs.reshape(666, 4, Di), ki.reshape(666, 2, Di)
    cu = torch.tensor([0, 300, 300, 666], dtype=torch.int32, device="cuda")
    # sequences shorter than a warp's run of 32 key rows, empty ones first, between and last
    short = torch.tensor([0, 0, 5, 5, 17, 40, 41, 300, 666, 666], dtype=torch.int32, device="cuda")
    # cu_seqlens_k as int64: not the kernel's (int32 only), the formula's (no error)
    for args in ((qs, ki), (flat_q, flat_k, cu), (flat_q, flat_k), (flat_q, flat_k, short),
                 (flat_q, flat_k, cu.long())):
        poison_allocator()
        q8, k8 = msa.fp8_index_copies(*args)
        w8, v8 = fp8_copies_torch(*args)
        assert q8.is_contiguous() and q8.shape == args[0].shape and k8.shape == args[1].shape
        assert torch.equal(q8.view(torch.uint8), w8.view(torch.uint8))
        assert torch.equal(k8.view(torch.uint8), v8.view(torch.uint8))
    names = cuda_kernel_names(lambda: msa.fp8_index_copies(flat_q, flat_k, cu))
    assert any("quantize_kernel" in n for n in names), names
