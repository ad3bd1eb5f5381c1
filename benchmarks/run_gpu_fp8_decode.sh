#!/usr/bin/env bash
# FP8 (e4m3) decode: the FP8 GPU tests not run by run_gpu_verify.sh within its limit, a search
# of ffn and qkv at M = 1 (POINT_S seconds each, default 25), and the FP8 benchmark at M = 1 on
# those tables. Packed into $OUT/fp8_decode.tgz after each step.
#   source .whl/setup.sh && bash benchmarks/run_gpu_fp8_decode.sh
set -uo pipefail
source "$(dirname "$0")/gpu_steps.sh" fp8_decode
step pytest_gpu_fp8_rest 40 python3 -m pytest -m gpu -q -p no:cacheprovider -rf \
  tests/kernels/test_fp8.py -k "e4m3_from_bytes or smem_model"
db="sqlite:///$work/fp8_decode.db"
step search 90 bash -c "for k in ffn qkv; do python3 -m fusetune.cli search --kernel \$k \
  --gpu ${GPU:-h100} --model llama-2-7b --weights fp8-e4m3 --batch 1 --seq 1 --dtype float16 \
  --trials 200 --time-budget ${POINT_S:-25} --db $db; done"
python3 -m fusetune.cli export "$work/fp8_decode_tables.yaml" --gpu "${GPU:-h100}" --db "$db" \
  > /dev/null
step bench 45 python3 -m benchmarks.bench_fp8 --tables "$work/fp8_decode_tables.yaml" \
  --kernels ffn,qkv --rows 1 --no-graph --rounds 1 --markdown "$work/fp8_decode_bench.md"
pack
