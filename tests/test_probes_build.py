"""The standalone probes in benchmarks/cpp (built by nvcc alone, outside CMake: their headers give the line) still
compile against csrc as the kernels' headers change. Needs nvcc (skips without it)."""
import subprocess
from pathlib import Path

import pytest
from helpers import find_nvcc

ROOT = Path(__file__).resolve().parent.parent
PROBES = ["wgmma_rate_bench.cu", "tma_box_offset_probe.cu"]


@pytest.mark.parametrize("probe", PROBES)
def test_probe_compiles(tmp_path, probe):
    nvcc = find_nvcc()
    if nvcc is None:
        pytest.skip("needs nvcc")
    src = ROOT / "benchmarks" / "cpp" / probe
    header = src.read_text().split("#include", 1)[0]
    assert "nvcc " in header, f"{probe}: its header should give the build line"
    cmd = [nvcc, "-O3", "-std=c++20", "--expt-relaxed-constexpr", "-gencode=arch=compute_90a,code=sm_90a",
           f"-I{ROOT / 'csrc'}", "-o", str(tmp_path / "probe"), str(src)]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, f"{' '.join(cmd)} failed:\n{r.stderr[-4000:]}"
    assert (tmp_path / "probe").is_file()
