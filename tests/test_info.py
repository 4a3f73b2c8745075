"""python -m msa.info / msa.info.collect(), the version and the build record (msa/_build_info.py)."""
import datetime
import importlib.metadata
import json
import os
import re
import subprocess
import sys

import pytest
import torch

import msa
from msa import info

PKG_DIR = os.path.dirname(os.path.abspath(msa.__file__))
VERSION_RE = re.compile(r"^\d+\.\d+\.\d+(\+[a-z0-9]+(\.[a-z0-9]+)*)?$")
BUILD_KEYS = {"version", "distribution", "commit", "build_date", "torch_version", "torch_cuda", "torch_requirement",
              "stable_abi", "torch_target", "torch_target_cmake", "cuda", "cuda_toolkit", "cuda_archs", "build_type",
              "build_python"}


def _run_info(*args):
    """python -m msa.info of this very msa (PYTHONPATH: the folder above it), wherever the tests run."""
    env = dict(os.environ, PYTHONPATH=os.path.dirname(PKG_DIR) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    return subprocess.run([sys.executable, "-m", "msa.info", *args], capture_output=True, text=True, env=env,
                          timeout=300)


def test_version_format():
    assert VERSION_RE.match(msa.__version__), msa.__version__
    assert msa.__version__.split("+")[0] == info._base_version()


def test_version_is_the_installed_one():
    binfo = info.build_info()
    if binfo is None:
        assert msa.__version__ == info._base_version()  # a tree setup.py never built
        return
    assert msa.__version__ == binfo["version"]
    try:
        dist = importlib.metadata.distribution("msa-attention")
    except importlib.metadata.PackageNotFoundError:
        pytest.skip("msa-attention is not installed as a distribution")
    located = os.path.abspath(str(dist.locate_file("msa/__init__.py")))
    if located != os.path.join(PKG_DIR, "__init__.py"):
        pytest.skip("the installed distribution is not this msa (an editable install)")
    assert dist.version == msa.__version__


def test_build_info_fields():
    binfo = info.build_info()
    if binfo is None:
        pytest.skip("no msa/_build_info.py: a source tree setup.py never built")
    assert BUILD_KEYS <= set(binfo), BUILD_KEYS - set(binfo)
    assert binfo["distribution"] == "msa-attention"
    assert VERSION_RE.match(binfo["version"])
    assert binfo["commit"] and isinstance(binfo["commit"], str)
    when = datetime.datetime.fromisoformat(binfo["build_date"].replace("Z", "+00:00"))
    assert when.tzinfo is not None
    assert re.match(r"^\d+\.\d+", binfo["torch_version"])
    assert binfo["torch_requirement"].startswith("torch")
    assert isinstance(binfo["stable_abi"], bool)
    assert binfo["torch_target"] is None or re.match(r"^\d+\.\d+$", str(binfo["torch_target"]))
    if binfo["cuda"]:
        assert re.match(r"^\d+\.\d+", binfo["cuda_toolkit"]), binfo["cuda_toolkit"]
        assert all(re.match(r"^\d+[af]?$", a) for a in binfo["cuda_archs"].split(";")), binfo["cuda_archs"]
    else:
        assert binfo["cuda_toolkit"] == "none" and binfo["cuda_archs"] == "none"


def test_module_code_matches_the_archs():
    """The fatbinary holds what CMakeLists.txt is meant to emit for the recorded MSA_CUDA_ARCHS: portable
    SASS per arch, sm_90a for the Hopper kernels, compute_<lowest> PTX."""
    binfo, path = info.build_info(), info.module_path()
    assert path is not None
    fat = info.fatbin_archs(path)
    if binfo is None:
        pytest.skip("no build record to compare with")
    if not binfo["cuda"]:
        assert fat is None
        return
    want = info.archs_from_list(binfo["cuda_archs"])
    assert fat["sass"] == want["sass"] and fat["ptx"] == want["ptx"], (fat, want)


def test_collect():
    out = info.collect()
    json.dumps(out)  # what --json prints
    assert out["msa"]["version"] == msa.__version__
    assert out["msa"]["distribution"] == "msa-attention"
    assert out["module"]["loaded"] and out["module"]["error"] is None
    assert out["runtime"]["torch"] == torch.__version__
    assert out["runtime"]["torch_cuda"] == torch.version.cuda
    assert out["runtime"]["python"] == sys.version.split()[0]
    assert set(out["module"]["cuda_kernels"]) == {n for n in info.CUDA_OPS if msa.has_cuda_kernel(n)}
    if not torch.cuda.is_available():
        assert out["devices"] == [] and out["path"] == info.CPU_PATH


def test_cli_json():
    r = _run_info("--json")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["msa"]["version"] == msa.__version__
    assert out["msa"]["location"] == PKG_DIR
    assert out["module"]["loaded"]


def test_cli_text():
    r = _run_info()
    assert r.returncode == 0, r.stderr
    assert f"msa {msa.__version__}" in r.stdout
    assert "compiled module: loaded" in r.stdout
    if not torch.cuda.is_available():
        assert info.CPU_PATH in r.stdout


def test_run_by_path():
    """info.py runs as a file too (the way to see why `import msa` fails); --fatbin needs no torch."""
    r = subprocess.run([sys.executable, os.path.join(PKG_DIR, "info.py"), "--fatbin", info.module_path()],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout) == info.fatbin_archs(info.module_path())


def test_archs_from_list():
    got = info.archs_from_list("80;86;89;90;90a;100;120")
    assert got == {"sass": ["sm_80", "sm_86", "sm_89", "sm_90", "sm_90a", "sm_100", "sm_120"], "ptx": ["compute_80"]}
    assert info.archs_from_list("90a") == {"sass": ["sm_90", "sm_90a"], "ptx": ["compute_90"]}


FULL = info.archs_from_list("80;86;89;90;90a;100;120")
H200, A100, RTX = 232448, 166912, 101376  # opt-in shared memory per block, bytes


@pytest.fixture
def clean_env(monkeypatch):
    for k in ("MSA_PORTABLE_KERNELS", "MSA_SMALL_SMEM", "MSA_FWD_ROWS"):
        monkeypatch.delenv(k, raising=False)
    return monkeypatch


@pytest.mark.parametrize("cap,optin,code,path,rows,small", [
    ((9, 0), H200, "sass", "hopper", 128, False),
    ((8, 0), A100, "sass", "portable", 64, False),
    ((8, 6), RTX, "sass", "portable", 64, True),
    ((8, 9), RTX, "sass", "portable", 64, True),
    ((8, 7), A100, "sass", "portable", 64, False),   # sm_86 SASS runs on sm_87
    ((10, 0), H200, "sass", "portable", 128, False),
    ((12, 0), RTX, "sass", "portable", 64, True),
    ((11, 0), H200, "ptx", "portable", 128, False),  # no sm_110 SASS: compute_80 PTX
])
def test_rule(clean_env, cap, optin, code, path, rows, small):
    d = info.describe_device(cap, optin, **FULL)
    assert d["code"]["kind"] == code and d["path"] == path and d["source"] == "rule"
    assert d["config"]["fwd_out_rows"] == rows and d["config"]["small_smem"] == small
    assert "rule-derived" in d["reason"]


def test_rule_env_knobs(clean_env):
    clean_env.setenv("MSA_PORTABLE_KERNELS", "1")
    d = info.describe_device((9, 0), H200, **FULL)
    assert d["path"] == "portable" and d["config"]["fwd_out_rows"] == 128 and "MSA_PORTABLE_KERNELS=1" in d["reason"]
    clean_env.setenv("MSA_FWD_ROWS", "64")
    assert info.describe_device((9, 0), H200, **FULL)["config"]["fwd_out_rows"] == 64
    clean_env.setenv("MSA_SMALL_SMEM", "1")
    d = info.describe_device((9, 0), H200, **FULL)
    assert d["config"]["small_smem"] and "MSA_SMALL_SMEM=1" in d["reason"]
    clean_env.delenv("MSA_PORTABLE_KERNELS")  # the Hopper kernels have their own tiles: no small configuration
    d = info.describe_device((9, 0), H200, **FULL)
    assert d["path"] == "hopper" and not d["config"]["small_smem"]


def test_rule_builds_without_sm90_or_sass(clean_env):
    d = info.describe_device((9, 0), H200, **info.archs_from_list("80"))
    assert d["path"] == "portable" and d["code"]["kind"] == "ptx" and "no 90a" in d["reason"]
    d = info.describe_device((7, 5), 65536, **FULL)
    assert d["code"]["kind"] == "none"
    d = info.describe_device((8, 0), A100, sass=[], ptx=[], cuda_build=False, cuda_kernels=False)
    assert d["path"] == "none"


def test_device_config_answer_wins(clean_env):
    cfg = {"sm90_in_build": True, "uses_sm90": False, "fwd_out_rows": 64, "small_smem": True, "smem_optin": RTX}
    d = info.describe_device((8, 6), RTX, device_config=cfg, **FULL)
    assert d["source"] == "device_config" and d["path"] == "portable" and "rule-derived" not in d["reason"]


_real_cuda = torch.cuda.is_available()


def test_collect_with_a_fake_gpu(clean_env, monkeypatch):
    """collect()'s device loop on a CPU machine: an H200 as torch would describe it."""
    import types
    props = types.SimpleNamespace(name="NVIDIA H200 (fake)", major=9, minor=0, total_memory=150 * 2**30,
                                  shared_memory_per_block_optin=H200)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i: props)
    out = info.collect()
    assert len(out["devices"]) == 1
    dev = out["devices"][0]
    assert "error" not in dev, dev
    assert dev["name"] == props.name and dev["capability"] == "9.0" and dev["smem_optin"] == H200
    if not out["module"]["cuda_kernels"]:  # a CPU-only build
        assert dev["path"] == "none"
        return
    # No real GPU: device_config (when the build has it) fails and the rule answers, saying so. On a
    # machine with a GPU the op answers for the real device 0 behind the fake properties.
    assert dev["source"] == ("device_config" if _real_cuda else "rule")
    if not _real_cuda:
        assert dev["path"] == ("hopper" if "sm_90a" in out["code"]["sass"] else "portable")
    text = info.format_text(out)
    assert "cuda:0: NVIDIA H200 (fake), compute capability 9.0" in text


def test_fatbin_parser_on_a_non_elf(tmp_path):
    p = tmp_path / "x.so"
    p.write_bytes(b"not an elf")
    assert info.fatbin_archs(str(p)) is None


@pytest.mark.gpu
def test_collect_gpu(clean_env):
    """On a GPU: every device reports the kernels' own answer (device_config), which agrees with the rule
    on what does not depend on the kernels' shared memory sizes (those the op alone knows for new builds)."""
    out = info.collect()
    assert out["devices"] and all("error" not in d for d in out["devices"]), out["devices"]
    smem, _ = info._smem_table(None)
    for dev in out["devices"]:
        assert dev["path"] in ("hopper", "portable") and dev["code"]["kind"] in ("sass", "ptx"), dev
        if not info._has_cuda_op(torch, "device_config"):
            assert dev["source"] == "rule"
            continue
        assert dev["source"] == "device_config", dev
        cap = tuple(int(x) for x in dev["capability"].split("."))
        rule = info.rule_config(cap, dev["smem_optin"], "sm_90a" in out["code"]["sass"], smem)
        for k in ("sm90_in_build", "uses_sm90", "smem_optin"):
            assert rule[k] == dev["config"][k], (k, rule[k], dev["config"][k])
