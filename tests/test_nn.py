"""msa.nn: the MSAAttention layer and its helpers (kl_loss, warmup, set_warmup, rotary embedding, packed
positions), on the CPU path (always run) and on CUDA (`gpu`).

The oracle is built by hand here, in float64, from the layer's weights: projections, RMSNorm and rotary
written out (no msa.nn code), dense softmax attention masked to the selected blocks, the KL of SPEC 4 as
plain autograd-able math, and torch's SDPA for the warmup (dense) mode. The selection the layer used is
recorded (msa.nn.msa_attention wrapped to return the indices); it is checked to be a valid top-k of the
hand-built index scores (SPEC 2), and the oracle attends over it, so near-ties that float rounding may
swap do not make a test flaky. Training harnesses (torch.compile, activation checkpointing, autocast,
FSDP2) are compared with the same model run eagerly / unwrapped.
"""
import contextlib
import copy
import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

import msa
import msa.nn as mnn
from topk_check import assert_valid_topk

f64 = torch.float64
HID = 128
TOPK, BS = 3, 64
HEADS = [(4, 2, 2, 1), (8, 2, 4, 1)]
INDEX_PARAMS = ("q_idx_proj.weight", "k_idx_proj.weight", "q_idx_norm.weight", "k_idx_norm.weight")


