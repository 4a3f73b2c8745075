import numpy as np
# dq^T[Di=128, units=16] per Di half h: rows 64h + (16 w + g + 8 e>>1), cols 8 (i>>2) + 2 tq + (i & 1)
rng = np.random.default_rng(0)
M = rng.standard_normal((128, 16))
frag = {}  # (h, w, lane) -> d[8]
for h in range(2):
    for w in range(4):
        for lane in range(32):
            g, tq = lane // 4, lane % 4
            d = np.zeros(8)
            for i in range(8):
                row = 64 * h + 16 * w + g + 8 * ((i >> 1) & 1)
                col = 8 * (i >> 2) + 2 * tq + (i & 1)
                d[i] = M[row, col]
            frag[(h, w, lane)] = d
written = np.full((128, 16), np.nan)
count = np.zeros((128, 16), int)
for h in range(2):
    for w in range(4):
        for half in range(2):
            # x per lane before transpose
            X = {lane: [frag[(h, w, lane)][2 * half], frag[(h, w, lane)][2 * half + 1],
                        frag[(h, w, lane)][4 + 2 * half], frag[(h, w, lane)][5 + 2 * half]] for lane in range(32)}
            # emulate transpose_quad_rows
            for m in (1, 2):
                new = {l: list(X[l]) for l in range(32)}
                for lane in range(32):
                    gb = (lane // 4) & 3
                    hi = (gb & m) != 0
                    for j0 in range(4):
                        if j0 & m == 0:
                            partner = lane ^ (4 * m)
                            pgb = (partner // 4) & 3
                            phi = (pgb & m) != 0
                            send_partner = X[partner][j0] if phi else X[partner][j0 | m]
                            if hi:
                                new[lane][j0] = send_partner
                            else:
                                new[lane][j0 | m] = send_partner
                X = new
            for lane in range(32):
                g, tq = lane // 4, lane % 4
                gb = g & 3
                unit = 2 * tq + (gb & 1) + 8 * (gb >> 1)
                d0 = 64 * h + 8 * half + 16 * w + 4 * (g >> 2)
                for i in range(4):
                    written[d0 + i, unit] = X[lane][i]
                    count[d0 + i, unit] += 1
assert (count == 1).all(), count
assert np.allclose(written, M)
print("dq epilogue mapping ok")
