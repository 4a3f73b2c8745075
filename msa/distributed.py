"""Context parallelism: MSA over a sequence sharded across the ranks of a torch.distributed group.

Every rank holds a shard of the sequence dimension of all five tensors, (B, N / P, H, D), in one of two
layouts (the one `shard_sequence` cuts and `gather_sequence` undoes):

- "zigzag" (default): the sequence in 2P equal chunks, rank r holding chunks r and 2P-1-r, so every rank
  has the same share of the causal triangle;
- "contiguous": rank r holds chunk r of P.

`msa_attention_cp` moves the data once before the attention and once after it, with all-to-alls on the
given group (NCCL on GPUs, gloo on CPUs) and nothing else: the P ranks form Ph head shards times Pq
query shards (P = Ph * Pq).

- Head-parallel (Ulysses, Ph = P, up to Hi ranks): a rank gets the whole sequence of Hi / P index groups,
  their query heads, the kv and index-key heads they read (replicated where groups share one), and
  runs the ordinary (square) call.
- Query-split (Pq > 1, needed beyond Hi ranks): the ranks of one query shard hold positions that form
  one or two ranges (with zigzag: chunks c and 2Pq-1-c of 2Pq); within a head shard each of them runs
  its ranges as queries that are a suffix of the keys [0, end) (msa_attention_varlen with
  cu_seqlens_k). Selection, the KL rows and dk / dv / dk_idx over the whole key range are then exactly
  the single-GPU ones.

Everything is differentiable: the all-to-alls are autograd functions whose backward sends the gradients
back the same way (adding where a head was replicated). The KL returned on every rank is the mean over
all rows of all ranks; its backward sums what every rank sends into it (as
torch.distributed.nn.functional.all_reduce): gradients are those of the sum over ranks of each rank's
loss. A rank's out is its own shard, so `loss_r = f(out_r) + lam * kl / P` on every rank, summed over
ranks, is `f(out) + lam * kl` of the single-GPU call (or `+ lam * kl` as is where the per-rank gradients
are averaged over the group, as DDP / FSDP do).
"""
from __future__ import annotations

import functools
import math

import torch
import torch.distributed as dist
# Imported here, at `import msa` (before init_process_group in any script): its functions' default argument
# group=group.WORLD is evaluated at import, and torch imports it lazily (the first torch.library op call imports
# torch._dynamo, which imports FSDP, which imports it). Imported after init, those defaults hold the default
# process group past destroy_process_group; its gloo worker threads then live into the interpreter's exit and one
# that drops the last reference to a Python-owned tensor there aborts the process (SIGABRT, "terminate called
# without an active exception": tests/test_distributed.py's flaky CI failure).
import torch.distributed.nn.functional  # noqa: F401

from .interface import _check_heads, _index_dtype, msa_attention, msa_attention_varlen

LAYOUTS = ("zigzag", "contiguous")
MODES = ("auto", "head", "query")

__all__ = ["shard_sequence", "gather_sequence", "shard_positions", "msa_attention_cp", "LAYOUTS", "MODES"]


# ----------------------------------------------------------------------------------------------
# Layouts: which positions of the full sequence each rank holds, in its local row order
# ----------------------------------------------------------------------------------------------
def _world(group):
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError("msa.distributed: torch.distributed is not initialized (call "
                           "torch.distributed.init_process_group first)")
    return dist.get_world_size(group), dist.get_rank(group)


def _check_layout(layout, n_local):
    if layout not in LAYOUTS:
        raise ValueError(f"layout: expected one of {LAYOUTS}, got {layout!r}")
    if layout == "zigzag" and n_local % 2:
        raise ValueError(f"layout: 'zigzag' needs an even number of rows per rank (two chunks of N / 2P), got "
                         f"{n_local}; pad N to a multiple of 2P or use layout='contiguous'")


def _owned(layout, N, P, rank):
    """The positions rank `rank` holds, as ascending (start, end) ranges (its local rows in that order).
    Position sets stay ranges throughout: plans are built from range overlaps, never from N-long sets."""
    if layout == "contiguous":
        c = N // P
        return ((rank * c, (rank + 1) * c),)
    c = N // (2 * P)
    return _merge([(rank * c, (rank + 1) * c), ((2 * P - 1 - rank) * c, (2 * P - rank) * c)])


