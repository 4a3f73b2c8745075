"""Index-quality metrics: how much of the main attention a block selection retrieves.

Layouts and heads are msa's (docs/SPEC.md section 1):

- batched: q (B, N, Hq, D), k (B, N, Hkv, D), indices int32 (B, Hi, N, topk);
- packed: q (T, Hq, D), k (T, Hkv, D), indices int32 (Hi, T, topk), with `cu_seqlens` int32 (S+1,).
  Every sequence is independent and its blocks start at its own first token.

`indices` is a selection as `msa.select_blocks` / `msa.msa_attention(..., return_indices=True)` return it
(ascending block ids, -1 in unused slots; any other selection works too). Query head h reads kv head
h // (Hq/Hkv) and belongs to index group r = h // (Hq/Hi). For query row i (0-based inside its sequence):

- main attention: the dense causal softmax over all keys j <= i of its sequence of
  softmax_scale * <q[i, h], k[j, kvh(h)]> (softmax_scale defaults to 1/sqrt(D)); computed in fp32
  (fp64 for fp64 inputs), whatever the input dtype;
- block mass A[i, h, b] = that softmax summed over the tokens of block b (b = j // block_size), and
  Abar[i, r, b] = the mean of A over the Hq/Hi heads of group r;
- I*(i, r) = the min(topk, i//block_size + 1) visible blocks (b <= i//block_size) with the largest Abar
  (topk = indices.shape[-1]; no block is forced in; ties go to the lower block index);
- Î(i, r) = the valid entries of indices[i, r]: >= 0 and <= i//block_size, repeats counted once;
- block recall(i, r) = |I* ∩ Î| / |I*|;
- score recall(i, r) = sum_{b in Î} Abar[i, r, b] / sum_{b in I*} Abar[i, r, b]: the main attention mass
  of the retrieved blocks over that of the main branch's own top-k blocks (<= 1 up to rounding when
  |Î| <= topk, which holds for any valid selection).

The returned values are means over all (row, group) pairs used, fp32 0-dim tensors on q's device.
Which rows are used (`select_rows`):

- skip_trivial=True (default): only rows with more visible blocks than topk (i//block_size + 1 > topk),
  where the selection is a real choice; the other rows are trivially perfect for msa's selection.
  With no qualifying row the values are NaN and rows = 0.
- rows=None: every (qualifying) row of every sequence / batch element.
- rows=n (int): n rows evenly spaced over all qualifying rows of the whole token axis (batched: the
  B*N rows, batch element after batch element; packed: the T rows): row number floor((2j+1) Q / 2n),
  j < n, of the Q qualifying rows in token order (all of them when n >= Q). Deterministic.
- rows=tensor (1-D, integer): explicit positions, deduplicated. Batched: token indices within the
  sequence in [0, N), used in each batch element; packed: token indices into [0, T). With
  skip_trivial=True the trivial ones among them are dropped.

Nothing N x N is built: logits are computed only for the rows used, in chunks of rows whose fp32
(fp64) logits take at most ~256 MB (`chunk_rows` overrides the chunk height), so extra memory is
O(chunk * N * Hq). The same code runs on CPU and CUDA tensors; only `cu_seqlens`, `rows` and the row
positions are handled on the host.
"""
from __future__ import annotations

import math
import numbers

import torch

from ._op_checks import _fail, is_int as _is_int
from .interface import _check_batched, _check_cu_seqlens

__all__ = ["recall", "block_recall", "score_recall", "select_rows"]

_FLOAT_DTYPES = (torch.bfloat16, torch.float16, torch.float32, torch.float64)
_CHUNK_BYTES = 256 << 20  # budget of one logits chunk


def _check_tensor(name, x, rank, layout):
    if not isinstance(x, torch.Tensor):
        _fail(name, "a torch.Tensor", type(x).__name__, TypeError)
    if x.dim() != rank:
        _fail(name, f"a {rank}-dim tensor {layout}", f"shape {tuple(x.shape)}")


