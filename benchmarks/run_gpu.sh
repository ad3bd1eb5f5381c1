#!/usr/bin/env bash
# On a GPU machine: GPU tests, a real RMSNorm search at Llama-2-7B dims, export, and the
# side-by-side benchmark. Everything lands in $OUT (default ./bench_out).
#   bash benchmarks/run_gpu.sh            # full run (the BENCHMARKS.md numbers)
#   QUICK=1 bash benchmarks/run_gpu.sh    # a few trials on two points, for a smoke test
set -euo pipefail
out=${OUT:-bench_out}
mkdir -p "$out"
db=${DB:-sqlite:///$out/search.db}
gpu=${GPU:-h100}
if [ -n "${QUICK:-}" ]; then
  grid=(--batch 1,32 --seq 1 --dtype float16 --trials 6)
  rows=1,4096
else
  grid=(--batch 1,8,32 --seq 1,512 --dtype float16,bfloat16 --trials ${TRIALS:-30})
  rows=1,32,512,4096,16384
fi
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv | tee "$out/gpu.txt"
python3 -m pytest -m gpu -q -p no:cacheprovider tests 2>&1 | tee "$out/pytest_gpu.log" || true
python3 -m fusetune.cli search --kernel rmsnorm --gpu "$gpu" --model llama-2-7b "${grid[@]}" \
  --db "$db" 2>&1 | tee "$out/search.log"
python3 -m fusetune.cli export "$out/tables.yaml" --gpu "$gpu" --db "$db"
python3 -m benchmarks.bench_rmsnorm --tables "$out/tables.yaml" --rows "$rows" \
  --markdown "$out/bench.md" --json "$out/bench.json" 2>&1 | tee "$out/bench.log"
