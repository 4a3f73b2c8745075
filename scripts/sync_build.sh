#!/usr/bin/env bash
# Before an in-place build on a warm device machine: the tree copied over the last build may carry sources older
# than its objects (e.g. after scripts/ab_patch.sh or scripts/ablate.sh built a patched side), which ninja would
# not rebuild. The hash of the sources the last build was made from (.msa_build_hash) decides: when it differs,
# every source is touched. `scripts/sync_build.sh` before the build, `scripts/sync_build.sh done` after a good one.
cd "$(dirname "$0")/.." || exit 1
src_hash=$(find csrc CMakeLists.txt setup.py -type f | sort | xargs cat | sha256sum | cut -d' ' -f1)
if [ "${1:-}" = done ]; then echo "$src_hash" > .msa_build_hash; exit 0; fi
if [ "$(cat .msa_build_hash 2>/dev/null)" != "$src_hash" ]; then find csrc -type f -exec touch {} +; fi
