"""Thin CMake + ninja driver for the msa._C torch extension.

Environment switches:
  MSA_CUDA_ARCHS   CUDA archs, default "80;90a" (portable kernels for each, Hopper kernels for 90a)
  MSA_FORCE_CPU=1  build the CPU-only module even when a CUDA toolkit is present
  MSA_CUTLASS_DIR  CUTLASS checkout or include folder (default: third_party/cutlass, then the
                   headers of the pinned nvidia-cutlass wheel, see third_party/cutlass.pin)
  MAX_JOBS         parallel compile jobs (default: all cores)
  MSA_PTXAS_VERBOSE=1  print registers, shared memory and spills of every kernel
  CUDA_HOME / CUDACXX  where nvcc is
"""
import importlib.util
import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

ROOT = Path(__file__).resolve().parent


def _nvcc():
    if os.environ.get("MSA_FORCE_CPU", "0") == "1":
        return None
    cands = [os.environ.get("CUDACXX")]
    for var in ("CUDA_HOME", "CUDA_PATH"):
        if os.environ.get(var):
            cands.append(os.path.join(os.environ[var], "bin", "nvcc"))
    # The toolkit's own nvcc before PATH: a wrapper script on PATH hides where the toolkit is.
    cands += ["/usr/local/cuda/bin/nvcc", shutil.which("nvcc")]
    for c in cands:
        if c and os.path.isfile(c) and os.access(c, os.X_OK):
            return c
    return None


def _cutlass_dir():
    if os.environ.get("MSA_CUTLASS_DIR"):
        return os.environ["MSA_CUTLASS_DIR"]
    local = ROOT / "third_party" / "cutlass" / "include"
    if (local / "cute" / "tensor.hpp").exists():
        return str(local)
    spec = importlib.util.find_spec("cutlass_library")
    if spec is not None and spec.submodule_search_locations:
        inc = Path(list(spec.submodule_search_locations)[0]) / "source" / "include"
        if (inc / "cute" / "tensor.hpp").exists():
            return str(inc)
    raise RuntimeError(
        "msa: CUTLASS headers not found. Install the pinned wheel (pip install nvidia-cutlass==4.2.0.0, "
        "see third_party/cutlass.pin) or set MSA_CUTLASS_DIR to a CUTLASS checkout.")


class CMakeExtension(Extension):
    def __init__(self, name):
        super().__init__(name, sources=[], py_limited_api=True)


class CMakeBuild(build_ext):
    def build_extension(self, ext):
        import torch.utils

        target = Path(self.get_ext_fullpath(ext.name)).resolve()
        out_dir = target.parent
        build_dir = Path(self.build_temp).resolve() / "cmake"
        build_dir.mkdir(parents=True, exist_ok=True)
        nvcc = _nvcc()
        args = [
            f"-S{ROOT}", f"-B{build_dir}", "-GNinja",
            f"-DCMAKE_BUILD_TYPE={os.environ.get('MSA_BUILD_TYPE', 'Release')}",
            f"-DCMAKE_PREFIX_PATH={torch.utils.cmake_prefix_path}",
            f"-DMSA_PYTHON_INCLUDE_DIR={sysconfig.get_paths()['include']}",
            f"-DMSA_OUTPUT_DIR={out_dir}",
            f"-DPython_EXECUTABLE={sys.executable}",
        ]
        env = dict(os.environ)
        if nvcc is None:
            print("msa: no CUDA toolkit (nvcc) found: building the CPU-only module. Only the CPU path "
                  "(the chunked PyTorch reference) will exist; set CUDA_HOME or CUDACXX to build the GPU "
                  "kernels.", file=sys.stderr)
            args.append("-DMSA_WITH_CUDA=OFF")
        else:
            args += ["-DMSA_WITH_CUDA=ON", f"-DCMAKE_CUDA_COMPILER={nvcc}",
                     f"-DCUDA_TOOLKIT_ROOT_DIR={Path(nvcc).resolve().parent.parent}",
                     f"-DMSA_CUDA_ARCHS={os.environ.get('MSA_CUDA_ARCHS', '80;90a')}",
                     f"-DMSA_CUTLASS_DIR={_cutlass_dir()}",
                     f"-DMSA_PTXAS_VERBOSE={'ON' if os.environ.get('MSA_PTXAS_VERBOSE') == '1' else 'OFF'}"]
            # torch's CMake config wants an arch list (else it probes the GPU); ours are set per source.
            env.setdefault("TORCH_CUDA_ARCH_LIST", "8.0;9.0")
        jobs = os.environ.get("MAX_JOBS") or str(os.cpu_count() or 1)
        subprocess.run(["cmake", *args], check=True, env=env)
        subprocess.run(["cmake", "--build", str(build_dir), "-j", jobs], check=True, env=env)
        built = out_dir / "_C.abi3.so"
        if built != target:  # setuptools picked another suffix: keep the name it will look for
            shutil.move(str(built), str(target))


setup(
    ext_modules=[CMakeExtension("msa._C")],
    cmdclass={"build_ext": CMakeBuild},
    options={"bdist_wheel": {"py_limited_api": "cp39"}},
)
