#!/usr/bin/env bash
# Tests a built wheel against the torch releases it claims, from the INSTALLED package (not the source
# tree): per torch version a fresh venv, torch==X, the wheel (--no-deps: the combination is the point),
# requirements-test.txt (pytest, numpy and the pinned hf/demo extras), then `import msa`,
# `python -m msa.info --json`, `pip check`, and the CPU test suite copied to a temporary folder (so
# `import msa` resolves to site-packages), GPU tests skipping without CUDA.
#
#   scripts/test_wheel.sh WHEEL [TORCH_VERSION...]
#
# Without versions: the wheel's variant's torch releases (cu130: 2.11.0 2.12.1 2.13.0 2.14.1; cpu:
# 2.10.0 .. 2.14.1; cu124: 2.10.0). Results: OUT/summary.tsv (one line per torch: install, pip check,
# import, passed/failed/errors/skipped, seconds), OUT/summary.json, and per torch the pytest log, junit
# XML and msa.info JSON. Venvs are deleted after each run; what pip downloads is kept in one wheel folder
# ($MSA_CACHE/wheels: pip's own HTTP cache does not keep files served without Cache-Control headers), which
# every later venv installs from (--no-index): torch 2.11 .. 2.14 share most of their nvidia-* wheels.
#
# Environment:
#   MSA_TEST_K        pytest -k expression (default: the whole suite); e.g. 'reference or ops' for a quick pass
#   MSA_TEST_ARGS     more pytest arguments (e.g. "-x" or a test file list, which replaces "tests")
#   MSA_TEST_IMPORT_ONLY=1  stop after import + msa.info (no pytest)
#   MSA_TEST_OUT      where results go (default: <wheel's folder>/tests-<variant>)
#   MSA_TESTS_DIR     the tests to run (default: this repository's tests/)
#   MSA_CACHE         shared caches (default ~/.cache/msa-wheels; downloaded wheels in $MSA_CACHE/wheels)
#   MSA_KEEP=1        keep the venvs
set -uo pipefail
cd "$(dirname "$0")/.."
REPO=$(pwd)
[ $# -ge 1 ] || { sed -n '2,25p' "$0"; exit 2; }
WHEEL=$(readlink -f "$1"); shift
[ -f "$WHEEL" ] || { echo "test_wheel: no such wheel: $WHEEL" >&2; exit 2; }
base=$(basename "$WHEEL")
variant=$(echo "$base" | sed -n 's/^msa_attention-[^+-]*+\([a-z0-9.]*\)-.*/\1/p')
VERSIONS=("$@")
if [ ${#VERSIONS[@]} -eq 0 ]; then
  case "$variant" in
    cu130) VERSIONS=(2.11.0 2.12.1 2.13.0 2.14.1) ;;
    cpu) VERSIONS=(2.10.0 2.11.0 2.12.1 2.13.0 2.14.1) ;;
    cu124) VERSIONS=(2.10.0) ;;
    *) echo "test_wheel: variant '$variant' has no default torch list: name the versions" >&2; exit 2 ;;
  esac
fi
CACHE=${MSA_CACHE:-$HOME/.cache/msa-wheels}
WHEELS="$CACHE/wheels"
export PIP_DISABLE_PIP_VERSION_CHECK=1
OUT=${MSA_TEST_OUT:-$(dirname "$WHEEL")/tests-${variant:-wheel}}
TESTS=${MSA_TESTS_DIR:-$REPO/tests}
mkdir -p "$OUT" "$CACHE" "$WHEELS"
OUT=$(readlink -f "$OUT")
SUMMARY="$OUT/summary.tsv"
[ -f "$SUMMARY" ] || printf 'date\twheel\ttorch\ttorch_cuda\tinstall\tpip_check\timport\tpassed\tfailed\terrors\tskipped\tseconds\tselection\n' > "$SUMMARY"
log() { echo "test_wheel: $*" >&2; }

