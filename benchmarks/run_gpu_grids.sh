#!/usr/bin/env bash
# Exhaustive grids for `fusetune evaluate-search` on the GPU machine, within BUDGET_S seconds
# (default 540): GRID_SET=main (default), heldout, heldout2, heldout3 or spread (grid_sets.sh lists
# their pairs); each on its sub-space in benchmarks/grid_spaces/
# (the full spaces hold 2,000-20,000 feasible configs a point). Resumable: a GRID_DB file
# (default grid.db, an ignored file) travels with the working tree, is copied to $OUT/grid.db,
# completed there, and comes back. Replay the returned database on any machine with
# `fusetune evaluate-search ... --space ... --no-grid`.
set -u
source .whl/setup.sh || exit 1
source "$(dirname "$0")/grid_sets.sh"
mkdir -p "$OUT"
grid_db=${GRID_DB:-grid.db}
[ -f "$grid_db" ] && cp "$grid_db" "$OUT/grid.db"
db=sqlite:///$OUT/grid.db
deadline=$(( $(date +%s) + ${BUDGET_S:-540} ))
run() {
  left=$(( deadline - $(date +%s) ))
  [ "$left" -gt 20 ] || { echo "no time left for: $*"; return; }
  echo "== $* (${left} s left)"
  timeout --signal=INT "$left" python3 -m fusetune.cli evaluate-search --gpu h100 --db "$db" \
    --isolate --trial-timeout 60 --seeds 1 --strategies random --dtype float16 "$@" 2>&1 \
    | tail -12
}
pairs=$(grid_pairs "${GRID_SET:-main}") || exit 2
while read -r _name args <&3; do
  # shellcheck disable=SC2086  # the arguments are words
  run $args
done 3<<< "$pairs"  # fd 3: the commands keep stdin
ls -la "$OUT"
