"""Whether the first CUDA call after a synchronisation is slow on this host (s31: the op's first allocation of a call
took ~30-40 us of host time, wherever it was, and ~9 us when it was not the first): python scripts/host_first_touch.py.

After torch.cuda.synchronize() (the bench synchronises every repetition), times on the host, in microseconds (median
of 50): four torch.empty allocations in a row, four tiny kernel launches in a row (Tensor.zero_), and the same
again after a short busy-wait instead of a synchronisation. If the first of each row is the slow one after a
synchronisation only, the cost is the host thread waking from the wait (CPU frequency, caches), not msa's code:
dense attention's first launch in the bench pays it too."""
import statistics
import time

import torch


def row(make, n=4):
    ts = []
    for _ in range(n):
        t0 = time.perf_counter()
        make()
        ts.append((time.perf_counter() - t0) * 1e6)
    return ts


def spin(us):
    end = time.perf_counter() + us * 1e-6
    while time.perf_counter() < end:
        pass


def main():
    dev = torch.device("cuda")
    keep = []
    buf = torch.empty(1024, device=dev)

    def alloc():
        keep.append(torch.empty(4096, device=dev))

    def launch():
        buf.zero_()

    for name, make in (("empty", alloc), ("launch", launch)):
        for wait in ("synchronize", "spin"):
            rows = []
            for _ in range(50):
                if wait == "synchronize":
                    torch.cuda._sleep(2_000_000)  # the GPU busy for ~1 ms: the synchronisation really waits
                    torch.cuda.synchronize()
                else:
                    torch.cuda.synchronize()
                    spin(200)
                rows.append(row(make))
                keep.clear()
            med = [statistics.median(r[i] for r in rows) for i in range(4)]
            print(f"{name:6s} after {wait:11s}: " + " ".join(f"{m:7.1f}" for m in med) + " us")


if __name__ == "__main__":
    main()