@pytest.fixture(scope="module", autouse=True)
def _one_cpu_thread():
    """The CPU path runs many small parallel regions: on a shared machine, intra-op threads competing for
    busy cores make it 10-100x slower (measured: 0.06 s vs 6 s per step). One thread, restored afterwards."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


# ----------------------------------------------------------------------------------------------
# The layer, its weights, and the hand-built float64 oracle
# ----------------------------------------------------------------------------------------------
def cfg_of(heads=HEADS[0], D=64, hidden=HID, topk=TOPK, block_size=BS, **opts):
    return dict(heads=heads, D=D, hidden=hidden, topk=topk, block_size=block_size, opts=opts)


def make_layer(cfg, seed=0, dtype=f64, device="cpu"):
    """MSAAttention of `cfg` with seeded random weights (norm weights around 1, biases around 0, so that
    every parameter shapes the output), then moved to device / dtype."""
    Hq, Hkv, Hi, Hki = cfg["heads"]
    layer = mnn.MSAAttention(cfg["hidden"], Hq, Hkv, cfg["D"], Hi, cfg["D"], Hki, topk=cfg["topk"],
                             block_size=cfg["block_size"], **cfg["opts"])
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in layer.named_parameters():
            r = torch.randn(p.shape, generator=g)
            if "norm" in name:
                p.copy_(1 + 0.3 * r)
            elif name.endswith("bias"):
                p.copy_(0.3 * r)
            else:
                p.copy_(r * (1.0 / math.sqrt(p.shape[1])))
    return layer.to(device=device, dtype=dtype)


def weights(layer, device=None):
    """float64 leaf copies of the layer's parameters, by name (the oracle's weights)."""
    return {n: p.detach().to(device=device or p.device, dtype=f64).clone().requires_grad_(True)
            for n, p in layer.named_parameters()}


def _full(t):
    """A gradient as a plain tensor (FSDP2 gives DTensors)."""
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def hand_inputs(W, cfg, x, positions=None):
    """q, k, v, q_idx, k_idx (B, N, H, D) in float64 from x (B, N, hidden), written out by hand."""
    o = cfg["opts"]
    Hq, Hkv, Hi, Hki = cfg["heads"]
    D = cfg["D"]
    eps = o.get("norm_eps", 1e-6)
    theta = o.get("rope_theta", 10000.0)
    B, N = x.shape[:2]
    pos = (torch.arange(N, device=x.device) if positions is None else positions).to(f64)
    pos = pos.expand(B, N) if pos.dim() == 1 else pos

    def lin(name, inp, bias):
        out = inp @ W[name + ".weight"].T
        return out + W[name + ".bias"] if bias else out

    def rms(t, name, on):
        if not on:
            return t
        return t * torch.rsqrt(t.pow(2).mean(-1, keepdim=True) + eps) * W[name + ".weight"]

    def rope(t, on, dim):
        if not on:
            return t
        dim = dim or D
        half = dim // 2
        inv = theta ** (-torch.arange(half, dtype=f64, device=t.device) * 2 / dim)
        ang = pos[..., None] * inv  # (B, N, half)
        c, s = ang.cos()[:, :, None], ang.sin()[:, :, None]
        x1, x2 = t[..., :half], t[..., half:dim]
        return torch.cat((x1 * c - x2 * s, x2 * c + x1 * s, t[..., dim:]), dim=-1)

    bias = o.get("bias", False)
    qk_norm, iqk_norm = o.get("qk_norm", False), o.get("index_qk_norm", True)
    main_rope, index_rope = o.get("rope", True), o.get("index_rope", True)
    rd, ird = o.get("rope_dim"), o.get("index_rope_dim")
    xd = x.detach()  # the index branch reads the detached hidden states (SPEC 4)
    q = rope(rms(lin("q_proj", x, bias).unflatten(-1, (Hq, D)), "q_norm", qk_norm), main_rope, rd)
    k = rope(rms(lin("k_proj", x, bias).unflatten(-1, (Hkv, D)), "k_norm", qk_norm), main_rope, rd)
    v = lin("v_proj", x, bias).unflatten(-1, (Hkv, D))
    qi = rope(rms(lin("q_idx_proj", xd, False).unflatten(-1, (Hi, D)), "q_idx_norm", iqk_norm), index_rope, ird)
    ki = rope(rms(lin("k_idx_proj", xd, False).unflatten(-1, (Hki, D)), "k_idx_norm", iqk_norm), index_rope, ird)
    return q, k, v, qi, ki


def group_mask(indices, N, block_size):
    """(B, Hi, N, N) bool: key j attended by query i of group r, from indices (B, Hi, N, k); None = dense."""
    causal = torch.ones(N, N, dtype=torch.bool, device=indices.device if indices is not None else "cpu").tril()
    if indices is None:
        return causal
    blk = torch.arange(N, device=indices.device) // block_size  # the block of every key
    hit = (indices.long()[..., None, :] == blk[:, None]).any(-1)  # (B, Hi, N, N)
    return hit & causal


def oracle(W, cfg, x, indices=None, warmup=False, positions=None):
    """(y, kl, (q, k, v, qi, ki)) in float64. Main branch: dense softmax over the keys of the selected
    blocks (indices (B, Hi, N, k)) or, in warmup, torch's causal SDPA. kl: SPEC 4 with the teacher P
    detached, differentiable in the index weights like the op."""
    Hq, Hkv, Hi, Hki = cfg["heads"]
    o = cfg["opts"]
    D = cfg["D"]
    scale = o.get("softmax_scale") or 1 / math.sqrt(D)
    iscale = o.get("index_scale") or 1 / math.sqrt(D)
    q, k, v, qi, ki = hand_inputs(W, cfg, x, positions)
    B, N = x.shape[:2]
    ke, ve = (t.repeat_interleave(Hq // Hkv, dim=2) for t in (k, v))
    gm = group_mask(None if warmup else indices, N, cfg["block_size"]).to(x.device)
    gm = gm.expand(B, Hi, N, N)
    mask = gm.repeat_interleave(Hq // Hi, dim=1)  # (B, Hq, N, N)
    s = torch.einsum("bihd,bjhd->bhij", q, ke) * scale
    p = torch.softmax(s.masked_fill(~mask, -math.inf), dim=-1)
    if warmup:
        out = F.scaled_dot_product_attention(q.transpose(1, 2), ke.transpose(1, 2), ve.transpose(1, 2),
                                             is_causal=True, scale=scale).transpose(1, 2)
    else:
        out = torch.einsum("bhij,bjhd->bihd", p, ve)
    y = out.flatten(-2) @ W["o_proj.weight"].T
    if o.get("bias", False):
        y = y + W["o_proj.bias"]
    P = p.detach().view(B, Hi, Hq // Hi, N, N).mean(2)
    kie = ki.repeat_interleave(Hi // Hki, dim=2)
    sidx = torch.einsum("bird,bjrd->brij", qi, kie) * iscale
    logpidx = torch.log_softmax(sidx.masked_fill(~gm, -math.inf), dim=-1)
    use = gm & (P > 0)
    term = P * (torch.where(use, P, 1).log() - torch.where(use, logpidx, 0))
    kl = torch.where(use, term, 0).sum() / (B * N * Hi)
    return y, kl, (q, k, v, qi, ki)


@contextlib.contextmanager
def record_calls():
    """Wraps the msa ops msa.nn calls: records per call the inputs the op saw and its selection."""
    calls = []
    orig = mnn.msa_attention

    def rec(q, k, v, qi, ki, **kw):
        out, kl, idx = orig(q, k, v, qi, ki, return_indices=True, **kw)
        calls.append(dict(q=q.detach(), k=k.detach(), v=v.detach(), qi=qi.detach(), ki=ki.detach(), idx=idx,
                          out=out.detach(), kl=kl.detach(), kw=kw))
        return out, kl

    mnn.msa_attention = rec
    try:
        yield calls
    finally:
        mnn.msa_attention = orig


def check_selection(idx, qi, ki, cfg, rel_tol):
    """idx (B, Hi, N, k): a valid top-k (SPEC 2) of the index scores of qi/ki (B, N, H, Di)."""
    B, N, Hi, Di = qi.shape
    cu = torch.arange(0, B * N + 1, N, dtype=torch.int32)
    flat = idx.permute(1, 0, 2, 3).reshape(Hi, B * N, idx.shape[-1])
    iscale = cfg["opts"].get("index_scale") or 1 / math.sqrt(Di)
    assert_valid_topk(flat, qi.reshape(B * N, Hi, Di), ki.reshape(B * N, ki.shape[2], Di), cu, cfg["topk"],
                      cfg["block_size"], iscale, rel_tol=rel_tol)


def rel_err(a, b):
    a, b = a.detach().to(f64).cpu(), b.detach().to(f64).cpu()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def assert_rel(a, b, tol, what):
    assert a.shape == b.shape, f"{what}: shape {tuple(a.shape)} vs {tuple(b.shape)}"
    e = rel_err(a, b)
    assert e <= tol, f"{what}: relative error {e:.3g} > {tol}"


def randn(shape, seed, dtype=f64, device="cpu", requires_grad=False):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=g, dtype=f64).to(device=device, dtype=dtype).requires_grad_(requires_grad)


def layer_vs_oracle(cfg, B, N, *, warmup=False, seed=0, dtype=f64, device="cpu", ref_device=None, tol=None,
                    positions=None, grads=True):
    """Runs the layer (recording its selection) and the oracle on the same weights and x; compares y, kl,
    and the gradients of (y * w).sum() + c * kl w.r.t. x and every parameter."""
    ref_device = ref_device or device
    tol = tol or dict(y=1e-5, kl=1e-5, grad=1e-5, sel=1e-4)  # the rotary angles are fp32 (HF convention)
    layer = make_layer(cfg, seed=seed, dtype=dtype, device=device)
    layer.warmup = warmup
    W = weights(layer, ref_device)
    x = randn((B, N, cfg["hidden"]), seed + 1, dtype, device, requires_grad=True)
    xr = x.detach().to(ref_device, f64).requires_grad_(True)
    with record_calls() as calls:
        y, kl = layer(x, positions=positions)
    assert y.dtype == dtype and y.shape == x.shape and kl.dim() == 0
    idx = calls[0]["idx"].to(ref_device)
    pr = positions.to(ref_device) if positions is not None else None
    y_ref, kl_ref, hand = oracle(W, cfg, xr, indices=idx, warmup=warmup, positions=pr)
    if not warmup and tol["sel"] is not None:  # valid on the hand-built index inputs
        check_selection(idx.cpu(), hand[3].detach().cpu(), hand[4].detach().cpu(), cfg, tol["sel"])
    assert_rel(y, y_ref, tol["y"], "y")
    kl_f, kl_rf = float(kl.detach()), float(kl_ref.detach())
    assert abs(kl_f - kl_rf) <= tol["kl"] * abs(kl_rf), (kl_f, kl_rf)
    if grads:
        w = randn(y.shape, seed + 2, dtype, device)
        ((y * w).sum() + 3.0 * kl).backward()
        ((y_ref * w.to(ref_device, f64)).sum() + 3.0 * kl_ref).backward()
        assert_rel(x.grad, xr.grad, tol["grad"], "x.grad")
        for n, p in layer.named_parameters():
            assert p.grad is not None, n
            assert p.grad.dtype == p.dtype, n
            assert_rel(p.grad, W[n].grad, tol["grad"], n + ".grad")
    return dict(layer=layer, x=x, y=y, kl=kl, y_ref=y_ref, kl_ref=kl_ref, hand=hand, W=W, calls=calls)


# ----------------------------------------------------------------------------------------------
# 1. The layer against the hand-built oracle (CPU, float64)
# ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("heads", HEADS)
def test_layer_matches_oracle(heads):
    """y, kl and every gradient equal the hand-built float64 computation on the layer's own selection,
    which is a valid top-k of the hand-built index scores; kl also equals msa.msa_attention's on the
    hand-built inputs; the sparse output is not the dense one (the selection restricts attention)."""
    cfg = cfg_of(heads)
    r = layer_vs_oracle(cfg, B=2, N=520)
    q, k, v, qi, ki = (t.detach() for t in r["hand"])
    out_op, kl_op, idx_op = msa.msa_attention(q, k, v, qi, ki, topk=TOPK, block_size=BS, return_indices=True)
    same = (idx_op == r["calls"][0]["idx"]).all(-1).float().mean()
    assert same > 0.999, f"only {float(same):.4f} of the rows select as msa.select_blocks on the hand inputs"
    torch.testing.assert_close(r["kl"], kl_op, rtol=1e-5, atol=0)
    y_dense = oracle(r["W"], cfg, r["x"].detach(), warmup=True)[0]
    assert (r["y"] - y_dense).abs().amax() > 1e-2, "the sparse layer output equals the dense one"


@pytest.mark.parametrize("heads", HEADS)
def test_warmup_matches_causal_sdpa(heads):
    """layer.warmup = True: y is torch's causal SDPA of the hand-built q/k/v (GQA expanded), kl the dense
    SPEC 5 KL (also msa.msa_attention(warmup=True) on the hand-built inputs), gradients those of SDPA."""
    cfg = cfg_of(heads)
    r = layer_vs_oracle(cfg, B=2, N=400, warmup=True)
    q, k, v, qi, ki = (t.detach() for t in r["hand"])
    _, kl_op = msa.msa_attention(q, k, v, qi, ki, topk=TOPK, block_size=BS, warmup=True)
    torch.testing.assert_close(r["kl"], kl_op, rtol=1e-6, atol=0)


# ----------------------------------------------------------------------------------------------
# 2. Gradient routing: the KL trains only the index branch, the output never reaches it
# ----------------------------------------------------------------------------------------------
def test_gradient_routing():
    layer = make_layer(cfg_of(HEADS[1]), dtype=torch.float32)
    x = randn((1, 150, HID), 3, torch.float32, requires_grad=True)
    y, kl = layer(x)
    assert kl.dtype == torch.float32 and kl.requires_grad
    (gx,) = torch.autograd.grad(kl, x, retain_graph=True, allow_unused=True)
    assert gx is None or not gx.any(), "the KL reaches x (the index branch must read x.detach())"
    kl.backward(retain_graph=True)
    for n, p in layer.named_parameters():
        if n in INDEX_PARAMS:
            assert p.grad is not None and p.grad.abs().sum() > 0, f"{n}: no gradient from the KL"
        else:
            assert p.grad is None or not p.grad.any(), f"{n}: gradient from the KL"
    assert x.grad is None
    layer.zero_grad(set_to_none=True)
    y.square().sum().backward()
    assert x.grad is not None and x.grad.abs().sum() > 0
    for n, p in layer.named_parameters():
        if n in INDEX_PARAMS:
            assert p.grad is None or not p.grad.any(), f"{n}: gradient from y"
        else:
            assert p.grad is not None and p.grad.abs().sum() > 0, f"{n}: no gradient from y"


# ----------------------------------------------------------------------------------------------
# 3. Options and bad arguments
# ----------------------------------------------------------------------------------------------
OPTIONS = [
    dict(qk_norm=True, index_qk_norm=False),
    dict(rope=False, index_rope=False),
    dict(rope=True, index_rope=False, qk_norm=True),
    dict(rope=False, index_rope=True),
    dict(rope_dim=32, index_rope_dim=16, rope_theta=500.0),
    dict(bias=True, softmax_scale=0.05, index_scale=0.3, norm_eps=1e-2),
]


@pytest.mark.parametrize("opts", OPTIONS, ids=lambda o: ",".join(f"{k}={v}" for k, v in o.items()))
def test_options_match_oracle(opts):
    cfg = cfg_of(HEADS[0], **opts)
    r = layer_vs_oracle(cfg, B=1, N=200)
    layer = r["layer"]
    assert (layer.q_norm is not None) == opts.get("qk_norm", False)
    assert (layer.q_idx_norm is not None) == opts.get("index_qk_norm", True)
    assert (layer.q_proj.bias is not None) == opts.get("bias", False)
    assert layer.q_idx_proj.bias is None and layer.k_idx_proj.bias is None


def test_explicit_positions():
    """positions= reach the rotary of both branches: non-uniform positions match the oracle at those
    positions, and differ from the default ones (rotary is relative: a plain shift would not show)."""
    cfg = cfg_of(HEADS[0])
    pos = torch.arange(200) * 3 + torch.arange(200) % 7
    r = layer_vs_oracle(cfg, B=1, N=200, positions=pos, grads=False)
    y_default = r["layer"](r["x"])[0]
    assert (r["y"] - y_default).abs().amax() > 1e-3


def test_positions_shapes():
    """positions of shape (N,), (1, N) and (B, N) give one result when they hold the same positions; any other
    shape (a length that is not N, a packed shape for batched x) is a ValueError naming positions, not a
    broadcasting error from inside the rotary."""
    layer = make_layer(cfg_of(HEADS[0]))
    x = randn((2, 140, HID), 12)
    pos = torch.arange(140) * 2
    y = layer(x, positions=pos)[0]
    for p in (pos[None], pos.expand(2, 140)):
        torch.testing.assert_close(layer(x, positions=p)[0], y, rtol=0, atol=0)
    for bad in (pos[:70], pos.expand(3, 140), pos.expand(2, 140)[..., None], pos.tolist()):
        with pytest.raises(ValueError, match="positions"):
            layer(x, positions=bad)
    xp, cu = x.reshape(280, HID), torch.tensor([0, 140, 280], dtype=torch.int32)
    with pytest.raises(ValueError, match="positions"):
        layer(xp, cu_seqlens=cu, max_seqlen=140, positions=pos)


@pytest.mark.parametrize("kw, name", [
    (dict(hidden=0), "hidden"),
    (dict(num_heads=True), "num_heads"),
    (dict(num_kv_heads=2.0), "num_kv_heads"),
    (dict(num_heads=6, num_kv_heads=4, index_heads=2), "num_kv_heads"),
    (dict(index_heads=3), "index_heads"),
    (dict(num_heads=12, num_kv_heads=4, index_heads=6), "index_heads"),  # neither of Hi, Hkv divides the other
    (dict(index_heads=2, index_key_heads=4), "index_key_heads"),
    (dict(index_key_heads=0), "index_key_heads"),
    (dict(head_dim=96), "head_dim"),
    (dict(index_head_dim=32), "index_head_dim"),
    (dict(rope_dim=33), "rope_dim"),
    (dict(rope_dim=128), "rope_dim"),
    (dict(index_rope_dim=0), "index_rope_dim"),
    (dict(topk=0), "topk"),
    (dict(topk=33), "topk"),
    (dict(block_size=96), "block_size"),
])
def test_bad_constructor_args(kw, name):
    args = dict(hidden=HID, num_heads=4, num_kv_heads=2, head_dim=64, index_heads=2, index_head_dim=64)
    args.update(kw)
    with pytest.raises(ValueError, match=rf"MSAAttention: {name}:"):
        mnn.MSAAttention(**args)


def test_bad_x():
    layer = make_layer(cfg_of(HEADS[0]), dtype=torch.float32)
    cu = torch.tensor([0, 10], dtype=torch.int32)
    for x, extra in ((torch.randn(10, HID), {}), (torch.randn(1, 10, HID + 1), {}),
                     (torch.randn(1, 1, 10, HID), {}), (torch.randn(1, 10, HID), dict(cu_seqlens=cu, max_seqlen=10)),
                     (torch.randn(10, HID - 1), dict(cu_seqlens=cu, max_seqlen=10))):
        with pytest.raises(ValueError, match="MSAAttention: x:"):
            layer(x, **extra)
    with pytest.raises(ValueError, match="MSAAttention: max_seqlen:"):
        layer(torch.randn(10, HID), cu_seqlens=cu)
    with pytest.raises(ValueError, match="RotaryEmbedding"):
        mnn.RotaryEmbedding(15)


# ----------------------------------------------------------------------------------------------
# 4. Packed (varlen) input and positions
# ----------------------------------------------------------------------------------------------
def test_positions_from_cu_seqlens():
    cases = [([0, 0, 3, 3, 7, 7], 7, [0, 1, 2, 0, 1, 2, 3]), ([0, 5], 5, list(range(5))), ([0, 0], 0, []),
             ([0, 0, 0, 2], 2, [0, 1]), ([0, 1, 2, 3], 3, [0, 0, 0])]
    for cu, total, want in cases:
        got = mnn.positions_from_cu_seqlens(torch.tensor(cu, dtype=torch.int32), total)
        assert got.dtype == torch.int64 and got.tolist() == want, (cu, got.tolist())
    g = torch.Generator().manual_seed(0)
    lengths = torch.randint(0, 9, (40,), generator=g).tolist()
    cu = torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist(), dtype=torch.int32)
    want = [p for n in lengths for p in range(n)]
    assert mnn.positions_from_cu_seqlens(cu, sum(lengths)).tolist() == want


def test_varlen_equals_separate_sequences():
    """Packed sequences (one empty, partial blocks) equal each sequence run alone through the batched
    path: y, kl (row-weighted), gradients; every rotary sees positions restarting per sequence (a
    forward pre-hook records them; rotary is relative, so y alone would not catch global positions)."""
    lengths = [150, 0, 70, 130]
    cfg = cfg_of(HEADS[1])
    layer = make_layer(cfg)
    T = sum(lengths)
    cu = torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist(), dtype=torch.int32)
    x = randn((T, HID), 5, requires_grad=True)
    w = randn((T, HID), 6)
    seen = []
    hooks = [m.register_forward_pre_hook(lambda m, a: seen.append(a[0].clone()))
             for m in (layer.rotary, layer.index_rotary)]
    try:
        y, kl = layer(x, cu_seqlens=cu, max_seqlen=max(lengths))
    finally:
        for h in hooks:
            h.remove()
    want_pos = torch.cat([torch.arange(n) for n in lengths])
    assert len(seen) == 2 and all(torch.equal(s, want_pos) for s in seen)
    ((y * w).sum() + 2.0 * kl).backward()
    g_packed = {n: p.grad.clone() for n, p in layer.named_parameters()}
    layer.zero_grad()
    xs = x.detach().clone().requires_grad_(True)
    ys, kl_sum = [], 0.0
    for s0, s1 in zip(cu[:-1].tolist(), cu[1:].tolist()):
        if s1 == s0:
            continue
        ysq, kls = layer(xs[s0:s1][None])
        ys.append(ysq[0])
        kl_sum = kl_sum + kls * (s1 - s0) / T
    y_sep = torch.cat(ys)
    torch.testing.assert_close(y, y_sep, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(kl, kl_sum, rtol=1e-10, atol=0)
    ((y_sep * w).sum() + 2.0 * kl_sum).backward()
    torch.testing.assert_close(x.grad, xs.grad, rtol=1e-10, atol=1e-12)
    for n, p in layer.named_parameters():
        torch.testing.assert_close(g_packed[n], p.grad, rtol=1e-9, atol=1e-12, msg=lambda m: f"{n}: {m}")


def test_rotary_helpers():
    """RotaryEmbedding + apply_rotary against the hand-written rotate-half rotary (partial dim)."""
    x = randn((2, 40, 3, 64), 7, torch.float32)
    pos = torch.arange(40) + 11
    rot = mnn.RotaryEmbedding(24, theta=777.0)
    cos, sin = rot(pos)
    assert cos.shape == (40, 24) and cos.dtype == torch.float32
    got = mnn.apply_rotary(x, cos, sin)
    half = 12
    inv = 777.0 ** (-torch.arange(half, dtype=f64) * 2 / 24)
    ang = pos.to(f64)[:, None] * inv
    c, s = ang.cos()[:, None], ang.sin()[:, None]
    xd = x.double()
    want = torch.cat((xd[..., :half] * c - xd[..., half:24] * s, xd[..., half:24] * c + xd[..., :half] * s,
                      xd[..., 24:]), -1)
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)
    assert torch.equal(got[..., 24:], x[..., 24:])


def test_rotary_frequencies_stay_fp32():
    """model.to(bfloat16) / .double() and a meta-device init do not change the rotary angles (the
    frequencies are fp32, not a buffer that follows the module's dtype)."""
    pos = torch.arange(4096)
    want = mnn.RotaryEmbedding(64)(pos)
    layer = make_layer(cfg_of(), dtype=torch.float32)
    for dtype in (torch.bfloat16, torch.float16, f64):
        layer.to(dtype)
        for rot in (layer.rotary, layer.index_rotary):
            got = rot(pos)
            assert got[0].dtype == torch.float32
            assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1]), dtype
    meta = mnn.MSAAttention(HID, 4, 2, 64, 2, 64, topk=TOPK, block_size=BS, device="meta")
    meta.to_empty(device="cpu")
    got = meta.rotary(pos)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


