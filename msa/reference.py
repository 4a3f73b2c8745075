"""The exact semantics of MSA (docs/SPEC.md sections 2-5) in chunked PyTorch.

This is the CPU path of the public API and the oracle the CUDA kernels are tested against. Every
function works on the packed (thd) layout: tensors are (T, H, D) and `cu_seqlens` (S+1,) splits them
into independent sequences. Work is chunked over query rows, so memory is O(N * chunk), never O(N^2).

Queries may be a suffix of the keys (docs/semantics.md, "Queries that are a suffix of the keys"): with
`cu_seqlens_k`, the query-side tensors (q, q_idx, dout, out, lse, indices) are split by `cu_seqlens` and
the key-side ones (k, v, k_idx) by `cu_seqlens_k`; sequence s's len_q queries are its last len_q key
positions, so query row i sits at position i + len_k - len_q (causal aligned bottom-right, as flash-attn).

Accumulation is fp32 for bf16/fp16 inputs and fp64 for fp64 inputs (the CPU path also accepts fp32 and
fp64, which is what gradcheck needs); `lse`, `lse_idx` and `kl` come back in that accumulation dtype.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F

# Upper bound on the elements of one (heads x rows x keys) score chunk.
_CHUNK_ELEMS = 1 << 22


def acc_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def _sum_dtype(acc: torch.dtype) -> torch.dtype:
    """The dtype of a sum over the reference's query chunks: acc, at least fp32 (tests force acc to bf16 / fp16)."""
    return torch.promote_types(acc, torch.float32)


def seq_bounds(cu_seqlens: torch.Tensor, cu_seqlens_k: torch.Tensor | None = None) -> list[tuple[int, int, int, int]]:
    """(q0, nq, k0, nk) of every sequence with queries: query rows [q0, q0 + nq), key rows [k0, k0 + nk),
    nq <= nk (checked by the callers of the ops); query row q0 + i is at position i + nk - nq."""
    cu = cu_seqlens.tolist()
    ck = cu if cu_seqlens_k is None else cu_seqlens_k.tolist()
    return [(a, b - a, c, d - c) for a, b, c, d in zip(cu[:-1], cu[1:], ck[:-1], ck[1:]) if b > a]


