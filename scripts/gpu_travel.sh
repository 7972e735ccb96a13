#!/usr/bin/env bash
# What travels with every device call is the working tree: tracked files plus untracked files git
# does not ignore, at most 64 MiB a call together with the carried payload part. The GPU host
# needs the code, the shipped draft and the draft data, but not the archive of CPU results
# (bench/results: figures, logs and plots of earlier sessions, ~16 MiB by the forty-first
# session), which would leave too little room per call for the FlashInfer and e2e bundles.
#
#   bash scripts/gpu_travel.sh light     before the GPU calls: the archive leaves the index (its
#                                        files stay on disk) and .git/info/exclude ignores it, so
#                                        it is neither tracked nor untracked-not-ignored
#   bash scripts/gpu_travel.sh restore   after them, BEFORE any commit: the archive is tracked
#                                        again exactly as HEAD has it, the ignore line removed
#   bash scripts/gpu_travel.sh size      what would travel now (MiB)
#
# While light, `git status` lists the archive as deleted (staged): do not commit then. `light` refuses
# when the archive holds changes not yet committed (they would be lost from the index).
set -euo pipefail
cd "$(git rev-parse --show-toplevel)"

LIGHT_PATHS=(bench/results)
MARK="# heterospec: scripts/gpu_travel.sh light (undo: bash scripts/gpu_travel.sh restore)"
EXCLUDE="$(git rev-parse --git-path info/exclude)"

tree_bytes() { git ls-files -co --exclude-standard -z | du -cb --files0-from=- 2> /dev/null | tail -1 | cut -f1; }
mib() { awk -v b="$1" 'BEGIN { printf "%.1f", b / 1048576 }'; }
is_light() { [[ -f "$EXCLUDE" ]] && grep -qxF "$MARK" "$EXCLUDE"; }

case "${1:-size}" in
  light)
    if is_light; then echo "already light"; else
      if [[ -n "$(git status --porcelain -- "${LIGHT_PATHS[@]}")" ]]; then
        echo "gpu_travel: ${LIGHT_PATHS[*]} holds uncommitted changes; commit or drop them first:" >&2
        git status --short -- "${LIGHT_PATHS[@]}" >&2
        exit 1
      fi
      before="$(tree_bytes)"
      git rm -r -q --cached -- "${LIGHT_PATHS[@]}"
      mkdir -p "$(dirname "$EXCLUDE")"
      { echo "$MARK"; for p in "${LIGHT_PATHS[@]}"; do echo "/$p/"; done; } >> "$EXCLUDE"
      echo "light: ${LIGHT_PATHS[*]} left out; the tree that travels: $(mib "$before") -> $(mib "$(tree_bytes)") MiB"
      echo "restore before any commit: bash scripts/gpu_travel.sh restore"
    fi
    ;;
  restore)
    if ! is_light; then echo "not light: nothing to restore"; else
      git reset -q -- "${LIGHT_PATHS[@]}"
      # drop the mark and the ignore lines it added (the lines after it, one per path)
      awk -v mark="$MARK" -v n="${#LIGHT_PATHS[@]}" '$0 == mark { skip = n; next } skip > 0 { skip--; next } { print }' \
        "$EXCLUDE" > "$EXCLUDE.tmp" && mv "$EXCLUDE.tmp" "$EXCLUDE"
      echo "restored: ${LIGHT_PATHS[*]} tracked again; the tree that travels: $(mib "$(tree_bytes)") MiB"
    fi
    ;;
  size)
    echo "the tree that travels: $(mib "$(tree_bytes)") MiB$(is_light && echo ' (light)' || true)"
    ;;
  *)
    echo "usage: bash scripts/gpu_travel.sh light|restore|size" >&2
    exit 2
    ;;
esac