def test_copy_after_forward():
    """copy.deepcopy (an EMA copy) and pickling work after a forward; the copy holds no KL of the
    original's graph, the original keeps it for kl_loss."""
    import pickle
    model = Model(cfg_of(), layers=2)
    h, kls = model(randn((1, 70, HID), 11, requires_grad=True))
    twin = copy.deepcopy(model)
    assert all(b.attn.msa_kl is None for b in twin.blocks)
    torch.testing.assert_close(mnn.kl_loss(model), kls.sum())
    again = pickle.loads(pickle.dumps(model))
    h2, _ = again(randn((1, 70, HID), 11))
    torch.testing.assert_close(h2, h.detach(), rtol=0, atol=0)


# ----------------------------------------------------------------------------------------------
# 5. warmup, set_warmup, kl_loss
# ----------------------------------------------------------------------------------------------
class Block(nn.Module):
    """Pre-norm residual block around an MSAAttention, with an MLP."""

    def __init__(self, cfg, seed, dtype=f64, device="cpu"):
        super().__init__()
        self.norm = nn.RMSNorm(cfg["hidden"], device=device, dtype=dtype)
        self.attn = make_layer(cfg, seed=seed, dtype=dtype, device=device)
        self.mlp = nn.Linear(cfg["hidden"], cfg["hidden"], device=device, dtype=dtype)

    def forward(self, x):
        y, kl = self.attn(self.norm(x))
        x = x + y
        return x + self.mlp(F.gelu(x)), kl


