"""What this msa is and which kernels each GPU gets: `python -m msa.info [--json]`.

Prints the installed version, the build record (msa/_build_info.py, written by setup.py: commit, date,
the torch built against, the stable-ABI target, CUDA toolkit and archs), the code the compiled module
holds (SASS and PTX, read from the module's fatbinary), the runtime (Python, torch and its CUDA), whether
the compiled module loaded, and per visible GPU: name, compute capability, opt-in shared memory per block,
whether the build has SASS for it or runs by JIT from PTX, the kernel path it takes and why.

`collect()` returns the same as a dict (what `--json` prints); it never raises. Where `import msa` itself
fails (the compiled module does not load: a build for another torch), run this file by path to see why:
    python "$(python -c 'import importlib.util as u; print(u.find_spec("msa").submodule_search_locations[0])')/info.py"

The kernel path: the kernels decide at every call. Where the build has the op
`torch.ops.msa.device_config(device)` its answer is reported (source "device_config"); otherwise the rule
below, read from csrc/api (source "rule", labelled so):
  - "hopper": an sm_90 GPU, a build with 90a in its archs (the wgmma/TMA kernels of csrc/sm90 and the
    sm_90a variants) and MSA_PORTABLE_KERNELS != 1 (csrc/api/dispatch.h use_sm90_kernels);
  - else "portable" (mma.sync + cp.async, csrc/sm80), whose forward output pass takes 128-row tiles where
    the GPU's opt-in shared memory per block holds them, else 64 (csrc/api/sparse_fwd.cpp fwd_out_rows,
    MSA_FWD_ROWS=64 forces 64), and the small shared memory (99 KB) configuration where the GPU offers
    less than the default portable forward needs at its 64-row tile, or MSA_SMALL_SMEM=1 (never with the
    Hopper kernels).
Without CUDA every op runs the CPU path (the chunked PyTorch reference, msa/reference.py).
"""
from __future__ import annotations

import importlib
import importlib.util
import json
import os
import platform
import struct
import sys

if __name__ == "__main__" and not __package__:  # run by path: this folder must not shadow top-level modules
    _here = os.path.dirname(os.path.abspath(__file__))
    sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != _here]

HERE = os.path.dirname(os.path.abspath(__file__))

# Shared memory per block (bytes, bf16/fp16) of the default portable sparse kernels, keyed by (D, pass,
# rows): pass 0 the forward stats pass, 1 the output pass (128- or 64-row tiles), 2 the backward. What
# msa::sm80::sparse_smem_bytes (then in csrc/sm80/sparse_fwd/sparse_combine.cu, now smem.cu) returned in a build of ce2aed0, and
# what the Smem structs of csrc/sm80 give at 4cd68bb (a host program compiled against them). The rule needs
# them only where torch.ops.msa.device_config gives no answer (builds before 05b7f82, or the op failing);
# builds from 05b7f82 hide the function (-fvisibility=hidden), see _smem_table.
SMEM_BYTES = {
    (64, 0, 128): 80896, (64, 1, 128): 170880, (64, 1, 64): 120256, (64, 2, 128): 100096,
    (128, 0, 128): 113664, (128, 1, 128): 220032, (128, 1, 64): 161216, (128, 2, 128): 165632,
}
_SMEM_SYMBOL = "_ZN3msa4sm8017sparse_smem_bytesEiii"  # msa::sm80::sparse_smem_bytes(int, int, int)
CUDA_OPS = ("select_blocks", "sparse_fwd", "sparse_bwd", "msa_fwd", "msa_bwd", "reverse_index",
            "validate_cu_seqlens")
CPU_PATH = "CPU path (chunked PyTorch reference)"
ENV_KNOBS = ("MSA_PORTABLE_KERNELS", "MSA_SMALL_SMEM", "MSA_FWD_ROWS", "CUDA_VISIBLE_DEVICES")


# ----------------------------------------------------------------------------------------------
# The build: msa/_build_info.py and the module's fatbinary
# ----------------------------------------------------------------------------------------------
def build_info() -> dict | None:
    """msa/_build_info.py's BUILD_INFO (None in a source tree setup.py never built)."""
    path = os.path.join(HERE, "_build_info.py")
    if not os.path.isfile(path):
        return None
    spec = importlib.util.spec_from_file_location("_msa_build_info", path)
    mod = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(mod)
    except Exception as e:  # noqa: BLE001 - a broken record is reported, not raised
        return {"error": f"{type(e).__name__}: {e}"}
    return dict(getattr(mod, "BUILD_INFO", {}))