def _check_inputs(q, k, indices, block_size, softmax_scale, skip_trivial, chunk_rows, packed):
    """Everything but rows / cu_seqlens. Returns the token dims (B, N) or (T,)."""
    rank = 3 if packed else 4
    layout = "(T, H, D)" if packed else "(B, N, H, D)"
    _check_tensor("q", q, rank, layout)
    _check_tensor("k", k, rank, layout)
    if q.dtype not in _FLOAT_DTYPES:
        _fail("q", f"dtype in {[str(d) for d in _FLOAT_DTYPES]}", q.dtype, TypeError)
    if k.dtype != q.dtype:
        _fail("k", f"dtype {q.dtype} (that of q)", k.dtype, TypeError)
    if k.device != q.device:
        _fail("k", f"device {q.device} (that of q)", k.device)
    lead = tuple(q.shape[:-2])
    if tuple(k.shape[:-2]) != lead or k.shape[-1] != q.shape[-1]:
        _fail("k", f"shape {lead + ('Hkv', q.shape[-1])} (token dims and head dim of q)", f"shape {tuple(k.shape)}")
    hq, hkv = q.shape[-2], k.shape[-2]
    if hq < 1 or hkv < 1 or hq % hkv:
        _fail("k", f"a kv head count dividing Hq={hq}", hkv)
    if q.shape[-1] < 1:
        _fail("q", "head dim D >= 1", q.shape[-1])

    ilayout = "(Hi, T, topk)" if packed else "(B, Hi, N, topk)"
    _check_tensor("indices", indices, rank, ilayout)
    if indices.dtype != torch.int32:
        _fail("indices", "dtype torch.int32", indices.dtype, TypeError)
    if indices.device != q.device:
        _fail("indices", f"device {q.device} (that of q)", indices.device)
    hi = indices.shape[0] if packed else indices.shape[1]
    tok = tuple(indices.shape[1:2]) if packed else (indices.shape[0], indices.shape[2])
    if tok != lead or indices.shape[-1] < 1:
        _fail("indices", f"shape {ilayout} with token dims {lead} (those of q) and topk >= 1",
              f"shape {tuple(indices.shape)}")
    if hi < 1 or hq % hi:
        _fail("indices", f"an index group count Hi dividing Hq={hq}", hi)

    if not _is_int(block_size):
        _fail("block_size", "an int", repr(block_size), TypeError)
    if block_size < 1:
        _fail("block_size", "a positive int", block_size)
    if softmax_scale is not None:
        if isinstance(softmax_scale, bool) or not isinstance(softmax_scale, numbers.Real):
            _fail("softmax_scale", "a float or None", repr(softmax_scale), TypeError)
        if not math.isfinite(softmax_scale):
            _fail("softmax_scale", "a finite float", softmax_scale)
    if not isinstance(skip_trivial, bool):
        _fail("skip_trivial", "a bool", repr(skip_trivial), TypeError)
    if chunk_rows is not None:
        if not _is_int(chunk_rows):
            _fail("chunk_rows", "an int or None", repr(chunk_rows), TypeError)
        if chunk_rows < 1:
            _fail("chunk_rows", "an int >= 1", chunk_rows)
    return lead


def _seq_lengths(cu_seqlens, max_seqlen, total, device):
    """Host list of sequence lengths from a checked cu_seqlens."""
    _check_cu_seqlens(cu_seqlens, device)
    cu = cu_seqlens.tolist()
    if cu[0] != 0 or cu[-1] != total or any(b < a for a, b in zip(cu[:-1], cu[1:])):
        _fail("cu_seqlens", f"non-decreasing offsets from 0 to T={total}", cu if len(cu) <= 8 else f"{cu[:8]}...")
    lengths = [b - a for a, b in zip(cu[:-1], cu[1:])]
    if max_seqlen is not None:
        if not _is_int(max_seqlen):
            _fail("max_seqlen", "an int or None", repr(max_seqlen), TypeError)
        if max_seqlen < max(lengths):
            _fail("max_seqlen", f"an int >= the longest sequence ({max(lengths)})", max_seqlen)
    return lengths


