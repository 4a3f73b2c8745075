#!/usr/bin/env python3
"""The order of a kernel's landmark instructions, from a scripts/sass_functions.py dump, to check on a machine without
a GPU that a change schedules as written (which wgmmas are issued before which waits, where the exponentials, the
barriers and the shared-memory stores fall, whether ptxas spilled inside a loop):

  python3 scripts/sass_functions.py /tmp/s --only sparse_bwd_sm90_bf16_d128
  python3 scripts/sass_order.py /tmp/s/sm_90a 'bwd_ws.*Lb0ELb1E' [--from REGEX] [--lines N]

FUNCTION is a .sass file or a folder and a regex naming one of its files. Landmarks: HGMMA (shape, accumulator
register, A from registers or descriptors), WARPGROUP.ARRIVE / DEPBAR, BAR, SYNCS (mbarrier waits and arrivals),
MUFU, HMMA (mma.sync), SHFL, shared-memory stores and loads, global loads, stores and reductions, local memory
(spills), bulk / TMA copies, branches backwards (loops).
Consecutive landmarks of the same kind are counted as one line ("8x HGMMA.64x64x16 R184 desc").
--from starts at the first instruction matching REGEX (e.g. 'TRYWAIT' for a loop's top)."""
import argparse
import os
import re
import sys

LANDMARK = re.compile(r"^(HGMMA|WARPGROUP|BAR|SYNCS|MUFU|STS|LDS|LDSM|STL|LDL|UBLKRED|UBLKCP|UTMALDG|UTMASTG|BRA|"
                      r"MEMBAR|FENCE|REDG|RED|ATOMG|HMMA|SHFL|LDG|STG|LDGSTS)\b")


def body_of(path, regex):
    if os.path.isdir(path):
        hits = sorted(f for f in os.listdir(path) if f.endswith(".sass") and re.search(regex or "", f))
        if len(hits) != 1:
            sys.exit(f"sass_order.py: {len(hits)} files in {path} match {regex!r}: " + ", ".join(hits[:8]))
        path = os.path.join(path, hits[0])
    with open(path) as f:
        return f.read().splitlines()


def label(line, index):
    """A landmark's kind (the key runs are merged by) and its text, or None."""
    text = re.sub(r"^@!?U?P\w+\s+", "", line.split(";")[0].strip())  # predicate and encoding dropped
    m = LANDMARK.match(text)
    if not m:
        return None
    op = text.split()[0]
    kind = m.group(1)
    if kind == "HGMMA":
        regs = re.findall(r"\bR\d+\b", text)
        a = "desc" if "gdesc" in text.split(",")[1] else "regs"
        return (op, regs[0] if regs else "", a), f"{op} {regs[0] if regs else ''} A:{a}"
    if kind == "BRA":
        target = re.search(r"0x([0-9a-f]+)", text)
        if not target or int(target.group(1), 16) >= 16 * index:  # instructions are 16 bytes
            return None  # forward branches are noise here
        return ("BRA",), "BRA back to " + target.group(0)
    if kind in ("BAR", "SYNCS", "WARPGROUP", "MEMBAR", "FENCE"):
        return (text,), text
    return (op,), op


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("function", help="a .sass file, or a folder of them")
    ap.add_argument("regex", nargs="?", default="", help="with a folder: the file's name")
    ap.add_argument("--from", dest="start", default="", help="start at the first instruction matching this")
    ap.add_argument("--lines", type=int, default=80, help="print at most this many landmark lines")
    a = ap.parse_args()
    lines = body_of(a.function, a.regex)
    # cuobjdump numbers instructions by address in a trailing comment that sass_functions.py drops: label() counts
    # them (16 bytes each) to tell a backward branch.
    instrs = [l for l in lines if l.strip() and not l.strip().startswith(".") and ";" in l]
    begin = 0
    if a.start:
        begin = next((i for i, l in enumerate(instrs) if re.search(a.start, l)), None)
        if begin is None:
            sys.exit(f"sass_order.py: no instruction matches {a.start!r}")
    out = []  # runs of one kind: [key, first instruction, count, text]
    for i in range(begin, len(instrs)):
        got = label(instrs[i], i)
        if got is None:
            continue
        if out and out[-1][0] == got[0]:
            out[-1][2] += 1
        else:
            out.append([got[0], i, 1, got[1]])
    for _, first, count, text in out[:a.lines]:
        print(f"{first:6d}  {str(count) + 'x ' if count > 1 else '   '}{text}")
    if len(out) > a.lines:
        print(f"... {len(out) - a.lines} more landmark lines (--lines)")


if __name__ == "__main__":
    main()
