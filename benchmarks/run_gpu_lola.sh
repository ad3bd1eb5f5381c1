#!/usr/bin/env bash
# On a GPU machine: GPU tests, lola searches at GPT-2 (768 -> 3072) and 4096 -> 16384 dims,
# export, and the side-by-side benchmark against eager, torch.compile and the GEMM alone.
set -euo pipefail
out=${OUT:-bench_out}
mkdir -p "$out"
db=${DB:-sqlite:///$out/lola.db}
gpu=${GPU:-h100}
[ -n "${SKIP_TESTS:-}" ] || python3 -m pytest -m gpu -q -p no:cacheprovider tests/kernels/test_lola.py 2>&1 \
  | tee "$out/pytest_gpu_lola.log" || true
for dims in dim=768,out=3072 dim=4096,out=16384; do
  python3 -m fusetune.cli search --kernel lola --gpu "$gpu" --dims "$dims" --batch 1,4096 \
    --seq 1 --dtype float16 --trials "${TRIALS:-40}" ${POINT_S:+--time-budget "$POINT_S"} --db "$db" 2>&1 | tee -a "$out/lola_search.log"
done
python3 -m fusetune.cli export "$out/lola_tables.yaml" --gpu "$gpu" --kernel lola --db "$db"
python3 -m benchmarks.bench_lola --tables "$out/lola_tables.yaml" \
  --markdown "$out/lola_bench.md" --json "$out/lola_bench.json" 2>&1 | tee "$out/lola_bench.log"
