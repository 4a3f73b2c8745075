#!/usr/bin/env python3
"""Compile every CUDA source CMakeLists.txt lists (portable ones for sm_80, Hopper ones for sm_90a) to
cubins and write each kernel's SASS to OUT/<arch>/<symbol>.sass (and its registers, stack, shared and local
bytes to <symbol>.res), so that a refactor can be checked to leave the machine code unchanged without a GPU:
run it before and after, then `diff -r BEFORE AFTER` or scripts/sass_compare.py BEFORE AFTER.

  python3 scripts/sass_functions.py OUT [--rename smxx=sm80 ...] [--jobs 2] [--only REGEX]

--rename OLD=NEW rewrites OLD to NEW in symbol names and code (a namespace moved between the two trees; the
mangled names keep their length when OLD and NEW do). Needs nvcc and the CUTLASS headers (nvidia-cutlass
in the venv, or MSA_CUTLASS_INCLUDE)."""
import argparse
import concurrent.futures as cf
import os
import re
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ARCHS = {"MSA_SM80_SOURCES": ("sm_80", "compute_80"), "MSA_SM90_SOURCES": ("sm_90a", "compute_90a")}


def sources():
    text = open(os.path.join(ROOT, "CMakeLists.txt")).read()
    for var, arch in ARCHS.items():
        m = re.search(r"set\(" + var + r"\s+([^)]*)\)", text)
        for path in m.group(1).split():
            yield path, arch


def cutlass_include():
    if os.environ.get("MSA_CUTLASS_INCLUDE"):
        return os.environ["MSA_CUTLASS_INCLUDE"]
    import cutlass_library
    return os.path.join(os.path.dirname(cutlass_library.__file__), "source", "include")


def cuobjdump():
    """cuobjdump from the CUDA toolkit, else the copy triton ships (the pip torch's dependency)."""
    import shutil
    if shutil.which("cuobjdump"):
        return "cuobjdump"
    try:
        import triton
        path = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
        if os.path.exists(path):
            return path
    except ImportError:
        pass
    sys.exit("sass_functions.py: no cuobjdump (CUDA toolkit or triton)")


def compile_one(path, arch, inc, tmp):
    sm, compute = arch
    cubin = os.path.join(tmp, path.replace("/", "_") + "." + sm + ".cubin")
    cmd = ["nvcc", "-std=c++17", "-O3", "--expt-relaxed-constexpr", "-cubin", "-o", cubin,
           f"-gencode=arch={compute},code={sm}", "-Icsrc", "-I" + inc, "-DMSA_WITH_SM90", path]
    subprocess.run(cmd, cwd=ROOT, check=True)
    sass = subprocess.run([cuobjdump(), "-sass", cubin], check=True, capture_output=True, text=True).stdout
    res = subprocess.run([cuobjdump(), "-res-usage", cubin], check=True, capture_output=True, text=True).stdout
    return sm, sass, res


def resources(dump):
    """{symbol: 'REG:.. STACK:.. SHARED:.. LOCAL:..'} from a cuobjdump -res-usage listing."""
    out = {}
    for name, usage in re.findall(r"Function (\S+?):\s*\n\s*(REG:.*)", dump):
        out[anon(name)] = " ".join(f for f in usage.split() if f.split(":")[0] in ("REG", "STACK", "SHARED", "LOCAL"))
    return out


def functions(dump):
    """(symbol, body) per function of a cuobjdump -sass listing; the body without the addresses' comments."""
    for part in re.split(r"\n\s*Function : ", dump)[1:]:
        name, _, body = part.partition("\n")
        # addresses' comments and column padding (set by the cubin's longest line) dropped; an anonymous
        # namespace's hash (from the file's path) made neutral, so a moved file compares equal
        lines = [" ".join(re.sub(r"/\*[0-9a-f]{4,}\*/", "", l).split()) for l in body.splitlines()]
        yield (anon(name.strip()), anon("\n".join(l for l in lines if l)))


def anon(text):
    """An anonymous namespace's mangled name (<len>_GLOBAL__N__<hash>_<len>_<file>_<hash>) -> ANON."""
    return re.sub(r"\d\d_GLOBAL__N__[0-9a-f]{8}_\d+_\w*?_[0-9a-f]{8}(?=\d)", "ANON", text)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--rename", action="append", default=[])
    ap.add_argument("--jobs", type=int, default=os.cpu_count() or 2)
    ap.add_argument("--only", default="", help="compile only the sources matching this regex")
    a = ap.parse_args()
    renames = [r.split("=", 1) for r in a.rename]
    inc = cutlass_include()
    todo = [(p, arch) for p, arch in sources() if re.search(a.only, p)]
    count = 0
    with tempfile.TemporaryDirectory() as tmp, cf.ThreadPoolExecutor(a.jobs) as pool:
        for sm, dump, res_dump in pool.map(lambda t: compile_one(*t, inc, tmp), todo):
            os.makedirs(os.path.join(a.out, sm), exist_ok=True)
            res = resources(res_dump)
            for name, body in functions(dump):
                usage = res.get(name, "")
                for old, new in renames:
                    name, body = name.replace(old, new), body.replace(old, new)
                with open(os.path.join(a.out, sm, name[:200] + ".sass"), "w") as f:
                    f.write(body + "\n")
                with open(os.path.join(a.out, sm, name[:200] + ".res"), "w") as f:  # registers, stack, shared
                    f.write(usage + "\n")
                count += 1
    print(f"{len(todo)} sources, {count} functions -> {a.out}", file=sys.stderr)


if __name__ == "__main__":
    main()
