#!/usr/bin/env bash
# One H100 call: every `gpu`-marked test, FP8 (e4m3) searches of ffn and qkv at the decode and
# prefill points (compile-ahead on, the default) and the FP8 benchmark on their tables, the
# planted-bad-config search through the isolating worker, and compile-ahead off vs on (search
# mode). Every step is cut off (like Ctrl-C) past its limit; everything so far is packed into
# $OUT/session.tgz after each step.
#   source .whl/setup.sh && bash benchmarks/run_gpu_fp8_tuner.sh
set -uo pipefail
source "$(dirname "$0")/gpu_steps.sh" session
gpu=${GPU:-h100}
step pytest_gpu 170 python3 -m pytest -m gpu -q -p no:cacheprovider -rf tests
db="sqlite:///$work/fp8.db"
step fp8_search 130 bash -c "for k in ffn qkv; do python3 -m fusetune.cli search --kernel \$k \
  --gpu $gpu --model llama-2-7b --weights fp8-e4m3 --batch 1,4096 --seq 1 --dtype float16 \
  --trials 40 --time-budget ${POINT_S:-8} --db $db; done"
python3 -m fusetune.cli export "$work/fp8_tables.yaml" --gpu "$gpu" --db "$db" > /dev/null
step fp8_bench 100 python3 -m benchmarks.bench_fp8 --tables "$work/fp8_tables.yaml" \
  --kernels ffn,qkv,lola --rows 1,4096 --no-graph --rounds 1 --markdown "$work/fp8_bench.md" \
  --json "$work/fp8_bench.json"
step planted 80 python3 -m benchmarks.planted_search --db "sqlite:///$work/planted.db" \
  --trials 30
step compile_ahead 75 python3 benchmarks/bench_compile_ahead.py --mode search --trials 16 \
  --time-cap 32 --markdown "$work/compile_ahead.md" --json "$work/compile_ahead.json"
cp "$work"/*.md "$final"/ 2>/dev/null
pack
