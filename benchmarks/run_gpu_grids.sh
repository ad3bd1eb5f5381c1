#!/usr/bin/env bash
# Exhaustive grids for `fusetune evaluate-search` on the GPU machine, within BUDGET_S seconds
# (default 540): GRID_SET=main (default) the six (kernel, point) pairs, GRID_SET=heldout four
# more; each on its sub-space in benchmarks/grid_spaces/
# (the full spaces hold 2,000-20,000 feasible configs a point). Resumable: a GRID_DB file
# (default grid.db, an ignored file) travels with the working tree, is copied to $OUT/grid.db,
# completed there, and comes back. Replay the returned database on any machine with
# `fusetune evaluate-search ... --space ... --no-grid`.
set -u
source .whl/setup.sh || exit 1
mkdir -p "$OUT"
grid_db=${GRID_DB:-grid.db}
[ -f "$grid_db" ] && cp "$grid_db" "$OUT/grid.db"
db=sqlite:///$OUT/grid.db
spaces=benchmarks/grid_spaces
deadline=$(( $(date +%s) + ${BUDGET_S:-540} ))
run() {
  left=$(( deadline - $(date +%s) ))
  [ "$left" -gt 20 ] || { echo "no time left for: $*"; return; }
  echo "== $* (${left} s left)"
  timeout --signal=INT "$left" python3 -m fusetune.cli evaluate-search --gpu h100 --db "$db" \
    --isolate --trial-timeout 60 --seeds 1 --strategies random --dtype float16 "$@" 2>&1 \
    | tail -12
}
case ${GRID_SET:-main} in
  main)  # the six pairs
    run --kernel ffn --model llama-2-7b --batch 1 --seq 1 --space $spaces/ffn_decode.yaml
    run --kernel qkv --model llama-2-7b --batch 1 --seq 1 --space $spaces/qkv_decode.yaml
    run --kernel lola --model gpt2 --batch 1 --seq 4096 --space $spaces/lola_prefill.yaml
    run --kernel ffn --model llama-2-7b --batch 1 --seq 4096 --space $spaces/ffn_prefill.yaml
    run --kernel qkv --model llama-2-7b --batch 1 --seq 4096 --space $spaces/qkv_prefill.yaml
    run --kernel rmsnorm --model llama-2-7b --batch 1 --seq 1
    ;;
  heldout)  # more pairs, to check a strategy chosen on the main six elsewhere
    run --kernel ffn --model llama-2-7b --batch 16 --seq 1 --space $spaces/ffn_batch16.yaml
    run --kernel lola --model llama-2-7b --batch 1 --seq 1 --space $spaces/lola_decode.yaml
    run --kernel ffn --model llama-2-7b --batch 1 --seq 512 --space $spaces/ffn_prefill.yaml
    run --kernel qkv --model llama-2-7b --batch 16 --seq 1 --space $spaces/qkv_batch16.yaml
    ;;
  *) echo "GRID_SET: main or heldout, not ${GRID_SET}"; exit 2 ;;
esac
ls -la "$OUT"
