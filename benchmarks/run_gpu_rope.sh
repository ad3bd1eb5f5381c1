#!/usr/bin/env bash
# On a GPU machine: GPU tests, a RoPE search at Llama-2-7B head shapes (both layouts), export,
# and the side-by-side benchmark. Everything lands in $OUT (default ./bench_out).
set -euo pipefail
out=${OUT:-bench_out}
mkdir -p "$out"
db=${DB:-sqlite:///$out/rope.db}
gpu=${GPU:-h100}
python3 -m pytest -m gpu -q -p no:cacheprovider tests 2>&1 | tee "$out/pytest_gpu.log" || true
for layout in 1 0; do
  python3 -m fusetune.cli search --kernel rope --gpu "$gpu" \
    --dims heads=32,head_dim=128,interleaved=$layout --batch 1,8 --seq 1,4096 \
    --dtype float16 --trials "${TRIALS:-30}" --db "$db" 2>&1 | tee -a "$out/rope_search.log"
done
python3 -m fusetune.cli export "$out/rope_tables.yaml" --gpu "$gpu" --kernel rope --db "$db"
python3 -m benchmarks.bench_rope --tables "$out/rope_tables.yaml" \
  --shapes 1x4096x32x128,8x4096x32x128 --markdown "$out/rope_bench.md" \
  --json "$out/rope_bench.json" 2>&1 | tee "$out/rope_bench.log"
