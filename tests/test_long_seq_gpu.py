"""Exactness at the sequence lengths users train at: N = 131072 (B = 1 and 2, bf16 and fp16) and
N = 1,048,576 (B = 1, bf16), bench heads. A few hundred rows, sampled near the end of the last sequence
and at random, are checked against an exact per-row computation (tests/row_oracle.py) of out, lse, dq,
dq_idx, the KL row terms and lse_idx, and their selection against fp32 block scores; a few kv blocks
likewise for dk, dv and dk_idx (every row that selected the block). Tolerances as in the short tests:
err <= 2 * err(same-precision torch) + atol (tests/attention_check.py)."""
import math
import os

import pytest
import torch

import msa

from attention_check import ATOL, assert_lse_close, max_err
from helpers import fp8_rel_tol, sm90_kernels_run
from row_oracle import block_grads, check_selection, in_chunks, row_terms, selectors

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("kernel_choice")]

HEADS = (16, 2, 4, 1)
D = Di = 128
BS, TOPK = 128, 16


def _assert_style(name, got, exact, lowp, dtype, unit):
    """The STYLE rule on sampled values (both errors against the exact float64 result)."""
    assert torch.isfinite(got).all(), f"{name}: non-finite values"
    err, base = max_err(got, exact), max_err(lowp, exact)
    scale = max(exact.abs().max().item(), unit)
    bound = 2 * base + ATOL[dtype] * scale
    assert err <= bound, f"{name}: max error {err:.3g} > 2 * {base:.3g} + {ATOL[dtype]:g} * {scale:.3g}"


def _check_rows(x, tokens, args, dtype, out, dq, dq_idx, lse, lse_idx, kl_rows):
    """out, dq, dq_idx, lse, lse_idx and the KL row terms of the sampled tokens (every index group) against
    the exact per-row computation; args = (indices or None for warmup, cu_seqlens, block size, scale,
    index scale, kl_coef), as row_oracle.row_terms takes them."""
    Hq, Hkv, Hi, Hki = HEADS
    kl_coef = args[-1]
    rows_t = tokens.repeat_interleave(Hi)
    rows_r = torch.arange(Hi, device=tokens.device).repeat(len(tokens))
    exact = in_chunks(lambda t, r: row_terms(x, t, r, *args, torch.float64), rows_t, rows_r)
    lowp = in_chunks(lambda t, r: row_terms(x, t, r, *args, dtype), rows_t, rows_r)
    G = Hq // Hi
    heads = rows_r[:, None] * G + torch.arange(G, device=tokens.device)
    _assert_style("out", out[rows_t[:, None], heads], exact["out"], lowp["out"], dtype, 1.0)
    _assert_style("dq", dq[rows_t[:, None], heads], exact["dq"], lowp["dq"], dtype, 1.0)
    _assert_style("dq_idx", dq_idx[rows_t, rows_r], exact["dq_idx"], lowp["dq_idx"], dtype, abs(kl_coef))
    assert_lse_close("lse", lse[heads, rows_t[:, None]], exact["lse"])
    assert_lse_close("lse_idx", lse_idx[rows_r, rows_t], exact["lse_idx"])
    kl_err = (kl_rows[rows_r, rows_t].double() - exact["kl_row"]).abs()
    assert (kl_err <= 1e-3 * exact["kl_row"].abs() + 1e-5).all(), f"KL row terms: max error {kl_err.max():.3g}"


def _inputs(T, dtype, seed):
    """Packed q, k, v, q_idx, k_idx and an upstream dout, random normal on the GPU. The seed differs between the
    kernel_choice runs: the outputs are too large for poison_allocator, so a row one path left unwritten would
    otherwise read the other path's right answer from the caching allocator."""
    Hq, Hkv, Hi, Hki = HEADS
    seed += 7919 if os.environ.get("MSA_PORTABLE_KERNELS") == "1" else 0
    g = torch.Generator(device="cuda").manual_seed(seed)
    shapes = (("q", Hq, D), ("k", Hkv, D), ("v", Hkv, D), ("q_idx", Hi, Di), ("k_idx", Hki, Di), ("dout", Hq, D))
    return {name: torch.randn(T, h, d, generator=g, device="cuda", dtype=dtype) for name, h, d in shapes}


