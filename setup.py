"""Thin CMake + ninja driver for the msa._C torch extension.

Environment switches:
  MSA_CUDA_ARCHS   CUDA archs, default "80;90a" (portable kernels for each, Hopper kernels for 90a)
  MSA_FORCE_CPU=1  build the CPU-only module even when a CUDA toolkit is present
  MSA_CUTLASS_DIR  CUTLASS checkout or include folder (default: third_party/cutlass, then the
                   headers of the pinned nvidia-cutlass wheel, see third_party/cutlass.pin)
  MAX_JOBS         parallel compile jobs (default: all cores)
  MSA_PTXAS_VERBOSE=1  print registers, shared memory and spills of every kernel
  CUDA_HOME / CUDACXX  where nvcc is

Packaging switches (scripts/build_wheels.sh sets them; see README.md, "Install"):
  MSA_LOCAL_VERSION      local version label of a wheel variant: cu130 -> version 0.1.0+cu130, in the
                         metadata and the wheel's file name (letters and digits, '.'-separated)
  MSA_TORCH_REQUIREMENT  the wheel's torch dependency (default "torch>=2.11")
  MSA_COMMIT             the commit recorded in msa/_build_info.py where this tree is no git checkout
                         (else git, else the .msa_commit file, else "unknown")
  SOURCE_DATE_EPOCH      the build date recorded (default: now)

The version's one source is msa/_version.py. Every build writes msa/_build_info.py (git-ignored, shipped
in wheels) next to the compiled module: version, commit, date, the torch built against, the stable-ABI
target, the CUDA toolkit and archs; `python -m msa.info` prints it.
"""
import datetime
import importlib.util
import json
import os
import pprint
import re
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext
from setuptools.command.sdist import sdist

ROOT = Path(__file__).resolve().parent
DIST_NAME = "msa-attention"  # the PyPI name "msa" is another project; the import name stays msa


def _base_version():
    text = (ROOT / "msa" / "_version.py").read_text()
    m = re.search(r'^base_version\s*=\s*"([^"]+)"', text, re.M)
    if m is None:
        raise RuntimeError("msa: msa/_version.py holds no base_version = \"...\"")
    return m.group(1)


def _version():
    """The base version plus MSA_LOCAL_VERSION as the PEP 440 local label, normalized (lower case,
    '.'-separated) so the wheel's file name and its metadata carry the same string."""
    base = _base_version()
    label = os.environ.get("MSA_LOCAL_VERSION", "").strip()
    if not label:
        return base
    norm = re.sub(r"[-_.]+", ".", label.lower())
    if not re.fullmatch(r"[a-z0-9]+(\.[a-z0-9]+)*", norm):
        raise SystemExit(f"msa: MSA_LOCAL_VERSION={label!r} is not a PEP 440 local label (letters and digits, "
                         f"'.'-separated, e.g. cu130)")
    return f"{base}+{norm}"


def _torch_requirement():
    req = os.environ.get("MSA_TORCH_REQUIREMENT", "").strip() or "torch>=2.11"
    if not re.match(r"torch\s*([<>=!~(]|$)", req):
        raise SystemExit(f"msa: MSA_TORCH_REQUIREMENT={req!r}: expected a requirement on torch, e.g. 'torch>=2.11'")
    return req


def _git(*args):
    try:
        out = subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() if out.returncode == 0 else None


def _commit():
    """MSA_COMMIT, else git when ROOT is the top of a checkout (an exported tree inside another
    repository must not report that one's HEAD), else .msa_commit, else "unknown"."""
    if os.environ.get("MSA_COMMIT", "").strip():
        return os.environ["MSA_COMMIT"].strip()
    top = _git("rev-parse", "--show-toplevel")
    if top and Path(top).resolve() == ROOT:
        sha = _git("rev-parse", "HEAD")
        if sha:
            return sha + ("+dirty" if _git("status", "--porcelain", "--untracked-files=no") else "")
    stamp = ROOT / ".msa_commit"
    if stamp.is_file() and stamp.read_text().strip():
        return stamp.read_text().strip()
    return "unknown"


def _build_date():
    epoch = os.environ.get("SOURCE_DATE_EPOCH")
    when = datetime.datetime.fromtimestamp(int(epoch), datetime.timezone.utc) if epoch else \
        datetime.datetime.now(datetime.timezone.utc)
    return when.replace(microsecond=0).isoformat().replace("+00:00", "Z")


def _nvcc_version(nvcc):
    """'13.0.88' from `nvcc --version` ("Cuda compilation tools, release 13.0, V13.0.88")."""
    try:
        out = subprocess.run([nvcc, "--version"], capture_output=True, text=True, timeout=60).stdout
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    m = re.search(r"\bV(\d+\.\d+\.\d+)", out) or re.search(r"release (\d+\.\d+)", out)
    return m.group(1) if m else "unknown"


