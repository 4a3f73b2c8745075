"""The C++ microbenchmarks' host sources (benchmarks/cpp/*.cpp) compile against today's params structs.

The full build (tests/test_cpp_bench_build.py) is opt-in: it compiles every kernel (minutes). This runs the host
compiler's syntax pass over the benchmarks' .cpp files only (seconds, both kernel paths' code: MSA_WITH_SM90 on), so
a field renamed or removed in csrc/params.h fails in any test run that has a CUDA toolkit's headers, not first on the
GPU machine (s59 found the benchmarks broken by a rename four sessions old). It skips without a toolkit: the CUDA
runtime headers in torch's wheels lack crt/, which cuda_runtime.h includes.
"""
import os
import shutil
import subprocess
from pathlib import Path

import pytest
from helpers import find_nvcc

ROOT = Path(__file__).resolve().parent.parent
SOURCES = sorted((ROOT / "benchmarks" / "cpp").glob("*.cpp"))


def _toolkit_include():
    nvcc = find_nvcc()
    if nvcc is None:
        return None
    inc = Path(nvcc).resolve().parent.parent / "include"
    return inc if (inc / "crt" / "host_defines.h").is_file() else None


def _compiler():
    return os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++")


def test_sources_found():
    names = {p.name for p in SOURCES}
    assert {"bench_common.cpp", "bench_fwd.cpp", "sparse_fwd_bench.cpp", "sparse_bwd_bench.cpp"} <= names, names


@pytest.mark.parametrize("src", SOURCES, ids=[p.name for p in SOURCES])
def test_host_source_compiles(src):
    inc, cxx = _toolkit_include(), _compiler()
    if inc is None or cxx is None:
        pytest.skip("needs a CUDA toolkit's headers (nvcc beside them) and a C++ compiler")
    cmd = [cxx, "-std=c++20", "-fsyntax-only", "-DMSA_WITH_CUDA=1", "-DMSA_WITH_SM90=1", f"-I{ROOT / 'csrc'}",
           "-isystem", str(inc), str(src)]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, f"{' '.join(cmd)}\n{r.stderr[-4000:]}"
