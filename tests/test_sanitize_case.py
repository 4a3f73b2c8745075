"""scripts/sanitize_case.py, the case compute-sanitizer runs (scripts/gpu_check.sh, MSA_SANITIZE=1), reaches every
kernel csrc/ defines and each variant in scripts/kernel_coverage.py's VARIANTS (on an sm_90 GPU with a Hopper
build); its calls stay in step with the ops' schemas (on the CPU path, everywhere)."""
import subprocess
import sys
from pathlib import Path

import pytest

from helpers import kernel_coverage, sm90_kernels_run

ROOT = Path(__file__).resolve().parent.parent
CASE = ROOT / "scripts" / "sanitize_case.py"


def test_global_kernels_parsed_with_their_template_parameters():
    kernels = kernel_coverage().global_kernels()
    assert len(kernels) >= 20, sorted(kernels)
    assert kernels["out_pass_ws_kernel"] == ["T", "D", "kDsi"]
    assert kernels["sparse_fwd_kernel"] == ["Mma", "T", "D", "kOut", "kRows", "kGu", "kSmall"]
    assert kernels["reverse_index_keys_kernel"] == []


def test_parse_launched_names():
    cov = kernel_coverage()
    assert cov.parse_launched("void msa::sm90::out_ws::out_pass_ws_kernel<__nv_bfloat16, 128, true>"
                              "(msa::SparseFwdParams, CUtensorMap_st)") == ("out_pass_ws_kernel",
                                                                           ["__nv_bfloat16", "128", "true"])
    assert cov.parse_launched("msa::(anonymous namespace)::reverse_index_keys_kernel(msa::ReverseIndexParams)") == (
        "reverse_index_keys_kernel", [])
    kernel, args = cov.parse_launched("void cub::detail::Kernel<cub::Policy<int, int>::P900, false>(int*, int const*)")
    assert kernel == "Kernel" and args == ["cub::Policy<int, int>::P900", "false"]


def test_missing_names_the_gaps_and_no_stale_variants():
    cov = kernel_coverage()
    kernels = cov.global_kernels()
    gaps = cov.missing([])
    assert not [g for g in gaps if "stale" in g], gaps
    assert len(gaps) == len(kernels) + len(cov.VARIANTS)
    # A list holding exactly the wanted variants (and one launch of every other kernel) leaves no gap; without one
    # variant, that one is named.
    names = []
    for kernel, want in cov.VARIANTS:
        params = kernels[kernel]
        names.append(f"void msa::ns::{kernel}<{', '.join(want.get(p, 'x') for p in params)}>(P)")
    names += [f"msa::ns::{k}(P)" for k, params in kernels.items() if not params]
    names += [f"void msa::ns::{k}<{', '.join('x' for _ in params)}>(P)" for k, params in kernels.items() if params]
    assert cov.missing(names) == []
    assert cov.missing(names[1:]) == [f"{cov.VARIANTS[0][0]} with {cov.VARIANTS[0][1]}: not launched"]
    # Another library's kernel of the same name does not count.
    assert cov.missing([names[0].replace("msa::ns::", "other::")] + names[1:]) == cov.missing(names[1:])


def _run_case(tmp_path, *args):
    # The case clears the shell's MSA_* knobs itself and sets its own.
    r = subprocess.run([sys.executable, str(CASE), *args], capture_output=True, text=True, timeout=900, cwd=tmp_path)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-4000:]
    assert "sanitize case done" in r.stdout


def test_case_runs_on_the_cpu_path(tmp_path):
    _run_case(tmp_path, "--device", "cpu")


@pytest.mark.gpu
def test_case_reaches_every_kernel_and_variant(tmp_path, monkeypatch):
    monkeypatch.delenv("MSA_PORTABLE_KERNELS", raising=False)  # the subprocess runs without the MSA_* knobs
    if not sm90_kernels_run():
        pytest.skip("the variants listed are those of a Hopper build on an sm_90 GPU")
    out = tmp_path / "kernels.txt"
    _run_case(tmp_path, "--kernels", str(out))
    names = [n for n in out.read_text().splitlines() if n]
    assert kernel_coverage().missing(names) == [], "\n".join(names)
