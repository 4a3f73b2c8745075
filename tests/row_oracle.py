"""An exact per-row oracle for long sequences: SPEC 2-4 for sampled rows and sampled kv blocks, computed on
the GPU from the inputs, the upstream gradients and the kernel's own selection, with no N x N tensor.

Tensors are packed (T, H, D). A row is (token t, index group r): its attended set is the causally visible
tokens of its selected blocks (at most topk * block_size), gathered into a padded (R, L) token list. The
exact result is computed in float64; the same computation in the input dtype is the same-precision
baseline of the STYLE rule (tests/attention_check.py).
"""
import math

import torch

from topk_check import assert_top_scores

CHUNK = 128  # rows per gathered chunk: (CHUNK, topk * block_size, D) float64 per tensor


def seq_start(cu, t):
    """First token of the sequence holding each token of t."""
    return cu[torch.searchsorted(cu, t, right=True) - 1]


def attended(indices, t, r, cu, block_size):
    """(tokens, mask) (R, topk * block_size): the attended set of rows (t, r) under `indices` (Hi, T, k);
    -1, repeated and causally invisible entries are masked out (SPEC 3)."""
    blocks = indices[r, t].long()  # (R, k)
    k = blocks.shape[1]
    first = torch.ones_like(blocks, dtype=torch.bool)
    for j in range(1, k):
        first[:, j] = ~(blocks[:, :j] == blocks[:, j:j + 1]).any(-1)
    s0 = seq_start(cu, t)
    tok = s0[:, None, None] + blocks[:, :, None] * block_size + torch.arange(block_size, device=t.device)
    ok = ((blocks >= 0) & first)[:, :, None] & (tok <= t[:, None, None])
    tok = torch.where(ok, tok, t[:, None, None])
    return tok.reshape(len(t), -1), ok.reshape(len(t), -1)


def row_terms(x, t, r, indices, cu, block_size, scale, iscale, kl_coef, dtype):
    """Per row (t, r), in `dtype` arithmetic: lse (R, G), out and dq (R, G, D), kl_row, lse_idx (R,),
    dq_idx (R, Di), and on the attended set (R, L): the tokens, P (R, G, L), dS (R, G, L) and
    dS_idx / (d_kl / rows) = Pidx - P_mean (R, L). x holds q, k, v, q_idx, k_idx, dout (packed)."""
    q, k, v, qi, ki, do = (x[n] for n in ("q", "k", "v", "q_idx", "k_idx", "dout"))
    Hq, Hkv, Hi, Hki = q.shape[1], k.shape[1], qi.shape[1], ki.shape[1]
    G = Hq // Hi
    assert Hi % Hkv == 0, "the oracle covers Hi >= Hkv (every group on one kv head)"
    tok, mask = attended(indices, t, r, cu, block_size)
    heads = r[:, None] * G + torch.arange(G, device=t.device)  # (R, G)
    kvh, kih = r // (Hi // Hkv), r // (Hi // Hki)
    Q = q[t[:, None], heads].to(dtype)  # (R, G, D)
    dO = do[t[:, None], heads].to(dtype)
    K, V = k[tok, kvh[:, None]].to(dtype), v[tok, kvh[:, None]].to(dtype)  # (R, L, D)
    Qi, Ki = qi[t, r].to(dtype), ki[tok, kih[:, None]].to(dtype)  # (R, Di), (R, L, Di)
    neg = torch.tensor(-math.inf, dtype=dtype, device=t.device)
    s = torch.where(mask[:, None], torch.einsum("rgd,rld->rgl", Q, K) * scale, neg)
    lse = torch.logsumexp(s, dim=-1)
    p = torch.exp(s - lse[..., None])
    out = torch.einsum("rgl,rld->rgd", p, V)
    dp = torch.einsum("rgd,rld->rgl", dO, V)
    delta = (dO * out).sum(-1, keepdim=True)
    ds = p * (dp - delta)
    dq = torch.einsum("rgl,rld->rgd", ds, K) * scale
    si = torch.where(mask, torch.einsum("rd,rld->rl", Qi, Ki) * iscale, neg)
    lse_idx = torch.logsumexp(si, dim=-1)
    log_pi = si - lse_idx[:, None]
    pm = p.mean(1)
    log_pm = torch.log(pm)
    kl_row = torch.where(mask & (pm > 0), pm * (log_pm - log_pi), torch.zeros_like(pm)).sum(-1)
    dsi = torch.where(mask, torch.exp(log_pi) - pm, torch.zeros_like(pm))
    dq_idx = torch.einsum("rl,rld->rd", dsi, Ki) * (iscale * kl_coef)
    return dict(lse=lse, out=out, dq=dq, kl_row=kl_row, lse_idx=lse_idx, dq_idx=dq_idx, tok=tok, mask=mask,
                p=p, ds=ds, dsi=dsi, Q=Q, dO=dO, Qi=Qi)


