"""An independent float64 brute force of docs/SPEC.md sections 2-5: plain loops per query and per head, in numpy.

Shares no code with msa.reference. Inputs are packed (T, H, D) numpy float64 arrays. `cu_k` (None: `cu`)
splits the key-side arrays where the queries are a suffix of the keys: query i of a sequence with nq
queries and nk keys sits at position i + nk - nq.
"""
from __future__ import annotations

import math

import numpy as np


def _rows(cu, cu_k=None):
    """(t, k0, pos) per query row: its row, its sequence's first key row, its position."""
    ck = cu if cu_k is None else cu_k
    out = []
    for a, b, c, d in zip(cu[:-1], cu[1:], ck[:-1], ck[1:]):
        nq, nk = int(b) - int(a), int(d) - int(c)
        out += [(int(a) + i, int(c), i + nk - nq) for i in range(nq)]
    return out


def block_scores(q_idx, k_idx, cu, block_size, index_scale, cu_k=None):
    """Per (r, token) the list M[b] of SPEC 2 (local block = +inf), as a dict {(r, t): array}."""
    Hi, Hki = q_idx.shape[1], k_idx.shape[1]
    out = {}
    for t, k0, i in _rows(cu, cu_k):
        local = i // block_size
        for r in range(Hi):
            kh = r // (Hi // Hki)
            sc = index_scale * (k_idx[k0:k0 + i + 1, kh] @ q_idx[t, r])  # scores of keys j <= i
            m = np.array([sc[b * block_size:(b + 1) * block_size].max() for b in range(local + 1)])
            m[local] = np.inf
            out[(r, t)] = m
    return out


def select(q_idx, k_idx, cu, topk, block_size, index_scale, cu_k=None):
    """(Hi, T, topk) int array: top blocks, ties to the lower block, ascending, -1 padded."""
    Hi, T = q_idx.shape[1], q_idx.shape[0]
    idx = np.full((Hi, T, topk), -1, dtype=np.int64)
    for (r, t), m in block_scores(q_idx, k_idx, cu, block_size, index_scale, cu_k).items():
        ranked = sorted(range(len(m)), key=lambda b: (-m[b], b))
        chosen = sorted(ranked[:min(topk, len(m))])
        idx[r, t, :len(chosen)] = chosen
    return idx


def attend_sets(indices, cu, block_size, Hi, dense, cu_k=None):
    """{(r, t): sorted list of attended tokens (sequence-relative positions)}."""
    sets = {}
    for t, _, i in _rows(cu, cu_k):
        for r in range(Hi):
            if dense:
                sets[(r, t)] = list(range(i + 1))
            else:
                blocks = {int(b) for b in indices[r, t] if b >= 0}
                sets[(r, t)] = [j for j in range(i + 1) if j // block_size in blocks]
    return sets


def attention(q, k, v, sets, cu, scale, Hi, cu_k=None):
    """out (T, Hq, D), lse (Hq, T), probs {(h, t): array over the attended set}."""
    T, Hq, D = q.shape
    Hkv = k.shape[1]
    out = np.zeros((T, Hq, D))
    lse = np.full((Hq, T), -np.inf)
    probs = {}
    for t, s0, _ in _rows(cu, cu_k):
        for h in range(Hq):
            kh = h // (Hq // Hkv)
            js = sets[(h // (Hq // Hi), t)]
            if not js:
                probs[(h, t)] = np.zeros(0)
                continue
            rows = s0 + np.array(js)
            logits = scale * (k[rows, kh] @ q[t, h])
            mx = logits.max()
            l = mx + math.log(np.exp(logits - mx).sum())
            p = np.exp(logits - l)
            out[t, h] = p @ v[rows, kh]
            lse[h, t] = l
            probs[(h, t)] = p
    return out, lse, probs


def kl(q_idx, k_idx, sets, probs, cu, index_scale, Hq, cu_k=None):
    """(kl, lse_idx): mean over T*Hi rows of sum_j P log(P / Pidx)."""
    T, Hi = q_idx.shape[0], q_idx.shape[1]
    Hki = k_idx.shape[1]
    G = Hq // Hi
    total = 0.0
    lse_idx = np.full((Hi, T), -np.inf)
    for t, s0, _ in _rows(cu, cu_k):
        for r in range(Hi):
            js = sets[(r, t)]
            if not js:
                continue
            P = sum(probs[(h, t)] for h in range(r * G, (r + 1) * G)) / G
            s = index_scale * (k_idx[s0 + np.array(js), r // (Hi // Hki)] @ q_idx[t, r])
            mx = s.max()
            l = mx + math.log(np.exp(s - mx).sum())
            lse_idx[r, t] = l
            nz = P > 0
            total += float((P[nz] * (np.log(P[nz]) - (s[nz] - l))).sum())
    return total / (T * Hi), lse_idx


def msa(q, k, v, q_idx, k_idx, cu, topk, block_size, scale, index_scale, warmup, indices=None, cu_k=None):
    """Everything of SPEC 2-5. `indices` given: use them instead of selecting (for low-precision runs)."""
    Hi = q_idx.shape[1]
    if indices is None:
        indices = select(q_idx, k_idx, cu, topk, block_size, index_scale, cu_k)
    sets = attend_sets(indices, cu, block_size, Hi, warmup, cu_k)
    out, lse, probs = attention(q, k, v, sets, cu, scale, Hi, cu_k)
    kl_value, lse_idx = kl(q_idx, k_idx, sets, probs, cu, index_scale, q.shape[1], cu_k)
    return dict(out=out, lse=lse, kl=kl_value, lse_idx=lse_idx, indices=indices)


def check_valid_topk(indices, scores, topk, rel_tol=0.0):
    """Assert `indices` (Hi, T, topk) is a valid top-k of `scores` ({(r, t): M}) per SPEC 2: right count,
    local block in, ascending, -1 padded, and no unselected block above a selected one (beyond
    rel_tol * |score| for accumulation order)."""
    for (r, t), m in scores.items():
        row = [int(b) for b in indices[r, t]]
        chosen = [b for b in row if b >= 0]
        want = min(topk, len(m))
        assert len(chosen) == want, f"row {(r, t)}: {len(chosen)} blocks, expected {want}"
        assert row[len(chosen):] == [-1] * (topk - len(chosen)), f"row {(r, t)}: padding {row}"
        assert chosen == sorted(set(chosen)), f"row {(r, t)}: not ascending/unique {row}"
        assert len(m) - 1 in chosen, f"row {(r, t)}: local block {len(m) - 1} missing from {row}"
        rest = [b for b in range(len(m)) if b not in chosen]
        if rest:
            worst_chosen = min(m[b] for b in chosen)
            best_rest = max(m[b] for b in rest)
            tol = rel_tol * max(abs(worst_chosen), abs(best_rest), 1.0)
            assert best_rest <= worst_chosen + tol, (
                f"row {(r, t)}: unselected block scores {best_rest} > selected {worst_chosen}")
