"""Model of patches/topk_fp8_keys.patch (s69), and of patches/topk16_keys.patch (64-bit keys of fp32 scores): the FP8
top-k's RegKeyList and fp8_block_key against TopHeap's float form (csrc/common/top_list.cuh), on one row: blocks
offered in ascending order with f16 maxima (many ties, +-0, +-inf, NaN, the largest finite values), the float form's
score abs_scale * max in fp32 (s > thr strict, NaN never taken) against the keys (key > thr, unsigned), and the kept
sets compared. Blocks up to 65535; scales 0 and within [2^-125, 2^112] (the kernel takes the heaps outside: fp32
products of distinct f16 maxima tie or overflow there).
python3 key_list_model.py"""
import math
import random
import struct

import numpy as np

NEG, POS = -math.inf, math.inf
PAD = 0xFFFFFFFF


def worse(sa, ba, sb, bb):
    return sa < sb or (sa == sb and ba > bb)


def heap_run(stream, size, scale):
    sc, bl = [NEG] * size, [-1] * size
    thr = NEG if size > 0 else POS
    for b, h in stream:
        with np.errstate(invalid="ignore"):  # 0 * inf
            s = float(np.float32(scale) * np.float32(h))  # abs_scale * __half2float in fp32
        if not (s > thr):
            continue
        j = min(range(size), key=lambda i: (sc[i], -bl[i]))  # the worst: lowest score, then highest block
        sc[j], bl[j] = s, b
        w = min(range(size), key=lambda i: (sc[i], -bl[i]))
        thr = sc[w]
    return sorted(x for x in bl if x >= 0)


def key_of(h, b, zero_scale):  # fp8_block_key after the quad max
    u = struct.unpack("<H", np.float16(h).tobytes())[0]
    if u == 0x8000:
        u = 0
    u = (~u & 0xFFFF) if u & 0x8000 else (u | 0x8000)
    if zero_scale:
        u = 0x8000 if (u - 0x0400) % 2**32 < 0xF800 else 0
    return ((u << 16) | (0xFFFF - b)) if (u - 0x0400) % 2**32 <= 0xF800 else 0


def list_run(stream, size, key_of, pad, block_bits):
    """RegKeyList on one row's two lanes (slot j of lane j // 8): empty slots hold j, padding `pad`; replace compares
    the keys' low 32 bits (RegKeyList::replace); kept blocks read back from the low block_bits."""
    lanes = [{"k": [j if j < size else pad for j in range(8 * h, 8 * h + 8)]} for h in (0, 1)]
    for ln in lanes:
        ln["w"] = min(ln["k"])

    def exchange():
        a, b = lanes
        a["hold"], b["hold"] = a["w"] < b["w"], b["w"] < a["w"]
        assert a["hold"] != b["hold"] or a["w"] == b["w"] == pad
        return min(a["w"], b["w"])
    thr = exchange()
    low = 0xFFFFFFFF
    for b, s in stream:
        key = key_of(s, b)
        if not key > thr:
            continue
        for ln in lanes:
            if ln["hold"]:
                assert sum((x & low) == (ln["w"] & low) for x in ln["k"]) == 1
                ln["k"] = [key if (x & low) == (ln["w"] & low) else x for x in ln["k"]]
                ln["w"] = min(ln["k"])
        thr = exchange()
    mask = (1 << block_bits) - 1
    return sorted(mask - (x & mask) for ln in lanes for x in ln["k"] if x >= 16 and x != pad)


def key_run(stream, size, scale):
    return list_run(stream, size, lambda h, b: key_of(h, b, scale == 0), PAD, 16)


rng = random.Random(69)
special = [0.0, -0.0, math.inf, -math.inf, math.nan, 65504.0, -65504.0, 6e-8, -6e-8, 1.0, -1.0]
cases = 0
for trial in range(20000):
    size = rng.randint(0, 16)
    n = rng.randint(0, 80)
    first = rng.choice([0, 0, 65535 - n])  # blocks near the 16-bit limit too
    pool = [rng.choice(special) if rng.random() < 0.3 else float(np.float16(rng.choice([1, 4, 64]) * rng.gauss(0, 1)))
            for _ in range(rng.randint(1, 12))]
    stream = [(first + b, rng.choice(pool)) for b in range(n)]
    scale = rng.choice([0.0, 0.125, 1.0, 0.08838834764831845, 2.0**-125, 2.0**112])  # keys: 0 or [2^-125, 2^112]
    want, got = heap_run(stream, size, scale), key_run(stream, size, scale)
    assert want == got, (size, scale, stream, want, got)
    cases += 1
print(f"{cases} rows: the FP8 key lists keep TopHeap's blocks")


def f32_key_of(s, b):  # f32_block_key (patches/topk16_keys.patch): 64-bit keys
    u = struct.unpack("<I", np.float32(s).tobytes())[0]
    if u == 0x80000000:
        u = 0
    u = (~u & 0xFFFFFFFF) if u & 0x80000000 else (u | 0x80000000)
    return ((u << 32) | (0xFFFFFFFF - b)) if (u - 0x00800000) % 2**32 <= 0xFF000000 else 0


PAD64 = 0xFFFFFFFF0000FFFF


def key64_run(stream, size):
    return list_run(stream, size, f32_key_of, PAD64, 32)


special32 = [0.0, -0.0, math.inf, -math.inf, math.nan, 3.4028235e38, -3.4028235e38, 1e-45, -1e-45, 1.0, -1.0]
cases = 0
for trial in range(20000):
    size = rng.randint(0, 16)
    n = rng.randint(0, 80)
    first = rng.choice([0, 0, 2**31 - 1 - n])
    pool = [rng.choice(special32) if rng.random() < 0.3 else float(np.float32(rng.gauss(0, 1)))
            for _ in range(rng.randint(1, 12))]
    stream = [(first + b, rng.choice(pool)) for b in range(n)]
    want, got = heap_run(stream, size, 1.0), key64_run(stream, size)
    assert want == got, (size, stream, want, got)
    cases += 1
print(f"{cases} rows: the 16-bit top-k's 64-bit key lists keep TopHeap's blocks")
