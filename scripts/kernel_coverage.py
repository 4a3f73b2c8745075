"""Which of msa's kernels (and which of their template variants) a run launched, against what csrc/ defines.

Torch-free, so tests load it by path. scripts/sanitize_case.py --kernels FILE writes the demangled names of the
kernels its case launched (one per line, from torch.profiler); `missing(names)` lists what the case failed to reach:
every __global__ function in csrc/ at least once, and each variant in VARIANTS (a Hopper build on an sm_90 GPU runs
both kernel paths: the portable ones under MSA_PORTABLE_KERNELS=1).

    python3 scripts/kernel_coverage.py FILE   # prints what is missing; exit status 1 if anything is
"""
import re
import sys
from pathlib import Path

CSRC = Path(__file__).resolve().parent.parent / "csrc"

# (kernel, {template parameter: value}): the variants a sanitizer run must reach, by the parameter names of the
# kernel's template in csrc/ (the demangled name lists every argument, defaulted ones too). A value matches an
# argument that equals it or ends with "::" + it (FwdMma matches msa::sm90::FwdMma: hence the namespace keys).
VARIANTS = [
    ("index_topk_sm90_kernel", {"WG": "2", "kLse": "false", "kSel": "false"}),
    ("index_topk_sm90_kernel", {"WG": "4", "kLse": "false", "kSel": "false"}),
    ("index_topk_sm90_kernel", {"kLse": "false", "kSel": "true"}),
    ("index_topk_sm90_kernel", {"kLse": "true"}),
    ("index_topk_sm90_kernel", {"kFp8": "true"}),  # the FP8 top-k (index_dtype)
    ("out_pass_ws_kernel", {"T": "__nv_bfloat16", "D": "128", "kDsi": "true"}),
    ("out_pass_ws_kernel", {"T": "__half", "D": "64", "kDsi": "true"}),
    ("out_pass_ws_kernel", {"T": "__nv_bfloat16", "D": "128", "kDsi": "false"}),
    ("out_pass_ws_kernel", {"T": "__half", "D": "64", "kDsi": "false"}),
    ("sparse_bwd_ws_kernel", {"T": "__nv_bfloat16", "D": "128", "kDet": "false", "kTma": "true"}),
    ("sparse_bwd_ws_kernel", {"T": "__half", "D": "64", "kDet": "false", "kTma": "true"}),
    ("sparse_bwd_ws_kernel", {"kDet": "false", "kTma": "false"}),
    ("sparse_bwd_ws_kernel", {"kDet": "true", "kTma": "true"}),
    ("sparse_bwd_ws_kernel", {"kDet": "true", "kTma": "false"}),
    ("sparse_fwd_kernel", {"Mma": "sm90::FwdMma", "kOut": "false"}),
    ("sparse_fwd_kernel", {"Mma": "sm90::FwdMma", "kOut": "true", "kGu": "4"}),
    ("sparse_fwd_kernel", {"Mma": "sm90::FwdMma", "kOut": "true", "kGu": "0"}),
    ("sparse_fwd_kernel", {"Mma": "sm80::FwdMma", "kOut": "false", "kSmall": "false"}),
    ("sparse_fwd_kernel", {"Mma": "sm80::FwdMma", "kOut": "true", "kRows": "128", "kSmall": "false"}),
    ("sparse_fwd_kernel", {"Mma": "sm80::FwdMma", "kOut": "true", "kRows": "64", "kSmall": "false"}),
    ("sparse_fwd_kernel", {"Mma": "sm80::FwdMma", "kOut": "true", "kSmall": "true"}),
    ("sparse_bwd_kernel", {"Mma": "sm90::BwdMma", "kDet": "false", "kDqMap": "true"}),
    ("sparse_bwd_kernel", {"Mma": "sm90::BwdMma", "kDet": "false", "kDqMap": "false"}),
    ("sparse_bwd_kernel", {"Mma": "sm80::BwdMma", "kDet": "false"}),
    ("sparse_bwd_kernel", {"Mma": "sm80::BwdMma", "kDet": "true"}),
    ("sparse_bwd_small_kernel", {"kDet": "false"}),
    ("sparse_bwd_small_kernel", {"kDet": "true"}),
    ("index_dk_kernel", {"Mma": "sm90::DkMma", "kDet": "false"}),
    ("index_dk_kernel", {"Mma": "sm80::DkMma", "kDet": "false"}),
    ("index_dk_kernel", {"kDet": "true"}),
    ("dense_kl_kernel", {"kG": "4", "kWs": "true"}),
    ("dense_kl_kernel", {"kG": "0", "kWs": "true"}),
    ("dense_kl_kernel", {"kG": "4", "kWs": "false"}),  # MSA_DENSE_KL_WS=0 (sanitize_case.dense_kl_two_warpgroups)
    ("dense_kl_kernel", {"kG": "0", "kWs": "false"}),
]


