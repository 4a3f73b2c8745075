"""SPEC 2 validity of a selection against fp32 block scores, vectorized (CPU or GPU torch)."""
import math

import torch


def block_scores(q_idx, k_idx, s0, s1, block_size, scale, chunk=1024):
    """(Hi, n, nb) fp32 max-pooled causal index scores of one sequence; the local block is +inf and
    later blocks -inf (SPEC 2)."""
    n = s1 - s0
    Hi, Hki = q_idx.shape[1], k_idx.shape[1]
    nb = -(-n // block_size)
    k = k_idx[s0:s1].float().repeat_interleave(Hi // Hki, dim=1)
    out = torch.empty(Hi, n, nb, device=q_idx.device)
    cols = torch.arange(nb * block_size, device=q_idx.device)
    for c0 in range(0, n, chunk):
        c1 = min(n, c0 + chunk)
        s = torch.einsum("chd,nhd->hcn", q_idx[s0 + c0:s0 + c1].float(), k) * scale
        s = torch.nn.functional.pad(s, (0, nb * block_size - n), value=-math.inf)
        rows = torch.arange(c0, c1, device=q_idx.device)
        s = s.masked_fill(cols[None, None, :] > rows[None, :, None], -math.inf)
        m = s.view(Hi, c1 - c0, nb, block_size).amax(-1)
        m[:, torch.arange(c1 - c0), rows // block_size] = math.inf
        out[:, c0:c1] = m
    return out


def assert_valid_topk(indices, q_idx, k_idx, cu_seqlens, topk, block_size, scale, rel_tol=1e-5):
    """indices (Hi, T, topk) packed. Count, local block, ascending, -1 padding, and no unselected block
    scoring above a selected one beyond rel_tol of the score magnitude."""
    cu = cu_seqlens.tolist()
    for s0, s1 in zip(cu[:-1], cu[1:]):
        if s1 == s0:
            continue
        n = s1 - s0
        m = block_scores(q_idx, k_idx, s0, s1, block_size, scale)
        nb = m.shape[-1]
        idx = indices[:, s0:s1].long()
        dev = idx.device
        local = torch.arange(n, device=dev) // block_size
        count = torch.clamp(local + 1, max=topk)
        used = torch.arange(topk, device=dev)[None, :] < count[:, None]  # (n, topk)
        assert (idx[:, ~used] == -1).all(), "padding is not -1"
        v = torch.where(used[None], idx, torch.zeros_like(idx))
        assert ((v >= 0) & (v <= local[None, :, None])).all(), "block out of range"
        if topk > 1:
            both = used[None, :, 1:].expand_as(v[..., 1:])
            assert (v[..., 1:] > v[..., :-1])[both].all(), "not strictly ascending"
        assert (v == local[None, :, None]).any(-1).all(), "local block missing"
        sel = torch.zeros(idx.shape[0], n, nb + 1, dtype=torch.bool, device=dev)
        sel.scatter_(2, torch.where(used[None], v, nb), True)  # unused slots land in the extra column
        sel = sel[..., :nb]
        assert (sel.sum(-1) == count[None]).all(), "wrong count"
        visible = torch.arange(nb, device=dev)[None, None, :] <= local[None, :, None]
        assert_top_scores(m, sel, visible, rel_tol, "rows")


def assert_top_scores(m, sel, visible, rel_tol, what):
    """No visible unselected block scores above a selected one beyond rel_tol of the score magnitude
    (SPEC 2: fp32 accumulation order may swap near-ties). m, sel, visible: (..., nb)."""
    worst_sel = torch.where(sel, m, math.inf).amin(-1)
    best_rest = torch.where(~sel & visible, m, -math.inf).amax(-1)
    mag = torch.maximum(torch.where(torch.isfinite(worst_sel), worst_sel.abs(), 0), best_rest.abs()
                        .nan_to_num(0, 0, 0)).clamp(min=1.0)
    bad = best_rest > worst_sel + rel_tol * mag
    assert not bad.any(), f"{int(bad.sum())} {what} select a block scoring below an unselected one"
