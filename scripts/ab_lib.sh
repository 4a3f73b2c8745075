# Sourced by scripts/ab_variants.sh and scripts/ab_microbench.sh. A variant is a patch, or several comma-separated
# ones applied in order (PATCH1,PATCH2).
# ab_name LIST: the variant's name, its patches' base names joined by "-".
ab_name() {
  local pf name="" patches
  IFS=, read -r -a patches <<< "$1"
  for pf in "${patches[@]}"; do name="$name${name:+-}$(basename "$pf" .patch)"; done
  echo "$name"
}
# ab_apply LIST LOGFILE: applies the patches in order, each checked by a dry run first (its output appended to
# LOGFILE); at the first that does not apply it says so, prints LOGFILE and returns 1 (what it applied stays
# applied: ab_revert undoes it). ab_applied lists what is applied.
ab_applied=()
ab_apply() {
  local pf patches
  IFS=, read -r -a patches <<< "$1"
  ab_applied=()
  for pf in "${patches[@]}"; do
    if ! patch -p1 --dry-run --forward < "$pf" >> "$2" 2>&1; then
      echo "$(ab_name "$1"): $pf does not apply"
      cat "$2"
      return 1
    fi
    patch -p1 --forward --no-backup-if-mismatch < "$pf" > /dev/null 2>&1
    ab_applied+=("$pf")
  done
}
# ab_revert: undoes the applied patches, last first.
ab_revert() {
  local i
  for ((i = ${#ab_applied[@]} - 1; i >= 0; i--)); do patch -p1 -R --no-backup-if-mismatch < "${ab_applied[i]}" > /dev/null 2>&1; done
  ab_applied=()
}