def select_rows(seqlens, topk, *, block_size=128, rows=None, skip_trivial=True, batched=False):
    """The rows `recall` uses: a list with one int64 CPU tensor per sequence of the ascending row
    positions (within that sequence) it evaluates.

    seqlens: the sequence lengths (batched: [N] * B, with batched=True; packed: from cu_seqlens).
    topk, block_size, rows, skip_trivial: as in `recall` (module docstring for the rules).
    """
    if isinstance(rows, (list, tuple)):
        rows = torch.as_tensor(rows) if len(rows) else torch.zeros(0, dtype=torch.long)
    first = topk * block_size if skip_trivial else 0  # first qualifying position of a sequence
    qual = [torch.arange(min(first, n), n) for n in seqlens]
    if rows is None:
        return qual
    if _is_int(rows):
        if rows < 1:
            _fail("rows", "an int >= 1, a 1-D integer tensor or None", rows)
        counts = torch.tensor([len(x) for x in qual])
        total = int(counts.sum())
        m = min(rows, total)
        pick = (2 * torch.arange(m) + 1) * total // (2 * m) if m else torch.zeros(0, dtype=torch.long)
        ends = counts.cumsum(0)
        seq = torch.searchsorted(ends, pick, right=True)
        starts = ends - counts
        return [qual[s][pick[seq == s] - starts[s]] for s in range(len(seqlens))]
    if not isinstance(rows, torch.Tensor):
        _fail("rows", "None, an int or a 1-D integer tensor", type(rows).__name__, TypeError)
    if rows.dtype.is_floating_point or rows.dtype.is_complex or rows.dtype == torch.bool:
        _fail("rows", "an integer tensor", rows.dtype, TypeError)
    if rows.dim() != 1:
        _fail("rows", "a 1-D tensor", f"shape {tuple(rows.shape)}")
    rows = torch.unique(rows.detach().cpu().long())
    span = seqlens[0] if batched and seqlens else sum(seqlens)
    if rows.numel() and (int(rows[0]) < 0 or int(rows[-1]) >= span):
        what = "token positions within the sequence" if batched else "token indices into T"
        _fail("rows", f"{what} in [0, {span})", f"values in [{int(rows[0])}, {int(rows[-1])}]")
    if batched:
        return [rows[rows >= first] for _ in seqlens]
    ends = torch.tensor(seqlens).cumsum(0)
    seq = torch.searchsorted(ends, rows, right=True)
    pos = rows - (ends - torch.tensor(seqlens))[seq]
    return [pos[(seq == s) & (pos >= first)] for s in range(len(seqlens))]


