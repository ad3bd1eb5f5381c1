#!/usr/bin/env bash
# Replays search strategies against the grids that benchmarks/run_gpu_grids.sh stored (no GPU
# needed): `bash benchmarks/replay_grids.sh GRID_DB OUT_DIR [SEEDS] [BUDGET]` (GRID_SET=main,
# heldout, heldout2, heldout3: the pairs benchmarks/grid_sets.sh lists; GRID_SET=gemv: the GEMV
# grids of run_gpu_gemv.sh, GRID_SET=gemv_wide: those
# of GEMV_SPACE=gemv_wide bash benchmarks/run_gpu_gemv.sh, GRID_SET=qkv_tma and
# fp8_tma: the grids of run_gpu_tma.sh's TMA_SET=qkv and fp8; STRATEGIES: which).
# One report per pair, Markdown and JSON, in OUT_DIR.
set -euo pipefail
db=${1:?grid database file}
out=${2:?output directory}
seeds=${3:-10}
budget=${4:-80}
spaces=benchmarks/grid_spaces
mkdir -p "$out"
replay() {
  name=$1; shift
  echo "== $name"
  python3 -m fusetune.cli evaluate-search --no-grid --gpu h100 --db "sqlite:///$db" \
    --dtype float16 --seeds "$seeds" --budget "$budget" \
    --strategies "${STRATEGIES:-random,tpe,gp,fusetune,fusetune-cold}" \
    --markdown "$out/$name.md" --json "$out/$name.json" "$@" 2>&1 | tail -14
}
if [ "${GRID_SET:-main}" = gemv ] || [ "${GRID_SET:-main}" = gemv_wide ]; then
  # the GEMV sub-spaces (benchmarks/run_gpu_gemv.sh; GEMV_SPACE=gemv_wide: the wide ones)
  g=$GRID_SET
  replay ffn_$g --kernel ffn --model llama-2-7b --batch 1 --seq 1 --space $spaces/ffn_$g.yaml
  replay qkv_$g --kernel qkv --model llama-2-7b --batch 1 --seq 1 --space $spaces/qkv_$g.yaml
  replay lola_$g --kernel lola --dims dim=4096,out=16384 --batch 1 --seq 1 \
    --space $spaces/lola_$g.yaml
  replay ffn_${g}_e4m3 --kernel ffn --model llama-2-7b --batch 1 --seq 1 --weights fp8-e4m3 \
    --space $spaces/ffn_$g.yaml
  replay qkv_${g}_e4m3 --kernel qkv --model llama-2-7b --batch 1 --seq 1 --weights fp8-e4m3 \
    --space $spaces/qkv_$g.yaml
  exit 0
fi
if [ "${GRID_SET:-main}" = qkv_tma ]; then  # run_gpu_tma.sh, TMA_SET=qkv
  replay qkv_prefill_tma --kernel qkv --model llama-2-7b --batch 1 --seq 4096 \
    --space $spaces/qkv_prefill_tma.yaml
  exit 0
fi
if [ "${GRID_SET:-main}" = fp8_tma ]; then  # run_gpu_tma.sh, TMA_SET=fp8
  replay ffn_prefill_fp8_tma --kernel ffn --model llama-2-7b --batch 1 --seq 4096 \
    --weights fp8-e4m3 --space $spaces/ffn_prefill_fp8_tma.yaml
  replay qkv_prefill_fp8_tma --kernel qkv --model llama-2-7b --batch 1 --seq 4096 \
    --weights fp8-e4m3 --space $spaces/qkv_prefill_fp8_tma.yaml
  exit 0
fi
# the pairs of benchmarks/run_gpu_grids.sh (GRID_SET=main, heldout, heldout2, heldout3)
source "$(dirname "$0")/grid_sets.sh"
pairs=$(grid_pairs "${GRID_SET:-main}")
while read -r name args <&3; do
  # shellcheck disable=SC2086  # the arguments are words
  replay "$name" $args
done 3<<< "$pairs"  # fd 3: the commands keep stdin