def module_path() -> str | None:
    """The compiled module's file (msa/_C*.so) next to this file."""
    for name in sorted(os.listdir(HERE)):
        if name.startswith("_C.") and name.endswith(".so"):
            return os.path.join(HERE, name)
    return None


def _elf_section(data: bytes, wanted: str):
    """(offset, size) of section `wanted` of a 64-bit little-endian ELF, or None."""
    if data[:4] != b"\x7fELF" or data[4] != 2 or data[5] != 1:
        return None
    shoff, = struct.unpack_from("<Q", data, 0x28)
    shentsize, shnum, shstrndx = struct.unpack_from("<HHH", data, 0x3A)
    if shoff == 0 or shnum == 0:
        return None
    heads = [struct.unpack_from("<IIQQQQIIQQ", data, shoff + i * shentsize) for i in range(shnum)]
    names = heads[shstrndx][4]
    for h in heads:
        start = names + h[0]
        if data[start:data.index(b"\0", start)].decode(errors="replace") == wanted:
            return h[4], h[5]
    return None


def fatbin_archs(path: str) -> dict | None:
    """The device code in a module's .nv_fatbin section: {"sass": ["sm_80", ...], "ptx": ["compute_80"],
    "sass_entries": n, "ptx_entries": n}; None when the file has no fatbinary (a CPU-only build).

    The layout (as cuobjdump reads it): fatbins of a 16-byte header (magic 0xBA55ED50, version, header
    size, payload size) and entries of {kind: 1 PTX / 2 ELF, ..., header size, payload size, ..., arch},
    flag 0x100000 marking an arch-specific ("a") target such as sm_90a."""
    with open(path, "rb") as f:
        data = f.read()
    sec = _elf_section(data, ".nv_fatbin")
    if sec is None:
        return None
    blob = data[sec[0]:sec[0] + sec[1]]
    sass, ptx, n_sass, n_ptx = set(), set(), 0, 0
    pos = 0
    while pos + 16 <= len(blob):
        magic, _version, head, size = struct.unpack_from("<IHHQ", blob, pos)
        if magic != 0xBA55ED50:
            pos += 8  # fatbins are 8-byte aligned
            continue
        entry, end = pos + head, pos + head + size
        while entry + 64 <= end:
            kind, _, ehead, payload = struct.unpack_from("<HHIQ", blob, entry)
            arch, = struct.unpack_from("<I", blob, entry + 28)
            flags, = struct.unpack_from("<Q", blob, entry + 40)
            suffix = "a" if flags & 0x100000 else ""
            if kind == 2:
                sass.add((arch, suffix))
                n_sass += 1
            elif kind == 1:
                ptx.add((arch, suffix))
                n_ptx += 1
            if ehead == 0:
                break
            entry += ehead + payload
        pos = end
    return {"sass": [f"sm_{a}{s}" for a, s in sorted(sass)], "ptx": [f"compute_{a}{s}" for a, s in sorted(ptx)],
            "sass_entries": n_sass, "ptx_entries": n_ptx}


def archs_from_list(archs: str) -> dict:
    """What CMakeLists.txt emits for MSA_CUDA_ARCHS: portable SASS for each arch (90a -> sm_90), sm_90a
    SASS of the Hopper kernels when 90a is listed, and compute_<lowest> PTX."""
    items = [a.strip() for a in archs.replace(",", ";").split(";") if a.strip()]
    nums = sorted({int(a.rstrip("af")) for a in items if a.rstrip("af").isdigit()})
    sass = [f"sm_{n}" for n in nums] + (["sm_90a"] if "90a" in items else [])
    return {"sass": sorted(sass, key=_arch_key), "ptx": [f"compute_{nums[0]}"] if nums else []}


def _arch_key(name: str):
    digits = "".join(c for c in name if c.isdigit())
    return int(digits or 0), name


