"""The C++ microbenchmarks (benchmarks/cpp) configure, build and answer --help without a GPU.

Opt-in (a full kernel build takes minutes): MSA_TEST_CPP_BENCH=1 python -m pytest tests/test_cpp_bench_build.py
MSA_CUDA_ARCHS (default 90a) picks the archs, MSA_CUTLASS_DIR the CUTLASS headers (default: as setup.py finds
them), MSA_TEST_CPP_BENCH_BUILD a build directory to reuse (default: a fresh temporary one).
"""
import os
import shutil
import subprocess
from pathlib import Path

import pytest
from helpers import find_nvcc, load_file

ROOT = Path(__file__).resolve().parent.parent
BENCHES = ["index_topk", "reverse_index", "sparse_fwd", "sparse_combine", "sparse_bwd", "dense_kl"]

pytestmark = pytest.mark.skipif(os.environ.get("MSA_TEST_CPP_BENCH") != "1",
                                reason="set MSA_TEST_CPP_BENCH=1 to build the C++ microbenchmarks")


def _cutlass_dir():
    """setup.py's lookup (MSA_CUTLASS_DIR, third_party/cutlass, the pinned wheel); None when it finds none."""
    setup_py = load_file(ROOT / "setup.py", "msa_setup")  # defines its helpers only: setup() runs under __main__
    try:
        return setup_py._cutlass_dir()
    except RuntimeError:
        return None


@pytest.fixture(scope="module")
def bindir(tmp_path_factory):
    import torch.utils

    nvcc, cutlass = find_nvcc(), _cutlass_dir()
    if nvcc is None or shutil.which("cmake") is None or shutil.which("ninja") is None:
        pytest.skip("needs nvcc, cmake and ninja")
    if cutlass is None:
        pytest.skip("needs the CUTLASS headers (nvidia-cutlass wheel or MSA_CUTLASS_DIR)")
    build = Path(os.environ.get("MSA_TEST_CPP_BENCH_BUILD") or tmp_path_factory.mktemp("msa-cpp-bench"))
    configure = ["cmake", "-S", str(ROOT), "-B", str(build), "-G", "Ninja", "-DCMAKE_BUILD_TYPE=Release",
                 "-DMSA_BUILD_BENCHMARKS=ON", f"-DMSA_CUDA_ARCHS={os.environ.get('MSA_CUDA_ARCHS', '90a')}",
                 f"-DMSA_CUTLASS_DIR={cutlass}", f"-DCMAKE_PREFIX_PATH={torch.utils.cmake_prefix_path}",
                 f"-DCMAKE_CUDA_COMPILER={nvcc}", f"-DCUDAToolkit_ROOT={Path(nvcc).resolve().parent.parent}"]
    jobs = os.environ.get("MAX_JOBS") or str(os.cpu_count() or 1)
    for cmd in (configure, ["cmake", "--build", str(build), "--target", "msa_benchmarks", "-j", jobs]):
        r = subprocess.run(cmd, capture_output=True, text=True)
        assert r.returncode == 0, f"{' '.join(cmd)} failed:\n{r.stdout[-4000:]}\n{r.stderr[-4000:]}"
    return build / "bin"


@pytest.mark.parametrize("name", BENCHES)
def test_help(bindir, name):
    exe = bindir / f"msa_bench_{name}"
    assert exe.is_file(), f"{exe} was not built"
    r = subprocess.run([str(exe), "--help"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith(f"usage: msa_bench_{name}")
    for flag in ("--n N", "--reps", "--dtype", "--d 64|128", "--portable", "--small-smem", "kernel,shape,ms,tflops,gbps"):
        assert flag in r.stdout, f"--help of {name} does not mention {flag}"


@pytest.mark.parametrize("name", BENCHES)
def test_bad_option(bindir, name):
    r = subprocess.run([str(bindir / f"msa_bench_{name}"), "--no-such-option"], capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 2 and "unknown option --no-such-option" in r.stderr


def test_atomics_bench_built(bindir):
    archs = os.environ.get("MSA_CUDA_ARCHS", "90a").split(";")
    if not any(int(a.rstrip("af")) >= 90 for a in archs):
        pytest.skip("atomics_bench needs an arch >= 90")
    assert (bindir / "msa_atomics_bench").is_file()