def _split_args(text):
    """Top-level comma split of a template argument list (nested <...> and (...) kept whole)."""
    out, depth, cur = [], 0, ""
    for ch in text:
        if ch in "<(":
            depth += 1
        elif ch in ">)":
            depth -= 1
        if ch == "," and depth == 0:
            out.append(cur.strip())
            cur = ""
        else:
            cur += ch
    if cur.strip():
        out.append(cur.strip())
    return out


def global_kernels(csrc=CSRC):
    """{kernel name: [template parameter names] ([] for a plain function)} of every __global__ in csrc/."""
    found = {}
    for path in sorted(Path(csrc).rglob("*")):
        if path.suffix not in (".cu", ".cuh", ".h"):
            continue
        text = re.sub(r"//[^\n]*", "", path.read_text())  # a __global__ named in a comment is no kernel
        for m in re.finditer(r"__global__", text):
            tail = re.sub(r"__launch_bounds__\([^)]*\)", "", text[m.end():m.end() + 400])
            name = re.search(r"([A-Za-z_][A-Za-z_0-9]*)\s*\(", tail).group(1)
            head = text[max(0, m.start() - 400):m.start()]
            tmpl = re.search(r"template\s*<([^;{}]*)>\s*$", head)
            params = []
            if tmpl:
                for decl in _split_args(tmpl.group(1)):
                    params.append(re.sub(r"\s*=.*$", "", decl).split()[-1])
            found[name] = params
    return found


def parse_launched(name):
    """(kernel, [template arguments]) of a demangled kernel name such as
    "void msa::sm90::out_ws::out_pass_ws_kernel<__nv_bfloat16, 128, true>(msa::SparseFwdParams, CUtensorMap_st)"."""
    s = name.replace("(anonymous namespace)", "anon")
    depth = 0
    for i, ch in enumerate(s):
        if ch == "<":
            depth += 1
        elif ch == ">":
            depth -= 1
        elif ch == "(" and depth == 0:
            break
    else:
        i = len(s)
    prefix, args = s[:i].rstrip(), []
    if prefix.endswith(">"):  # the template argument list: back to its matching "<"
        depth = 0
        for j in range(len(prefix) - 1, -1, -1):
            depth += {">": 1, "<": -1}.get(prefix[j], 0)
            if depth == 0:
                break
        args, prefix = _split_args(prefix[j + 1:-1]), prefix[:j]
    ids = re.findall(r"[A-Za-z_][A-Za-z_0-9]*", prefix)
    return (ids[-1] if ids else None), args


def _matches(arg, want):
    return arg == want or arg.endswith("::" + want)


def missing(names, csrc=CSRC, variants=VARIANTS):
    """What `names` (demangled kernel names) fail to cover: kernels never launched, then variants not reached."""
    kernels = global_kernels(csrc)
    launched = [parse_launched(n) for n in names if "msa::" in n]  # torch's or cub's kernels never count
    seen = {k for k, _ in launched if k}
    out = [f"{k}: never launched" for k in sorted(kernels) if k not in seen]
    for kernel, want in variants:
        params = kernels.get(kernel)
        if params is None:
            out.append(f"{kernel}: no such __global__ in csrc/ (VARIANTS is stale)")
            continue
        unknown = [p for p in want if p not in params]
        if unknown:
            out.append(f"{kernel}: no template parameter {unknown} (VARIANTS is stale)")
            continue
        pos = {p: params.index(p) for p in want}
        if not any(k == kernel and len(args) == len(params) and all(_matches(args[pos[p]], v) for p, v in want.items())
                   for k, args in launched):
            out.append(f"{kernel} with {want}: not launched")
    return out


def main(argv):
    if len(argv) != 2:
        print(__doc__.strip().splitlines()[-1].strip(), file=sys.stderr)
        return 2
    names = [line.strip() for line in Path(argv[1]).read_text().splitlines() if line.strip()]
    gaps = missing(names)
    for g in gaps:
        print(g)
    print(f"{len(names)} kernels launched, {len(gaps)} gaps")
    return 1 if gaps else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