class Model(nn.Module):
    def __init__(self, cfg, layers=2, dtype=f64, device="cpu", ckpt=False):
        super().__init__()
        torch.manual_seed(123)  # the norms / MLPs
        self.blocks = nn.ModuleList(Block(cfg, seed=10 + i, dtype=dtype, device=device) for i in range(layers))
        self.ckpt = ckpt

    def forward(self, x):
        kls = []
        for b in self.blocks:
            x, kl = checkpoint(b, x, use_reentrant=False) if self.ckpt else b(x)
            kls.append(kl)
        return x, torch.stack(kls)


def test_warmup_context_and_set_warmup():
    model = Model(cfg_of(), layers=3)
    attn = [b.attn for b in model.blocks]
    attn[1].warmup = True
    with mnn.warmup(model) as m:
        assert m is model and all(a.warmup for a in attn)
    assert [a.warmup for a in attn] == [False, True, False]
    with mnn.warmup(model, enabled=False):
        assert not any(a.warmup for a in attn)
    assert [a.warmup for a in attn] == [False, True, False]
    with pytest.raises(KeyError):
        with mnn.warmup(model):
            assert all(a.warmup for a in attn)
            raise KeyError("boom")
    assert [a.warmup for a in attn] == [False, True, False]
    assert mnn.set_warmup(model, True) == 3 and all(a.warmup is True for a in attn)
    assert mnn.set_warmup(model, 0) == 3 and all(a.warmup is False for a in attn)
    plain = nn.Sequential(nn.Linear(4, 4), nn.ReLU())
    with pytest.raises(ValueError, match="warmup"):
        with mnn.warmup(plain):
            pass
    assert mnn.set_warmup(plain, True) == 0


