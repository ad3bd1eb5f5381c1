#!/usr/bin/env bash
# On a GPU machine: GPU tests, a qkv search at Llama-2-7B dims (decode and prefill), export,
# and the side-by-side benchmark against eager, torch.compile and the GEMM alone.
set -euo pipefail
out=${OUT:-bench_out}
mkdir -p "$out"
db=${DB:-sqlite:///$out/qkv.db}
gpu=${GPU:-h100}
[ -n "${SKIP_TESTS:-}" ] || python3 -m pytest -m gpu -q -p no:cacheprovider tests/kernels/test_qkv.py 2>&1 \
  | tee "$out/pytest_gpu_qkv.log" || true
python3 -m fusetune.cli search --kernel qkv --gpu "$gpu" --model llama-2-7b --batch 1 \
  --seq 1,16,4096 --dtype float16 --trials "${TRIALS:-40}" ${POINT_S:+--time-budget "$POINT_S"} --db "$db" 2>&1 \
  | tee "$out/qkv_search.log"
python3 -m fusetune.cli export "$out/qkv_tables.yaml" --gpu "$gpu" --kernel qkv --db "$db"
python3 -m benchmarks.bench_qkv --tables "$out/qkv_tables.yaml" --rows 1,16,4096 \
  --markdown "$out/qkv_bench.md" --json "$out/qkv_bench.json" 2>&1 | tee "$out/qkv_bench.log"