def _torch_target(cmake_args, build_dir):
    """The stable-ABI target the build was configured with: every CMake variable whose name holds
    TORCH_TARGET, from the -D arguments passed and from the configured cache (a default set in
    CMakeLists.txt shows there). {} for a build against this torch's full (version-locked) ABI."""
    found = {}
    cache = build_dir / "CMakeCache.txt"
    if cache.is_file():
        for line in cache.read_text(errors="replace").splitlines():
            m = re.match(r"([A-Za-z0-9_]*TORCH_TARGET[A-Za-z0-9_]*):[A-Z]+=(.*)$", line)
            if m and m.group(2).strip():
                found[m.group(1)] = m.group(2).strip()
    for a in cmake_args:
        m = re.match(r"-D([A-Za-z0-9_]*TORCH_TARGET[A-Za-z0-9_]*)(?::[A-Z]+)?=(.*)$", a)
        if m and m.group(2).strip():
            found[m.group(1)] = m.group(2).strip()
    return found


def _uses_stable_abi():
    """Whether the bindings register through PyTorch's stable ABI (torch/csrc/stable)."""
    src = ROOT / "csrc" / "torch_bindings.cpp"
    return src.is_file() and "STABLE_TORCH_LIBRARY" in src.read_text(errors="replace")


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
    def run(self):
        super().run()  # builds into build_lib (and copies the module into the source tree when inplace)
        info = getattr(self, "_msa_build_info", None)
        if info is None:
            return
        dests = {Path(self.build_lib).resolve() / "msa"}
        if self.inplace:  # editable installs and build_ext --inplace run from the source tree
            dests.add(ROOT / "msa")
        text = ('"""Written by setup.py at build time (git-ignored; shipped in wheels). `python -m msa.info` prints '
                'it."""\n\n' f"BUILD_INFO = {pprint.pformat(info, sort_dicts=False, width=110)}\n"
                "version = BUILD_INFO[\"version\"]\n")
        for d in dests:
            d.mkdir(parents=True, exist_ok=True)
            (d / "_build_info.py").write_text(text)
        print(f"msa: build info {json.dumps(info)}", file=sys.stderr)

    def build_extension(self, ext):
        import torch.utils

        target = Path(self.get_ext_fullpath(ext.name)).resolve()
        out_dir = target.parent
        build_dir = Path(self.build_temp).resolve() / "cmake"
        build_dir.mkdir(parents=True, exist_ok=True)
        nvcc = _nvcc()
        archs = os.environ.get("MSA_CUDA_ARCHS", "80;90a")
        args = [
            f"-S{ROOT}", f"-B{build_dir}", "-GNinja",
            f"-DCMAKE_BUILD_TYPE={os.environ.get('MSA_BUILD_TYPE', 'Release')}",
            f"-DCMAKE_PREFIX_PATH={torch.utils.cmake_prefix_path}",
            f"-DMSA_PYTHON_INCLUDE_DIR={sysconfig.get_paths()['include']}",
            f"-DMSA_OUTPUT_DIR={out_dir}",
        ]
        env = dict(os.environ)
        if nvcc is None:
            print("msa: no CUDA toolkit (nvcc) found: building the CPU-only module. Only the CPU path "
                  "(the chunked PyTorch reference) will exist; set CUDA_HOME or CUDACXX to build the GPU "
                  "kernels.", file=sys.stderr)
            args.append("-DMSA_WITH_CUDA=OFF")
        else:
            args += ["-DMSA_WITH_CUDA=ON", f"-DCMAKE_CUDA_COMPILER={nvcc}",
                     f"-DCUDAToolkit_ROOT={Path(nvcc).resolve().parent.parent}",
                     f"-DMSA_CUDA_ARCHS={archs}",
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
        target_abi = _torch_target(args, build_dir)
        self._msa_build_info = {
            "version": self.distribution.get_version(),
            "distribution": DIST_NAME,
            "commit": _commit(),
            "build_date": _build_date(),
            "torch_version": torch.__version__,          # the torch the build compiled against
            "torch_cuda": torch.version.cuda,             # ... and the CUDA that torch was built for
            "torch_requirement": _torch_requirement(),    # what the wheel's metadata asks for
            "stable_abi": _uses_stable_abi(),             # bindings through torch/csrc/stable
            "torch_target": next(iter(target_abi.values()), None),  # the stable-ABI target (None: none)
            "torch_target_cmake": target_abi,             # every *TORCH_TARGET* CMake variable seen
            "cuda": nvcc is not None,
            "cuda_toolkit": _nvcc_version(nvcc) if nvcc else "none",
            "cuda_archs": archs if nvcc else "none",
            "build_type": os.environ.get("MSA_BUILD_TYPE", "Release"),
            "build_python": sys.version.split()[0],
        }


class Sdist(sdist):
    def make_release_tree(self, base_dir, files):
        """The sdist carries .msa_commit: a build from it has no git to ask."""
        super().make_release_tree(base_dir, files)
        commit = _commit()
        if commit != "unknown":
            stamp = Path(base_dir) / ".msa_commit"
            if stamp.exists():
                stamp.unlink()  # a hard link to the tree's own file: do not write through it
            stamp.write_text(commit + "\n")


# Guarded so tools can import this file for its helpers (tests/test_cpp_bench_build.py: _cutlass_dir);
# pip's setuptools backend and `python setup.py ...` both run it as __main__.
if __name__ == "__main__":
    setup(
        name=DIST_NAME,
        version=_version(),
        install_requires=[_torch_requirement()],
        ext_modules=[CMakeExtension("msa._C")],
        cmdclass={"build_ext": CMakeBuild, "sdist": Sdist},
        options={"bdist_wheel": {"py_limited_api": "cp39"}},
    )