def code_for(cap: tuple[int, int], sass: list[str], ptx: list[str]) -> dict:
    """How the portable kernels run on a GPU of compute capability `cap`: SASS built for sm_XY runs on
    sm_XZ with Z >= Y (an "a" target only on its own arch); else PTX of compute_N <= the GPU JIT-compiles
    at first use (cached by the driver)."""
    num = cap[0] * 10 + cap[1]
    plain = [int(s[3:]) for s in sass if s[3:].isdigit()]
    fits = [n for n in plain if n // 10 == cap[0] and n <= num]
    if fits:
        best = max(fits)
        how = f"SASS sm_{best}" + ("" if best == num else f" (runs on sm_{num})")
        if f"sm_{num}a" in sass:
            how += f"; the Hopper kernels: SASS sm_{num}a"
        return {"kind": "sass", "target": f"sm_{best}", "text": how}
    jit = [int(p[8:]) for p in ptx if p[8:].isdigit() and int(p[8:]) <= num]
    if jit:
        best = max(jit)
        return {"kind": "ptx", "target": f"compute_{best}",
                "text": f"JIT from compute_{best} PTX (no SASS for sm_{num} in this build; the driver compiles "
                        f"at first use and caches it)"}
    return {"kind": "none", "target": None, "text": f"no code for sm_{num} in this build: CUDA inputs fail"}


def _smem_table(module: str | None) -> tuple[dict, str]:
    """The portable kernels' shared memory needs: from the module's own sparse_smem_bytes when it can be
    called (the numbers of this very build), else the table above."""
    if module:
        try:
            import ctypes
            fn = getattr(ctypes.CDLL(module), _SMEM_SYMBOL)
            fn.restype, fn.argtypes = ctypes.c_int, [ctypes.c_int] * 3
            table = {key: int(fn(*key)) for key in SMEM_BYTES}
            if all(v > 0 for v in table.values()):
                return table, "this build's msa::sm80::sparse_smem_bytes"
        except (OSError, AttributeError):
            pass
    return dict(SMEM_BYTES), "msa/info.py's table of sparse_smem_bytes (the build's own could not be called)"


def _env_is(name: str, value: str) -> bool:
    return os.environ.get(name) == value


def _env_positive(name: str, fallback: int) -> int:
    try:
        v = int(os.environ.get(name, "0"))
    except ValueError:
        v = 0
    return v if v > 0 else fallback


def rule_config(cap: tuple[int, int], optin: int | None, sm90_in_build: bool, smem: dict) -> dict:
    """The kernel path by the rules of csrc/api (see the module docstring), for D = 128 and D = 64:
    use_sm90_kernels (dispatch.h), fwd_out_rows and small_smem_config (sparse_fwd.cpp)."""
    uses_sm90 = sm90_in_build and cap == (9, 0) and not _env_is("MSA_PORTABLE_KERNELS", "1")
    forced64 = _env_positive("MSA_FWD_ROWS", 128) == 64
    rows, need, small = {}, {}, {}
    for d in (128, 64):
        if forced64:
            rows[d] = 64
        else:
            rows[d] = 128 if optin is not None and optin >= smem[(d, 1, 128)] else 64
        # The default portable forward at its smallest tile: the stats pass and the 64-row output pass.
        need[d] = max(smem[(d, 0, 128)], smem[(d, 1, 64)])
        small[d] = not uses_sm90 and (_env_is("MSA_SMALL_SMEM", "1") or (optin is not None and optin < need[d]))
    return {"sm90_in_build": sm90_in_build, "uses_sm90": uses_sm90, "fwd_out_rows": rows[128],
            "fwd_out_rows_d64": rows[64], "small_smem": small[128], "small_smem_d64": small[64],
            "smem_optin": optin, "default_portable_needs": need[128], "default_portable_needs_d64": need[64]}


def _why(cfg: dict, cap: tuple[int, int], smem: dict) -> tuple[str, str]:
    """(kernel path, reason) from a device config."""
    sm = f"sm_{cap[0]}{cap[1]}"
    if cfg["uses_sm90"]:
        return "hopper", (f"{sm} GPU, the build has the sm_90a kernels and MSA_PORTABLE_KERNELS != 1: wgmma/TMA "
                          f"index top-k and sparse forward/backward; the rest portable")
    if cap == (9, 0) and cfg["sm90_in_build"]:
        why = "MSA_PORTABLE_KERNELS=1 keeps the portable kernels"
    elif cap == (9, 0):
        why = "this build has no 90a kernels (MSA_CUDA_ARCHS without 90a)"
    else:
        why = f"{sm} is not sm_90: the Hopper kernels are for sm_90 only"
    optin = cfg.get("smem_optin")
    rows = cfg["fwd_out_rows"]
    if _env_positive("MSA_FWD_ROWS", 128) == 64:
        tile = "64-row forward output tiles (MSA_FWD_ROWS=64)"
    elif rows == 128:
        tile = f"128-row forward output tiles ({optin} B opt-in >= {smem[(128, 1, 128)]} B needed at D = 128)"
    else:
        tile = f"64-row forward output tiles ({optin} B opt-in < {smem[(128, 1, 128)]} B for 128 rows at D = 128)"
    if cfg["small_smem"]:
        if _env_is("MSA_SMALL_SMEM", "1"):
            tile += "; the small shared memory (99 KB) configuration (MSA_SMALL_SMEM=1)"
        else:
            tile += (f"; the small shared memory (99 KB) configuration ({optin} B opt-in < "
                     f"{cfg.get('default_portable_needs', '?')} B the default portable forward needs at D = 128)")
    return "portable", f"{why}; {tile}"


def _device_config_op(torch, index: int):
    """torch.ops.msa.device_config on device `index` as a dict, or None where the build has no such op.
    Its schema is device_config(Tensor like) -> Tensor: int64 [sm90_in_build, uses_sm90, fwd_out_rows,
    small_smem, smem_optin] for like's device (D = 128)."""
    if not _has_cuda_op(torch, "device_config"):
        return None
    ops = torch.ops.msa
    vals = [int(v) for v in ops.device_config(torch.empty(0, device=f"cuda:{index}")).tolist()]
    keys = ("sm90_in_build", "uses_sm90", "fwd_out_rows", "small_smem", "smem_optin")
    cfg = dict(zip(keys, vals))
    for k in ("sm90_in_build", "uses_sm90", "small_smem"):
        cfg[k] = bool(cfg.get(k, 0))
    return cfg


def describe_device(cap: tuple[int, int], optin: int | None, *, sass: list[str], ptx: list[str],
                    cuda_build: bool = True, loaded: bool = True, cuda_kernels: bool = True,
                    device_config: dict | None = None, smem: dict | None = None) -> dict:
    """One GPU's entry: compute capability `cap`, opt-in shared memory per block `optin` (bytes), against a
    build holding `sass` / `ptx`; `device_config` is torch.ops.msa.device_config's answer where the build
    has the op (else the rule decides, labelled source "rule")."""
    smem = smem or SMEM_BYTES
    dev: dict = {"capability": f"{cap[0]}.{cap[1]}", "sm": f"sm_{cap[0]}{cap[1]}", "smem_optin": optin}
    dev["code"] = code_for(cap, sass, ptx) if cuda_build else \
        {"kind": "none", "target": None, "text": "CPU-only build: no CUDA kernels"}
    if not loaded:
        dev.update(path=None, reason="the compiled module does not load", source=None)
        return dev
    if not cuda_kernels:
        dev.update(path="none", source=None,
                   reason="this build has no CUDA kernels (CPU-only): CUDA inputs raise, nothing falls back")
        return dev
    source = "device_config"
    cfg = device_config
    if cfg is None:
        cfg, source = rule_config(cap, optin, "sm_90a" in sass, smem), "rule"
    dev["config"] = cfg
    dev["path"], dev["reason"] = _why(cfg, cap, smem)
    dev["source"] = source
    if source == "rule":
        small = cfg["small_smem"] and not cfg["uses_sm90"]
        dev["reason"] += (" [rule-derived from csrc/api: no answer from torch.ops.msa.device_config; a build "
                          "without that op predates the small shared memory configuration (2e703b6) and raises "
                          "NotImplementedError on such a GPU before any launch]" if small else
                          " [rule-derived from csrc/api: no answer from torch.ops.msa.device_config]")
    if dev["code"]["kind"] == "none":
        dev["reason"] += "; but " + dev["code"]["text"]
    return dev


# ----------------------------------------------------------------------------------------------
# collect() and the CLI
# ----------------------------------------------------------------------------------------------
def _has_cuda_op(torch, name: str) -> bool:
    """Whether op msa::name exists and has a CUDA kernel in this build."""
    try:
        return hasattr(torch.ops.msa, name) and torch._C._dispatch_has_kernel_for_dispatch_key(f"msa::{name}", "CUDA")
    except Exception:  # noqa: BLE001
        return False


def _installed_version() -> str | None:
    try:
        from importlib.metadata import PackageNotFoundError, version
    except ImportError:  # pragma: no cover - Python < 3.8
        return None
    try:
        return version("msa-attention")
    except PackageNotFoundError:
        return None


def _base_version() -> str | None:
    path = os.path.join(HERE, "_version.py")
    scope: dict = {}
    try:
        with open(path) as f:
            exec(compile(f.read(), path, "exec"), scope)  # noqa: S102 - our own one-line version file
    except OSError:
        return None
    return scope.get("base_version")


def collect() -> dict:
    """Everything `python -m msa.info --json` prints. Never raises: failures are reported as fields."""
    out: dict = {}
    binfo = build_info()
    module = module_path()
    out["msa"] = {"version": None, "installed_version": _installed_version(), "base_version": _base_version(),
                  "distribution": "msa-attention", "location": HERE}
    out["build"] = binfo
    try:
        fat = fatbin_archs(module) if module else None
    except (OSError, struct.error, ValueError) as e:
        fat = {"error": f"{type(e).__name__}: {e}"}
    cuda_build = bool(binfo.get("cuda")) if binfo and "cuda" in binfo else (fat is not None)
    if fat is not None and "error" not in fat:
        code, code_src = fat, "the module's fatbinary"
    elif binfo and binfo.get("cuda_archs") not in (None, "none"):
        code, code_src = archs_from_list(binfo["cuda_archs"]), "the build's MSA_CUDA_ARCHS"
    else:
        code, code_src = None, None
    out["code"] = {"cuda_build": cuda_build, "source": code_src, **(code or {"sass": [], "ptx": []})}
    out["runtime"] = {"python": sys.version.split()[0], "platform": platform.platform(),
                      "executable": sys.executable}
    out["env"] = {k: os.environ[k] for k in ENV_KNOBS if k in os.environ}
    try:
        import torch
    except Exception as e:  # noqa: BLE001
        out["runtime"]["torch"] = None
        out["module"] = {"loaded": False, "path": module, "error": f"torch does not import: {type(e).__name__}: {e}"}
        out["devices"], out["path"] = [], None
        return out
    out["runtime"].update({"torch": torch.__version__, "torch_cuda": torch.version.cuda,
                           "cuda_available": torch.cuda.is_available()})
    # The compiled module: importing msa loads it (msa/_ops.py); an undefined symbol surfaces here.
    try:
        msa = importlib.import_module("msa")
        from msa import _ops
        out["msa"]["version"] = getattr(msa, "__version__", None)
        out["module"] = {"loaded": True, "path": module, "error": None,
                         "cuda_kernels": [n for n in CUDA_OPS if _ops.has_cuda_kernel(n)],
                         "device_config_op": _has_cuda_op(torch, "device_config")}
    except Exception as e:  # noqa: BLE001
        out["msa"]["version"] = (binfo or {}).get("version") or out["msa"]["base_version"]
        out["module"] = {"loaded": False, "path": module, "error": f"{type(e).__name__}: {e}", "cuda_kernels": [],
                         "device_config_op": False}
    out["compatibility"] = _compat(binfo, torch.__version__, torch.version.cuda)
    smem, smem_src = _smem_table(module if out["module"]["loaded"] else None)
    out["code"]["smem_source"] = smem_src
    devices = []
    n = torch.cuda.device_count() if torch.cuda.is_available() else 0
    for i in range(n):
        dev: dict = {"index": i}
        try:
            p = torch.cuda.get_device_properties(i)
            dev.update({"name": p.name, "total_memory": p.total_memory})
            cfg = None
            if out["module"]["loaded"]:
                try:
                    cfg = _device_config_op(torch, i)
                except Exception as e:  # noqa: BLE001 - the rule answers instead, and the failure is shown
                    dev["device_config_error"] = f"{type(e).__name__}: {e}"
            dev.update(describe_device((p.major, p.minor), getattr(p, "shared_memory_per_block_optin", None),
                                       sass=out["code"]["sass"], ptx=out["code"]["ptx"], cuda_build=cuda_build,
                                       loaded=out["module"]["loaded"], cuda_kernels=bool(out["module"]["cuda_kernels"]),
                                       device_config=cfg, smem=smem))
        except Exception as e:  # noqa: BLE001
            dev["error"] = f"{type(e).__name__}: {e}"
        devices.append(dev)
    out["devices"] = devices
    out["path"] = CPU_PATH if not devices else "CUDA inputs: per device below; CPU inputs: " + CPU_PATH
    return out


def _minor(v: str | None) -> tuple[int, ...] | None:
    try:
        return tuple(int(x) for x in (v or "").split("+")[0].split(".")[:2])
    except ValueError:
        return None


def _compat(binfo: dict | None, runtime_torch: str, runtime_cuda: str | None = None) -> dict:
    """Which torch this build is meant to load on, against the running one."""
    if not binfo or "torch_version" not in binfo:
        return {"ok": None, "text": "no build record (msa/_build_info.py): a source tree setup.py never built"}
    built, run = binfo["torch_version"], runtime_torch
    target = binfo.get("torch_target")
    if target:
        ok = (_minor(run) or (0,)) >= (_minor(str(target)) or (99,))
        text = f"stable-ABI build (target torch {target}, built with {built}): loads on torch >= {target}"
    else:
        ok = _minor(built) == _minor(run)
        text = f"built against torch {built} with the version-locked C++ ABI: loads on that torch minor only"
    if binfo.get("cuda") and binfo.get("cuda_toolkit", "none") != "none":
        major = str(binfo["cuda_toolkit"]).split(".")[0]
        text += f", built for CUDA {major} (needs a torch for CUDA {major}.x: libcudart.so.{major})"
        if runtime_cuda is None:
            text += "; running a CPU-only torch, which has no CUDA runtime to load"
            ok = False
        elif str(runtime_cuda).split(".")[0] != major:
            ok = False
    text += f"; running torch {run}" + (f" (CUDA {runtime_cuda})" if runtime_cuda else " (CPU)")
    if ok is False:
        text += ": NOT a supported combination"
    return {"ok": ok, "text": text}


def _fmt_bytes(b):
    return "?" if b is None else f"{b} B ({b / 1024:.1f} KB)"


def format_text(info: dict) -> str:
    lines = []
    m, b = info["msa"], info.get("build")
    lines.append(f"msa {m.get('version')} (distribution {m['distribution']}, installed "
                 f"{m.get('installed_version') or 'not as a distribution'}) at {m['location']}")
    if not b:
        lines.append("build: no record (msa/_build_info.py): a source tree setup.py never built")
    else:
        for k, v in b.items():
            lines.append(f"  build.{k}: {v}")
    c = info["code"]
    if c["cuda_build"]:
        lines.append(f"code: SASS {', '.join(c['sass']) or '-'}; PTX {', '.join(c['ptx']) or '-'} "
                     f"(from {c['source']})")
    else:
        lines.append("code: CPU-only build (no CUDA kernels)")
    r = info["runtime"]
    lines.append(f"runtime: Python {r['python']}, torch {r.get('torch')} (CUDA {r.get('torch_cuda')}), "
                 f"CUDA available: {r.get('cuda_available')}")
    if info.get("env"):
        lines.append("env: " + ", ".join(f"{k}={v}" for k, v in info["env"].items()))
    mod = info.get("module", {})
    if mod.get("loaded"):
        lines.append(f"compiled module: loaded ({mod['path']}); CUDA kernels: "
                     f"{', '.join(mod['cuda_kernels']) or 'none (CPU-only build)'}; device_config op: "
                     f"{'yes' if mod.get('device_config_op') else 'no'}")
    else:
        lines.append(f"compiled module: NOT loaded ({mod.get('path')}): {mod.get('error')}")
    if info.get("compatibility"):
        lines.append(f"compatibility: {info['compatibility']['text']}")
    if not info.get("devices"):
        lines.append(f"devices: none visible: {CPU_PATH}")
    for d in info.get("devices", []):
        if "error" in d:
            lines.append(f"cuda:{d['index']}: {d['error']}")
            continue
        lines.append(f"cuda:{d['index']}: {d['name']}, compute capability {d['capability']}, opt-in shared memory "
                     f"per block {_fmt_bytes(d['smem_optin'])}")
        lines.append(f"  code: {d['code']['text']}")
        if d.get("device_config_error"):
            lines.append(f"  torch.ops.msa.device_config failed: {d['device_config_error']}")
        lines.append(f"  kernel path: {d['path']} ({d.get('source') or '-'}): {d['reason']}")
    return "\n".join(lines)


def main(argv=None) -> int:
    import argparse
    p = argparse.ArgumentParser(prog="python -m msa.info", description=__doc__.split("\n\n")[0])
    p.add_argument("--json", action="store_true", help="print collect() as JSON")
    p.add_argument("--fatbin", metavar="SO", help="only list the SASS / PTX in this module file (no torch needed)")
    args = p.parse_args(argv)
    if args.fatbin:
        print(json.dumps(fatbin_archs(args.fatbin), indent=2))
        return 0
    info = collect()
    print(json.dumps(info, indent=2, default=str) if args.json else format_text(info))
    return 0


if __name__ == "__main__":
    sys.exit(main())