def test_warmup_context_switches_the_computation():
    """Inside msa.nn.warmup the layers compute the dense result (SDPA oracle), outside the sparse one."""
    cfg = cfg_of()
    model = Model(cfg, layers=1)
    attn = model.blocks[0].attn
    x = randn((1, 300, HID), 8)
    W = weights(attn)
    with mnn.warmup(model):
        y_w = attn(x)[0]
    y_s = attn(x)[0]
    torch.testing.assert_close(y_w, oracle(W, cfg, x, warmup=True)[0].detach(), rtol=1e-5, atol=1e-5)
    assert (y_s - y_w).abs().amax() > 1e-2


def test_kl_loss():
    model = Model(cfg_of(HEADS[1]), layers=3)
    with pytest.raises(RuntimeError, match="kl_loss: no msa layer of this model holds a KL"):
        mnn.kl_loss(model)
    with pytest.raises(RuntimeError, match="kl_loss"):
        mnn.kl_loss(nn.Linear(3, 3))
    x = randn((1, 140, HID), 9, requires_grad=True)
    h, kls = model(x)
    assert kls.shape == (3,) and len(set(kls.tolist())) == 3
    torch.testing.assert_close(mnn.kl_loss(model), kls.sum(), rtol=1e-12, atol=0)
    torch.testing.assert_close(mnn.kl_loss(model, reduction="mean"), kls.mean(), rtol=1e-12, atol=0)
    with pytest.raises(ValueError, match="reduction"):
        mnn.kl_loss(model, reduction="max")
    # the gradient of kl_loss is that of the returned KLs: the index weights of every layer
    g = torch.autograd.grad(mnn.kl_loss(model), [b.attn.q_idx_proj.weight for b in model.blocks], retain_graph=True)
    want = torch.autograd.grad(kls.sum(), [b.attn.q_idx_proj.weight for b in model.blocks])
    for a, b in zip(g, want):
        assert a.abs().sum() > 0
        torch.testing.assert_close(a, b, rtol=1e-12, atol=0)
    # a new forward replaces the terms
    h2, kls2 = model(randn((1, 100, HID), 10))
    torch.testing.assert_close(mnn.kl_loss(model), kls2.sum(), rtol=1e-12, atol=0)
    assert abs(float(kls2.sum().detach() - kls.sum().detach())) > 1e-6