def _merge(ranges):
    """Ascending, disjoint (start, end) ranges -> the same set with adjacent ranges joined (empty ones dropped)."""
    out = []
    for a, e in sorted(r for r in ranges if r[1] > r[0]):
        if out and out[-1][1] == a:
            out[-1] = (out[-1][0], e)
        else:
            out.append((a, e))
    return tuple(out)


def _count(ranges):
    return sum(e - a for a, e in ranges)


def _positions(ranges, device=None):
    if not ranges:
        return torch.zeros(0, dtype=torch.int64, device=device)
    return torch.cat([torch.arange(a, e, device=device) for a, e in ranges])


def _rows_of(ranges, sub):
    """Indices, in the concatenated rows of `ranges`, of the positions of `ranges` that `sub` holds, ascending."""
    out, base = [], 0
    for a, e in ranges:
        for s0, s1 in sub:
            lo, hi = max(a, s0), min(e, s1)
            if lo < hi:
                out.append(torch.arange(base + lo - a, base + hi - a))
        base += e - a
    return torch.cat(out) if out else torch.zeros(0, dtype=torch.int64)


# ----------------------------------------------------------------------------------------------
# The one communication primitive: a differentiable all-to-all of (rows x heads) pieces
# ----------------------------------------------------------------------------------------------
class _Exchange(torch.autograd.Function):
    """x (B, n, H, D) -> (B, out_rows, out_heads, D). `plan[p]` = (send_rows, send_heads, recv_rows,
    recv_heads): what this rank sends to rank p (x[:, send_rows][:, :, send_heads]) and where the piece
    from p lands. Receivers' pieces do not overlap; a (row, head) sent to several ranks gets the sum of
    their gradients back."""

    @staticmethod
    def forward(ctx, x, plan, group, out_rows, out_heads):
        B, D = x.shape[0], x.shape[-1]
        ctx.plan, ctx.group, ctx.in_shape = plan, group, x.shape
        send = [x[:, sr[:, None], sh[None, :]].reshape(-1) for sr, sh, _, _ in plan]
        recv_sizes = [B * rr.numel() * rh.numel() * D for _, _, rr, rh in plan]
        out = x.new_zeros(B, out_rows, out_heads, D)
        recv = _all_to_all(torch.cat(send), [s.numel() for s in send], recv_sizes, group)
        for (_, _, rr, rh), piece in zip(plan, recv):
            out[:, rr[:, None], rh[None, :]] = piece.view(B, rr.numel(), rh.numel(), D)
        return out

    @staticmethod
    def backward(ctx, g):
        plan, group = ctx.plan, ctx.group
        B, D = g.shape[0], g.shape[-1]
        g = g.contiguous()
        send = [g[:, rr[:, None], rh[None, :]].reshape(-1) for _, _, rr, rh in plan]
        recv_sizes = [B * sr.numel() * sh.numel() * D for sr, sh, _, _ in plan]
        gx = g.new_zeros(ctx.in_shape)
        recv = _all_to_all(torch.cat(send), [s.numel() for s in send], recv_sizes, group)
        for (sr, sh, _, _), piece in zip(plan, recv):
            gx[:, sr[:, None], sh[None, :]] += piece.view(B, sr.numel(), sh.numel(), D)
        return gx, None, None, None, None


def _all_to_all(send, send_sizes, recv_sizes, group):
    recv = send.new_empty(sum(recv_sizes))
    dist.all_to_all_single(recv, send, recv_sizes, send_sizes, group=group)
    return recv.split(recv_sizes)