def _sample_tokens(cu, T, n_end=64, n_rand=96, seed=0):
    g = torch.Generator(device="cpu").manual_seed(seed)
    end = torch.arange(T - n_end, T)  # near the end of the last sequence
    rand = torch.randint(0, T, (n_rand,), generator=g)
    return torch.unique(torch.cat([end, rand])).to(cu.device)


_LONG = [(1, 131072, torch.bfloat16, False), (2, 131072, torch.bfloat16, False), (1, 131072, torch.float16, False),
         (2, 131072, torch.float16, False), (1, 1048576, torch.bfloat16, False), (2, 131072, torch.bfloat16, True),
         (1, 1048576, torch.bfloat16, True)]


@pytest.mark.parametrize("B,N,dtype,fp8", _LONG, ids=[f"{b}x{n}-{str(d)[6:]}{'-fp8_index' if f else ''}"
                                                      for b, n, d, f in _LONG])
def test_long_sequence_sampled_rows(B, N, dtype, fp8):
    """fp8: the selection scores the e4m3 copies (index_dtype, msa.fp8_index_copies; the FP8 top-k on Hopper),
    checked against fp32 block scores of those copies; everything else as without."""
    T = B * N
    Hi = HEADS[2]  # index groups: the KL rows are T * Hi
    dev = "cuda"
    x = _inputs(T, dtype, seed=N + B)
    cu = torch.arange(0, T + 1, N, dtype=torch.int32, device=dev)
    scale, iscale = 1 / math.sqrt(D), 1 / math.sqrt(Di)
    # fp16: the KL's gradients are ~index_scale / rows (1e-8 at 128K), below fp16's range; fp16 training
    # scales the loss (GradScaler starts at 2^16), so that is the d_kl the fp16 cases check with.
    dkl = torch.tensor(2.0 ** 16 if dtype == torch.float16 else 1.0, device=dev)
    ops = torch.ops.msa
    sel = msa.fp8_index_copies(x["q_idx"], x["k_idx"]) if fp8 else (x["q_idx"], x["k_idx"])
    out, kl, idx, lse, lse_idx, g_q, g_k, kl_rows = ops.msa_fwd(
        x["q"], x["k"], x["v"], x["q_idx"], x["k_idx"], None, N, TOPK, BS, scale, iscale, False, True, True, False,
        None, None, *(sel if fp8 else (None, None)))
    dq, dk, dv, dq_idx, dk_idx = ops.msa_bwd(
        x["dout"], dkl, x["q"], x["k"], x["v"], out, lse, x["q_idx"], x["k_idx"], lse_idx, idx, g_q, g_k, None, N,
        BS, scale, iscale, False)
    del g_q, g_k
    kl_coef = dkl.item() / (T * Hi)  # SPEC 4: dS_idx = d_kl / rows * (Pidx - P)
    tokens = _sample_tokens(cu, T, seed=N + B)
    # The FP8 tensor cores' accumulation keeps fewer bits than fp32: near-ties within fp8_rel_tol may swap.
    check_selection(idx, tokens, *sel, cu, TOPK, BS, iscale, rel_tol=fp8_rel_tol(Di) if fp8 else 1e-5)

    args = (idx, cu, BS, scale, iscale, kl_coef)
    _check_rows(x, tokens, args, dtype, out, dq, dq_idx, lse, lse_idx, kl_rows)

    # kv blocks of the last sequence: one in the middle (selected by ~5K rows at 1M) and the last.
    s0 = T - N
    nb = -(-N // BS)
    for block in (nb // 2, nb - 1):
        blk0 = s0 + block * BS
        sel_t, sel_r = selectors(idx, cu, blk0, block, BS)
        assert len(sel_t) >= BS, f"block {block}: too few selecting rows ({len(sel_t)})"
        e_dk, e_dv, e_dki = block_grads(x, blk0, sel_t, sel_r, *args, torch.float64)
        l_dk, l_dv, l_dki = block_grads(x, blk0, sel_t, sel_r, *args, dtype)
        n = min(BS, T - blk0)
        sl = slice(blk0, blk0 + n)
        _assert_style(f"dk (block {block})", dk[sl], e_dk[:n], l_dk[:n], dtype, 1.0)
        _assert_style(f"dv (block {block})", dv[sl], e_dv[:n], l_dv[:n], dtype, 1.0)
        _assert_style(f"dk_idx (block {block})", dk_idx[sl], e_dki[:n], l_dki[:n], dtype, abs(kl_coef))


def test_fp16_index_grads_at_the_fp16_floor():
    """fp16 without loss scaling (d_kl = 1): the KL's gradients (~index_scale / rows) are fp16 subnormals
    at long N, so even the exact gradient rounded to fp16 is far from exact (6e-3 relative at 4096 rows,
    ~1 at 128K). The kernels hold them in fp32 until the final cast: their error is that rounding's,
    within one fp16 subnormal step."""
    B, N, dtype = 1, 32768, torch.float16
    T = B * N
    Hi = HEADS[2]
    dev = "cuda"
    x = _inputs(T, dtype, seed=5)
    cu = torch.tensor([0, T], dtype=torch.int32, device=dev)
    scale, iscale = 1 / math.sqrt(D), 1 / math.sqrt(Di)
    ops = torch.ops.msa
    out, kl, idx, lse, lse_idx, g_q, g_k, _ = ops.msa_fwd(
        x["q"], x["k"], x["v"], x["q_idx"], x["k_idx"], None, N, TOPK, BS, scale, iscale, False, True, True)
    *_, dq_idx, dk_idx = ops.msa_bwd(None, torch.tensor(1.0, device=dev), x["q"], x["k"], x["v"], out, lse,
                                     x["q_idx"], x["k_idx"], lse_idx, idx, g_q, g_k, None, N, BS, scale, iscale,
                                     False)
    kl_coef = 1.0 / (T * Hi)
    tokens = _sample_tokens(cu, T, seed=5)
    rows_t, rows_r = tokens.repeat_interleave(Hi), torch.arange(Hi, device=dev).repeat(len(tokens))
    args = (idx, cu, BS, scale, iscale, kl_coef)
    exact = in_chunks(lambda t, r: row_terms(x, t, r, *args, torch.float64), rows_t, rows_r)["dq_idx"]
    step = 2.0 ** -24  # fp16's subnormal spacing
    floor = max_err(exact.half(), exact)
    assert floor > 0.1 * step, "the case must reach fp16's subnormal range"
    err = max_err(dq_idx[rows_t, rows_r], exact)
    assert err <= floor + step, f"dq_idx: error {err:.3g} beyond fp16 rounding ({floor:.3g}) + one step"
    block = N // BS // 2
    sel_t, sel_r = selectors(idx, cu, block * BS, block, BS)
    e_dki = block_grads(x, block * BS, sel_t, sel_r, *args, torch.float64)[2]
    floor = max_err(e_dki.half(), e_dki)
    err = max_err(dk_idx[block * BS:(block + 1) * BS], e_dki)
    assert err <= floor + step, f"dk_idx: error {err:.3g} beyond fp16 rounding ({floor:.3g}) + one step"


def _dense_attended(indices, t, r, cu, block_size):
    """row_oracle.attended for warmup (SPEC 5): every earlier token of the row's sequence."""
    from row_oracle import seq_start
    s0 = seq_start(cu, t)
    L = int(cu[-1].item())  # one width for every chunk (in_chunks concatenates them)
    tok = s0[:, None] + torch.arange(L, device=t.device)
    ok = tok <= t[:, None]
    return torch.where(ok, tok, t[:, None]), ok  # masked entries point at the row's own token


def test_fp8_selection_past_65536_blocks():
    """The Hopper FP8 top-k's register lists pack a block's index into 16 bits of a key: a CTA whose rows see more than
    65536 blocks keeps its lists in shared memory instead. Two sequences of 64-key blocks, one index head: the first
    (65536 blocks and 64 keys) ends in a CTA (256 rows) of 64 tokens whose own block is 65536, the last with keys
    (blocks 0 .. 65535 offered); the second (one block more) ends in one that sees 65537, in shared memory. Their
    rows, the CTAs' before them, and rows at random, against fp32 block scores of the copies."""
    if not sm90_kernels_run():
        pytest.skip("the limit is the sm_90a FP8 kernel's")
    bs = 64
    lens = (65536 * bs + 64, 65537 * bs + 64)
    T = sum(lens)
    g = torch.Generator(device="cuda").manual_seed(65536)
    qi, ki = (torch.randn(T, 1, Di, generator=g, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    cu = torch.tensor([0, lens[0], T], dtype=torch.int32, device="cuda")
    idx = msa.select_blocks(qi, ki, cu_seqlens=cu, max_seqlen=max(lens), topk=TOPK, block_size=bs,
                            index_dtype=torch.float8_e4m3fn)
    q8, k8 = msa.fp8_index_copies(qi, ki, cu)
    del qi, ki
    tokens = torch.cat([torch.arange(lens[0] - 96, lens[0]), torch.arange(T - 160, T),
                        torch.randint(0, T, (32,), generator=torch.Generator().manual_seed(1))])
    check_selection(idx, torch.unique(tokens).cuda(), q8, k8, cu, TOPK, bs, 1 / math.sqrt(Di), rel_tol=fp8_rel_tol(Di))


@pytest.mark.parametrize("N,det", [(131072, False), (524288, True)])
def test_warmup_long_sequence_sampled_rows(N, det, monkeypatch):
    """Warmup at N = 131072 (the dense main branch and the dense KL pass over ~1000 key tiles): out, lse,
    dq, dq_idx, the KL row terms and lse_idx of sampled rows, and dk_idx of the last kv block, against the
    exact per-row computation over the full causal set (on both kernel paths: the Hopper dense KL kernel,
    and the sparse kernels' dense mode). Deterministic at N = 524288: the sparse kernels' dense mode on both
    paths, with Hi * T * ceil(N / 128) = 2^33 (row, slot) entries, which int32 entry ids over the whole
    call could not count (they are per query chunk)."""
    import row_oracle
    dtype = torch.bfloat16
    monkeypatch.setattr(row_oracle, "attended", _dense_attended)
    # rows of N keys each: (CHUNK, N, D) float64 = 4.3 GB
    monkeypatch.setattr(row_oracle, "CHUNK", 32 * 131072 // N)
    T = N
    Hi = HEADS[2]  # index groups: the KL rows are T * Hi
    x = _inputs(T, dtype, seed=7)
    cu = torch.tensor([0, T], dtype=torch.int32, device="cuda")
    scale, iscale = 1 / math.sqrt(D), 1 / math.sqrt(Di)
    dkl = torch.tensor(1.0, device="cuda")
    ops = torch.ops.msa
    out, kl, idx, lse, lse_idx, g_q, g_k, kl_rows = ops.msa_fwd(
        x["q"], x["k"], x["v"], x["q_idx"], x["k_idx"], None, N, TOPK, BS, scale, iscale, True, False, True, det)
    dq, dk, dv, dq_idx, dk_idx = ops.msa_bwd(
        x["dout"], dkl, x["q"], x["k"], x["v"], out, lse, x["q_idx"], x["k_idx"], lse_idx, idx, g_q, g_k, None, N,
        BS, scale, iscale, True, det)
    kl_coef = dkl.item() / (T * Hi)
    g = torch.Generator(device="cpu").manual_seed(3)
    tokens = torch.unique(torch.cat([torch.arange(T - 8, T), torch.randint(0, T, (8,), generator=g)])).cuda()
    args = (None, cu, BS, scale, iscale, kl_coef)
    _check_rows(x, tokens, args, dtype, out, dq, dq_idx, lse, lse_idx, kl_rows)
    # dk_idx of the last kv block, from every row that sees it (the block's own tokens, every group).
    blk0 = T - BS
    sel_t = torch.arange(blk0, T, device="cuda").repeat_interleave(Hi)
    sel_r = torch.arange(Hi, device="cuda").repeat(BS)
    e_dki = block_grads(x, blk0, sel_t, sel_r, *args, torch.float64)[2]
    l_dki = block_grads(x, blk0, sel_t, sel_r, *args, dtype)[2]
    _assert_style("dk_idx (last block)", dk_idx[blk0:], e_dki, l_dki, dtype, abs(kl_coef))


@pytest.mark.parametrize("N,Nq", [(131072, 32768), (1048576, 131072)])
def test_suffix_long_sequence_sampled_rows(N, Nq):
    """Queries that are the last Nq of N keys (a query shard of context parallelism, bottom-right causal) at
    the lengths CP runs: sampled query rows (out, lse, dq, dq_idx, KL row terms, lse_idx, the selection)
    against the exact per-row computation on the whole sequence, and dk / dv / dk_idx of kv blocks before
    the first query (keys only), in the middle and last, from every query row that selected them."""
    dtype = torch.bfloat16
    Hq, Hkv, Hi, Hki = HEADS
    s0 = N - Nq  # the first query's position
    x = _inputs(N, dtype, seed=N + Nq)  # the whole sequence; the call gets the queries' rows s0..N-1
    dev = "cuda"
    cu = torch.tensor([0, N], dtype=torch.int32, device=dev)  # the oracle's layout: positions = key rows
    cu_q = torch.tensor([0, Nq], dtype=torch.int32, device=dev)
    scale, iscale = 1 / math.sqrt(D), 1 / math.sqrt(Di)
    dkl = torch.tensor(1.0, device=dev)
    ops = torch.ops.msa
    q, qi, do = x["q"][s0:], x["q_idx"][s0:], x["dout"][s0:]
    out, kl, idx, lse, lse_idx, g_q, g_k, kl_rows = ops.msa_fwd(
        q, x["k"], x["v"], qi, x["k_idx"], cu_q, Nq, TOPK, BS, scale, iscale, False, True, True, False, cu, N)
    dq, dk, dv, dq_idx, dk_idx = ops.msa_bwd(
        do, dkl, q, x["k"], x["v"], out, lse, qi, x["k_idx"], lse_idx, idx, g_q, g_k, cu_q, Nq, BS, scale, iscale,
        False, False, cu, N)
    del g_q, g_k
    assert dk.shape[0] == N and dk_idx.shape[0] == N and dq.shape[0] == Nq
    kl_coef = dkl.item() / (Nq * Hi)  # the KL rows are the query rows

    def whole(t, dim):  # a query-row tensor placed at its positions in the whole sequence
        shape = list(t.shape)
        shape[dim] = N
        w = t.new_full(shape, -1 if t.dtype == torch.int32 else 0)
        w.narrow(dim, s0, Nq).copy_(t)
        return w

    idx_w = whole(idx, 1)  # rows before s0: no selection (-1), so no oracle row selects through them
    g = torch.Generator(device="cpu").manual_seed(N)
    tokens = torch.unique(torch.cat([torch.arange(N - 64, N), torch.arange(s0, s0 + 32),
                                     s0 + torch.randint(0, Nq, (96,), generator=g)])).to(dev)
    check_selection(idx_w, tokens, x["q_idx"], x["k_idx"], cu, TOPK, BS, iscale)
    args = (idx_w, cu, BS, scale, iscale, kl_coef)
    _check_rows(x, tokens, args, dtype, whole(out, 0), whole(dq, 0), whole(dq_idx, 0), whole(lse, 1),
                whole(lse_idx, 1), whole(kl_rows, 1))
    nb = N // BS
    for block in (s0 // BS // 2, nb // 2 + nb // 4, nb - 1):  # keys only, among the queries, the last
        blk0 = block * BS
        sel_t, sel_r = selectors(idx_w, cu, blk0, block, BS)
        assert len(sel_t) >= BS, f"block {block}: too few selecting rows ({len(sel_t)})"
        e_dk, e_dv, e_dki = block_grads(x, blk0, sel_t, sel_r, *args, torch.float64)
        l_dk, l_dv, l_dki = block_grads(x, blk0, sel_t, sel_r, *args, dtype)
        sl = slice(blk0, blk0 + BS)
        _assert_style(f"dk (block {block})", dk[sl], e_dk, l_dk, dtype, 1.0)
        _assert_style(f"dv (block {block})", dv[sl], e_dv, l_dv, dtype, 1.0)
        _assert_style(f"dk_idx (block {block})", dk_idx[sl], e_dki, l_dki, dtype, abs(kl_coef))
