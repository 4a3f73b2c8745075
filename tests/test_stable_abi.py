"""The compiled module uses PyTorch's stable ABI only (csrc/api/stable.h): no symbol of torch's C++ API
(at::, c10::, torch:: mangled names) and no libc10 / libtorch_python dependency, so one build loads on
every torch >= the TORCH_TARGET_VERSION it was built for. A C++ torch call slipping into the host code
would pass every other test on the torch it was built with and fail to import on the next release."""
import glob
import os
import re
import shutil
import subprocess

import pytest

import msa

LIB = glob.glob(os.path.join(os.path.dirname(msa.__file__), "_C*.so"))


def _run(*cmd):
    return subprocess.run(cmd, check=True, capture_output=True, text=True).stdout


@pytest.mark.skipif(not LIB or shutil.which("nm") is None or shutil.which("readelf") is None,
                    reason="needs the built msa._C and binutils (nm, readelf)")
def test_no_torch_cpp_symbols_or_libraries():
    undefined = _run("nm", "-D", "--undefined-only", LIB[0]).split()
    cpp = sorted({s for s in undefined if re.match(r"_ZN?K?(2at|3c10|5torch|6caffe2)", s)})
    assert not cpp, f"torch C++ symbols in msa._C (not stable ABI): {cpp[:10]}"
    shims = [s for s in undefined if s.startswith(("aoti_torch_", "torch_"))]
    assert shims, "expected the stable C shim (aoti_torch_*) to be used"
    needed = re.findall(r"\(NEEDED\)\s+Shared library: \[([^\]]+)\]", _run("readelf", "-d", LIB[0]))
    assert not [n for n in needed if n.startswith(("libc10", "libtorch_python", "libtorch.so"))], needed
