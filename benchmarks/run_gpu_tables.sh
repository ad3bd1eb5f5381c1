#!/usr/bin/env bash
# One GPU call: the read-only bandwidth ceiling (loop shapes, unrolled loads, evict-first
# hints), then the matmul kernels side by side (plain calls) with the shipped tables, at decode,
# 16 rows and prefill. Everything lands in $OUT/tables.tgz (see gpu_steps.sh).
#   source .whl/setup.sh && bash benchmarks/run_gpu_tables.sh
set -uo pipefail
source "$(dirname "$0")/gpu_steps.sh" tables
STEP_TAIL=16
step read_bw 150 python3 -m benchmarks.bench_read_bw --mb 180,100,134
for k in ffn qkv; do
  step "${k}_bench" 100 python3 -m benchmarks.bench_$k --rows 1,16,4096 --no-graph --rounds 1 \
    --markdown "$work/${k}_bench.md" --json "$work/${k}_bench.json"
done
step lola_bench 100 python3 -m benchmarks.bench_lola --no-graph --rounds 1 \
  --shapes 4096:768:3072,1:4096:16384,4096:4096:16384 \
  --markdown "$work/lola_bench.md" --json "$work/lola_bench.json"
