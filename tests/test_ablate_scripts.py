"""The ablation scripts (scripts/ablate_*.sh) still hit the code they edit.

Each script names its variants as 'NAME|FILE|SED' and hands them to scripts/ablate.sh, which builds and profiles one
variant per GPU call's minute; a sed that no longer matches (the kernel's line changed) is only noticed there, after
the e0 build, as a wasted variant. Here each script runs against a stand-in ablate.sh that applies every variant's
sed to its file's text (the file itself untouched) and reports how many lines it changed: every variant must change
at least one. CPU only (bash, sed, diff)."""

import os
import shutil
import subprocess

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPTS = sorted(
    f for f in os.listdir(os.path.join(REPO, "scripts")) if f.startswith("ablate_") and f.endswith(".sh")
)

# The stand-in: for each spec and each of its sed's s commands on its own (a multi-command sed is split before each
# ";s/"), the number of source lines it changes (diff's '<' lines), one "NAME#K COUNT" line per command K.
STUB = r"""#!/usr/bin/env bash
shift
for spec in "$@"; do
  IFS='|' read -r name file expr <<< "$spec"
  k=0
  while IFS= read -r cmd; do
    n=$(sed "$cmd" "$file" | diff - "$file" | grep -c '^<')
    echo "$name#$k $n"
    k=$((k + 1))
  done < <(printf '%s\n' "$expr" | sed 's/;s\//\ns\//g')
done
"""


@pytest.mark.skipif(any(shutil.which(t) is None for t in ("bash", "sed", "diff")), reason="needs bash, sed and diff")
@pytest.mark.parametrize("script", SCRIPTS)
def test_every_ablation_edit_matches(script, tmp_path):
    shutil.copy(os.path.join(REPO, "scripts", script), tmp_path / script)
    stub = tmp_path / "ablate.sh"
    stub.write_text(STUB)
    stub.chmod(0o755)
    out = subprocess.run(["bash", str(tmp_path / script), str(tmp_path / "out")], cwd=REPO, capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    counts = dict(line.rsplit(" ", 1) for line in out.stdout.splitlines() if line.strip())
    assert counts, f"{script}: no variants reached ablate.sh"
    dead = sorted(name for name, n in counts.items() if int(n) == 0)
    assert not dead, f"{script}: these variants' sed commands (#K: the K-th s command) no longer change any line: {dead}"