def test_register_msa_module(monkeypatch):
    """Modules registered by a predicate are seen by kl_loss / warmup / set_warmup."""
    monkeypatch.setattr(mnn, "_MSA_MODULE_TESTS", [])

    class Other(nn.Module):
        def __init__(self):
            super().__init__()
            self.warmup, self.msa_kl = False, None

    model = nn.Sequential(Other(), Other())
    with pytest.raises(ValueError, match="no msa layer"):
        with mnn.warmup(model):
            pass
    mnn.register_msa_module(lambda m: isinstance(m, Other))
    assert mnn.set_warmup(model, True) == 2 and model[0].warmup
    model[0].msa_kl, model[1].msa_kl = torch.tensor(0.25), torch.tensor(0.5)
    assert float(mnn.kl_loss(model)) == 0.75


# ----------------------------------------------------------------------------------------------
# 6-8. torch.compile, activation checkpointing, autocast (CPU)
# ----------------------------------------------------------------------------------------------
def _train_step(model, x, w, lam=0.5):
    """(h, per-layer kls, kl_loss, loss, grads by name, x.grad) of one forward+backward."""
    model.zero_grad(set_to_none=True)
    x = x.detach().clone().requires_grad_(True)
    h, kls = model(x)
    kll = mnn.kl_loss(model)
    stored = torch.stack([b.attn.msa_kl for b in _blocks(model)])
    loss = (h.to(w.dtype) * w).sum() + lam * kll
    loss.backward()
    grads = {n: _full(p.grad).detach().clone() for n, p in _named_params(model)}
    return dict(h=h.detach(), kls=kls.detach(), kl_loss=kll.detach(), stored=stored.detach(), loss=loss.detach(),
                grads=grads, xgrad=x.grad)


def _blocks(model):
    return getattr(model, "_orig_mod", model).blocks


def _named_params(model):
    return getattr(model, "_orig_mod", model).named_parameters()


def _compare_steps(got, want, tol, what):
    assert_rel(got["h"], want["h"], tol, f"{what}: h")
    assert_rel(got["kls"], want["kls"], tol, f"{what}: kls")
    assert_rel(got["kl_loss"], want["kl_loss"], tol, f"{what}: kl_loss")
    assert_rel(got["xgrad"], want["xgrad"], tol, f"{what}: x.grad")
    assert got["grads"].keys() == want["grads"].keys()
    for n in want["grads"]:
        assert_rel(got["grads"][n], want["grads"][n], tol, f"{what}: {n}.grad")


def _check_stored(step):
    """kl_loss collected the KL each layer returned (self.msa_kl), also from a compiled region."""
    torch.testing.assert_close(step["stored"], step["kls"], rtol=1e-6, atol=0)
    torch.testing.assert_close(step["kl_loss"], step["kls"].sum(), rtol=1e-6, atol=0)


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_compile_fullgraph_cpu(backend):
    """torch.compile(fullgraph=True) of a 2-layer model: forward, kl_loss (from the msa_kl the layers keep
    inside the compiled region) and backward equal eager; with aot_eager also dynamic=True on a second
    N without recompiling."""
    torch._dynamo.reset()
    cfg = cfg_of(HEADS[0])
    model = Model(cfg, layers=2, dtype=torch.float32)
    eager = copy.deepcopy(model)
    compiled = torch.compile(model, backend=backend, fullgraph=True, dynamic=(backend == "aot_eager"))
    sizes = (200, 150) if backend == "aot_eager" else (200,)
    try:
        for i, N in enumerate(sizes):
            if i:
                torch.compiler.set_stance("fail_on_recompile")
            x, w = randn((1, N, HID), 20 + i, torch.float32), randn((1, N, HID), 30 + i, torch.float32)
            got, want = _train_step(compiled, x, w), _train_step(eager, x, w)
            _check_stored(got)
            _compare_steps(got, want, 1e-5, f"{backend} N={N}")
    finally:
        torch.compiler.set_stance("default")
        torch._dynamo.reset()


def test_activation_checkpointing_cpu():
    """Non-reentrant checkpoint around each block: the same outputs, KLs, kl_loss and gradients, and the
    layers did run twice (the recompute)."""
    cfg = cfg_of(HEADS[1])
    plain = Model(cfg, layers=2)
    ck = copy.deepcopy(plain)
    ck.ckpt = True
    calls = []
    for b in ck.blocks:
        b.attn.register_forward_hook(lambda m, a, o: calls.append(1))
    x, w = randn((2, 150, HID), 40), randn((2, 150, HID), 41)
    got, want = _train_step(ck, x, w), _train_step(plain, x, w)
    assert len(calls) == 4, "checkpointing did not recompute the layers"
    _check_stored(got)
    _compare_steps(got, want, 1e-12, "checkpoint")


