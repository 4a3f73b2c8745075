"""msa.metrics (block recall, score recall) against a dense float64 reference written with plain loops."""
import math

import pytest
import torch

import msa
from msa import metrics

from helpers import make_inputs, make_packed

BS, TOPK, D = 64, 4, 64
HEADS = [(8, 2, 4, 1), (4, 4, 4, 1)]


# ----------------------------------------------------------------------------------------------
# Dense reference: full N x N softmax in float64, sets and loops for I* and Î.
# ----------------------------------------------------------------------------------------------
def dense_reference(q, k, indices, block_size, cu=None, scale=None):
    """Per token t of the packed axis and group r: block recall br[t][r], score recall sr[t][r], the
    main branch's own top-k set star[t][r] (sorted list), and whether row t is non-trivial.

    Batched inputs (cu None) are turned into packed ones: token t = b * N + i.
    """
    if cu is None:
        B, N = q.shape[:2]
        q, k = q.reshape(B * N, *q.shape[2:]), k.reshape(B * N, *k.shape[2:])
        indices = indices.permute(1, 0, 2, 3).reshape(indices.shape[1], B * N, -1)
        cu = [N * b for b in range(B + 1)]
    T, Hq, Dh = q.shape
    Hkv, Hi, topk = k.shape[1], indices.shape[0], indices.shape[-1]
    scale = 1 / math.sqrt(Dh) if scale is None else scale
    br, sr, star, real = [None] * T, [None] * T, [None] * T, [None] * T
    for a, e in zip(cu[:-1], cu[1:]):
        n = e - a
        if n == 0:
            continue
        qs = q[a:e].double().cpu()
        ks = k[a:e].double().cpu().repeat_interleave(Hq // Hkv, dim=1)
        logits = torch.einsum("ihd,jhd->hij", qs, ks) * scale
        logits.masked_fill_(torch.ones(n, n, dtype=torch.bool).triu(1), -math.inf)
        P = logits.softmax(-1)  # (Hq, n, n)
        nb = -(-n // block_size)
        A = torch.stack([P[..., b * block_size:(b + 1) * block_size].sum(-1) for b in range(nb)], -1)
        Abar = A.view(Hi, Hq // Hi, n, nb).mean(1).tolist()
        idx = indices[:, a:e].tolist()
        for i in range(n):
            vis = i // block_size + 1
            real[a + i] = vis > topk
            br[a + i], sr[a + i], star[a + i] = [], [], []
            for r in range(Hi):
                m = Abar[r][i]
                top = set(sorted(range(vis), key=lambda b: (-m[b], b))[:min(topk, vis)])
                got = {b for b in idx[r][i] if 0 <= b < vis}
                br[a + i].append(len(top & got) / len(top))
                sr[a + i].append(sum(m[b] for b in got) / sum(m[b] for b in top))
                star[a + i].append(sorted(top))
    return dict(br=br, sr=sr, star=star, real=real)


def ref_mean(ref, tokens):
    """(block recall, score recall, row count) of the reference over the given packed tokens."""
    tokens = list(tokens)
    if not tokens:
        return math.nan, math.nan, 0
    br = [x for t in tokens for x in ref["br"][t]]
    sr = [x for t in tokens for x in ref["sr"][t]]
    return sum(br) / len(br), sum(sr) / len(sr), len(tokens)


def real_tokens(ref):
    return [t for t, ok in enumerate(ref["real"]) if ok]


def assert_matches(out, expected, tol=1e-6):
    br, sr, rows = expected
    assert int(out["rows"]) == rows
    if rows == 0:
        assert math.isnan(float(out["block_recall"])) and math.isnan(float(out["score_recall"]))
        return
    assert out["block_recall"].dtype == torch.float32 and out["block_recall"].dim() == 0
    assert float(out["block_recall"]) == pytest.approx(br, abs=tol)
    assert float(out["score_recall"]) == pytest.approx(sr, abs=tol)


def random_indices(B, Hi, N, topk, block_size, seed=0, device="cpu"):
    """Random slots in [-1, nb + 1): covers -1, repeats and blocks past the row's own."""
    g = torch.Generator().manual_seed(seed)
    nb = -(-N // block_size)
    return torch.randint(-1, nb + 1, (B, Hi, N, topk), generator=g).to(torch.int32).to(device)


def star_indices(ref, topk, B, N):
    """The batched int32 (B, Hi, N, topk) selection holding I* itself, ascending, -1 padded."""
    Hi = len(ref["star"][0])
    out = torch.full((Hi, B * N, topk), -1, dtype=torch.int32)
    for t, sets in enumerate(ref["star"]):
        for r, s in enumerate(sets):
            out[r, t, :len(s)] = torch.tensor(s, dtype=torch.int32)
    return out.view(Hi, B, N, topk).permute(1, 0, 2, 3).contiguous()


def local_indices(B, Hi, N, topk, block_size):
    out = torch.full((B, Hi, N, topk), -1, dtype=torch.int32)
    out[..., 0] = (torch.arange(N) // block_size).to(torch.int32)
    return out


_CACHE = {}


def case(heads, B=1, N=700, kind="select", seed=0):
    """(q, k, indices, ref) for one configuration, float64 on the CPU; the reference is cached."""
    key = (heads, B, N, kind, seed)
    if key not in _CACHE:
        q, k, _, q_idx, k_idx = make_inputs(B, N, heads, D, D, seed=seed)
        if kind == "select":
            idx = msa.select_blocks(q_idx, k_idx, topk=TOPK, block_size=BS)
        elif kind == "random":
            idx = random_indices(B, heads[2], N, TOPK, BS, seed)
        else:
            idx = local_indices(B, heads[2], N, TOPK, BS)
        _CACHE[key] = (q, k, idx, dense_reference(q, k, idx, BS))
    return _CACHE[key]


# ----------------------------------------------------------------------------------------------
# Values against the dense reference
# ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("heads", HEADS)
@pytest.mark.parametrize("kind", ["random", "select"])
def test_matches_dense_reference(heads, kind):
    q, k, idx, ref = case(heads, kind=kind)
    out = metrics.recall(q, k, idx, block_size=BS)
    assert_matches(out, ref_mean(ref, real_tokens(ref)))
    assert float(metrics.block_recall(q, k, idx, block_size=BS)) == float(out["block_recall"])
    assert float(metrics.score_recall(q, k, idx, block_size=BS)) == float(out["score_recall"])
    if kind == "select":  # a valid top-k selection: score recall <= 1
        assert float(out["score_recall"]) <= 1 + 1e-6


def test_batch_and_softmax_scale():
    heads = HEADS[0]
    q, k, _, q_idx, k_idx = make_inputs(2, 333, heads, D, D, seed=3)
    idx = msa.select_blocks(q_idx, k_idx, topk=TOPK, block_size=BS)
    ref = dense_reference(q, k, idx, BS, scale=0.3)
    out = metrics.recall(q, k, idx, block_size=BS, softmax_scale=0.3)
    assert_matches(out, ref_mean(ref, real_tokens(ref)))


@pytest.mark.parametrize("heads", HEADS)
def test_perfect_and_local_selection(heads):
    q, k, _, ref = case(heads, kind="select")
    best = star_indices(ref, TOPK, 1, 700)
    for skip in (True, False):
        out = metrics.recall(q, k, best, block_size=BS, skip_trivial=skip)
        assert float(out["block_recall"]) == 1.0
        assert float(out["score_recall"]) == pytest.approx(1.0, abs=1e-6)

    q, k, local, ref = case(heads, kind="local")
    out = metrics.recall(q, k, local, block_size=BS)
    assert_matches(out, ref_mean(ref, real_tokens(ref)))
    # Only one of topk blocks retrieved: block recall is at most 1/topk, score recall below 1.
    assert 0 < float(out["block_recall"]) <= 1 / TOPK + 1e-6
    assert 0 < float(out["score_recall"]) < 1


def test_low_precision_inputs():
    """bf16/fp16/fp32 inputs are computed in fp32: close to fp64 on the same rounded values."""
    q, k, idx, _ = case(HEADS[0], kind="select")
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        qd, kd = q.to(dtype), k.to(dtype)
        want = metrics.recall(qd.double(), kd.double(), idx, block_size=BS)
        got = metrics.recall(qd, kd, idx, block_size=BS)
        assert float(got["block_recall"]) == pytest.approx(float(want["block_recall"]), abs=2e-3)
        assert float(got["score_recall"]) == pytest.approx(float(want["score_recall"]), abs=1e-4)
    plain = metrics.recall(q.float(), k.float(), idx, block_size=BS)
    with torch.autocast("cpu", dtype=torch.bfloat16):  # autocast does not lower the logits' precision
        cast = metrics.recall(q.float(), k.float(), idx, block_size=BS)
    assert float(cast["score_recall"]) == float(plain["score_recall"])


def test_numpy_scalars_act_as_python_numbers():
    """NumPy integers and floats (a config read by NumPy) give what the Python numbers give, as in msa.interface."""
    np = pytest.importorskip("numpy")
    q, k, _, q_idx, k_idx, cu, max_seqlen = make_packed([300, 517], HEADS[0], D, D, seed=6)
    idx = msa.select_blocks(q_idx, k_idx, topk=TOPK, block_size=BS, cu_seqlens=cu, max_seqlen=max_seqlen)
    want = metrics.recall(q, k, idx, block_size=BS, cu_seqlens=cu, max_seqlen=max_seqlen, rows=40,
                          softmax_scale=0.125, chunk_rows=64)
    got = metrics.recall(q, k, idx, block_size=np.int64(BS), cu_seqlens=cu, max_seqlen=np.int32(max_seqlen),
                         rows=np.int64(40), softmax_scale=np.float32(0.125), chunk_rows=np.int16(64))
    assert got.keys() == want.keys()
    for key in want:
        assert torch.equal(torch.as_tensor(got[key]), torch.as_tensor(want[key])), key


# ----------------------------------------------------------------------------------------------
# Packed layout
# ----------------------------------------------------------------------------------------------
def test_packed_equals_per_sequence():
    lengths = [300, 129, 517]  # the 129-token sequence has no non-trivial row
    q, k, _, q_idx, k_idx, cu, max_seqlen = make_packed(lengths, HEADS[0], D, D, seed=5)
    idx = msa.select_blocks(q_idx, k_idx, topk=TOPK, block_size=BS, cu_seqlens=cu, max_seqlen=max_seqlen)
    out = metrics.recall(q, k, idx, block_size=BS, cu_seqlens=cu, max_seqlen=max_seqlen)
    ref = dense_reference(q, k, idx, BS, cu=cu.tolist())
    assert_matches(out, ref_mean(ref, real_tokens(ref)))

    # Combined from per-sequence batched calls, weighted by their row counts.
    totals, count = [0.0, 0.0], 0
    for a, b in zip(cu[:-1].tolist(), cu[1:].tolist()):
        part = metrics.recall(q[a:b][None], k[a:b][None], idx[:, a:b][None], block_size=BS)
        n = int(part["rows"])
        if n:
            totals[0] += n * float(part["block_recall"])
            totals[1] += n * float(part["score_recall"])
            count += n
    assert int(out["rows"]) == count == sum(max(0, n - TOPK * BS) for n in lengths)
    assert float(out["block_recall"]) == pytest.approx(totals[0] / count, abs=1e-6)
    assert float(out["score_recall"]) == pytest.approx(totals[1] / count, abs=1e-6)

    # Explicit packed rows are token indices into T; int sampling spans the whole token axis.
    rows = torch.tensor([0, 299, 300, 429, 429 + 256, 945, 700])
    sub = metrics.recall(q, k, idx, block_size=BS, cu_seqlens=cu, rows=rows)
    assert_matches(sub, ref_mean(ref, [t for t in sorted(set(rows.tolist())) if ref["real"][t]]))
    sampled = metrics.recall(q, k, idx, block_size=BS, cu_seqlens=cu, rows=40)
    plan = metrics.select_rows(lengths, TOPK, block_size=BS, rows=40)
    starts = [0, 300, 429]
    assert_matches(sampled, ref_mean(ref, [s + int(p) for s, pos in zip(starts, plan) for p in pos]))


# ----------------------------------------------------------------------------------------------
# Row selection
# ----------------------------------------------------------------------------------------------
def test_explicit_rows():
    q, k, _, q_idx, k_idx = make_inputs(2, 700, HEADS[0], D, D, seed=1)
    idx = random_indices(2, HEADS[0][2], 700, TOPK, BS, seed=1)
    ref = dense_reference(q, k, idx, BS)
    rows = torch.tensor([699, 5, 256, 255, 300, 699, 0])
    for skip in (True, False):
        used = [i for i in sorted(set(rows.tolist())) if i >= TOPK * BS or not skip]
        out = metrics.recall(q, k, idx, block_size=BS, rows=rows, skip_trivial=skip)
        assert_matches(out, ref_mean(ref, [b * 700 + i for b in range(2) for i in used]))
    out = metrics.recall(q, k, idx, block_size=BS, rows=[10, 20])  # all trivial -> nothing used
    assert_matches(out, (math.nan, math.nan, 0))
    assert_matches(metrics.recall(q, k, idx, block_size=BS, rows=[]), (math.nan, math.nan, 0))


def test_int_sampling():
    q, k, idx, ref = case(HEADS[0], kind="random")
    out = metrics.recall(q, k, idx, block_size=BS, rows=37)
    plan = metrics.select_rows([700], TOPK, block_size=BS, rows=37)[0]
    assert len(plan) == 37 and plan.unique().numel() == 37
    assert int(plan.min()) >= TOPK * BS and int(plan.max()) < 700
    gaps = plan.diff()
    assert int(gaps.max()) - int(gaps.min()) <= 1  # evenly spaced
    assert_matches(out, ref_mean(ref, plan.tolist()))
    again = metrics.recall(q, k, idx, block_size=BS, rows=37)
    assert float(again["block_recall"]) == float(out["block_recall"])
    # More rows asked than qualify: all of them.
    full = metrics.recall(q, k, idx, block_size=BS)
    every = metrics.recall(q, k, idx, block_size=BS, rows=10_000)
    assert int(every["rows"]) == int(full["rows"]) == 700 - TOPK * BS
    assert float(every["score_recall"]) == pytest.approx(float(full["score_recall"]), abs=1e-12)


def test_int_sampling_spans_batch():
    plan = metrics.select_rows([700, 700, 700], TOPK, block_size=BS, rows=30, batched=True)
    assert [len(p) for p in plan] == [10, 10, 10]
    plan = metrics.select_rows([100, 300, 1000], TOPK, block_size=BS, rows=10, skip_trivial=False)
    assert [len(p) for p in plan] == [1, 2, 7]


def test_chunk_rows():
    q, k, idx, _ = case(HEADS[1], kind="random")
    full = metrics.recall(q, k, idx, block_size=BS, skip_trivial=False)
    small = metrics.recall(q, k, idx, block_size=BS, skip_trivial=False, chunk_rows=7)
    for key in ("block_recall", "score_recall"):
        assert float(small[key]) == pytest.approx(float(full[key]), abs=1e-9)
    assert int(small["rows"]) == int(full["rows"]) == 700


def test_skip_trivial():
    q, k, idx, ref = case(HEADS[0], kind="select")
    real = metrics.recall(q, k, idx, block_size=BS)
    every = metrics.recall(q, k, idx, block_size=BS, skip_trivial=False)
    assert_matches(every, ref_mean(ref, range(700)))
    assert int(every["rows"]) == 700 and int(real["rows"]) == 700 - TOPK * BS
    # msa's selection is perfect on trivial rows: counting them can only raise the means.
    for key in ("block_recall", "score_recall"):
        assert float(every[key]) >= float(real[key]) - 1e-7

    q, k, _, q_idx, k_idx = make_inputs(2, 200, HEADS[0], D, D, seed=2)  # 200 < topk * block_size
    idx = msa.select_blocks(q_idx, k_idx, topk=TOPK, block_size=BS)
    out = metrics.recall(q, k, idx, block_size=BS)
    assert_matches(out, (math.nan, math.nan, 0))
    assert float(metrics.recall(q, k, idx, block_size=BS, skip_trivial=False)["block_recall"]) == 1.0


# ----------------------------------------------------------------------------------------------
# Bad input
# ----------------------------------------------------------------------------------------------
def _bad_cases():
    q, k, _, q_idx, k_idx = make_inputs(1, 130, HEADS[0], D, D)
    idx = msa.select_blocks(q_idx, k_idx, topk=TOPK, block_size=BS)
    pq, pk, _, pqi, pki, cu, _ = make_packed([60, 70], HEADS[0], D, D)
    pidx = msa.select_blocks(pqi, pki, topk=TOPK, block_size=BS, cu_seqlens=cu, max_seqlen=70)
    good = dict(q=q, k=k, indices=idx)
    pgood = dict(q=pq, k=pk, indices=pidx, cu_seqlens=cu)
    return [
        ("q", TypeError, dict(good, q=q.numpy())),
        ("q", ValueError, dict(good, q=q[0])),
        ("q", TypeError, dict(good, q=q.long(), k=k.long())),
        ("k", TypeError, dict(good, k=k.float())),
        ("k", ValueError, dict(good, k=k[:, :100])),
        ("k", ValueError, dict(good, k=k[..., :32])),
        ("k", ValueError, dict(good, k=torch.cat([k, k[:, :, :1]], 2))),
        ("indices", TypeError, dict(good, indices=idx.long())),
        ("indices", ValueError, dict(good, indices=idx[:, :, :100])),
        ("indices", ValueError, dict(good, indices=idx[:, :3])),
        ("indices", ValueError, dict(good, indices=idx[0])),
        ("block_size", ValueError, dict(good, block_size=0)),
        ("block_size", TypeError, dict(good, block_size=64.0)),
        ("block_size", TypeError, dict(good, block_size=True)),
        ("softmax_scale", TypeError, dict(good, softmax_scale="0.1")),
        ("softmax_scale", ValueError, dict(good, softmax_scale=math.nan)),
        ("skip_trivial", TypeError, dict(good, skip_trivial=1)),
        ("chunk_rows", ValueError, dict(good, chunk_rows=0)),
        ("rows", ValueError, dict(good, rows=0)),
        ("rows", ValueError, dict(good, rows=torch.tensor([130]))),
        ("rows", ValueError, dict(good, rows=torch.tensor([-1]))),
        ("rows", ValueError, dict(good, rows=torch.tensor([[1]]))),
        ("rows", TypeError, dict(good, rows=torch.tensor([1.0]))),
        ("rows", TypeError, dict(good, rows=1.5)),
        ("max_seqlen", TypeError, dict(good, max_seqlen=130)),  # as msa.select_blocks
        ("cu_seqlens", TypeError, dict(pgood, cu_seqlens=cu.long())),
        ("cu_seqlens", TypeError, dict(pgood, cu_seqlens=[0, 60, 130])),
        ("cu_seqlens", ValueError, dict(pgood, cu_seqlens=torch.tensor([0, 60, 129], dtype=torch.int32))),
        ("cu_seqlens", ValueError, dict(pgood, cu_seqlens=torch.tensor([0, 70, 60, 130], dtype=torch.int32))),
        ("cu_seqlens", ValueError, dict(pgood, cu_seqlens=cu[:1])),
        ("max_seqlen", ValueError, dict(pgood, max_seqlen=60)),
        ("max_seqlen", TypeError, dict(pgood, max_seqlen=70.0)),
        ("rows", ValueError, dict(pgood, rows=torch.tensor([130]))),
        ("indices", ValueError, dict(pgood, indices=idx[0, :, :100])),
    ]


@pytest.mark.parametrize("i", range(len(_bad_cases())))
def test_bad_input(i):
    name, exc, kwargs = _bad_cases()[i]
    kwargs.setdefault("block_size", BS)
    with pytest.raises(exc, match=name):
        metrics.recall(kwargs.pop("q"), kwargs.pop("k"), kwargs.pop("indices"), **kwargs)


# ----------------------------------------------------------------------------------------------
# CUDA: the same code on the GPU, bf16 inputs, O(N) memory
# ----------------------------------------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.parametrize("heads", HEADS)
def test_gpu_bf16_matches_dense(heads):
    q, k, _, q_idx, k_idx = make_inputs(2, 700, heads, D, D, dtype=torch.bfloat16, device="cuda", seed=7)
    idx = msa.select_blocks(q_idx, k_idx, topk=TOPK, block_size=BS)
    ref = dense_reference(q, k, idx.cpu(), BS)  # fp64 on the same bf16 values
    out = metrics.recall(q, k, idx, block_size=BS)
    assert out["block_recall"].device.type == "cuda"
    assert_matches(out, ref_mean(ref, real_tokens(ref)), tol=2e-3)
    rows = torch.tensor([256, 300, 512, 699])
    sub = metrics.recall(q, k, idx, block_size=BS, rows=rows, chunk_rows=3)
    assert_matches(sub, ref_mean(ref, [b * 700 + i for b in range(2) for i in rows.tolist()]), tol=2e-3)
    best = star_indices(ref, TOPK, 2, 700).cuda()
    out = metrics.recall(q, k, best, block_size=BS)
    assert float(out["block_recall"]) > 0.995 and float(out["score_recall"]) > 0.9995


@pytest.mark.gpu
def test_gpu_packed_matches_cpu():
    lengths = [1000, 300, 2049]
    q, k, _, q_idx, k_idx, cu, max_seqlen = make_packed(lengths, HEADS[0], D, D, dtype=torch.bfloat16,
                                                         device="cuda", seed=8)
    idx = msa.select_blocks(q_idx, k_idx, topk=TOPK, block_size=BS, cu_seqlens=cu, max_seqlen=max_seqlen)
    out = metrics.recall(q, k, idx, block_size=BS, cu_seqlens=cu, max_seqlen=max_seqlen)
    want = metrics.recall(q.cpu().double(), k.cpu().double(), idx.cpu(), block_size=BS, cu_seqlens=cu.cpu())
    assert int(out["rows"]) == int(want["rows"])
    assert float(out["block_recall"]) == pytest.approx(float(want["block_recall"]), abs=2e-3)
    assert float(out["score_recall"]) == pytest.approx(float(want["score_recall"]), abs=1e-4)


@pytest.mark.gpu
def test_gpu_memory_is_linear():
    N, heads = 32768, HEADS[0]
    q, k, _, q_idx, k_idx = make_inputs(1, N, heads, D, D, dtype=torch.bfloat16, device="cuda", seed=9)
    idx = msa.select_blocks(q_idx, k_idx, topk=16, block_size=128)
    del q_idx, k_idx
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    out = metrics.recall(q, k, idx, block_size=128, rows=256)
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    assert peak < N * N * 4 // 8, f"peak extra memory {peak / 2**20:.0f} MiB"
    assert int(out["rows"]) == 256
    want = metrics.recall(q.cpu().double(), k.cpu().double(), idx.cpu(), block_size=128, rows=256)
    assert float(out["block_recall"]) == pytest.approx(float(want["block_recall"]), abs=2e-3)
    assert float(out["score_recall"]) == pytest.approx(float(want["score_recall"]), abs=1e-4)
