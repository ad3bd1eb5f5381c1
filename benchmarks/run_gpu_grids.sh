#!/usr/bin/env bash
# Exhaustive grids for `fusetune evaluate-search` on the GPU machine, within BUDGET_S seconds
# (default 540). Resumable: a GRID_DB file (default grid.db, an ignored file) travels with the working
# tree, is copied to $OUT/grid.db, completed there, and comes back. Replay the returned database
# on any machine with `fusetune evaluate-search ... --no-grid`.
set -u
source .whl/setup.sh || exit 1
python3 -c "import scipy" 2>/dev/null && echo "scipy present" || echo "scipy missing"
mkdir -p "$OUT"
grid_db=${GRID_DB:-grid.db}
[ -f "$grid_db" ] && cp "$grid_db" "$OUT/grid.db"
db=sqlite:///$OUT/grid.db
deadline=$(( $(date +%s) + ${BUDGET_S:-540} ))
run() {
  left=$(( deadline - $(date +%s) ))
  [ "$left" -gt 20 ] || { echo "no time left for: $*"; return; }
  timeout --signal=INT "$left" python3 -m fusetune.cli evaluate-search --gpu h100 --db "$db" \
    --isolate --trial-timeout 60 --seeds 1 --strategies random "$@" 2>&1 | tail -25
}
run --kernel ffn --model llama-2-7b --batch 1 --seq 1 --dtype float16
run --kernel ffn --model llama-2-7b --batch 16 --seq 1 --dtype float16
run --kernel rmsnorm --model llama-2-7b --batch 1 --seq 1 --dtype float16
run --kernel ffn --model llama-2-7b --batch 4 --seq 1 --dtype float16
ls -la "$OUT"