def _chunks(nq: int, heads: int, nk: int):
    rows = max(16, min(512, _CHUNK_ELEMS // max(1, heads * nk)))
    for c0 in range(0, nq, rows):
        yield c0, min(nq, c0 + rows)


def _expand_heads(x: torch.Tensor, heads: int) -> torch.Tensor:
    """(n, hx, d) -> (n, heads, d): head j reads x head j // (heads // hx) (GQA / index-key sharing)."""
    return x if x.shape[1] == heads else x.repeat_interleave(heads // x.shape[1], dim=1)


def _scores(qc: torch.Tensor, ks: torch.Tensor, scale: float) -> torch.Tensor:
    """(c, H, d) x (n, H, d) -> (H, c, n) scaled dot products in the accumulation dtype."""
    return torch.einsum("chd,nhd->hcn", qc, ks) * scale


def _causal(c0: int, c1: int, n: int, off: int = 0) -> torch.Tensor:
    """(c, n) bool: key j visible from query row i (j <= i + off, off = len_k - len_q)."""
    return torch.arange(n)[None, :] <= torch.arange(c0 + off, c1 + off)[:, None]


def _attended(idx_c: torch.Tensor | None, c0: int, c1: int, n: int, block_size: int,
              groups: int, off: int = 0) -> torch.Tensor:
    """(groups, c, n) bool: the attended set T(i, r) (SPEC 3) of query rows [c0, c1) over n keys;
    idx_c None means dense (SPEC 5).

    Selected blocks act as a set: -1, out-of-range and repeated entries select nothing more.
    """
    causal = _causal(c0, c1, n, off)
    if idx_c is None:
        return causal.expand(groups, -1, -1)
    nb = -(-n // block_size)
    sel = torch.zeros(idx_c.shape[0], c1 - c0, nb + 1, dtype=torch.bool)
    idx = idx_c.long()
    sel.scatter_(2, torch.where((idx < 0) | (idx >= nb), nb, idx), True)
    tokens = sel[..., :nb].repeat_interleave(block_size, dim=-1)[..., :n]
    return tokens & causal


def first_occurrence(indices: torch.Tensor) -> torch.Tensor:
    """Bool mask over the last dim of a selection: False where a slot repeats an earlier slot's block
    (a repeated block selects nothing more)."""
    first = torch.ones_like(indices, dtype=torch.bool)
    for j in range(1, indices.shape[-1]):
        first[..., j] = ~(indices[..., :j] == indices[..., j:j + 1]).any(-1)
    return first


def _finite(x: torch.Tensor) -> torch.Tensor:
    """lse of an empty row is -inf; subtracting 0 there keeps exp(-inf - lse) = 0 instead of NaN."""
    return torch.where(torch.isinf(x), torch.zeros_like(x), x)


# ----------------------------------------------------------------------------------------------
# SPEC 2: block selection
# ----------------------------------------------------------------------------------------------
def select_blocks(q_idx, k_idx, cu_seqlens, topk: int, block_size: int, index_scale: float, cu_seqlens_k=None):
    """int32 (Hi, T, topk): per (token, index head) the top blocks of the max-pooled causal index
    scores, own block forced in, ties to the lower block, ascending, -1 padded."""
    T, Hi, _ = q_idx.shape
    acc = acc_dtype(q_idx.dtype)
    out = torch.full((Hi, T, topk), -1, dtype=torch.int32)
    big = torch.iinfo(torch.int64).max
    for q0, nq, k0, n in seq_bounds(cu_seqlens, cu_seqlens_k):
        off = n - nq
        nb = -(-n // block_size)
        ks = _expand_heads(k_idx[k0:k0 + n], Hi).to(acc)
        for c0, c1 in _chunks(nq, Hi, n):
            c = c1 - c0
            s = _scores(q_idx[q0 + c0:q0 + c1].to(acc), ks, index_scale)
            s = s.masked_fill(~_causal(c0, c1, n, off), -math.inf)
            s = F.pad(s, (0, nb * block_size - n), value=-math.inf)
            m = s.view(Hi, c, nb, block_size).amax(-1)  # (Hi, c, nb); later blocks are -inf
            rows = torch.arange(c0 + off, c1 + off)  # positions
            local = rows // block_size
            m[:, torch.arange(c), local] = math.inf
            # Stable descending sort: equal scores keep ascending block order (ties -> lower block).
            order = torch.sort(m, dim=-1, descending=True, stable=True).indices[..., :topk]
            count = torch.clamp(local + 1, max=topk)
            keep = torch.arange(order.shape[-1])[None, :] < count[:, None]
            order = torch.where(keep, order, big).sort(dim=-1).values
            order = torch.where(order == big, -1, order)
            out[:, q0 + c0:q0 + c1, :order.shape[-1]] = order.to(torch.int32)
    return out


# ----------------------------------------------------------------------------------------------
# SPEC 3: sparse attention (dense causal when indices is None)
# ----------------------------------------------------------------------------------------------
def _main_chunk(q, ks, idx, q0, c0, c1, n, off, block_size, scale, lse=None):
    """Masked logits (Hq, c, n) and the attended mask for query rows [c0, c1) of one sequence (its
    queries from row q0, its n keys, position = row + off). With `lse` (Hq, c) also the probabilities."""
    Hq = q.shape[1]
    acc = ks.dtype
    groups = 1 if idx is None else idx.shape[0]
    mask = _attended(None if idx is None else idx[:, q0 + c0:q0 + c1], c0, c1, n, block_size, groups, off)
    mask = mask.repeat_interleave(Hq // groups, dim=0) if groups != Hq else mask
    s = _scores(q[q0 + c0:q0 + c1].to(acc), ks, scale).masked_fill(~mask, -math.inf)
    if lse is None:
        return s, mask
    p = torch.exp(s - _finite(lse)[..., None])
    return s, mask, p


def sparse_fwd(q, k, v, indices, cu_seqlens, block_size: int, softmax_scale: float, cu_seqlens_k=None):
    """out (T, Hq, D) in q's dtype and lse (Hq, T). `indices` None = dense causal (warmup).
    A row whose attended set is empty (only possible with hand-made indices) gets out 0, lse -inf."""
    T, Hq, D = q.shape
    acc = acc_dtype(q.dtype)
    out = torch.empty_like(q)
    lse = torch.empty(Hq, T, dtype=acc)
    for q0, nq, k0, n in seq_bounds(cu_seqlens, cu_seqlens_k):
        ks = _expand_heads(k[k0:k0 + n], Hq).to(acc)
        vs = _expand_heads(v[k0:k0 + n], Hq).to(acc)
        for c0, c1 in _chunks(nq, Hq, n):
            s, _ = _main_chunk(q, ks, indices, q0, c0, c1, n, n - nq, block_size, softmax_scale)
            l = torch.logsumexp(s, dim=-1)
            p = torch.exp(s - _finite(l)[..., None])
            out[q0 + c0:q0 + c1] = torch.einsum("hcn,nhd->chd", p, vs).to(q.dtype)
            lse[:, q0 + c0:q0 + c1] = l
    return out, lse


def sparse_bwd(dout, q, k, v, lse, indices, cu_seqlens, block_size: int, softmax_scale: float, cu_seqlens_k=None):
    """dq, dk, dv of out (SPEC 3) for the incoming dout, from the saved lse."""
    T, Hq, D = q.shape
    Hkv = k.shape[1]
    acc = acc_dtype(q.dtype)
    dq = torch.zeros(T, Hq, D, dtype=acc)
    dk = torch.zeros(k.shape[0], Hkv, D, dtype=acc)
    dv = torch.zeros(k.shape[0], Hkv, D, dtype=acc)
    for q0, nq, k0, n in seq_bounds(cu_seqlens, cu_seqlens_k):
        ks = _expand_heads(k[k0:k0 + n], Hq).to(acc)
        vs = _expand_heads(v[k0:k0 + n], Hq).to(acc)
        # Summed over query chunks in fp32 at least: the chunks are the reference's own split (a plain
        # PyTorch backward makes one product per key, rounded once), not a rounding step of the model.
        dk_h = torch.zeros(n, Hq, D, dtype=_sum_dtype(acc))
        dv_h = torch.zeros(n, Hq, D, dtype=_sum_dtype(acc))
        for c0, c1 in _chunks(nq, Hq, n):
            _, _, p = _main_chunk(q, ks, indices, q0, c0, c1, n, n - nq, block_size, softmax_scale,
                                  lse[:, q0 + c0:q0 + c1])
            do = dout[q0 + c0:q0 + c1].to(acc)
            dv_h += torch.einsum("hcn,chd->nhd", p, do)
            dp = torch.einsum("chd,nhd->hcn", do, vs)
            ds = p * (dp - (p * dp).sum(-1, keepdim=True))
            dq[q0 + c0:q0 + c1] = softmax_scale * torch.einsum("hcn,nhd->chd", ds, ks)
            dk_h += softmax_scale * torch.einsum("hcn,chd->nhd", ds, q[q0 + c0:q0 + c1].to(acc))
        dk[k0:k0 + n] = dk_h.view(n, Hkv, Hq // Hkv, D).sum(2)
        dv[k0:k0 + n] = dv_h.view(n, Hkv, Hq // Hkv, D).sum(2)
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


# ----------------------------------------------------------------------------------------------
# SPEC 4: KL alignment loss
# ----------------------------------------------------------------------------------------------
def _kl_chunk(q, ks, lse, q_idx, kis, indices, q0, c0, c1, n, off, block_size, scale, index_scale):
    """For query rows [c0, c1): log P (group-averaged main distribution), index logits, and the mask,
    all (Hi, c, n). log P = logsumexp over the group's heads of (s - lse) - log(G): no underflow."""
    Hq, Hi = q.shape[1], q_idx.shape[1]
    G = Hq // Hi
    rows = slice(q0 + c0, q0 + c1)
    s, _ = _main_chunk(q, ks, indices, q0, c0, c1, n, off, block_size, scale)
    logp = s - _finite(lse[:, rows])[..., None]
    logP = torch.logsumexp(logp.view(Hi, G, c1 - c0, n), dim=1) - math.log(G)
    mask = _attended(None if indices is None else indices[:, rows], c0, c1, n, block_size, Hi, off)
    s_idx = _scores(q_idx[rows].to(ks.dtype), kis, index_scale).masked_fill(~mask, -math.inf)
    return logP, s_idx, mask


def index_kl_rows(q, k, lse, q_idx, k_idx, indices, cu_seqlens, block_size: int, softmax_scale: float,
                  index_scale: float, cu_seqlens_k=None):
    """(kl_rows, lse_idx), both (Hi, T): each row's KL(P || Pidx) over its attended set (SPEC 4; the kl is
    their mean) and the index log-sum-exp over the same set."""
    T, Hq, _ = q.shape
    Hi = q_idx.shape[1]
    acc = acc_dtype(q.dtype)
    rows = torch.zeros(Hi, T, dtype=acc)
    lse_idx = torch.empty(Hi, T, dtype=acc)
    for q0, nq, k0, n in seq_bounds(cu_seqlens, cu_seqlens_k):
        ks = _expand_heads(k[k0:k0 + n], Hq).to(acc)
        kis = _expand_heads(k_idx[k0:k0 + n], Hi).to(acc)
        for c0, c1 in _chunks(nq, Hq, n):
            logP, s_idx, mask = _kl_chunk(q, ks, lse, q_idx, kis, indices, q0, c0, c1, n, n - nq, block_size,
                                          softmax_scale, index_scale)
            l_idx = torch.logsumexp(s_idx, dim=-1)
            log_pidx = s_idx - _finite(l_idx)[..., None]
            term = torch.exp(logP) * (logP - log_pidx)
            rows[:, q0 + c0:q0 + c1] = torch.where(mask, term, torch.zeros_like(term)).sum(-1)
            lse_idx[:, q0 + c0:q0 + c1] = l_idx
    return rows, lse_idx


def index_kl(q, k, lse, q_idx, k_idx, indices, cu_seqlens, block_size: int, softmax_scale: float,
             index_scale: float, cu_seqlens_k=None):
    """(kl, lse_idx): the exact KL(P || Pidx) averaged over rows = T * Hi (SPEC 4), and the index
    log-sum-exp (Hi, T) over the attended set."""
    rows, lse_idx = index_kl_rows(q, k, lse, q_idx, k_idx, indices, cu_seqlens, block_size, softmax_scale,
                                  index_scale, cu_seqlens_k)
    return rows.sum() / rows.numel(), lse_idx


def index_kl_bwd(dkl, q, k, lse, q_idx, k_idx, lse_idx, indices, cu_seqlens, block_size: int,
                 softmax_scale: float, index_scale: float, out_dtype=None, cu_seqlens_k=None):
    """dq_idx, dk_idx from dS_idx = dkl / rows * (Pidx - P) on the attended set (SPEC 4), in q_idx's
    dtype or `out_dtype`."""
    T, Hq, _ = q.shape
    Hi, Di = q_idx.shape[1], q_idx.shape[2]
    Hki = k_idx.shape[1]
    acc = acc_dtype(q.dtype)
    coef = dkl.to(acc) / (T * Hi)
    dq_idx = torch.zeros(T, Hi, Di, dtype=acc)
    dk_idx = torch.zeros(k_idx.shape[0], Hki, Di, dtype=acc)
    for q0, nq, k0, n in seq_bounds(cu_seqlens, cu_seqlens_k):
        ks = _expand_heads(k[k0:k0 + n], Hq).to(acc)
        kis = _expand_heads(k_idx[k0:k0 + n], Hi).to(acc)
        dk_h = torch.zeros(n, Hi, Di, dtype=_sum_dtype(acc))  # as in sparse_bwd
        for c0, c1 in _chunks(nq, Hq, n):
            rows = slice(q0 + c0, q0 + c1)
            logP, s_idx, mask = _kl_chunk(q, ks, lse, q_idx, kis, indices, q0, c0, c1, n, n - nq, block_size,
                                          softmax_scale, index_scale)
            pidx = torch.exp(s_idx - _finite(lse_idx[:, rows])[..., None])
            ds = torch.where(mask, pidx - torch.exp(logP), torch.zeros_like(pidx)) * coef
            dq_idx[rows] = index_scale * torch.einsum("hcn,nhd->chd", ds, kis)
            dk_h += index_scale * torch.einsum("hcn,chd->nhd", ds, q_idx[rows].to(acc))
        dk_idx[k0:k0 + n] = dk_h.view(n, Hki, Hi // Hki, Di).sum(2)
    return dq_idx.to(out_dtype or q_idx.dtype), dk_idx.to(out_dtype or k_idx.dtype)


# ----------------------------------------------------------------------------------------------
# SPEC 2-5 together
# ----------------------------------------------------------------------------------------------
def msa_fwd(q, k, v, q_idx, k_idx, cu_seqlens, topk, block_size, softmax_scale, index_scale, warmup,
            return_indices, cu_seqlens_k=None, sel=None):
    """(out, kl, indices, lse, lse_idx, kl_rows). Warmup: dense causal main branch and KL over the full
    causal set; the selection is skipped (indices (Hi, T, 0)) unless return_indices. sel: the selection's own
    (q_idx, k_idx) (index_dtype's e4m3 copies), None: q_idx, k_idx."""
    T, Hi = q_idx.shape[0], q_idx.shape[1]
    if warmup and not return_indices:
        indices = torch.empty(Hi, T, 0, dtype=torch.int32)
    else:
        sq, sk = (q_idx, k_idx) if sel is None else sel
        indices = select_blocks(sq, sk, cu_seqlens, topk, block_size, index_scale, cu_seqlens_k)
    attend = None if warmup else indices
    out, lse = sparse_fwd(q, k, v, attend, cu_seqlens, block_size, softmax_scale, cu_seqlens_k)
    kl_rows, lse_idx = index_kl_rows(q, k, lse, q_idx, k_idx, attend, cu_seqlens, block_size, softmax_scale,
                                     index_scale, cu_seqlens_k)
    return out, kl_rows.sum() / kl_rows.numel(), indices, lse, lse_idx, kl_rows


def reverse_index(indices, cu_seqlens, block_size: int):
    """(offsets, rows, block_offsets): CSR over keys r * max_blocks + global block of the tokens that
    selected the block, tokens ascending; max_blocks = T // block_size + S bounds the global blocks."""
    Hi, T, k = indices.shape
    cu = cu_seqlens.tolist()
    S = len(cu) - 1
    max_blocks = T // block_size + S
    nblocks = [-(-(b - a) // block_size) for a, b in zip(cu[:-1], cu[1:])]
    block_offsets = torch.tensor([0] + nblocks, dtype=torch.int64).cumsum(0)
    seq = torch.bucketize(torch.arange(T), torch.tensor(cu[1:]), right=True)  # sequence of each token
    t = torch.arange(T)
    local = (t - torch.tensor(cu)[seq]) // block_size
    idx = indices.long()
    valid = (idx >= 0) & (idx <= local[None, :, None]) & first_occurrence(idx)
    key = torch.arange(Hi)[:, None, None] * max_blocks + block_offsets[seq][None, :, None] + idx
    key = torch.where(valid, key, Hi * max_blocks)
    tok = t[None, :, None].expand(Hi, T, k)
    order = torch.sort(key.flatten(), stable=True).indices
    rows = tok.flatten()[order].to(torch.int32)
    counts = torch.bincount(key.flatten(), minlength=Hi * max_blocks + 1)[:Hi * max_blocks]
    offsets = torch.cat([torch.zeros(1, dtype=torch.int64), counts.cumsum(0)]).to(torch.int32)
    return offsets, rows, block_offsets.to(torch.int32)
