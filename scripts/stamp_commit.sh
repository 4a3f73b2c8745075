#!/usr/bin/env bash
# Writes .msa_commit (git-ignored) with the commit of this tree, "+dirty" when it has uncommitted
# changes; carry it with the tree to a machine without .git so benchmark results name the right commit.
cd "$(dirname "$0")/.." || exit 1
# A stamp naming a commit this .git does not hold came with a tree copied onto a machine whose .git is stale
# (the device): keep it (s29 stored a run as d32ac6a+dirty that way).
if [ -f .msa_commit ] && ! git cat-file -e "$(cut -d+ -f1 .msa_commit)^{commit}" 2>/dev/null; then cat .msa_commit; exit 0; fi
c=$(git rev-parse --short HEAD)
[ -n "$(git status --porcelain --untracked-files=no)" ] && c="$c+dirty"
echo "$c" > .msa_commit
echo "$c"
