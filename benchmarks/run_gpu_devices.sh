#!/usr/bin/env bash
# On a machine with two GPUs or more of one model: tuning throughput of `fusetune search
# --devices 0` against `--devices all` (benchmarks/bench_devices.py: ffn at Llama-2-7B dims,
# batch 1,16 x seq 1,512 in float16, 24 trials a point, seed 0; both runs from a cold Triton
# cache, each stopped after --run-timeout 110 s at most: under four minutes in all). Everything
# lands in $OUT (default ./bench_out): bench_devices.md/.json, both databases and logs. Extra
# arguments go to bench_devices, e.g. `bash benchmarks/run_gpu_devices.sh --trials 16`.
set -euo pipefail
out=${OUT:-bench_out}
mkdir -p "$out"
nvidia-smi --query-gpu=index,name,driver_version,clocks.sm,clocks.mem --format=csv \
  | tee "$out/gpus.txt" || true
python3 -m benchmarks.bench_devices --out "$out" "$@" 2>&1 | tee "$out/bench_devices.log"
