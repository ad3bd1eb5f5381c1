#!/usr/bin/env bash
# On a GPU machine: the FP8 GPU tests, FP8 searches of ffn, qkv and lola at Llama-2-7B dims
# (decode and prefill, e4m3), export, and bench_fp8 (accuracy, then time beside the fp16
# kernels, cuBLAS FP8 and cuBLAS fp16). Everything lands in $OUT (default ./bench_out).
#   SKIP_SEARCH=1 bash benchmarks/run_gpu_fp8.sh   # tests and benchmark only (default configs)
set -euo pipefail
out=${OUT:-bench_out}
mkdir -p "$out"
db=${DB:-sqlite:///$out/fp8.db}
gpu=${GPU:-h100}
[ -n "${SKIP_TESTS:-}" ] || python3 -m pytest -m gpu -q -p no:cacheprovider \
  tests/kernels/test_fp8.py 2>&1 | tee "$out/pytest_gpu_fp8.log" || true
tables=()
if [ -z "${SKIP_SEARCH:-}" ]; then
  # bench_fp8's shapes: Llama-2-7B's ffn and qkv, lola 4096 -> 16384
  for what in "ffn --model llama-2-7b" "qkv --model llama-2-7b" "lola --dims dim=4096,out=16384"
  do
    # shellcheck disable=SC2086
    python3 -m fusetune.cli search --kernel $what --gpu "$gpu" \
      --weights fp8-e4m3 --batch 1,16,4096 --seq 1 --dtype float16 --trials "${TRIALS:-40}" \
      ${POINT_S:+--time-budget "$POINT_S"} --db "$db" 2>&1 | tee -a "$out/fp8_search.log"
  done
  python3 -m fusetune.cli export "$out/fp8_tables.yaml" --gpu "$gpu" --db "$db"
  tables=(--tables "$out/fp8_tables.yaml")
fi
python3 -m benchmarks.bench_fp8 ${tables[@]+"${tables[@]}"} --markdown "$out/fp8_bench.md" \
  --json "$out/fp8_bench.json" 2>&1 | tee "$out/fp8_bench.log"
