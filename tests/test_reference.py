"""The CPU path (msa.reference through the public API) against the independent brute force."""
import math

import numpy as np
import pytest
import torch

import brute
import msa
from helpers import HEADS, assert_rounded_once, batch_cu, make_inputs, make_packed, packed
from msa import reference

NS = [1, 5, 127, 128, 129, 300, 700]
TOPKS = [1, 3, 16]


def _cases():
    """Every N with every head class; B, D, Di, block size, topk and warmup rotate so that each value
    meets many others (28 cases, plus warmup twins of a few)."""
    cases = []
    for n_i, N in enumerate(NS):
        for h_i, heads in enumerate(HEADS):
            i = n_i * len(HEADS) + h_i
            cases.append(dict(B=[1, 3][i % 2], N=N, heads=heads, D=[64, 128][(i // 2) % 2],
                              Di=[128, 64][(i // 4) % 2], block_size=[64, 128][(i // 3) % 2],
                              topk=TOPKS[i % 3], warmup=(i % 5 == 4)))
    return cases


# Longer sequences where topk > 1 selects fewer blocks than are visible (the _cases above mostly see every block:
# N <= 700), so the ranking itself is compared with the brute force beyond the forced local block.
SEL_CASES = [dict(B=1, N=1100, heads=HEADS[0], D=64, Di=64, block_size=64, topk=5, warmup=False),
             dict(B=2, N=900, heads=HEADS[1], D=128, Di=128, block_size=128, topk=3, warmup=False)]


def _ids(c):
    return "B{B}-N{N}-h{heads}-D{D}-Di{Di}-bs{block_size}-k{topk}-w{warmup:d}".format(**c).replace(" ", "")


def _run_msa(case, dtype, seed):
    B, N = case["B"], case["N"]
    q, k, v, qi, ki = make_inputs(B, N, case["heads"], case["D"], case["Di"], dtype=dtype, seed=seed)
    out, kl, idx = msa.msa_attention(q, k, v, qi, ki, topk=case["topk"], block_size=case["block_size"],
                                     warmup=case["warmup"], return_indices=True)
    return (q, k, v, qi, ki), out, kl, idx


def _brute(inputs, case, indices=None):
    q, k, v, qi, ki = inputs
    return brute.msa(packed(q), packed(k), packed(v), packed(qi), packed(ki), batch_cu(case["B"], case["N"]),
                     case["topk"], case["block_size"], 1 / math.sqrt(case["D"]), 1 / math.sqrt(case["Di"]),
                     case["warmup"], indices)


@pytest.mark.parametrize("case", _cases() + SEL_CASES, ids=_ids)
def test_float64_matches_brute_force(case):
    inputs, out, kl, idx = _run_msa(case, torch.float64, seed=hash(_ids(case)) % 1000)
    B, N = case["B"], case["N"]
    want = _brute(inputs, case)
    Hi = inputs[3].shape[2]
    got_idx = idx.permute(1, 0, 2, 3).reshape(Hi, B * N, -1).numpy()
    np.testing.assert_array_equal(got_idx, want["indices"])
    np.testing.assert_allclose(packed(out), want["out"], rtol=1e-9, atol=1e-11)
    assert abs(kl.item() - want["kl"]) <= 1e-9 * max(1.0, abs(want["kl"]))
    assert kl.dim() == 0


@pytest.mark.parametrize("case", _cases()[::5] + SEL_CASES, ids=_ids)  # [::5]: topk 1, 16 and 3 in turn
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_close_to_brute_force(case, dtype):
    """Half inputs: the selection is a valid top-k of the fp64 block scores, and with that selection
    out and kl match the fp64 brute force of the same (rounded) inputs: out to one unit of its dtype's
    rounding (the CPU path accumulates in fp32 and rounds once: measured within half a unit)."""
    inputs, out, kl, idx = _run_msa(case, dtype, seed=7)
    B, N = case["B"], case["N"]
    Hi = inputs[3].shape[2]
    got_idx = idx.permute(1, 0, 2, 3).reshape(Hi, B * N, -1).numpy()
    scores = brute.block_scores(packed(inputs[3]), packed(inputs[4]), batch_cu(B, N), case["block_size"],
                                1 / math.sqrt(case["Di"]))
    brute.check_valid_topk(got_idx, scores, case["topk"], rel_tol=1e-5)
    want = _brute(inputs, case, indices=got_idx)
    assert out.dtype == dtype and kl.dtype == torch.float32
    assert_rounded_once("out", packed(out), want["out"], dtype)
    assert abs(kl.item() - want["kl"]) <= 1e-4 * max(1.0, abs(want["kl"]))


@pytest.mark.parametrize("warmup", [False, True])
def test_varlen_equals_each_sequence_alone(warmup):
    lengths = [300, 5, 129, 1, 64]
    heads = (8, 2, 4, 1)
    q, k, v, qi, ki, cu, mx = make_packed(lengths, heads, 64, 64, seed=3)
    out, kl, idx = msa.msa_attention_varlen(q, k, v, qi, ki, cu, mx, topk=2, block_size=64, warmup=warmup,
                                            return_indices=True)
    assert out.shape == q.shape and idx.shape == (4, sum(lengths), 2)
    total = 0.0
    for s, (a, b) in enumerate(zip(cu[:-1].tolist(), cu[1:].tolist())):
        one = [x[a:b].unsqueeze(0) for x in (q, k, v, qi, ki)]
        o1, kl1, idx1 = msa.msa_attention(*one, topk=2, block_size=64, warmup=warmup, return_indices=True)
        torch.testing.assert_close(out[a:b], o1[0], rtol=0, atol=1e-12)
        torch.testing.assert_close(idx[:, a:b], idx1[0], rtol=0, atol=0)
        total += kl1.item() * (b - a)
    assert abs(kl.item() - total / sum(lengths)) < 1e-12


def test_varlen_matches_brute_force_with_empty_sequence():
    lengths = [129, 0, 7, 200]
    heads = (16, 2, 4, 2)
    q, k, v, qi, ki, cu, mx = make_packed(lengths, heads, 128, 64, seed=11)
    out, kl, idx = msa.msa_attention_varlen(q, k, v, qi, ki, cu, mx, topk=2, block_size=64, return_indices=True)
    n = lambda x: x.detach().numpy()  # noqa: E731
    want = brute.msa(n(q), n(k), n(v), n(qi), n(ki), cu.tolist(), 2, 64, 128 ** -0.5, 64 ** -0.5, False)
    np.testing.assert_array_equal(idx.numpy(), want["indices"])
    np.testing.assert_allclose(n(out), want["out"], rtol=1e-9, atol=1e-11)
    assert abs(kl.item() - want["kl"]) < 1e-9


def test_ties_go_to_the_lower_block():
    """Equal index keys make every block score equal: the earliest blocks win, plus the local one."""
    B, N, heads = 1, 640, (4, 4, 4, 1)
    q, k, v, qi, ki = make_inputs(B, N, heads, 64, 64, seed=5)
    ki = torch.ones_like(ki)
    idx = msa.select_blocks(qi, ki, topk=3, block_size=64)
    for t in (0, 64, 130, 639):
        local = t // 64
        want = sorted({0, 1, local} if local >= 2 else set(range(local + 1)))
        assert idx[0, 0, t].tolist() == want + [-1] * (3 - len(want)), (t, idx[0, 0, t])


def test_sparse_attention_matches_brute_force_and_lse():
    B, N, heads = 2, 300, (8, 4, 2, 1)
    q, k, v, qi, ki = make_inputs(B, N, heads, 64, 64, seed=9)
    idx = msa.select_blocks(qi, ki, topk=3, block_size=64)
    out, lse = msa.sparse_attention(q, k, v, idx, block_size=64, return_lse=True)
    Hi = qi.shape[2]
    pidx = idx.permute(1, 0, 2, 3).reshape(Hi, B * N, -1).numpy()
    sets = brute.attend_sets(pidx, batch_cu(B, N), 64, Hi, False)
    want_out, want_lse, _ = brute.attention(packed(q), packed(k), packed(v), sets, batch_cu(B, N), 0.125, Hi)
    np.testing.assert_allclose(packed(out), want_out, rtol=1e-9, atol=1e-11)
    np.testing.assert_allclose(lse.permute(1, 0, 2).reshape(8, -1).numpy(), want_lse, rtol=1e-12)


def test_sparse_attention_hand_made_indices():
    """Repeats count once, out-of-range entries select nothing, an empty row gives out 0 and lse -inf."""
    B, N, heads = 1, 200, (4, 4, 2, 1)
    q, k, v, _, _ = make_inputs(B, N, heads, 64, 64, seed=1)
    idx = torch.full((1, 2, N, 3), -1, dtype=torch.int32)
    idx[0, 0, :, 0] = 0
    idx[0, 0, :, 1] = 0          # repeat
    idx[0, 0, :, 2] = 9          # out of range
    idx[0, 1, :64, 0] = 1        # tokens < 64 cannot see block 1: empty rows
    idx[0, 1, 64:, 0] = 1
    out, lse = msa.sparse_attention(q, k, v, idx, block_size=64, return_lse=True)
    sets = brute.attend_sets(idx[0].numpy(), [0, N], 64, 2, False)
    want_out, want_lse, _ = brute.attention(packed(q), packed(k), packed(v), sets, [0, N], 0.125, 2)
    np.testing.assert_allclose(packed(out), want_out, rtol=1e-9, atol=1e-11)
    np.testing.assert_array_equal(np.isinf(lse[0].numpy()), np.isinf(want_lse))
    assert torch.isinf(lse[0, 2:, :64]).all() and (out[0, :64, 2:] == 0).all()


def test_chunking_does_not_change_results(monkeypatch):
    """Results are independent of the chunk size (memory is O(N * chunk))."""
    B, N, heads = 1, 300, (8, 2, 4, 1)
    inputs = make_inputs(B, N, heads, 64, 64, seed=2)
    full = msa.msa_attention(*inputs, topk=3, block_size=64, return_indices=True)
    monkeypatch.setattr(reference, "_CHUNK_ELEMS", 1)  # 16-row chunks
    small = msa.msa_attention(*inputs, topk=3, block_size=64, return_indices=True)
    for a, b in zip(full, small):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-13)


def test_reverse_index_cpu_matches_definition():
    lengths = [300, 5, 129]
    q, k, v, qi, ki, cu, mx = make_packed(lengths, (8, 2, 4, 1), 64, 64, seed=4)
    idx = msa.select_blocks(qi, ki, topk=3, block_size=64, cu_seqlens=cu, max_seqlen=mx)
    idx[1, 10, 1] = idx[1, 10, 0]  # a repeat counts once
    offsets, rows, block_offsets = torch.ops.msa.reverse_index(idx, cu, mx, 64)
    Hi, T, _ = idx.shape
    max_blocks = T // 64 + len(lengths)
    assert block_offsets.tolist() == [0, 5, 6, 9]
    for r in range(Hi):
        for s, (a, b) in enumerate(zip(cu[:-1].tolist(), cu[1:].tolist())):
            for blk in range(-(-(b - a) // 64)):
                key = r * max_blocks + block_offsets[s].item() + blk
                got = rows[offsets[key]:offsets[key + 1]].tolist()
                want = [t for t in range(a, b) if blk in set(idx[r, t].tolist()) and blk <= (t - a) // 64]
                assert got == want, (r, s, blk)
    assert offsets[-1].item() == sum(len(set(x for x in idx[r, t].tolist() if x >= 0))
                                     for r in range(Hi) for t in range(T))


def test_topk_checker_accepts_reference_and_rejects_tampering():
    """The SPEC 2 validity checker used on the GPU selection: it passes the reference's selection and
    fails each kind of wrong one."""
    from topk_check import assert_valid_topk, block_scores
    q, k, v, qi, ki, cu, mx = make_packed([700, 129], (8, 2, 4, 1), 64, 64, dtype=torch.bfloat16, seed=12)
    idx = msa.select_blocks(qi, ki, topk=3, block_size=64, cu_seqlens=cu, max_seqlen=mx)
    assert_valid_topk(idx, qi, ki, cu, 3, 64, 0.125)
    t = 650  # a row with 11 visible blocks: 2 chosen earlier blocks + the local one
    bad = []  # (tampered selection, the rule that must reject it)
    x = idx.clone(); x[0, 10, 2] = 0; bad.append((x, "padding is not -1"))  # row 10 sees one block: slots 1, 2 unused
    x = idx.clone(); x[0, t, 2] = -1; bad.append((x, "block out of range"))  # a used slot emptied
    x = idx.clone(); x[0, t, 1] = 11; bad.append((x, "block out of range"))  # a block past the row's own
    x = idx.clone(); x[0, t, 0], x[0, t, 1] = x[0, t, 1], x[0, t, 0]; bad.append((x, "not strictly ascending"))
    # the local block replaced by an unchosen earlier one that keeps the row ascending
    r = next(r for r in range(t, 700) if int(idx[1, r, 1]) + 1 < r // 64)
    x = idx.clone(); x[1, r, 2] = int(idx[1, r, 1]) + 1; bad.append((x, "local block missing"))
    scores = block_scores(qi, ki, 0, 700, 64, 0.125)[0, t]
    chosen = idx[0, t, :2].tolist()
    worst = min((b for b in range(t // 64) if b not in chosen), key=lambda b: float(scores[b]))
    x = idx.clone(); x[0, t, 0] = worst; x[0, t] = x[0, t].sort().values
    bad.append((x, "select a block scoring below an unselected one"))
    for x, rule in bad:
        with pytest.raises(AssertionError, match=rule):
            assert_valid_topk(x, qi, ki, cu, 3, 64, 0.125)
