#!/usr/bin/env bash
# Every speed target of the fused kernels measured again on the shipped tables, each benchmark
# side by side with its peers in a process of its own (CUDA-graph replays, do_bench medians):
# TARGET_STEPS names the steps, in order (default: all, about 12 minutes — two calls):
#   decode   benchmarks.bench_decode: ffn, qkv, lola at one row against the read-only kernel
#            of their weight bytes
#   ffn      benchmarks.bench_ffn (tuned, default, eager, compile, Liger, GEMM) at one row, then
#            at 4096 rows in another process: in one process the rounds alternate the two
#            row counts, and the 4096-row GEMMs hold the H100 at its 700 W power limit with
#            the SM clock down to 1260-1590 MHz (from 1980), after which the one-row kernels
#            ran 3-4 µs slower than alone (ffn 71.7 against 67.4 µs, qkv 44.0 against 41.1;
#            the clocks are logged in gpu_clocks.csv)
#   qkv      benchmarks.bench_qkv, the same way
#   lola     benchmarks.bench_lola at one row (4096 -> 16384), then at 4096 rows (768 -> 3072
#            and 4096 -> 16384)
#   rope     benchmarks.bench_rope at [1 and 8, 4096, 32, 128], both pair layouts
#   rmsnorm  benchmarks.bench_rmsnorm at 4096 and 16384 rows of 4096, fp16 and bf16
# TARGET_DTYPE: the activations (default float16). Everything lands in $OUT/targets.tgz
# (TARGET_TAG: a suffix of its name), the markdown tables also in $OUT.
#   source .whl/setup.sh && TARGET_STEPS="decode ffn qkv" bash benchmarks/run_gpu_targets.sh
set -uo pipefail
source "$(dirname "$0")/gpu_steps.sh" "targets${TARGET_TAG:+_$TARGET_TAG}"
dt=${TARGET_DTYPE:-float16}
# The GPU's SM and memory clocks, power and temperature every 250 ms, beside the step logs.
nvidia-smi --query-gpu=timestamp,clocks.sm,clocks.mem,power.draw,temperature.gpu \
  --format=csv -lms 250 > "$work/gpu_clocks.csv" 2>&1 &
smi=$!
trap 'kill $smi 2>/dev/null' EXIT
for s in ${TARGET_STEPS:-decode ffn qkv lola rope rmsnorm}; do
  case $s in
    decode) step decode 150 python3 -m benchmarks.bench_decode --dtype "$dt" ;;
    ffn|qkv) for r in 1 4096; do
               step "${s}_$r" 150 python3 -m "benchmarks.bench_$s" --rows "$r" --rounds 3 \
                 --dtype "$dt" --markdown "$work/${s}_$r.md" --json "$work/${s}_$r.json"
             done ;;
    lola) step lola_1 120 python3 -m benchmarks.bench_lola --shapes 1:4096:16384 --rounds 3 \
            --dtype "$dt" --markdown "$work/lola_1.md" --json "$work/lola_1.json"
          step lola_4096 180 python3 -m benchmarks.bench_lola \
            --shapes 4096:768:3072,4096:4096:16384 --rounds 2 --dtype "$dt" \
            --markdown "$work/lola_4096.md" --json "$work/lola_4096.json" ;;
    rope) step rope 120 python3 -m benchmarks.bench_rope --shapes 1x4096x32x128,8x4096x32x128 \
            --rounds 2 --dtype "$dt" --markdown "$work/rope.md" --json "$work/rope.json" ;;
    rmsnorm) step rmsnorm 100 python3 -m benchmarks.bench_rmsnorm --rows 4096,16384 --rounds 2 \
               --dtype float16,bfloat16 --markdown "$work/rmsnorm.md" --json "$work/rmsnorm.json" ;;
    *) echo "unknown step $s (valid: decode ffn qkv lola rope rmsnorm)"; exit 2 ;;
  esac
  cp "$work"/*.md "$final"/ 2>/dev/null
done
pack