class _AllReduceSum(torch.autograd.Function):
    """Sum over the group; the backward sums the gradients of every rank (torch.distributed.nn's rule)."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        y = x.clone()
        dist.all_reduce(y, group=group)
        return y

    @staticmethod
    def backward(ctx, g):
        g = g.clone()
        dist.all_reduce(g, group=ctx.group)
        return g, None


def _route(x, group, rank, src_pos, dst_pos, send_heads, recv_heads, out_heads):
    """Moves rows between two distributions of positions over the ranks: src_pos[p] / dst_pos[p] are the
    positions rank p holds before / after, as ascending ranges. This rank sends rank p the heads
    send_heads[p] of x; the heads it receives from rank p land at recv_heads[p] of its out_heads."""
    plan = _plan(tuple(src_pos), tuple(dst_pos), (*send_heads, *recv_heads), rank, x.device)
    return _Exchange.apply(x, plan, group, _count(dst_pos[rank]), out_heads)


@functools.lru_cache(maxsize=64)
def _plan(src_pos, dst_pos, heads, rank, device):
    """The index tensors of a route (cached: every layer of a model routes the same plan)."""
    P = len(src_pos)
    send_heads, recv_heads = heads[:P], heads[P:]

    def heads_on(hs):
        return torch.tensor(hs, dtype=torch.int64, device=device)
    return [(_rows_of(src_pos[rank], dst_pos[p]).to(device), heads_on(send_heads[p]),
             _rows_of(dst_pos[rank], src_pos[p]).to(device), heads_on(recv_heads[p])) for p in range(P)]


def _scatter_heads(x, group, rank, src_pos, dst_pos, heads_of):
    """Owners -> compute ranks: rank p gets the heads heads_of[p] (global indices) at positions dst_pos[p]."""
    mine = tuple(range(len(heads_of[rank])))
    return _route(x, group, rank, src_pos, dst_pos, heads_of, [mine] * len(heads_of), len(mine))


# ----------------------------------------------------------------------------------------------
# Public: shard / gather
# ----------------------------------------------------------------------------------------------
def shard_sequence(x, group=None, *, layout="zigzag", dim=1):
    """This rank's shard of a full tensor (dim `dim` is the sequence, N divisible by P, or by 2P for
    zigzag), in the layout `msa_attention_cp` expects. A slice: gradients flow back into x."""
    P, rank = _world(group)
    N = x.shape[dim]
    if N % (2 * P if layout == "zigzag" else P):
        raise ValueError(f"x: expected a sequence length divisible by {2 * P if layout == 'zigzag' else P} "
                         f"({layout} layout over {P} ranks), got {N}")
    _check_layout(layout, N // P)
    return x.index_select(dim, _positions(_owned(layout, N, P, rank), x.device))


def shard_positions(n_local, group=None, *, layout="zigzag", device=None):
    """int64 (n_local,): the positions in the full sequence of this rank's rows (rotary embeddings of a
    sharded sequence take these, not 0..n_local-1)."""
    P, rank = _world(group)
    _check_layout(layout, n_local)
    return _positions(_owned(layout, n_local * P, P, rank), device)


def gather_sequence(y, group=None, *, layout="zigzag", dim=1):
    """The full tensor from every rank's shard (the inverse of shard_sequence), differentiable: the
    gradient of a rank's shard is the sum of every rank's gradient of those positions."""
    P, rank = _world(group)
    n = y.shape[dim]
    _check_layout(layout, n)
    N = n * P
    x = y.movedim(dim, 1)
    lead, rest = x.shape[0], x.shape[2:]
    x4 = x.reshape(lead, n, 1, math.prod(rest))
    one = [(0,)] * P
    full = _route(x4, group, rank, [_owned(layout, N, P, p) for p in range(P)], [((0, N),)] * P, one, one, 1)
    return full.reshape(lead, N, *rest).movedim(1, dim)


# ----------------------------------------------------------------------------------------------
# Public: the attention
# ----------------------------------------------------------------------------------------------
def _head_range(shard, shards, users, heads):
    """Heads of a tensor with `heads` heads read by user heads [shard * users / shards, +users / shards)
    (query heads of kv heads, index groups of index-key heads), as a tuple of head indices (they key the
    plan cache)."""
    per = users // shards
    ratio = users // heads  # users per head
    first, last = shard * per // ratio, ((shard + 1) * per - 1) // ratio
    return tuple(range(first, last + 1))


def _head_shards(P, mode, hq, hkv, hi, hki):
    def fits(ph):
        """Index groups split evenly; kv (index-key) heads split evenly, or each shard's query heads (index
        groups) read one of them."""
        if hi % ph:
            return False
        kv = hkv % ph == 0 or (ph % hkv == 0 and (hq // hkv) % (hq // ph) == 0)
        ki = hki % ph == 0 or (ph % hki == 0 and (hi // hki) % (hi // ph) == 0)
        return kv and ki
    if mode not in MODES:
        raise ValueError(f"mode: expected one of {MODES}, got {mode!r}")
    if mode == "query":
        return 1
    if mode == "head":
        if not fits(P):
            raise ValueError(f"mode: 'head' needs the {P} ranks to split the Hi = {hi} index groups (and the "
                             f"Hkv = {hkv}, Hki = {hki} heads they read) evenly; use mode='auto' or 'query'")
        return P
    return max(ph for ph in range(1, P + 1) if P % ph == 0 and fits(ph))


def _check_ranks_agree(group, q, k, q_idx, k_idx, layout, mode, topk, block_size, warmup, index_dtype=None):
    """One all-reduce of the call's signature (shapes, dtype, options): ranks that disagree would route
    different plans (a hang or a wrong answer); here every rank raises the same ValueError instead."""
    dtypes = (torch.bfloat16, torch.float16, torch.float32, torch.float64)
    sig = [*q.shape, *k.shape, *q_idx.shape, *k_idx.shape, LAYOUTS.index(layout) if layout in LAYOUTS else -1,
           MODES.index(mode) if mode in MODES else -1, int(topk), int(block_size), int(bool(warmup)),
           dtypes.index(q.dtype) if q.dtype in dtypes else -1, int(index_dtype is not None)]
    dev = q.device if dist.get_backend(group) == "nccl" else torch.device("cpu")
    x = torch.tensor(sig + [-v for v in sig], dtype=torch.int64, device=dev)
    dist.all_reduce(x, op=dist.ReduceOp.MAX, group=group)
    hi, lo = x[:len(sig)].tolist(), [-v for v in x[len(sig):].tolist()]
    if hi != lo:
        names = ["q"] * 4 + ["k"] * 4 + ["q_idx"] * 4 + ["k_idx"] * 4 + ["layout", "mode", "topk", "block_size",
                                                                          "warmup", "dtype", "index_dtype"]
        bad = sorted({n for n, a, b in zip(names, lo, hi) if a != b})
        raise ValueError(f"{', '.join(bad)}: expected the same on every rank of the group (shapes, dtype and options "
                         f"of msa_attention_cp), got different values on different ranks")


def msa_attention_cp(q, k, v, q_idx, k_idx, *, group=None, layout="zigzag", mode="auto", topk=16, block_size=128,
                     softmax_scale=None, index_scale=None, warmup=False, deterministic=None, check_ranks=True,
                     index_dtype=None):
    """`msa_attention` over a sequence sharded across the ranks of `group` (module docstring).

    q (B, N/P, Hq, D), k, v (B, N/P, Hkv, D), q_idx (B, N/P, Hi, Di), k_idx (B, N/P, Hki, Di): this rank's
    shard in `layout`, every rank the same shapes. mode: "head" (Ph = P), "query" (Ph = 1) or "auto" (the
    most head shards the heads allow). Returns (out, kl): out (B, N/P, Hq, D) this rank's shard, kl the
    mean over all B * N * Hi rows (the same value on every rank). Every rank must use out and kl the same
    way in its loss (the backward runs collectives too). check_ranks: first compare the shapes and options
    of every rank (one small all-reduce and a read back; pass False inside CUDA graphs or compiled steps).
    index_dtype: as in `msa_attention`. Each rank scales the keys it holds (a prefix of each sequence) by their own
    power of two: values within e4m3's normal range of it round as on one GPU, smaller ones (subnormal, about 2^-10
    of the prefix's largest) may round differently, so a few near-tie selections may differ from one GPU's.
    """
    _index_dtype(index_dtype)
    P, rank = _world(group)
    for name, x in (("k", k), ("v", v), ("q_idx", q_idx), ("k_idx", k_idx)):
        if not isinstance(x, torch.Tensor) or x.dim() != 4 or x.shape[:2] != q.shape[:2]:
            raise ValueError(f"{name}: expected a (B, N/P, H, D) shard with the leading dims {tuple(q.shape[:2])} "
                             f"of q, got {tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__}")
    if q.dim() != 4:
        raise ValueError(f"q: expected a (B, N/P, Hq, D) shard, got shape {tuple(q.shape)}")
    if check_ranks:
        _check_ranks_agree(group, q, k, q_idx, k_idx, layout, mode, topk, block_size, warmup, index_dtype)
    B, n = q.shape[:2]
    _check_layout(layout, n)
    N = n * P
    hq, hkv, hi, hki = q.shape[2], k.shape[2], q_idx.shape[2], k_idx.shape[2]
    _check_heads(hq, hkv, hi, hki)
    ph = _head_shards(P, mode, hq, hkv, hi, hki)
    pq = P // ph
    owned = [_owned(layout, N, P, p) for p in range(P)]
    # rank p: query shard p // ph, head shard p % ph; a query shard's positions are its ranks' positions
    col = [_merge([r for j in range(ph) for r in owned[c * ph + j]]) for c in range(pq)]
    q_pos = [col[p // ph] for p in range(P)]
    k_pos = [((0, col[p // ph][-1][1]),) for p in range(P)]

    def heads(users, count):
        return [_head_range(p % ph, ph, users, count) for p in range(P)]

    hq_of, hkv_of, hi_of, hki_of = heads(hq, hq), heads(hq, hkv), heads(hi, hi), heads(hi, hki)
    ql = _scatter_heads(q, group, rank, owned, q_pos, hq_of)
    qil = _scatter_heads(q_idx, group, rank, owned, q_pos, hi_of)
    kl_ = _scatter_heads(k, group, rank, owned, k_pos, hkv_of)
    vl = _scatter_heads(v, group, rank, owned, k_pos, hkv_of)
    kil = _scatter_heads(k_idx, group, rank, owned, k_pos, hki_of)

    kw = dict(topk=topk, block_size=block_size, softmax_scale=softmax_scale, index_scale=index_scale, warmup=warmup,
              deterministic=deterministic, index_dtype=index_dtype)
    runs = q_pos[rank]
    if len(runs) == 1:  # one range [a, e): the square call (a = 0) or its suffix form
        out, kl_local = msa_attention(ql, kl_, vl, qil, kil, **kw)
    else:
        lens = [e - a for a, e in runs]
        ks = [e for _, e in runs]
        cu_q = _offsets(tuple(lens * B), q.device)
        cu_k = _offsets(tuple(ks * B), q.device)
        flat_q = [t.reshape(B * t.shape[1], *t.shape[2:]) for t in (ql, qil)]
        flat_k = [torch.cat([t[b, :e] for b in range(B) for e in ks]) for t in (kl_, vl, kil)]
        o, kl_local = msa_attention_varlen(flat_q[0], flat_k[0], flat_k[1], flat_q[1], flat_k[2], cu_q, max(lens),
                                           cu_seqlens_k=cu_k, max_seqlen_k=max(ks), **kw)
        out = o.view(B, -1, *o.shape[1:])
    # back to the owners: each rank's rows of its query shard, the heads of rank p placed at hq_of[p]
    local = [tuple(range(len(hq_of[rank])))] * P
    out = _route(out, group, rank, q_pos, owned, local, hq_of, hq)
    rows_local = B * _count(q_pos[rank]) * len(hi_of[rank])
    kl = _AllReduceSum.apply(kl_local * (rows_local / (B * N * hi)), group)
    return out, kl


@functools.lru_cache(maxsize=64)
def _offsets(lengths, device):
    """cu_seqlens of `lengths` (a tuple) on `device`, one tensor per value: every layer and step passes the same
    one, so the ops' check of its values reads it back once (a new tensor per call would be read every call)."""
    return torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist(), dtype=torch.int32, device=device)
