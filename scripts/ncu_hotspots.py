"""Summarise `ncu --page source --print-source sass --csv` output: the instructions with the most
warp stall samples (with their top stall reasons) and the executed-instruction mix by opcode."""
import collections
import csv
import io
import re
import sys


def rows(path):
    text = open(path, errors="replace").read()
    start = text.find('"Address"')
    if start < 0:
        start = text.find('"#"')
    return list(csv.DictReader(io.StringIO(text[start:])))


def num(x):
    try:
        return float(str(x).replace(",", ""))
    except ValueError:
        return 0.0


def main(path):
    rs = rows(path)
    if not rs:
        print("no source rows found")
        return
    cols = list(rs[0].keys())
    samp = next((c for c in cols if "Sampling (All" in c), None)
    execd = next((c for c in cols if c.startswith("Instructions Executed")), None)
    src = next((c for c in cols if c in ("Source", "# Source")), cols[1])
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
    main(sys.argv[1])
