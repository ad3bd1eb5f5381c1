#!/usr/bin/env bash
# Reproduces the side-by-side tables of BENCHMARKS.md on this machine's GPU, on the shipped
# tables (or FUSETUNE_TABLES), each benchmark in a process of its own: a one-row kernel timed in
# the rounds after 4096-row GEMMs, which hold an H100 at its power limit with lower SM clocks,
# ran 3-4 µs slower than alone, so every row count gets its own process.
#
#   bash benchmarks/run_all.sh                       # every step below
#   STEPS="decode ffn" bash benchmarks/run_all.sh    # some of them, in this order
#
# Steps: decode, decode_fp8 (bench_decode, 16-bit and e4m3 weights), ffn, qkv (1 and 4096
# rows), lola (one row 4096 -> 16384; 4096 rows 768 -> 3072 and 4096 -> 16384), linear (1, 16
# and 4096 rows; down_proj and o_proj, bf16 and e4m3 weights), rope, rope_bwd, swiglu and
# swiglu_bwd (training sizes: 4 x 2048 tokens at Llama-3-8B's dims), rmsnorm, rmsnorm_bwd (dx
# and dweight at 4096x4096, 16384x4096 and 8192x8192 bf16), fp8 (bench_fp8 at 1 and 4096
# rows), generate (bench_generate: Llama-3-8B, batch 1,8 x prompt 128,1024; needs
# transformers, pip install 'fusetune[hf]'). The inference kernel steps take about 15 minutes
# (the training steps are not yet timed), generate longer. Not in the default list: devices
# (needs two GPUs or more of one model), compile_ahead (several minutes of compiling) and
# tables (bench_tables: every table entry of this GPU against the default, 3-5 minutes).
# DTYPE: the activations of the matmul and RoPE steps (default float16; linear, the training
# steps and generate: bfloat16). Each step's output goes to $OUT (default ./bench_out) as
# NAME.log, and its table as NAME.md / NAME.json (generate: the table in its log, rows in
# generate.json); the GPU's clocks, power and temperature every 250 ms to gpu_clocks.csv.
set -uo pipefail
out=${OUT:-bench_out}
mkdir -p "$out"
dt=${DTYPE:-float16}
dt16=${DTYPE:-bfloat16}
if command -v nvidia-smi >/dev/null; then
  nvidia-smi --query-gpu=timestamp,clocks.sm,clocks.mem,power.draw,temperature.gpu \
    --format=csv -lms 250 > "$out/gpu_clocks.csv" 2>&1 &
  smi=$!
  trap 'kill $smi 2>/dev/null' EXIT
fi

step() {  # step NAME SECONDS MODULE ARGS...: one benchmark, stopped like Ctrl-C past SECONDS
  local name=$1 limit=$2 module=$3; shift 3
  echo "=== $name ($(date +%T))"
  timeout -s INT "$limit" python3 -m "benchmarks.$module" "$@" \
    --markdown "$out/$name.md" --json "$out/$name.json" > "$out/$name.log" 2>&1
  echo "=== $name rc=$?"
  tail -n 20 "$out/$name.log"
}

all_steps="decode decode_fp8 ffn qkv lola linear rope rope_bwd swiglu swiglu_bwd rmsnorm"
all_steps="$all_steps rmsnorm_bwd fp8"
for s in ${STEPS:-$all_steps generate}; do
  case $s in
    decode) echo "=== decode"; timeout -s INT 150 python3 -m benchmarks.bench_decode \
              --dtype "$dt" 2>&1 | tee "$out/decode.log" ;;
    decode_fp8) echo "=== decode_fp8"; timeout -s INT 150 python3 -m benchmarks.bench_decode \
                  --dtype "$dt" --weights fp8-e4m3 2>&1 | tee "$out/decode_fp8.log" ;;
    ffn|qkv) for r in 1 4096; do
               step "${s}_$r" 150 "bench_$s" --rows "$r" --rounds 3 --dtype "$dt"
             done ;;
    lola) step lola_1 120 bench_lola --shapes 1:4096:16384 --rounds 3 --dtype "$dt"
          step lola_4096 180 bench_lola --shapes 4096:768:3072,4096:4096:16384 --rounds 2 \
            --dtype "$dt" ;;
    linear) for r in 1 16 4096; do
              step "linear_$r" 200 bench_linear --rows "$r" --rounds 3 --dtype "$dt16"
            done ;;
    rope) step rope 120 bench_rope --shapes 1x4096x32x128,8x4096x32x128 --rounds 2 \
            --dtype "$dt" ;;
    rope_bwd) step rope_bwd 180 bench_rope_bwd --shapes 4x2048x32x128,4x2048x8x128 --rounds 2 \
                --dtype "$dt16" ;;
    swiglu|swiglu_bwd) step "$s" 180 "bench_$s" --rows 8192 --hidden 14336 --rounds 2 \
                         --dtype "$dt16" ;;
    rmsnorm) step rmsnorm 100 bench_rmsnorm --rows 4096,16384 --rounds 2 \
               --dtype float16,bfloat16 ;;
    rmsnorm_bwd) step rmsnorm_bwd 150 bench_rmsnorm_bwd \
                   --shapes 4096x4096,16384x4096,8192x8192 --rounds 2 --dtype bfloat16 ;;
    fp8) step fp8_1 200 bench_fp8 --kernels ffn,qkv,lola --rows 1 --dtype "$dt"
         step fp8_4096 300 bench_fp8 --kernels ffn,qkv --rows 4096 --no-graph --dtype "$dt" ;;
    generate) echo "=== generate"; timeout -s INT 3600 python3 -m benchmarks.bench_generate \
                --model llama-3-8b --batch 1,8 --prompt 128,1024 --dtype "$dt16" \
                --json "$out/generate.json" 2>&1 | tee "$out/generate.log" ;;
    devices) echo "=== devices"; python3 -m benchmarks.bench_devices --out "$out" \
               --batch 1,16,64 --seq 1,512 --trials 32 --run-timeout 260 \
               2>&1 | tee "$out/devices.log" ;;
    compile_ahead) step compile_ahead 600 bench_compile_ahead --mode search --trials 16 \
                     --time-cap 60 ;;
    tables) step tables 1200 bench_tables --rounds 3 ;;
    *) echo "unknown step $s (valid: decode decode_fp8 ffn qkv lola linear rope rope_bwd" \
         "swiglu swiglu_bwd rmsnorm rmsnorm_bwd fp8 generate devices compile_ahead tables)"; exit 2 ;;
  esac
done
