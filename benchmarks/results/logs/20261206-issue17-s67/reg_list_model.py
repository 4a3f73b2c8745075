"""Model of patches/topk_fp8_reg_list.patch's RegTopList against csrc/common/top_list.cuh's TopHeap: one row's
blocks offered in ascending order with random scores (many ties, -inf, NaN), the take condition of each (strict
s > thr, NaN never taken), and the kept set compared. python3 reg_list_model.py"""
import math
import random

NEG, POS = -math.inf, math.inf


def worse(sa, ba, sb, bb):
    return sa < sb or (sa == sb and ba > bb)


def heap_run(stream, size):
    sc, bl = [NEG] * size, [-1] * size
    thr = NEG if size > 0 else POS
    for b, s in stream:
        if not (s > thr):
            continue
        i = 0
        for _ in range(5):
            l, r = 2 * i + 1, 2 * i + 2
            w, ws, wb = i, s, b
            if l < size and worse(sc[l], bl[l], ws, wb):
                w, ws, wb = l, sc[l], bl[l]
            if r < size and worse(sc[r], bl[r], ws, wb):
                w, ws, wb = r, sc[r], bl[r]
            if w == i:
                break
            sc[i], bl[i] = ws, wb
            i = w
        sc[i], bl[i] = s, b
        thr = sc[0]
    return sorted(x for x in bl if x >= 0)


class Lane:
    def __init__(self, size, half, per=8):
        self.s = [NEG if per * half + i < size else POS for i in range(per)]
        self.b = [-1] * per
        self.find_worst()

    def find_worst(self):  # the kernel's tree: pairs, then halves
        t = [(self.s[2 * k + 1], self.b[2 * k + 1], 2 * k + 1) if worse(self.s[2 * k + 1], self.b[2 * k + 1],
             self.s[2 * k], self.b[2 * k]) else (self.s[2 * k], self.b[2 * k], 2 * k) for k in range(4)]
        n = 2
        while n >= 1:
            for k in range(n):
                if worse(t[k + n][0], t[k + n][1], t[k][0], t[k][1]):
                    t[k] = t[k + n]
            n //= 2
        self.ws, self.wb, self.wi = t[0]


def reg_run(stream, size):
    lanes = [Lane(size, 0), Lane(size, 1)]

    def exchange():  # RegTopList::exchange on each of the two lanes (half 0, half 1)
        for half, (me, other) in enumerate((lanes, lanes[::-1])):
            me.hold = worse(me.ws, me.wb, other.ws, other.wb) or (
                not worse(other.ws, other.wb, me.ws, me.wb) and half == 0)
        assert lanes[0].hold != lanes[1].hold
        return lanes[0].ws if lanes[0].hold else lanes[1].ws
    thr = exchange()
    for b, s in stream:
        if not (s > thr):
            continue
        for ln in lanes:
            if ln.hold:
                ln.s[ln.wi], ln.b[ln.wi] = s, b
                ln.find_worst()
        thr = exchange()
    return sorted(x for ln in lanes for j, x in enumerate(ln.b) if x >= 0)


rng = random.Random(7)
cases = 0
for trial in range(20000):
    size = rng.randint(0, 16)
    n = rng.randint(0, 80)
    pool = [rng.choice([0.0, 1.0, 2.0, -1.0]) for _ in range(3)] + [NEG, math.nan]
    stream = [(b, rng.choice(pool) if rng.random() < 0.4 else rng.gauss(0, 1)) for b in range(n)]
    assert heap_run(stream, size) == reg_run(stream, size), (size, stream)
    cases += 1
print(f"RegTopList == TopHeap on {cases} random rows (sizes 0-16, ties, -inf, NaN)")
