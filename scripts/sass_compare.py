#!/usr/bin/env python3
r"""Compare two scripts/sass_functions.py dumps kernel by kernel: identical, or (when a refactor changed the
code's shape) whether the counts of the instructions that carry the work agree: tensor-core ops, math,
shared / global / local memory, barriers, shuffles. Equal counts with different integer arithmetic or
order is what a refactor that keeps the algorithm looks like; it is evidence, not proof (the GPU tests
decide), and spills (STL / LDL) and registers matter for speed: where the two dumps have .res files, a kernel
whose registers, stack, shared or local bytes moved shows them as [before -> after].

  python3 scripts/sass_compare.py BEFORE AFTER [--map REGEX=REPLACEMENT ...]

--map rewrites BEFORE's symbol names to AFTER's (Python re.sub, applied in order), for kernels whose
template parameters moved. The mainloop split of the sparse kernels (s21, landed s22), as it was checked:
  python3 scripts/sass_functions.py /tmp/a   # at the base, then the same with the patch applied -> /tmp/b
  python3 scripts/sass_compare.py /tmp/a /tmp/b \
    --map '_ZN3msa4sm8017sparse_fwd_kernelI(\w+?)Li(\d+)ELb(\d)ELb1ELi128ELi(\d+)ELb0E=_ZN3msa4smxx17sparse_fwd_kernelINS_4sm906FwdMmaE\1Li\2ELb\3ELi128ELi\4ELb0E' \
    --map '_ZN3msa4sm8017sparse_fwd_kernelI(\w+?)Li(\d+)ELb(\d)ELb0ELi(\d+)ELi0ELb(\d)E=_ZN3msa4smxx17sparse_fwd_kernelINS_4sm806FwdMmaE\1Li\2ELb\3ELi\4ELi0ELb\5E' \
    --map '_ZN3msa4sm8017sparse_bwd_kernelI(\w+?)Li(\d+)ELb1ELb(\d)E=_ZN3msa4smxx17sparse_bwd_kernelINS_4sm906BwdMmaE\1Li\2ELb\3E' \
    --map '_ZN3msa4sm8017sparse_bwd_kernelI(\w+?)Li(\d+)ELb0ELb(\d)E=_ZN3msa4smxx17sparse_bwd_kernelINS_4sm806BwdMmaE\1Li\2ELb\3E'
"""
import argparse
import collections
import os
import re
import sys

# Opcodes (the part before the first '.') counted: tensor-core, math, memory (incl. reductions, atomics, bulk /
# TMA copies), barriers, shuffles, spills.
CORE = ("HGMMA", "HMMA", "LDSM", "MUFU", "FFMA", "FMUL", "FADD", "FMNMX", "STS", "LDS", "LDG", "STG", "REDG", "RED",
        "ATOMG", "ATOMS", "ATOM", "UBLKRED", "UBLKCP", "UTMALDG", "UTMASTG", "LDGSTS", "BAR", "SYNCS", "SHFL",
        "WARPGROUP", "STL", "LDL")


def core_ops(text):
    counts = collections.Counter()
    for line in text.splitlines():
        ins = line.split(";")[0].strip()
        if not ins or ins.startswith("/*"):
            continue
        if ins.startswith("@"):
            ins = ins.split(None, 1)[1]
        op = ins.split()[0].split(".")[0]
        if op in CORE:
            counts[op] += 1
    return counts


def usage(stem):
    """The kernel's resource line (REG / STACK / SHARED / LOCAL) that sass_functions.py wrote, or ''."""
    try:
        return open(stem + ".res").read().strip()
    except OSError:
        return ""


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("before")
    ap.add_argument("after")
    ap.add_argument("--map", action="append", default=[])
    a = ap.parse_args()
    maps = [m.split("=", 1) for m in a.map]
    tally = collections.Counter()
    for arch in sorted(os.listdir(a.before)):
        for f in sorted(os.listdir(os.path.join(a.before, arch))):
            if not f.endswith(".sass"):
                continue
            old = f[:-len(".sass")]
            new = old
            for pat, rep in maps:
                new = re.sub(pat, rep, new)
            path = os.path.join(a.after, arch, new + ".sass")
            if not os.path.exists(path):
                print(f"missing  {arch} {new}")
                tally["missing"] += 1
                continue
            x = open(os.path.join(a.before, arch, f)).read().replace(old, "KERNEL")
            y = open(path).read().replace(new, "KERNEL")
            ra, rb = usage(os.path.join(a.before, arch, old)), usage(path[:-len(".sass")])
            res = f" [{ra} -> {rb}]" if ra != rb else ""
            if x == y:
                tally["identical"] += 1
                if res:
                    print(f"{'identical':15s} {arch} {old}{res}")
                continue
            cx, cy = core_ops(x), core_ops(y)
            diff = {k: (cx[k], cy[k]) for k in sorted(set(cx) | set(cy)) if cx[k] != cy[k]}
            kind = "same-core-ops" if not diff else "core-ops-differ"
            tally[kind] += 1
            print(f"{kind:15s} {arch} {old} lines {x.count(chr(10))} -> {y.count(chr(10))} {diff or ''}{res}")
    print(", ".join(f"{k} {v}" for k, v in sorted(tally.items())), file=sys.stderr)
    return 0 if tally["missing"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
