#!/usr/bin/env bash
# One H100 call: every `gpu`-marked test (the kernels, then FP8), the FP8 benchmark on the
# tables of the FP8 searches (benchmarks/results/fp8_h100_tables.yaml), and the planted-bad-
# config search through the isolating worker. Every step is cut off (like Ctrl-C) past its
# limit; everything so far is packed into $OUT/verify.tgz after each step.
#   source .whl/setup.sh && bash benchmarks/run_gpu_verify.sh
set -uo pipefail
source "$(dirname "$0")/gpu_steps.sh" verify
step pytest_gpu 150 python3 -m pytest -m gpu -q -p no:cacheprovider -rf tests \
  --deselect tests/kernels/test_fp8.py
step pytest_gpu_fp8 110 python3 -m pytest -m gpu -q -p no:cacheprovider -rf \
  tests/kernels/test_fp8.py
step fp8_bench 70 python3 -m benchmarks.bench_fp8 --tables benchmarks/results/fp8_h100_tables.yaml \
  --kernels ffn,qkv --rows 1,4096 --no-graph --rounds 1 --markdown "$work/fp8_bench.md" \
  --json "$work/fp8_bench.json"
step planted 110 python3 -m benchmarks.planted_search --db "sqlite:///$work/planted.db" \
  --trials 20
cp "$work"/*.md "$final"/ 2>/dev/null
pack
