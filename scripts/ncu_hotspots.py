"""Summarise `ncu --page source --print-source sass --csv` output (plain or .gz, as scripts/ncu_hotspots.sh
stores it): the instructions with the most warp stall samples (with their top stall reasons) and the
executed-instruction mix by opcode.

  python3 scripts/ncu_hotspots.py source.csv[.gz]                    the summary
  python3 scripts/ncu_hotspots.py source.csv.gz --seq [MIN_PCT]      every instruction in program order with its
                                                                     share and the running sum (those >= MIN_PCT)
  python3 scripts/ncu_hotspots.py source.csv.gz --regions 0,1488,... the samples, executed count and top stall
                                                                     reasons of each index range [a, b) of --seq"""
import collections
import csv
import gzip
import io
import re
import sys


def rows(path):
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt", errors="replace") as f:
        text = f.read()
    start = text.find('"Address"')
    if start < 0:
        start = text.find('"#"')
    return list(csv.DictReader(io.StringIO(text[start:])))


def num(x):
    try:
        return float(str(x).replace(",", ""))
    except ValueError:
        return 0.0


def columns(rs):
    cols = list(rs[0].keys())
    samp = next((c for c in cols if "Sampling (All" in c), None)
    execd = next((c for c in cols if c.startswith("Instructions Executed")), None)
    src = next((c for c in cols if c in ("Source", "# Source")), cols[1])
    return samp, execd, src


def sequence(path, min_pct):
    """Program order: index, share of the stall samples, running sum, executed count, instruction."""
    rs = rows(path)
    samp, execd, src = columns(rs)
    total = max(sum(num(r[samp]) for r in rs), 1)
    cum = 0.0
    for i, r in enumerate(rs):
        pct = num(r[samp]) / total * 100
        cum += pct
        if pct >= min_pct:
            print(f"{i:5d} {pct:5.2f} {cum:6.2f} {num(r[execd]) if execd else 0:10.3e}  {r[src][:90]}")


def regions(path, bounds):
    """Per index range [a, b) (as --seq numbers them): samples, executed instructions, top stall reasons."""
    rs = rows(path)
    samp, execd, _ = columns(rs)
    reasons = [c for c in rs[0] if c.startswith("stall_") and "Not Issued" not in c]
    total = max(sum(num(r[samp]) for r in rs), 1)
    for a, b in zip(bounds[:-1], bounds[1:]):
        seg = rs[a:b]
        by = collections.Counter()
        for r in seg:
            for c in reasons:
                by[c.replace("stall_", "")] += num(r[c])
        top = ", ".join(f"{k}={v / total * 100:.1f}" for k, v in by.most_common(5))
        print(f"[{a:5d},{b:5d}) samples {sum(num(r[samp]) for r in seg) / total * 100:5.1f}%  "
              f"executed {sum(num(r[execd]) for r in seg) if execd else 0:.3e}  {top}")


def main(path):
    rs = rows(path)
    if not rs:
        print("no source rows found")
        return
    cols = list(rs[0].keys())
    samp, execd, src = columns(rs)
    reasons = [c for c in cols if c.startswith("stall_") or ("Stall" in c and c != samp and "Sampling" not in c)]
    total = sum(num(r[samp]) for r in rs) if samp else 0
    print(f"{len(rs)} instructions; stall samples {total:.0f}; columns: {samp!r}, {execd!r}")
    if samp:
        print("\n## top instructions by stall samples")
        for r in sorted(rs, key=lambda r: -num(r[samp]))[:45]:
            top = sorted(((num(r[c]), c) for c in reasons), reverse=True)[:2]
            why = ", ".join(f"{c.replace('stall_', '')}={v:.0f}" for v, c in top if v > 0)
            print(f"{num(r[samp]) / max(total, 1) * 100:5.1f}%  {r.get('Address', '')}  {r[src][:70]:70s}  {why}")
    if execd:
        mix = collections.Counter()
        stalls = collections.Counter()
        for r in rs:
            op = re.sub(r"^@!?U?P\w+\s+", "", r[src].strip()).split(" ")[0].split(".")[0]
            mix[op] += num(r[execd])
            if samp:
                stalls[op] += num(r[samp])
        tot = sum(mix.values())
        print(f"\n## executed warp instructions by opcode (total {tot:.3e}), with their share of stall samples")
        for op, n in mix.most_common(30):
            print(f"{op:10s} {n:12.3e} {n / tot * 100:5.1f}%   stalls {stalls[op] / max(total, 1) * 100:5.1f}%")


if __name__ == "__main__":
    if len(sys.argv) > 2 and sys.argv[2] == "--seq":
        sequence(sys.argv[1], float(sys.argv[3]) if len(sys.argv) > 3 else 0.0)
    elif len(sys.argv) > 3 and sys.argv[2] == "--regions":
        regions(sys.argv[1], [int(x) for x in sys.argv[3].split(",")])
    else:
        main(sys.argv[1])