# torch.nn.RMSNorm (fp32 weight, bf16 input under CPU autocast) takes torch's unfused path and says so: expected here.
@pytest.mark.filterwarnings("ignore:Mismatch dtype between input and weight")
def test_autocast_cpu_bf16():
    """fp32 parameters under torch.autocast("cpu", bfloat16): the ops see bf16, y is bf16, the gradients
    fp32, and all are within bf16 accuracy of the float64 oracle on the recorded selection."""
    cfg = cfg_of(HEADS[1])
    layer = make_layer(cfg, dtype=torch.float32)
    W = weights(layer)
    x = randn((1, 260, HID), 50, torch.float32, requires_grad=True)
    w = randn((1, 260, HID), 51, torch.float32)
    with record_calls() as calls, torch.autocast("cpu", dtype=torch.bfloat16):
        y, kl = layer(x)
        loss = (y.float() * w).sum() + 3.0 * kl
    loss.backward()
    c = calls[0]
    assert all(c[n].dtype == torch.bfloat16 for n in ("q", "k", "v", "qi", "ki"))
    assert y.dtype == torch.bfloat16 and kl.dtype == torch.float32
    xr = x.detach().double().requires_grad_(True)
    y_ref, kl_ref, hand = oracle(W, cfg, xr, indices=c["idx"])
    check_selection(c["idx"], c["qi"], c["ki"], cfg, 1e-5)  # valid on what the op saw
    assert_rel(c["qi"], hand[3], 1e-2, "q_idx")
    # the op ran with its fp32 accumulation: as on the same bf16 inputs outside autocast
    out_op, kl_op = msa.msa_attention(c["q"], c["k"], c["v"], c["qi"], c["ki"], topk=TOPK, block_size=BS)
    assert torch.equal(c["out"], out_op) and torch.equal(c["kl"], kl_op)
    assert_rel(y, y_ref, 1.5e-2, "y")
    assert abs(kl.item() - kl_ref.item()) <= 5e-3 * kl_ref.item()
    ((y_ref * w.double()).sum() + 3.0 * kl_ref).backward()
    assert_rel(x.grad, xr.grad, 3e-2, "x.grad")
    for n, p in layer.named_parameters():
        assert p.grad.dtype == torch.float32
        assert_rel(p.grad, W[n].grad, 5e-2, n + ".grad")


# ----------------------------------------------------------------------------------------------
# 9. FSDP2 on one process
# ----------------------------------------------------------------------------------------------
@pytest.fixture
def process_group(tmp_path, request):
    """A world_size=1 default process group (gloo on CPU, nccl on CUDA), destroyed afterwards."""
    import torch.distributed as dist
    backend = request.param
    if not dist.is_available() or (backend == "nccl" and not dist.is_nccl_available()):
        pytest.skip(f"torch.distributed with {backend} is not available")
    if dist.is_initialized():
        dist.destroy_process_group()
    if backend == "nccl":
        torch.cuda.set_device(0)
    dist.init_process_group(backend, init_method=f"file://{tmp_path / 'pg'}", rank=0, world_size=1)
    try:
        yield backend
    finally:
        dist.destroy_process_group()


def fsdp2_vs_unsharded(device, dtype, N, cfg, tol, steps=2):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    plain = Model(cfg, layers=2, dtype=dtype, device=device)
    sharded = copy.deepcopy(plain)
    # The mesh on `device`: without one, fully_shard takes the accelerator whenever one is present.
    mesh = init_device_mesh(device, (torch.distributed.get_world_size(),))
    for b in sharded.blocks:
        fully_shard(b, mesh=mesh)
    fully_shard(sharded, mesh=mesh)
    assert type(next(sharded.parameters())).__name__ == "DTensor"
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-3) for m in (plain, sharded)]
    for step in range(steps):
        x = randn((2, N, HID), 60 + step, dtype, device)
        w = randn((2, N, HID), 70 + step, torch.promote_types(dtype, torch.float32), device)
        got, want = _train_step(sharded, x, w), _train_step(plain, x, w)
        _check_stored(got)
        _compare_steps(got, want, tol, f"FSDP2 step {step}")
        for o in opts:
            o.step()
    for (n, p), (_, q) in zip(sharded.named_parameters(), plain.named_parameters()):
        assert_rel(_full(p), q, tol, f"{n} after the optimizer steps")


@pytest.mark.parametrize("process_group", ["gloo"], indirect=True)
def test_fsdp2_cpu(process_group):
    fsdp2_vs_unsharded("cpu", f64, 150, cfg_of(HEADS[0]), 1e-12)


# ----------------------------------------------------------------------------------------------
# CUDA (run on the GPU machine): bf16 kernels against the float64 oracle, both kernel paths
# ----------------------------------------------------------------------------------------------
GPU_TOL = dict(y=2e-2, kl=2e-2, grad=4e-2, sel=1e-5)
GPU_CASES = [  # (cfg, B, N)
    (cfg_of((8, 2, 4, 1), D=64, topk=4, block_size=64), 2, 1500),
    (cfg_of((16, 2, 4, 1), D=128, hidden=256, topk=8, block_size=128), 1, 3000),
]


def _gpu_case(cfg, B, N, warmup, dtype=torch.bfloat16):
    r = layer_vs_oracle(cfg, B, N, warmup=warmup, dtype=dtype, device="cuda", tol=dict(GPU_TOL, sel=None),
                        seed=1)
    if not warmup:
        c = r["calls"][0]
        check_selection(c["idx"].cpu(), c["qi"].cpu(), c["ki"].cpu(), cfg, GPU_TOL["sel"])  # on what the op saw
        assert_rel(c["qi"], r["hand"][3], 1e-2, "q_idx")
        assert_rel(c["ki"], r["hand"][4], 1e-2, "k_idx")
    assert r["kl"].dtype == torch.float32
    return r


@pytest.mark.gpu
@pytest.mark.usefixtures("kernel_choice")
@pytest.mark.parametrize("warmup", [False, True], ids=["sparse", "warmup"])
@pytest.mark.parametrize("case", range(len(GPU_CASES)))
def test_gpu_layer_matches_oracle(case, warmup):
    """bf16 layer on CUDA: y, kl and all gradients within bf16 accuracy of the float64 oracle on the
    recorded selection, which is a valid top-k of the index inputs the kernel saw."""
    _gpu_case(*GPU_CASES[case], warmup)


@pytest.mark.gpu
def test_gpu_fp32_params_compute_dtype():
    """fp32 parameters on CUDA outside autocast: the kernels see compute_dtype (bf16), y and the
    gradients are fp32, within bf16 accuracy of the float64 oracle; and against the CPU float64 run
    of the same layer (its own selection), rows that selected the same blocks agree."""
    cfg, B, N = cfg_of((8, 2, 4, 1), topk=4), 1, 1100
    r = _gpu_case(cfg, B, N, warmup=False, dtype=torch.float32)
    c = r["calls"][0]
    assert all(c[n].dtype == torch.bfloat16 for n in ("q", "k", "v", "qi", "ki"))
    assert r["y"].dtype == torch.float32
    cpu_layer = copy.deepcopy(r["layer"]).to("cpu", f64)
    with record_calls() as cpu_calls:
        y_cpu, kl_cpu = cpu_layer(r["x"].detach().cpu().double())
    same = (cpu_calls[0]["idx"] == c["idx"].cpu()).all(-1).all(1)  # (B, N): every group selected alike
    assert same.float().mean() > 0.5, f"only {float(same.float().mean()):.3f} of the rows select as on the CPU"
    assert_rel(r["y"].cpu()[same], y_cpu[same], 2e-2, "y vs CPU float64 (rows of the same selection)")
    assert abs(float(r["kl"]) - float(kl_cpu)) <= 3e-2 * float(kl_cpu)


