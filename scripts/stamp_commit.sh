#!/usr/bin/env bash
# Writes .msa_commit (git-ignored) with the commit of this tree, "+dirty" when it has uncommitted
# changes; carry it with the tree to a machine without .git so benchmark results name the right commit.
cd "$(dirname "$0")/.." || exit 1
c=$(git rev-parse --short HEAD)
[ -n "$(git status --porcelain --untracked-files=no)" ] && c="$c+dirty"
echo "$c" > .msa_commit
echo "$c"
