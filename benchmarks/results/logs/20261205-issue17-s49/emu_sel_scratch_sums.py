# Python transliteration of sel_scratch_sums (csrc/sm90/index_topk/index_topk_kernel.cuh, s49 patch), lane by lane,
# against the direct per-row sums: the layout, swizzle and slot bookkeeping only (not CUDA's memory model).
import random, math
def popc(x): return bin(x).count("1")
def emulate(c, mx, sl2, take_mask, J0, NJ, kSlots):
    kPer = NJ // 4; kSwz = NJ // 4
    scr = [None] * (kSlots * 128)
    mine = [0.0] * 32
    rest = take_mask
    writes = 0
    while rest:
        rnd = 0
        for i in range(kSlots):
            low = rest & (-rest & 0xffffffff)
            rnd |= low; rest ^= low
        scr = [None] * (kSlots * 128)
        for lane in range(32):
            g, tq = lane // 4, lane % 4
            for r in range(2):
                o = 4 * g + r
                if (rnd >> o) & 1:
                    slot = popc(rnd & ((1 << o) - 1))
                    base_f2 = slot * 64 + tq * NJ
                    for jj in range(NJ):
                        idx = base_f2 + (jj ^ (tq * kSwz))
                        assert scr[2 * idx] is None, "two writers of one float2"
                        assert (jj ^ (tq * kSwz)) < NJ
                        scr[2 * idx] = c[lane][4 * (J0 + jj) + 2 * r]
                        scr[2 * idx + 1] = c[lane][4 * (J0 + jj) + 2 * r + 1]
        left = rnd; k = 0
        while left:
            o = (left & -left).bit_length() - 1
            left &= left - 1
            sums = []
            for lane in range(32):
                src_lane = o & ~3
                base = (mx[src_lane][1] if (o & 1) else mx[src_lane][0]) * sl2
                tw, jj = lane // 8, ((kPer // 2) * lane) % NJ
                src = k * 128 + 2 * (tw * NJ + (jj ^ (tw * kSwz)))
                vals = scr[src:src + kPer]
                assert None not in vals, (lane, src)
                sums.append(sum(2 ** (v * sl2 - base) for v in vals))
            total = sum(sums)
            mine[o] = total
            k += 1
    return mine
random.seed(1)
for trial in range(300):
    NJ = random.choice([16, 8]); J0 = 0 if NJ == 16 else random.choice([0, 8]); kSlots = 4
    c = [[random.gauss(0, 3) for _ in range(64)] for _ in range(32)]
    # mx: per quad, the row max over the block's columns (every lane of the quad holds both rows')
    mx = [[0, 0] for _ in range(32)]
    for g in range(8):
        for r in range(2):
            m = max(c[4 * g + tq][4 * j + 2 * r + e] for tq in range(4) for j in range(J0, J0 + NJ) for e in range(2))
            for tq in range(4): mx[4 * g + tq][r] = m
    take_mask = 0
    for g in range(8):
        for r in range(2):
            if random.random() < random.choice([0.1, 0.3, 1.0]): take_mask |= 1 << (4 * g + r)
    sl2 = 0.37
    got = emulate(c, mx, sl2, take_mask, J0, NJ, kSlots)
    for g in range(8):
        for r in range(2):
            o = 4 * g + r
            ref = sum(2 ** ((c[4 * g + tq][4 * j + 2 * r + e] - mx[o][r]) * sl2) for tq in range(4) for j in range(J0, J0 + NJ) for e in range(2))
            if (take_mask >> o) & 1:
                assert abs(got[o] - ref) <= 1e-9 * ref, (trial, o, got[o], ref)
            else:
                assert got[o] == 0.0
print("ok: 300 random blocks, every taking row's sum equals the direct sum")
