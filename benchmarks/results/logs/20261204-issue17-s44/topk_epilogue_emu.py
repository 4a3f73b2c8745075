# Emulates one warp of index_topk_sm90_kernel's top-k epilogue (kSel and plain), the old form against the s44 form,
# on random scores: the heaps (score, block, sum) must agree (sums to rounding), and the new form's warp vote must
# equal the old one's any(take) at every block.
import itertools, sys, warnings

import numpy as np
warnings.filterwarnings('ignore')
def fmx(xs):
    xs=[x for x in xs if not np.isnan(x)]
    return np.float32(max(xs)) if xs else np.float32(np.nan)


def worse(sa, ba, sb, bb): return sa < sb or (sa == sb and ba > bb)

class Heap:  # TopHeap: a min-heap by worse(), size topk - 1, replace_root
    def __init__(s, size): s.sc = [-np.inf] * size; s.bl = [-1] * size; s.su = [0.0] * size; s.size = size
    def replace_root(s, sc, b, x):
        i = 0
        for _ in range(5):
            l, r = 2 * i + 1, 2 * i + 2; w, ws, wb = i, sc, b
            if l < s.size and worse(s.sc[l], s.bl[l], ws, wb): w, ws, wb = l, s.sc[l], s.bl[l]
            if r < s.size and worse(s.sc[r], s.bl[r], ws, wb): w, ws, wb = r, s.sc[r], s.bl[r]
            if w == i: break
            s.sc[i], s.bl[i], s.su[i] = ws, wb, s.su[w]; i = w
        s.sc[i], s.bl[i], s.su[i] = sc, b, x
        return s.sc[0]

def cols(tq, j, e): return 8 * j + 2 * tq + e

def run(new, S, nb, topk, local, abs_scale, sl2, ksel):
    # S: (sub-tiles, 16 rows, 128 keys) fp32 scores (raw). local[row]: blocks before the row's own.
    heaps = [Heap(topk - 1) for _ in range(16)]
    votes = []
    init = -np.inf if topk > 1 else np.inf
    thr_owner = {(g, r): init for g in range(8) for r in range(2)}
    thr_all = {(g, tq): [init, init] for g in range(8) for tq in range(4)}
    exp2 = lambda x: np.float32(2.0) ** np.float32(x)
    for it in range(S.shape[0]):
        # per lane c values
        c = {}
        for g in range(8):
            for tq in range(4):
                v = np.zeros(64, np.float32)
                for j in range(16):
                    for e in range(2):
                        v[4 * j + e] = S[it, g, cols(tq, j, e)]; v[4 * j + 2 + e] = S[it, g + 8, cols(tq, j, e)]
                c[(g, tq)] = v
        m = {}
        for key, v in c.items():
            mm = np.zeros((2, 2), np.float32)
            for h in range(2):
                for r in range(2):
                    mm[h, r] = fmx([v[4 * j + 2 * r + e] for j in range(8 * h, 8 * h + 8) for e in range(2)])
            if nb == 1: mm[0, 0] = fmx([mm[0, 0], mm[1, 0]]); mm[0, 1] = fmx([mm[0, 1], mm[1, 1]])
            m[key] = mm
        for h in range(nb):
            b = it * nb + h
            J0, NJ = (0, 16) if nb == 1 else (8 * h, 8)
            quadmax = {(g, r): fmx([m[(g, tq)][h, r] for tq in range(4)]) for g in range(8) for r in range(2)}
            if not new:
                take = {(g, r): b < local[g + 8 * r] and np.float32(abs_scale * quadmax[(g, r)]) > thr_owner[(g, r)]
                        for g in range(8) for r in range(2)}
                anyt = any(take.values()); votes.append(anyt)
                if ksel and anyt:
                    for (g, r), t in take.items():
                        if t:
                            base = np.float32(quadmax[(g, r)] * sl2)
                            tot = np.float32(0)
                            for tq in range(4):
                                v = c[(g, tq)]
                                for j in range(J0, J0 + NJ):
                                    tot += exp2(v[4*j+2*r]*sl2 - base) + exp2(v[4*j+2*r+1]*sl2 - base)
                            thr_owner[(g, r)] = heaps[g + 8 * r].replace_root(np.float32(abs_scale * quadmax[(g, r)]), b, tot)
                elif not ksel:
                    for (g, r), t in take.items():
                        if t: thr_owner[(g, r)] = heaps[g + 8 * r].replace_root(np.float32(abs_scale * quadmax[(g, r)]), b, 0.0)
            else:
                cand = any((b < local[g] and np.float32(abs_scale * m[(g, tq)][h, 0]) > thr_all[(g, tq)][0]) or
                           (b < local[g + 8] and np.float32(abs_scale * m[(g, tq)][h, 1]) > thr_all[(g, tq)][1])
                           for g in range(8) for tq in range(4))
                votes.append(cand)
                if cand:
                    for g in range(8):
                        ls = {}
                        for tq in range(4):
                            v = c[(g, tq)]
                            for r in range(2):
                                ml = m[(g, tq)][h, r]
                                base = np.float32(0) if ml == -np.inf else np.float32(ml * sl2)
                                tot = np.float32(0)
                                for j in range(J0, J0 + NJ):
                                    tot += exp2(v[4*j+2*r]*sl2 - base) + exp2(v[4*j+2*r+1]*sl2 - base)
                                f = np.float32(0) if ml == -np.inf else exp2(np.float32(ml * sl2) - np.float32(quadmax[(g, r)] * sl2))
                                ls[(tq, r)] = tot * f
                        t_new = {}
                        for tq in range(2):  # owners
                            r = tq
                            s = np.float32(abs_scale * quadmax[(g, r)])
                            t = thr_all[(g, tq)][r]
                            if b < local[g + 8 * r] and s > t:
                                t = heaps[g + 8 * r].replace_root(s, b, sum(ls[(q, r)] for q in range(4)) if ksel else 0.0)
                            t_new[r] = t
                        for tq in range(4): thr_all[(g, tq)] = [t_new[0], t_new[1]]
    return heaps, votes



