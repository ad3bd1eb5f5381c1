#!/usr/bin/env bash
# Every speed target of the fused kernels measured again on the shipped tables, each benchmark
# side by side with its peers in a process of its own (CUDA-graph replays, do_bench medians):
# TARGET_STEPS names the steps, in order (default: all, about 12 minutes — two calls):
#   decode   benchmarks.bench_decode: ffn, qkv, lola at one row against the read-only kernel
#            of their weight bytes
#   ffn      benchmarks.bench_ffn --rows 1,4096 (tuned, default, eager, compile, Liger, GEMM)
#   qkv      benchmarks.bench_qkv --rows 1,4096
#   lola     benchmarks.bench_lola at 1 and 4096 rows (768 -> 3072 and 4096 -> 16384)
#   rope     benchmarks.bench_rope at [1 and 8, 4096, 32, 128], both pair layouts
#   rmsnorm  benchmarks.bench_rmsnorm at 4096 and 16384 rows of 4096, fp16 and bf16
# TARGET_DTYPE: the activations (default float16). Everything lands in $OUT/targets.tgz
# (TARGET_TAG: a suffix of its name), the markdown tables also in $OUT.
#   source .whl/setup.sh && TARGET_STEPS="decode ffn qkv" bash benchmarks/run_gpu_targets.sh
set -uo pipefail
source "$(dirname "$0")/gpu_steps.sh" "targets${TARGET_TAG:+_$TARGET_TAG}"
dt=${TARGET_DTYPE:-float16}
for s in ${TARGET_STEPS:-decode ffn qkv lola rope rmsnorm}; do
  case $s in
    decode) step decode 150 python3 -m benchmarks.bench_decode --dtype "$dt" ;;
    ffn|qkv) step "$s" 180 python3 -m "benchmarks.bench_$s" --rows 1,4096 --rounds 2 \
               --dtype "$dt" --markdown "$work/$s.md" --json "$work/$s.json" ;;
    lola) step lola 200 python3 -m benchmarks.bench_lola \
            --shapes 1:4096:16384,4096:768:3072,4096:4096:16384 --rounds 2 --dtype "$dt" \
            --markdown "$work/lola.md" --json "$work/lola.json" ;;
    rope) step rope 120 python3 -m benchmarks.bench_rope --shapes 1x4096x32x128,8x4096x32x128 \
            --rounds 2 --dtype "$dt" --markdown "$work/rope.md" --json "$work/rope.json" ;;
    rmsnorm) step rmsnorm 100 python3 -m benchmarks.bench_rmsnorm --rows 4096,16384 --rounds 2 \
               --dtype float16,bfloat16 --markdown "$work/rmsnorm.md" --json "$work/rmsnorm.json" ;;
    *) echo "unknown step $s (valid: decode ffn qkv lola rope rmsnorm)"; exit 2 ;;
  esac
  cp "$work"/*.md "$final"/ 2>/dev/null
done
pack
