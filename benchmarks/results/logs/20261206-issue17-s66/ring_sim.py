"""Random-interleaving model of the FP8 top-k's K ring (s66 pairs on main, the quads patch; s67 added 'single', the
16-bit loop's ring that s67's topk_fp8_n256.patch takes, at 2 and 4 stages): thread 0 (in warp 0)
loads, every warp waits full, arrives empty. Checks: no deadlock, every wait passes on the completion it targets
(never 2+ completions ahead: parity aliasing), every warp reads each sub-tile's data (load for sub-tile it done)."""
import random

def warp_prog(w, total, S, mode):
    def wait_full(it):
        yield ('wait', 'full', it % S, it // S, it)
    def arrive(it):
        yield ('arrive', 'empty', it % S, None, it)
    def load(nx):
        yield ('load', nx % S, nx)
    def wait_empty(nx):  # stage of nx previously held nx - S
        yield ('wait', 'empty', nx % S, (nx - S) // S, None)
    if w == 0:
        pro = (S - 1) if mode in ('pairs', 'single') else S // 2
        for st in range(min(pro, total)):
            yield from load(st)
    yield ('sync',)
    if mode == 'single':  # thread 0 refills the stage of it - 1 with it + S - 1, then every warp waits for it
        for it in range(total):
            if w == 0 and it + S - 1 < total:
                if it >= 1: yield from wait_empty(it + S - 1)
                yield from load(it + S - 1)
            yield from wait_full(it)
            yield ('read', it); yield from arrive(it)
    elif mode == 'pairs':
        it = 0
        while it < total:
            if w == 0:
                for nx in (it + 2, it + 3):
                    if nx >= S - 1 and nx < total:
                        if nx >= S: yield from wait_empty(nx)
                        yield from load(nx)
            two = it + 1 < total
            yield from wait_full(it)
            if two: yield from wait_full(it + 1)
            yield ('read', it); yield from arrive(it)
            if two: yield ('read', it + 1); yield from arrive(it + 1)
            it += 2
    else:
        G = S // 2
        it = 0
        while it < total:
            if w == 0:
                for nx in range(it + G, min(it + 2 * G, total)):
                    if nx >= S: yield from wait_empty(nx)
                    yield from load(nx)
            if it + G <= total:
                for j in range(G): yield from wait_full(it + j)
                for j in range(G): yield ('read', it + j); yield from arrive(it + j)
            else:
                for j in range(it, total):
                    yield from wait_full(j); yield ('read', j); yield from arrive(j)
            it += G

def run(total, S, mode, W, rng):
    comp = {('full', s): 0 for s in range(S)}; comp.update({('empty', s): 0 for s in range(S)})
    arrivals = {s: 0 for s in range(S)}
    stage_holds = {}
    progs = [warp_prog(w, total, S, mode) for w in range(W)]
    pending = [next(p, None) for p in progs]
    synced_done = 0
    steps = 0
    while any(x is not None for x in pending):
        steps += 1
        if steps > 10**6: raise RuntimeError('too long')
        ready = []
        for w, a in enumerate(pending):
            if a is None: continue
            if a[0] == 'wait':
                _, kind, st, k, _ = a
                c = comp[(kind, st)]
                if c >= k + 2: raise AssertionError(f'aliasing {mode} total={total} {a} c={c}')
                if c == k + 1: ready.append(w)
            elif a[0] == 'sync':
                if sum(1 for x in pending if x is not None and x[0] == 'sync') + synced_done == W or synced_done: ready.append(w)
            else:
                ready.append(w)
        if not ready: raise AssertionError(f'deadlock {mode} total={total} {pending}')
        w = rng.choice(ready); a = pending[w]
        if a[0] == 'load':
            st, nx = a[1], a[2]
            assert comp[('full', st)] == nx // S, (mode, total, a)
            stage_holds[st] = nx; comp[('full', st)] += 1
        elif a[0] == 'arrive':
            st = a[2]; arrivals[st] += 1
            if arrivals[st] == W: arrivals[st] = 0; comp[('empty', st)] += 1
        elif a[0] == 'sync':
            synced_done += 1
        elif a[0] == 'read':
            assert stage_holds.get(a[1] % S) == a[1], (mode, total, 'stale data', a)
        pending[w] = next(progs[w], None)

if __name__ == '__main__':
    rng = random.Random(1)
    for mode, S in (('pairs', 4), ('quads', 8), ('single', 2), ('single', 4)):
        for total in range(0, 41):
            for trial in range(30):
                run(total, S, mode, 3, rng)
        print(mode, S, 'ok')
