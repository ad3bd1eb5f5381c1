#!/usr/bin/env bash
# One GPU call after the SPREAD tunable (a one-row program's output rows spread over the matrix):
# the grid of the GEMV sub-space with SPREAD (benchmarks/grid_spaces/qkv_gemv_spread.yaml) for qkv
# with interleaved pairs in bfloat16 (the float16 grids: run_gpu_gemv.sh with
# GEMV_SPACE=gemv_spread), its winner exported; then, on the shipped tables, the decode kernels
# beside the read-only kernel of their bytes (bench_decode), qkv side by side with its peers
# (bench_qkv) and RMSNorm against a copy timed both as a plain call and as a graph
# (bench_rmsnorm). Everything lands in $OUT/spread.tgz (see gpu_steps.sh).
#   source .whl/setup.sh && bash benchmarks/run_gpu_spread.sh
set -uo pipefail
source "$(dirname "$0")/gpu_steps.sh" spread
gpu=$(python3 -c "import torch; from fusetune.tables import gpu_for_device; \
print(gpu_for_device(torch.device('cuda')).name)")
db=sqlite:///$work/spread_grid.db
step grid_qkv_bf16 150 python3 -m fusetune.cli evaluate-search --kernel qkv --gpu "$gpu" \
  --db "$db" --isolate --trial-timeout 60 --seeds 1 --strategies random --dtype bfloat16 \
  --batch 1 --seq 1 --model llama-2-7b --space benchmarks/grid_spaces/qkv_gemv_spread.yaml
step export 60 python3 -m fusetune.cli export "$work/spread_tables.yaml" --gpu "$gpu" --db "$db"
step decode 120 python3 -m benchmarks.bench_decode
step bench_qkv 240 python3 -m benchmarks.bench_qkv --rows 1,16 --markdown "$work/bench_qkv.md"
step bench_rmsnorm 180 python3 -m benchmarks.bench_rmsnorm --rows 4096,16384 \
  --markdown "$work/bench_rmsnorm.md"