def in_chunks(fn, *rows):
    """fn over CHUNK rows at a time, results concatenated along dim 0 (dicts of tensors)."""
    parts = [fn(*(a[i:i + CHUNK] for a in rows)) for i in range(0, len(rows[0]), CHUNK)]
    return {key: torch.cat([p[key] for p in parts]) for key in parts[0]}


def block_grads(x, blk0, rows_t, rows_r, indices, cu, block_size, scale, iscale, kl_coef, dtype):
    """dk, dv (block_size, Hkv, D) and dk_idx (block_size, Hki, Di) of the kv block whose first token is
    blk0, from every row (t, r) that selected it (rows_t / rows_r): each row's contribution on the
    block's tokens, summed in float64 (computed per row in `dtype`)."""
    q, k, qi, ki = x["q"], x["k"], x["q_idx"], x["k_idx"]
    Hkv, D, Hi, Hki, Di = k.shape[1], q.shape[2], qi.shape[1], ki.shape[1], qi.shape[2]
    dev = q.device
    dk = torch.zeros(block_size, Hkv, D, dtype=torch.float64, device=dev)
    dv = torch.zeros_like(dk)
    dki = torch.zeros(block_size, Hki, Di, dtype=torch.float64, device=dev)
    for i in range(0, len(rows_t), CHUNK):
        t, r = rows_t[i:i + CHUNK], rows_r[i:i + CHUNK]
        o = row_terms(x, t, r, indices, cu, block_size, scale, iscale, kl_coef, dtype)
        j = o["tok"] - blk0
        inb = o["mask"] & (j >= 0) & (j < block_size)  # (R, L): the row's keys inside this block
        ri, li = inb.nonzero(as_tuple=True)  # only those: a dense row has L ~ N entries, almost all outside
        jj = j[ri, li]
        kvh, kih = (r // (Hi // Hkv))[ri], (r // (Hi // Hki))[ri]
        # Per row and key: sum over the group's heads of dS q_h (dk), P dO_h (dv); dsi q_idx (dk_idx).
        c_dk = (torch.einsum("eg,egd->ed", o["ds"][ri, :, li], o["Q"][ri]) * scale).double()
        c_dv = torch.einsum("eg,egd->ed", o["p"][ri, :, li], o["dO"][ri]).double()
        c_ki = (o["dsi"][ri, li][:, None] * o["Qi"][ri] * (iscale * kl_coef)).double()
        dk.index_put_((jj, kvh), c_dk, accumulate=True)
        dv.index_put_((jj, kvh), c_dv, accumulate=True)
        dki.index_put_((jj, kih), c_ki, accumulate=True)
    return dk, dv, dki


def selectors(indices, cu, blk0, block, block_size):
    """(t, r) of every row whose selection holds kv block `block` (index within its sequence) of the
    sequence starting at token blk0 - block * block_size, and that can see it."""
    s0 = blk0 - block * block_size
    s1 = cu[torch.searchsorted(cu, torch.tensor([s0], device=cu.device), right=True)].item()
    hit = (indices[:, blk0:s1] == block).any(-1)  # (Hi, tokens from the block's start to its sequence end)
    r, t = hit.nonzero(as_tuple=True)
    return t + blk0, r


def check_selection(indices, t, q_idx, k_idx, cu, topk, block_size, scale, rel_tol=1e-5):
    """SPEC 2 for sampled tokens t (all index groups): count, the local block, ascending order, -1
    padding, and no unselected visible block scoring above a selected one (fp32 block scores)."""
    Hi, Hki = q_idx.shape[1], k_idx.shape[1]
    for tt in t.tolist():
        s0 = int(seq_start(cu, torch.tensor([tt], device=cu.device)).item())
        n = tt - s0 + 1
        local = (tt - s0) // block_size
        kk = k_idx[s0:tt + 1].float().repeat_interleave(Hi // Hki, dim=1)  # (n, Hi, Di)
        s = torch.einsum("hd,nhd->hn", q_idx[tt].float(), kk) * scale
        nb = local + 1
        s = torch.nn.functional.pad(s, (0, nb * block_size - n), value=-math.inf)
        m = s.view(Hi, nb, block_size).amax(-1)
        m[:, local] = math.inf
        idx = indices[:, tt].long()  # (Hi, k)
        count = min(topk, nb)
        assert (idx[:, count:] == -1).all(), f"token {tt}: padding is not -1"
        sel_b = idx[:, :count]
        assert ((sel_b >= 0) & (sel_b <= local)).all(), f"token {tt}: block out of range"
        assert (sel_b[:, 1:] > sel_b[:, :-1]).all(), f"token {tt}: not strictly ascending"
        assert (sel_b == local).any(-1).all(), f"token {tt}: local block missing"
        sel = torch.zeros(Hi, nb, dtype=torch.bool, device=idx.device)
        sel.scatter_(1, sel_b, True)
        assert_top_scores(m, sel, torch.ones_like(sel), rel_tol, f"groups of token {tt}")