def _block_sums(e, block_size):
    """(..., L) -> (..., ceil(L / block_size)) sums over consecutive blocks, without a padded copy."""
    L = e.shape[-1]
    full = L // block_size * block_size
    parts = []
    if full:
        parts.append(e[..., :full].unflatten(-1, (full // block_size, block_size)).sum(-1))
    if full < L:
        parts.append(e[..., full:].sum(-1, keepdim=True))
    return torch.cat(parts, -1) if len(parts) > 1 else parts[0]


def _sequence_sums(q, k, idx, pos, block_size, scale, chunk_rows):
    """Sums over the (row, group) pairs of one sequence's rows `pos` (host int64, ascending) of block
    recall and score recall: an fp64 (2,) tensor on q's device.

    q (n, Hq, D), k (n, Hkv, D), idx (Hi, n, topk) are views of one sequence.
    """
    Hq, D = q.shape[1:]
    Hkv, Hi, topk = k.shape[1], idx.shape[0], idx.shape[-1]
    acc = torch.float64 if q.dtype == torch.float64 else torch.float32
    dev = q.device
    L_max = int(pos[-1]) + 1
    if chunk_rows is None:
        chunk_rows = max(1, _CHUNK_BYTES // (Hq * L_max * acc.itemsize))
    kt = k[:L_max].to(acc).permute(1, 2, 0)  # (Hkv, D, L): one matmul per kv head, no head expansion
    sums = torch.zeros(2, dtype=torch.float64, device=dev)
    for c0 in range(0, len(pos), chunk_rows):
        p_host = pos[c0:c0 + chunk_rows]
        c, L = len(p_host), int(p_host[-1]) + 1
        nb = -(-L // block_size)
        p = p_host.to(dev)
        # Logits (Hq, c, L), head h = kvh * G + g, causal mask, unnormalized exp in place.
        qc = (q[p].to(acc) * scale).view(c, Hkv, Hq // Hkv, D).permute(1, 2, 0, 3).reshape(Hkv, -1, D)
        e = torch.matmul(qc, kt[..., :L]).view(Hq, c, L)
        e.masked_fill_(torch.arange(L, device=dev) > p[:, None], -math.inf)
        e.sub_(e.amax(-1, keepdim=True)).exp_()
        mass = _block_sums(e, block_size)  # (Hq, c, nb)
        del e
        mass = (mass / mass.sum(-1, keepdim=True)).view(Hi, Hq // Hi, c, nb).mean(1)  # Abar (Hi, c, nb)

        last = p // block_size  # the row's own block
        blocks = torch.arange(nb, device=dev)
        visible = blocks <= last[:, None]  # (c, nb)
        order = torch.sort(mass.masked_fill(~visible, -math.inf), dim=-1, descending=True, stable=True).indices
        rank = torch.empty_like(order).scatter_(-1, order, blocks.expand_as(order).contiguous())
        keff = torch.clamp(last + 1, max=topk)
        star = rank < keff[:, None]  # I* (Hi, c, nb)

        sel = idx[:, p, :].long()  # (Hi, c, topk)
        ok = (sel >= 0) & (sel <= last[None, :, None])
        hat = torch.zeros(Hi, c, nb + 1, dtype=torch.bool, device=dev)
        hat.scatter_(-1, torch.where(ok, sel, nb), True)
        hat = hat[..., :nb]  # Î (Hi, c, nb)

        block = (star & hat).sum(-1).to(acc) / keff.to(acc)
        score = (mass * hat).sum(-1) / (mass * star).sum(-1)
        sums += torch.stack([block.sum(), score.sum()]).double()
    return sums


@torch.no_grad()
def recall(q, k, indices, *, block_size=128, softmax_scale=None, rows=None, cu_seqlens=None, max_seqlen=None,
           skip_trivial=True, chunk_rows=None):
    """Block recall and score recall of the selection `indices` against the main attention of (q, k).

    Batched: q (B, N, Hq, D), k (B, N, Hkv, D), indices int32 (B, Hi, N, topk). Packed (with
    `cu_seqlens` int32 (S+1,) and optionally `max_seqlen`): q (T, Hq, D), k (T, Hkv, D), indices
    (Hi, T, topk). q and k in bf16/fp16/fp32/fp64, computed in fp32 (fp64 for fp64 inputs).
    Definitions, `rows` and `skip_trivial`: the module docstring. `chunk_rows`: query rows per logits
    chunk (default: a chunk of fp32 logits stays under ~256 MB).

    Returns dict(block_recall=, score_recall=) fp32 0-dim tensors (means over the (row, group) pairs
    used; NaN when no row is used) and rows= an int64 0-dim tensor, the number of rows used.
    """
    packed = cu_seqlens is not None
    if not packed:
        _check_batched(max_seqlen, "q")
    lead = _check_inputs(q, k, indices, block_size, softmax_scale, skip_trivial, chunk_rows, packed)
    topk = indices.shape[-1]
    if packed:
        lengths = _seq_lengths(cu_seqlens, max_seqlen, lead[0], q.device)
        ends = torch.tensor(lengths).cumsum(0).tolist()
        views = [(q[b - n:b], k[b - n:b], indices[:, b - n:b]) for n, b in zip(lengths, ends)]
    else:
        lengths = [lead[1]] * lead[0]
        views = [(q[s], k[s], indices[s]) for s in range(lead[0])]
    plan = select_rows(lengths, topk, block_size=block_size, rows=rows, skip_trivial=skip_trivial,
                       batched=not packed)
    scale = 1.0 / math.sqrt(q.shape[-1]) if softmax_scale is None else float(softmax_scale)

    sums = torch.zeros(2, dtype=torch.float64, device=q.device)
    count = 0
    with torch.autocast(q.device.type, enabled=False):  # the logits stay in fp32 / fp64 under autocast
        for s, pos in enumerate(plan):
            if len(pos):
                sums += _sequence_sums(*views[s], pos, block_size, scale, chunk_rows)
                count += len(pos)
    means = (sums / (count * indices.shape[-3])).float() if count else torch.full((2,), math.nan, device=q.device)
    return dict(block_recall=means[0], score_recall=means[1],
                rows=torch.tensor(count, dtype=torch.int64, device=q.device))


def block_recall(q, k, indices, **kwargs):
    """`recall(...)["block_recall"]`: mean |I* ∩ Î| / |I*| over the (row, group) pairs used."""
    return recall(q, k, indices, **kwargs)["block_recall"]


def score_recall(q, k, indices, **kwargs):
    """`recall(...)["score_recall"]`: mean attention mass of Î over that of I* over the pairs used."""
    return recall(q, k, indices, **kwargs)["score_recall"]