@pytest.mark.gpu
def test_gpu_varlen_equals_separate_sequences():
    lengths = [1000, 0, 1, 777, 300]
    cfg = cfg_of((8, 2, 4, 1), topk=4)
    layer = make_layer(cfg, dtype=torch.bfloat16, device="cuda")
    T = sum(lengths)
    cu = torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist(), dtype=torch.int32, device="cuda")
    x = randn((T, HID), 5, torch.bfloat16, "cuda")
    y, kl = layer(x, cu_seqlens=cu, max_seqlen=max(lengths))
    ys, kl_sum = [], 0.0
    for s0, s1 in zip(cu[:-1].tolist(), cu[1:].tolist()):
        if s1 > s0:
            ysq, kls = layer(x[s0:s1][None])
            ys.append(ysq[0])
            kl_sum = kl_sum + kls * (s1 - s0) / T
    assert_rel(y, torch.cat(ys), 1e-2, "y packed vs separate")
    assert abs(float(kl) - float(kl_sum)) <= 1e-3 * float(kl_sum)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gpu_compile_dynamic_no_recompile(dtype):
    """inductor, fullgraph=True, dynamic=True: a 2-layer model (fp32 parameters: the layer casts to bf16
    inside the graph; or bf16 parameters) equals eager at two sequence lengths, the second without
    recompiling; kl_loss reads the KLs stored inside the compiled region."""
    torch._dynamo.reset()
    cfg = cfg_of((8, 2, 4, 1), topk=4)
    model = Model(cfg, layers=2, dtype=dtype, device="cuda")
    eager = copy.deepcopy(model)
    compiled = torch.compile(model, fullgraph=True, dynamic=True)
    try:
        for i, N in enumerate((1000, 1300)):
            if i:
                torch.compiler.set_stance("fail_on_recompile")
            x = randn((2, N, HID), 80 + i, dtype, "cuda")
            w = randn((2, N, HID), 90 + i, torch.float32, "cuda")
            got, want = _train_step(compiled, x, w), _train_step(eager, x, w)
            _check_stored(got)
            # bf16 parameters: eager rounds every op to bf16, inductor keeps fused intermediates in fp32, and
            # the changed rounding flips near-tied selections (measured 5.7% and 8.8% on norm-weight grads
            # in two H200 runs); fp32 parameters (bf16 only inside the kernels) stay tight.
            _compare_steps(got, want, 2e-2 if dtype == torch.float32 else 1.5e-1, f"compiled N={N}")
    finally:
        torch.compiler.set_stance("default")
        torch._dynamo.reset()


@pytest.mark.gpu
@pytest.mark.usefixtures("kernel_choice")
def test_gpu_activation_checkpointing():
    cfg = cfg_of((8, 2, 4, 1), topk=4)
    plain = Model(cfg, layers=2, dtype=torch.bfloat16, device="cuda")
    ck = copy.deepcopy(plain)
    ck.ckpt = True
    x = randn((2, 1200, HID), 100, torch.bfloat16, "cuda")
    w = randn((2, 1200, HID), 101, torch.float32, "cuda")
    got, want = _train_step(ck, x, w), _train_step(plain, x, w)
    _check_stored(got)
    _compare_steps(got, want, 1e-3, "checkpoint")


@pytest.mark.gpu
@pytest.mark.usefixtures("kernel_choice")
def test_gpu_autocast_fp32_params():
    """fp32 parameters inside torch.autocast("cuda", bfloat16): the kernels see bf16, y is bf16, the
    gradients fp32; within bf16 accuracy of the float64 oracle (recorded selection) and of the same
    weights as bf16 parameters without autocast."""
    cfg = cfg_of((8, 2, 4, 1), topk=4)
    layer = make_layer(cfg, dtype=torch.float32, device="cuda")
    W = weights(layer)
    x = randn((2, 1200, HID), 110, torch.float32, "cuda", requires_grad=True)
    w = randn((2, 1200, HID), 111, torch.float32, "cuda")
    with record_calls() as calls, torch.autocast("cuda", dtype=torch.bfloat16):
        y, kl = layer(x)
        loss = (y.float() * w).sum() + 3.0 * kl
    loss.backward()
    c = calls[0]
    assert all(c[n].dtype == torch.bfloat16 for n in ("q", "k", "v", "qi", "ki"))
    assert y.dtype == torch.bfloat16 and kl.dtype == torch.float32
    assert all(p.grad.dtype == torch.float32 for p in layer.parameters())
    xr = x.detach().double().requires_grad_(True)
    y_ref, kl_ref, _ = oracle(W, cfg, xr, indices=c["idx"])
    assert_rel(y, y_ref, GPU_TOL["y"], "y")
    assert abs(float(kl) - float(kl_ref)) <= GPU_TOL["kl"] * float(kl_ref)
    ((y_ref * w.double()).sum() + 3.0 * kl_ref).backward()
    assert_rel(x.grad, xr.grad, GPU_TOL["grad"], "x.grad")
    for n, p in layer.named_parameters():
        assert_rel(p.grad, W[n].grad, GPU_TOL["grad"], n + ".grad")
    bf = copy.deepcopy(layer).to(torch.bfloat16)
    y_bf, kl_bf = bf(x.detach().to(torch.bfloat16))
    assert_rel(y, y_bf, 8e-2, "y autocast vs bf16 parameters")  # two bf16 roundings of the weights; near-tie flips
    assert abs(float(kl) - float(kl_bf)) <= 2e-2 * float(kl_bf)


@pytest.mark.gpu
@pytest.mark.parametrize("process_group", ["nccl"], indirect=True)
def test_fsdp2_cuda(process_group):
    cfg = cfg_of((8, 2, 4, 1), topk=4, deterministic=True)
    fsdp2_vs_unsharded("cuda", torch.float32, 1000, cfg, 1e-3)