# The grid (s44 review): nb x topk x kSel x the rows' own blocks (beyond the sub-tiles or among them) x scale x
# special values; a row whose lane is all -inf gives NaN sums in the old form only (the new one guards its base).
REPS = int(sys.argv[1]) if len(sys.argv) > 1 else 1
rng = np.random.default_rng(1)
def same_heaps(h0, h1, nan_ok=False):
    for a, b in zip(h0, h1):
        if a.sc != b.sc and not all((x == y) or (np.isnan(x) and np.isnan(y)) for x, y in zip(a.sc, b.sc)): return 'sc'
        if a.bl != b.bl: return 'bl'
        sa, sb = np.array(a.su), np.array(b.su)
        if not np.allclose(sa, sb, rtol=1e-5, atol=0, equal_nan=True): return 'su %s %s' % (sa[~np.isclose(sa,sb,rtol=1e-5,equal_nan=True)][:3], sb[~np.isclose(sa,sb,rtol=1e-5,equal_nan=True)][:3])
    return None
res = {}
for nb, topk, ksel, lmode, scl, special in itertools.product([1,2],[1,2,4,16,32],[False,True],['big','small'],[0.0883883,1.0],['none','ties','nan','neginf_lane','posinf']):
    for rep in range(REPS):
        nsub = int(rng.integers(3, 9)); bs = 128 if nb == 1 else 64; hr = int(rng.choice([1,4,16]))
        S = (rng.standard_normal((nsub, 16, 128)) * 2).astype(np.float32)
        if special == 'ties': S = np.round(S)
        if special == 'nan': S[rng.random(S.shape) < 0.02] = np.nan
        if special == 'posinf': S[rng.random(S.shape) < 0.002] = np.inf
        if special == 'neginf_lane':  # one lane's columns all -inf for some row of some sub-tile
            for _ in range(4):
                it_, row, tq = rng.integers(nsub), rng.integers(16), rng.integers(4)
                S[it_, row, [8*j + 2*tq + e for j in range(16) for e in range(2)]] = -np.inf
        pos0 = nsub*128 + int(rng.integers(0,64)) if lmode == 'big' else int(rng.integers(0, nsub*128))
        local = [(pos0 + row // hr) // bs for row in range(16)]
        sl2 = np.float32(scl * 1.4426950408889634)
        h0, v0 = run(False, S, nb, topk, local, scl, sl2, ksel)
        h1, v1 = run(True, S, nb, topk, local, scl, sl2, ksel)
        d = same_heaps(h0, h1)
        key = (special, 'votes' if v0 != v1 else '', d)
        if v0 != v1 or d: print(nb, topk, ksel, lmode, scl, special, 'votes differ' if v0 != v1 else '', d)
        res[(special, d is None and v0 == v1)] = res.get((special, d is None and v0 == v1), 0) + 1
print(res)
