"""Summary of scripts/clock_probe.sh's nvidia-smi samples (timestamp, SM MHz, W, C, clock-event reasons bitmask):
the loaded samples only (SM clock above idle and power above 150 W), their count, the SM clock's median / min / max,
the power's median and max, the last temperature and each reason bitmask's share (0x4 = software power cap,
0x20 = software thermal slowdown, 0x40 = hardware thermal slowdown, 0x80 = hardware power brake, 0x1 = idle).
    python3 scripts/clock_probe_summary.py FILE.smi.csv"""
import statistics
import sys
from collections import Counter


def main(path):
    rows = []
    with open(path) as f:
        for line in f:
            parts = [p.strip() for p in line.split(",")]
            if len(parts) != 5:
                continue
            try:
                rows.append((float(parts[1]), float(parts[2]), float(parts[3]), parts[4]))
            except ValueError:
                continue
    loaded = [r for r in rows if r[1] > 150.0 and r[0] > 500.0]
    if not loaded:
        print(f"clock samples: {len(rows)}, none under load")
        return
    clk = [r[0] for r in loaded]
    pw = [r[1] for r in loaded]
    reasons = Counter(r[3] for r in loaded)
    share = ", ".join(f"{k} {v / len(loaded):.0%}" for k, v in reasons.most_common())
    print(f"clock samples under load: {len(loaded)} of {len(rows)}; SM MHz median {statistics.median(clk):.0f} "
          f"(min {min(clk):.0f}, max {max(clk):.0f}); W median {statistics.median(pw):.0f} (max {max(pw):.0f}); "
          f"last {loaded[-1][2]:.0f} C; reasons: {share}")


if __name__ == "__main__":
    main(sys.argv[1])