run_one() {
  local tv=$1 t0 work venv py
  t0=$(date +%s)
  work=$(mktemp -d "$CACHE/test-$tv.XXXXXX")
  venv="$work/venv"; py="$venv/bin/python"
  local res="$OUT/torch-$tv" install=ok check=ok import=ok tcuda="-" counts="-	-	-	-"
  mkdir -p "$res"
  local selection="${MSA_TEST_K:-all}${MSA_TEST_ARGS:+ $MSA_TEST_ARGS}"
  [ "${MSA_TEST_IMPORT_ONLY:-0}" = 1 ] && selection="import only"
  log "torch $tv: venv in $work"
  python3 -m venv "$venv"
  # torch===X: exactly that release (==X would also take a local variant such as X+cpu from a find-links
  # folder). Downloads land in $WHEELS (files already there are not fetched again), installs come from it.
  local pins=("torch===$tv")
  if ! "$py" -m pip download -q -d "$WHEELS" "${pins[@]}" -r "$REPO/requirements-test.txt" > "$res/install.log" 2>&1; then
    install="download-failed"
  elif ! "$py" -m pip install -q --no-index --find-links "$WHEELS" "${pins[@]}" >> "$res/install.log" 2>&1; then
    install="torch-failed"
  elif ! "$py" -m pip install -q --no-deps "$WHEEL" >> "$res/install.log" 2>&1; then
    install="wheel-failed"
  elif ! "$py" -m pip install -q --no-index --find-links "$WHEELS" -r "$REPO/requirements-test.txt" "${pins[@]}" \
      >> "$res/install.log" 2>&1; then
    install="test-reqs-failed"
  fi
  if [ "$install" = ok ]; then
    tcuda=$("$py" -c 'import torch; print(torch.version.cuda)' 2>/dev/null || echo "?")
    "$py" -m pip check > "$res/pip_check.txt" 2>&1 || check="conflict"
    # From an empty folder: `import msa` must be the installed package.
    local tmp="$work/run"; mkdir -p "$tmp"
    if (cd "$tmp" && "$py" -c 'import msa, os, sys, sysconfig
site = sysconfig.get_paths()["purelib"]
assert os.path.abspath(msa.__file__).startswith(os.path.abspath(site)), (msa.__file__, site)
print(msa.__version__, msa.__file__)') > "$res/import.txt" 2>&1; then
      (cd "$tmp" && "$py" -m msa.info --json > "$res/info.json" 2>&1; "$py" -m msa.info > "$res/info.txt" 2>&1)
    else
      import="failed"
    fi
    if [ "$import" = ok ] && [ "${MSA_TEST_IMPORT_ONLY:-0}" != 1 ]; then
      cp -r "$TESTS" "$tmp/tests"
      rm -rf "$tmp/tests/__pycache__"
      # The repository's pytest settings (markers) without its rootdir: pytest runs in $tmp.
      "$py" - "$REPO/pyproject.toml" > "$tmp/pytest.ini" <<'PY'
import sys, tomllib
cfg = tomllib.load(open(sys.argv[1], "rb"))["tool"]["pytest"]["ini_options"]
print("[pytest]")
print("markers =\n" + "".join(f"    {m}\n" for m in cfg.get("markers", [])))
PY
      local args=(tests)
      [ -n "${MSA_TEST_ARGS:-}" ] && read -r -a args <<< "$MSA_TEST_ARGS"
      (cd "$tmp" && "$py" -m pytest -q -p no:cacheprovider --junitxml="$res/junit.xml" \
          ${MSA_TEST_K:+-k "$MSA_TEST_K"} "${args[@]}" > "$res/pytest.log" 2>&1)
      counts=$("$py" - "$res/junit.xml" <<'PY'
import sys, xml.etree.ElementTree as ET
try:
    root = ET.parse(sys.argv[1]).getroot()
except (OSError, ET.ParseError):
    print("-\t-\t-\t-"); sys.exit()
suites = [root] if root.tag == "testsuite" else list(root)
n = {k: sum(int(s.get(k, 0)) for s in suites) for k in ("tests", "failures", "errors", "skipped")}
print(f"{n['tests'] - n['failures'] - n['errors'] - n['skipped']}\t{n['failures']}\t{n['errors']}\t{n['skipped']}")
PY
)
      tail -n 3 "$res/pytest.log" >&2
    fi
  fi
  local secs=$(( $(date +%s) - t0 ))
  printf '%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\n' "$(date -u +%Y-%m-%dT%H:%M:%SZ)" "$base" "$tv" "$tcuda" \
    "$install" "$check" "$import" "$counts" "$secs" "$selection" >> "$SUMMARY"
  log "torch $tv: install=$install pip_check=$check import=$import passed/failed/errors/skipped=$(echo "$counts" | tr '\t' /) in ${secs}s"
  [ "$import" = failed ] && sed 's/^/    /' "$res/import.txt" | tail -n 3 >&2
  if [ "${MSA_KEEP:-0}" = 1 ]; then log "kept $work"; else rm -rf "$work"; fi
}

for tv in "${VERSIONS[@]}"; do run_one "$tv"; done
# summary.json from the tsv (every run so far)
python3 - "$SUMMARY" "$OUT/summary.json" <<'PY'
import csv, json, sys
rows = list(csv.DictReader(open(sys.argv[1]), delimiter="\t"))
json.dump(rows, open(sys.argv[2], "w"), indent=2)
PY
column -t -s $'\t' "$SUMMARY" 2>/dev/null || cat "$SUMMARY"
