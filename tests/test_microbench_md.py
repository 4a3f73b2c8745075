"""scripts/microbench_md.py: the stored form of a C++ microbenchmark run (header fields and the CSV verbatim)."""
import datetime
import os
import subprocess
import sys
from pathlib import Path

from helpers import load_file

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "scripts" / "microbench_md.py"
CSV = ("kernel,shape,ms,tflops,gbps\n"
       "index_topk/sm90,B=1 N=8192 Hq=16 Hkv=2 Hi=4 Hki=1 D=128 Di=128 bs=128 k=16 bf16,0.1065,322.63,\n"
       "reverse_index,B=1 N=8192 Hq=16 Hkv=2 Hi=4 Hki=1 D=128 Di=128 bs=128 k=16 bf16,0.0633,,66.3\n")
GPU = ("name, driver_version, clocks.current.sm [MHz], clocks.current.memory [MHz], temperature.gpu\n"
       "NVIDIA H200, 580.159.04, 1980 MHz, 3201 MHz, 41\n")


def _module():
    return load_file(SCRIPT, "microbench_md")


def _logdir(tmp_path):
    log = tmp_path / "mb"
    log.mkdir()
    (log / "microbench.csv").write_text(CSV)
    (log / "gpu.txt").write_text(GPU)
    return log


def test_render_fields_and_csv(tmp_path):
    mod = _module()
    now = datetime.datetime(2026, 12, 5, 21, 7, tzinfo=datetime.timezone.utc)
    md = mod.render(_logdir(tmp_path), "abc1234", "scripts/gpu_microbench.sh LOGDIR (N = 8192)", now,
                    mod._provenance().gpu_tag)
    lines = md.splitlines()
    assert lines[0] == "# C++ microbenchmarks (benchmarks/cpp), H200"
    assert "- date: 2026-12-05 21:07 UTC" in lines
    assert "- commit: abc1234" in lines
    assert "- device: NVIDIA H200, 580.159.04, 1980 MHz, 3201 MHz, 41" in lines
    assert any(line.startswith("- command: `scripts/gpu_microbench.sh LOGDIR (N = 8192)` (2 rows") for line in lines)
    body = md.split("```\n")[1]
    assert body == CSV, body


def test_cli_writes_result(tmp_path):
    log = _logdir(tmp_path)
    (log / "gpu.txt").write_text(GPU.replace("H200", "H100 80GB HBM3"))
    env = dict(os.environ, MSA_COMMIT="def5678+dirty")  # what gpu_microbench.sh exports from .msa_commit
    r = subprocess.run([sys.executable, str(SCRIPT), str(log)], capture_output=True, text=True, timeout=60, env=env)
    assert r.returncode == 0, r.stderr
    md = (log / "result.md").read_text()
    assert md.startswith("# C++ microbenchmarks (benchmarks/cpp), H100\n")
    assert "\n- commit: def5678+dirty\n" in md
    assert CSV.strip() in md


def test_cli_usage():
    r = subprocess.run([sys.executable, str(SCRIPT)], capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "usage" not in r.stderr and "microbench_md.py LOGDIR" in r.stdout
