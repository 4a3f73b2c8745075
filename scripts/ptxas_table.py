"""Per-kernel ptxas figures from a build log made with MSA_PTXAS_VERBOSE=1 (scripts/gpu_check.sh keeps it
as LOGDIR/build.log): registers, spill stores / loads, stack frame and static shared memory of every
entry function and arch, as a markdown table. python scripts/ptxas_table.py build.log [name-regex]"""
import re
import subprocess
import sys


def demangle(names):
    try:
        out = subprocess.run(["c++filt"], input="\n".join(names), capture_output=True, text=True, check=True)
        return out.stdout.splitlines()
    except (OSError, subprocess.CalledProcessError):
        return names


def parse(text):
    rows, cur = [], None
    for line in text.splitlines():
        m = re.search(r"Compiling entry function '(\S+)' for '(\S+)'", line)
        if m:
            cur = dict(name=m.group(1), arch=m.group(2), regs=None, spill_st=0, spill_ld=0, stack=0, smem=0)
            rows.append(cur)
            continue
        if cur is None:
            continue
        m = re.search(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads", line)
        if m:
            cur["stack"], cur["spill_st"], cur["spill_ld"] = map(int, m.groups())
        m = re.search(r"Used (\d+) registers(?:.*?(\d+) bytes smem)?", line)
        if m:
            cur["regs"] = int(m.group(1))
            cur["smem"] = int(m.group(2) or 0)
    return [r for r in rows if r["regs"] is not None]


def main():
    rows = parse(open(sys.argv[1]).read())
    if len(sys.argv) > 2:
        rows = [r for r in rows if re.search(sys.argv[2], r["name"])]
    names = demangle([r["name"] for r in rows])
    print("| kernel | arch | registers | spill st / ld (B) | stack (B) | static smem (B) |")
    print("|---|---|---|---|---|---|")
    seen = set()
    for r, n in sorted(zip(rows, names), key=lambda x: (x[1], x[0]["arch"])):
        key = (n, r["arch"])
        if key in seen:
            continue
        seen.add(key)
        n = re.sub(r"msa::(sm80|sm90)::|\(anonymous namespace\)::|__nv_bfloat16|\(msa::\w+\)", lambda m: {
            "__nv_bfloat16": "bf16"}.get(m.group(0), ""), n)
        print(f"| `{n}` | {r['arch']} | {r['regs']} | {r['spill_st']} / {r['spill_ld']} | {r['stack']} | {r['smem']} |")


if __name__ == "__main__":
    main()
