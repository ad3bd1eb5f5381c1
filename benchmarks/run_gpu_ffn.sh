#!/usr/bin/env bash
# On a GPU machine: GPU tests, an ffn search at Llama-2-7B dims (decode and prefill), export,
# and the side-by-side benchmark against eager, torch.compile and the cuBLAS GEMM alone.
set -euo pipefail
out=${OUT:-bench_out}
mkdir -p "$out"
db=${DB:-sqlite:///$out/ffn.db}
gpu=${GPU:-h100}
[ -n "${SKIP_TESTS:-}" ] || python3 -m pytest -m gpu -q -p no:cacheprovider tests/kernels/test_ffn.py 2>&1 \
  | tee "$out/pytest_gpu_ffn.log" || true
python3 -m fusetune.cli search --kernel ffn --gpu "$gpu" --model llama-2-7b \
  --batch 1,16,128,1024,4096 --seq 1 --dtype float16 --trials "${TRIALS:-40}" ${POINT_S:+--time-budget "$POINT_S"} --db "$db" \
  2>&1 | tee "$out/ffn_search.log"
python3 -m fusetune.cli export "$out/ffn_tables.yaml" --gpu "$gpu" --kernel ffn --db "$db"
python3 -m benchmarks.bench_ffn --tables "$out/ffn_tables.yaml" --rows 1,16,128,1024,4096 \
  --markdown "$out/ffn_bench.md" --json "$out/ffn_bench.json" 2>&1 | tee "$out/ffn_bench.log"
